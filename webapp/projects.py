"""Projects: limits and pools; pause with a mandatory reason, resume; who paused and when."""

from __future__ import annotations

from flask import Blueprint, render_template, url_for

from pgdispatch.sql import reads, transitions

from .db import get_conn
from .views import actor, form_text, perform, render_view

bp = Blueprint("projects", __name__, url_prefix="/projects")


def _row(name: str) -> str:
    """The project's row as it is now ("" when it no longer exists)."""
    for project in reads.list_projects(get_conn()):
        if project["name"] == name:
            return render_template("projects/_row.html", p=project)
    return ""


@bp.get("/")
def index():
    """Every project with its state."""
    return render_view("projects/index.html", "projects/_table.html",
                       projects=reads.list_projects(get_conn()))


@bp.post("/<name>/pause")
def pause(name: str):
    """Pause a project; no new job of it starts until it is resumed."""
    reason = form_text("reason")
    return perform(lambda conn: transitions.pause_project(conn, project=name, reason=reason or "",
                                                          actor=actor()),
                   success=lambda r: f"project {name} paused",
                   back=url_for("projects.index"), fragment=lambda: _row(name))


@bp.post("/<name>/resume")
def resume(name: str):
    """Resume a paused project."""
    reason = form_text("reason")
    return perform(lambda conn: transitions.resume_project(conn, project=name, reason=reason,
                                                           actor=actor()),
                   success=lambda r: f"project {name} resumed",
                   back=url_for("projects.index"), fragment=lambda: _row(name))

