"""A session that ends while a console page is open: the sign-in page says so and returns to
that page; an htmx poll or action is answered 401 with HX-Redirect (never a page to swap into
a fragment), before any CSRF check (webapp/auth.py)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from .conftest import PASSWORDS, csrf_from
from .support import count

COOKIE = "pgdispatch_session"


def _end_sessions(conn, username: str) -> None:
    """What signing out elsewhere, a new password or a demotion do to every session."""
    conn.execute("UPDATE users SET session_generation = session_generation + 1 "
                 "WHERE username = %s", (username,))


def _query(location: str) -> dict[str, list[str]]:
    parts = urlsplit(location)
    assert parts.path == "/login" and not parts.netloc, location
    return parse_qs(parts.query)


def test_an_htmx_poll_of_an_ended_session_is_sent_to_sign_in_again(operator, world):
    world.setup()
    _end_sessions(world.conn, "alice")
    poll = operator.get("/queue/?project=web", headers={
        "HX-Request": "true", "HX-Current-URL": "http://localhost/queue/?project=web"})
    assert poll.status_code == 401
    assert poll.headers["HX-Reswap"] == "none" and "HX-Request" in poll.headers["Vary"]
    assert _query(poll.headers["HX-Redirect"]) == {"next": ["/queue/?project=web"], "ended": ["1"]}
    body = poll.get_data(as_text=True)
    assert 'id="session-ended"' in body and "Sign in" in body and "<form" not in body
    # a page of another site named as the current URL is no place to return to
    foreign = operator.get("/queue/", headers={"HX-Request": "true",
                                               "HX-Current-URL": "http://evil.example/queue/"})
    assert _query(foreign.headers["HX-Redirect"]) == {"ended": ["1"]}
    # the sign-in page says why, and signing in returns to the page
    page = operator.get(poll.headers["HX-Redirect"])
    html = page.get_data(as_text=True)
    assert page.status_code == 200 and "Your session has ended" in html
    again = operator.post("/login", data={"username": "alice", "password": PASSWORDS["alice"],
                                          "csrf_token": csrf_from(html),
                                          "next": "/queue/?project=web"})
    assert again.status_code == 303 and again.headers["Location"] == "/queue/?project=web"
    assert operator.get("/queue/?project=web").status_code == 200


def test_an_action_from_a_page_whose_session_is_gone_reads_session_ended(app, operator, world):
    world.setup()
    # the cookie is gone altogether (expired, cleared): the CSRF token of the page is stale too
    stale = app.test_client()
    action = stale.post("/projects/web/pause", data={"reason": "freeze"}, headers={
        "HX-Request": "true", "X-CSRFToken": operator.csrf,
        "HX-Current-URL": "http://localhost/projects/"})
    assert action.status_code == 401, action.get_data(as_text=True)
    assert _query(action.headers["HX-Redirect"]) == {"next": ["/projects/"], "ended": ["1"]}
    assert world.conn.execute("SELECT paused_at FROM projects WHERE name = 'web'").fetchone()["paused_at"] is None
    assert count(world.conn, "audit_events", "action = 'pause_project'") == 0
    # a plain form POST of an ended session: to sign in, with no POST URL to return to
    _end_sessions(world.conn, "alice")
    plain = operator.post("/projects/web/pause", data={"reason": "x", "csrf_token": operator.csrf})
    assert plain.status_code == 302 and _query(plain.headers["Location"]) == {"ended": ["1"]}


def test_a_plain_page_load_says_the_session_ended_only_when_there_was_one(app, operator, world):
    _end_sessions(world.conn, "alice")
    ended = operator.get("/runners/")
    assert ended.status_code == 302
    assert _query(ended.headers["Location"]) == {"next": ["/runners/"], "ended": ["1"]}
    first_visit = app.test_client().get("/runners/")
    assert _query(first_visit.headers["Location"]) == {"next": ["/runners/"]}
    plain = app.test_client().get("/login?next=/runners/").get_data(as_text=True)
    assert "session has ended" not in plain
