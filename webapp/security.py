"""CSRF protection and the security headers every response carries."""

from __future__ import annotations

from flask import Flask, Response, request
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
    if request.endpoint != "static" and "Cache-Control" not in h:
        # pages show live state and operator data: never cached, never served stale
        h["Cache-Control"] = "no-store"
    return response
