"""Targets: who holds each and since when; resolve an uncertain one with its evidence beside;
one target's page: what runs next in its order, and what was superseded."""

from __future__ import annotations

from flask import Blueprint, render_template, request, url_for

from pgdispatch.sql import InvalidInput, reads, transitions
from pgdispatch.sql.transitions import RESOLUTIONS

from .db import get_conn
from .views import actor, form_text, perform, render_view

bp = Blueprint("targets", __name__, url_prefix="/targets")


def _card(name: str) -> str:
    """The target's card as it is now ("" when it no longer exists)."""
    for target in reads.list_targets(get_conn()):
        if target["name"] == name:
            return render_template("targets/_target.html", t=target, resolutions=RESOLUTIONS)
    return ""


@bp.get("/")
def index():
    """Every target, uncertain first."""
    return render_view("targets/index.html", "targets/_list.html",
                       targets=reads.list_targets(get_conn()), resolutions=RESOLUTIONS)


@bp.get("/<name>")
def show(name: str):
    """One target: holder, what runs next in its order with each one's reason, superseded."""
    return render_view("targets/show.html", "targets/_show.html",
                       t=reads.show_target(get_conn(), name=name), resolutions=RESOLUTIONS)


@bp.post("/<name>/resolve")
def resolve(name: str):
    """Resolve an uncertain target: the lost deployment succeeded, failed, or runs again."""
    outcome = request.form.get("outcome", "")
    note = form_text("note")

    def action(conn):
        if outcome not in RESOLUTIONS:
            raise InvalidInput("choose an outcome: " + ", ".join(RESOLUTIONS))
        return transitions.resolve_target(conn, target=name, outcome=outcome, note=note or "",
                                          actor=actor())

    return perform(action, success=lambda r: f"target {name} resolved as {outcome}; {_decided(r)}",
                   back=url_for("targets.index"), fragment=lambda: _card(name))


def _decided(result: dict) -> str:
    """What the resolution made of the lost deployment, in words."""
    job, state = result["job_id"], result["job_state"]
    if state == "queued":
        return f"job {job} is queued to run again"
    if state == "blocked":
        return f"job {job} runs again once approved (approval_required)"
    return f"job {job} {state}"
