"""Several web hosts behind one load balancer: a session signed by one is honoured by another
exactly when both have the same PGDISPATCH_SECRET_KEY (docs/operations.md, the deployment
guide). With a key of its own, each host would send the user back to the sign-in page
whenever the balancer picks another host, and its forms would fail their CSRF check."""

from __future__ import annotations

import dataclasses

from pgdispatch.webapp import create_app, shutdown

from .conftest import TEST_SETTINGS, csrf_from, login


def session_travels(db_url, accounts, other_key: str) -> tuple[int, int]:
    """Sign in on host A; send A's cookie to host B (built with ``other_key``). Returns B's
    status for the overview and for a form post carrying A's CSRF token."""
    accounts("alice")
    a = create_app(TEST_SETTINGS, database_url=db_url, TESTING=True)
    b = create_app(dataclasses.replace(TEST_SETTINGS, secret_key=other_key),
                   database_url=db_url, TESTING=True)
    try:
        on_a = a.test_client()
        assert login(on_a, "alice").status_code == 303
        token = csrf_from(on_a.get("/").get_data(as_text=True))
        cookie = on_a.get_cookie(a.config["SESSION_COOKIE_NAME"])
        on_b = b.test_client()
        on_b.set_cookie(cookie.key, cookie.value)
        page = on_b.get("/")
        post = on_b.post("/projects/web/pause", data={"csrf_token": token, "reason": "x"},
                         headers={"HX-Request": "true"})
        return page.status_code, post.status_code
    finally:
        shutdown(a)
        shutdown(b)


def test_hosts_with_one_key_share_sessions(db_url, accounts, world):
    world.setup()
    assert session_travels(db_url, accounts, TEST_SETTINGS.secret_key) == (200, 200)


def test_a_host_with_another_key_does_not(db_url, accounts, world):
    world.setup()
    page, post = session_travels(db_url, accounts, "another-secret-key-0123456789abcdef")
    assert page in (302, 303) and post in (400, 401, 403)
