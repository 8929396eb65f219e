"""Helpers shared by the console's blueprints: page or fragment, action responses, inputs.

``render_view`` is the one place that decides whether a request gets the whole page or just
the fragment (htmx requests), and it always sends ``Vary: HX-Request`` so that no cache
hands a fragment to a full page load or the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Response, abort, flash, make_response, redirect, render_template, request
from flask_login import current_user

from pgdispatch.sql import Conflict, InvalidInput, PgDispatchError

from .db import get_conn

MAX_BIGINT = 2**63 - 1
MAX_FILTER_CHARS = 200


def is_htmx() -> bool:
    """True for an htmx request that wants a fragment (not a history-restore full page)."""
    return (request.headers.get("HX-Request") == "true"
            and request.headers.get("HX-History-Restore-Request") != "true")


def _vary(response: Response) -> Response:
    response.vary.add("HX-Request")
    return response


def render_view(page: str, fragment: str, *, status: int = 200, **context: Any) -> Response:
    """Render ``fragment`` for an htmx request, else the full ``page`` (which includes it)."""
    template = fragment if is_htmx() else page
    return _vary(make_response(render_template(template, **context), status))


def flash_oob(category: str, message: str) -> str:
    """The flash area as an out-of-band swap carrying one message."""
    return render_template("_flash.html", messages=[(category, message)], oob=True)


def respond(*, message: str, category: str, status: int, back: str,
            fragment: Callable[[], str] | None = None) -> Response:
    """Answer a console action.

    htmx: the changed fragment (when given) plus the flash message out of band; without a
    fragment the main swap is suppressed (``HX-Reswap: none``). Plain form: success is a
    303 redirect to ``back`` with a flashed message (redirect after POST); a refusal is an
    error page with the status and the message, linking back.
    """
    if is_htmx():
        body = (fragment() if fragment is not None else "") + flash_oob(category, message)
        response = make_response(body, status)
        if fragment is None:
            response.headers["HX-Reswap"] = "none"
        return _vary(response)
    if status < 400:
        flash(message, category)
        return _vary(redirect(back, code=303))
    return _vary(make_response(render_template("errors/index.html", status=status,
                                               message=message, back=back), status))


def perform(action: Callable[[Any], Any], *, success: Callable[[Any], str], back: str,
            fragment: Callable[[], str] | None = None, role: str = "operator") -> Response:
    """Run ``action(conn)`` (a sql transition, which writes the audit event) as an operator
    (``role="admin"``: as an admin).

    A refusal from the database (``pgdispatch.sql.errors``) answers with its ``http_status``; a
    conflict (another operator acted first) also returns the fragment as it is now, so the
    loser sees the current state beside the "already … by alice at …" message.
    """
    require_admin() if role == "admin" else require_operator()
    try:
        result = action(get_conn())
    except PgDispatchError as exc:
        return respond(message=str(exc), category="error", status=exc.http_status, back=back,
                       fragment=fragment if isinstance(exc, Conflict) else None)
    return respond(message=success(result), category="success", status=200, back=back,
                   fragment=fragment)


def pause_or_resume(transition: Callable[..., Any], *, kind: str, name: str, pausing: bool,
                    back: str, fragment: Callable[[], str]) -> Response:
    """A console Pause or Resume of the ``kind`` ("project" | "pool") named ``name``, with
    the form's reason: ``transition(conn, <kind>=name, reason=..., actor=...)`` through
    ``perform``, answering "<kind> <name> paused" (or "resumed") and ``fragment`` (the row).
    A pause's reason is mandatory: a blank one goes as "" and the database refuses it
    (PD422, 422); a resume's is optional (None)."""
    reason = form_text("reason")
    if pausing:
        reason = reason or ""
    done = "paused" if pausing else "resumed"
    return perform(lambda conn: transition(conn, **{kind: name}, reason=reason, actor=actor()),
                   success=lambda r: f"{kind} {name} {done}", back=back, fragment=fragment)


def named_row(template: str, var: str, rows: list[dict], name: str) -> str:
    """``template`` rendered with the row of ``rows`` whose "name" is ``name`` as ``var``
    (``named_row("pools/_row.html", "q", pools, "linux")``); "" when no row has it (it no
    longer exists)."""
    for row in rows:
        if row["name"] == name:
            return render_template(template, **{var: row})
    return ""


def actor() -> str:
    """The signed-in username, recorded as the actor of audit events."""
    return current_user.username


def require_operator() -> None:
    """403 unless the signed-in user may act (operator or admin)."""
    if not getattr(current_user, "can_act", False):
        abort(403, description="your role may only view; ask an operator to do this")


def require_admin() -> None:
    """403 unless the signed-in user is an admin (accounts, tokens and limits)."""
    if not getattr(current_user, "is_admin", False):
        abort(403, description="only an admin may do this")


def form_text(name: str, *, required: bool = False) -> str | None:
    """A form field as text, stripped; None when absent or blank and not required."""
    value = request.form.get(name, "")
    value = value.strip() if isinstance(value, str) else ""
    if value == "":
        if required:
            raise InvalidInput(f"a {name} is required")
        return None
    return value


def arg_text(name: str) -> str | None:
    """A query-string filter: None when absent or blank; refused when it cannot be valid."""
    value = request.args.get(name, "").strip()
    if value == "":
        return None
    if "\x00" in value or len(value) > MAX_FILTER_CHARS:
        raise InvalidInput(f"{name} filter is not valid")
    return value


def arg_int(name: str, default: int, *, low: int = 0, high: int = MAX_BIGINT) -> int:
    """A whole-number query parameter within [low, high], else InvalidInput."""
    raw = request.args.get(name, "").strip()
    if raw == "":
        return default
    # ASCII digits only (int() also reads "1_000" and other scripts' digits), and no more of
    # them than a bigint has (int() refuses over 4300)
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 25 or not low <= int(raw) <= high:
        raise InvalidInput(f"{name} must be a whole number between {low} and {high}")
    return int(raw)


def check_job_id(job_id: int) -> int:
    """404 for ids no bigint can hold (the URL converter accepts any digits)."""
    if not 1 <= job_id <= MAX_BIGINT:
        shown = str(job_id)
        abort(404, description=f"unknown job {shown if len(shown) <= 40 else shown[:39] + '…'}")
    return job_id
