"""Projects: limits and pools; pause with a mandatory reason, resume; who paused and when."""

from __future__ import annotations

from flask import Blueprint, url_for

from pgdispatch.sql import reads, transitions

from .db import get_conn
from .views import named_row, pause_or_resume, render_view

bp = Blueprint("projects", __name__, url_prefix="/projects")


def _row(name: str) -> str:
    """The project's row as it is now ("" when it no longer exists)."""
    return named_row("projects/_row.html", "p", reads.list_projects(get_conn()), name)


@bp.get("/")
def index():
    """Every project with its state."""
    return render_view("projects/index.html", "projects/_table.html",
                       projects=reads.list_projects(get_conn()))


@bp.post("/<name>/pause")
def pause(name: str):
    """Pause a project; no new job of it starts until it is resumed."""
    return pause_or_resume(transitions.pause_project, kind="project", name=name, pausing=True,
                           back=url_for("projects.index"), fragment=lambda: _row(name))


@bp.post("/<name>/resume")
def resume(name: str):
    """Resume a paused project."""
    return pause_or_resume(transitions.resume_project, kind="project", name=name, pausing=False,
                           back=url_for("projects.index"), fragment=lambda: _row(name))
