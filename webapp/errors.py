"""Errors become a JSON ``{"error": ...}`` under /api/, an out-of-band flash for htmx, or an
error page; never a traceback. ``pgdispatch.sql.errors`` exceptions carry their own HTTP status."""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify, make_response, render_template, request, url_for
from flask_wtf.csrf import CSRFError
from werkzeug.exceptions import HTTPException

from pgdispatch.sql import PgDispatchError

from .views import flash_oob, is_htmx

log = logging.getLogger(__name__)


def init_app(app: Flask) -> None:
    """Register the handlers."""
    app.register_error_handler(CSRFError, _csrf_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(PgDispatchError, _pgdispatch_error)
    app.register_error_handler(Exception, _unexpected)


def is_api() -> bool:
    return request.path.startswith("/api/")


def error_response(status: int, message: str) -> Response:
    """The one shape of an error, chosen by who asked."""
    if is_api():
        response = jsonify(error=message)
        response.status_code = status
        if status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="pgdispatch"'
        return response
    try:
        if is_htmx():
            response = make_response(flash_oob("error", message), status)
            response.headers["HX-Reswap"] = "none"
            response.vary.add("HX-Request")
            return response
        back = request.referrer if request.referrer and request.referrer.startswith(request.host_url) \
            else url_for("overview.index")
        return make_response(render_template("errors/index.html", status=status, message=message,
                                             back=back), status)
    except Exception as exc:  # the page itself failed (the database is down, say): plain text
        if isinstance(exc, PgDispatchError):
            # every template is given the signed-in operator, read from the database: in an
            # outage that fails too, which is no news (logged once above), so no traceback
            log.warning("error for %s %s answered as text: %s", request.method, request.path, exc)
        else:
            log.exception("rendering the error page failed")
        response = make_response(f"{status}: {message}", status,
                                 {"Content-Type": "text/plain; charset=utf-8"})
        if is_htmx():
            response.headers["HX-Reswap"] = "none"
            response.vary.add("HX-Request")
        return response


def _csrf_error(exc: CSRFError):
    return error_response(400, f"the form expired or was not sent from the console ({exc.description}); "
                               "reload the page and try again")


def _http_error(exc: HTTPException):
    if exc.code is None or exc.code < 400:
        return exc
    message = exc.description or exc.name
    if exc.code == 404 and "requested URL was not found" in message:
        message = "no such page"
    if exc.code == 405:
        message = f"method {request.method} is not allowed here"
    response = error_response(exc.code, message)
    if exc.code == 405 and getattr(exc, "valid_methods", None):
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response


def _pgdispatch_error(exc: PgDispatchError):
    if exc.http_status >= 500:
        log.warning("%s: %s", type(exc).__name__, exc)
    return error_response(exc.http_status, str(exc))


def _unexpected(exc: Exception):
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(500, "internal error; the details are in the server log")
