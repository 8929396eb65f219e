"""CSRF protection and the security headers every response carries.

Every state-changing console request (POST) needs the session's CSRF token, as a form field
or, for htmx, the ``X-CSRFToken`` header that ``base.html`` sets on every htmx request; the
JSON API is exempt because it authenticates by bearer token only, never by cookie.
"""

from __future__ import annotations

from flask import Flask, Response, current_app, request
from flask_wtf.csrf import CSRFProtect

csrf = CSRFProtect()

# Scripts only from this origin (the vendored htmx), so no inline script or handler runs;
# styles likewise, which is why capacity bars are <meter> elements, not inline widths.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])


def init_app(app: Flask) -> None:
    """Install CSRFProtect and the header hook."""
    csrf.init_app(app)
    app.after_request(_headers)


def _headers(response: Response) -> Response:
    h = response.headers
    h.setdefault("X-Content-Type-Options", "nosniff")
    h.setdefault("X-Frame-Options", "DENY")
    h.setdefault("Referrer-Policy", "same-origin")
    h.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
    h.setdefault("Cross-Origin-Opener-Policy", "same-origin")
    h.setdefault("Cross-Origin-Resource-Policy", "same-origin")
    h.setdefault("Permissions-Policy", "camera=(), microphone=(), geolocation=(), payment=()")
    if current_app.config.get("SESSION_COOKIE_SECURE"):
        # secure cookies mean the console is served over HTTPS: browsers should insist on it
        h.setdefault("Strict-Transport-Security", "max-age=31536000")
    if request.endpoint != "static" and "Cache-Control" not in h:
        # pages show live state and operator data: never cached, never served stale
        h["Cache-Control"] = "no-store"
    return response
