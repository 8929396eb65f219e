"""Sign-in, roles, CSRF, rate limit, cookies and security headers."""

from __future__ import annotations

from pgdispatch.webapp import create_app, shutdown

from .conftest import TEST_SETTINGS, csrf_from, login
from .support import count

CONSOLE_PAGES = ["/", "/queue/", "/projects/", "/targets/", "/jobs/", "/runners/", "/audit/"]


def test_every_console_page_requires_login(app):
    client = app.test_client()
    for path in CONSOLE_PAGES + ["/jobs/1"]:
        response = client.get(path)
        assert response.status_code == 302, path
        assert response.headers["Location"].startswith("/login?next="), path


def test_htmx_poll_without_session_is_sent_to_login_not_given_a_login_page(app):
    response = app.test_client().get("/queue/", headers={"HX-Request": "true"})
    assert response.status_code == 401
    assert response.headers["HX-Redirect"].startswith("/login")
    assert b"<form" not in response.data


def test_login_then_pages_render(app, accounts):
    accounts("alice")
    client = app.test_client()
    response = login(client, "alice")
    assert response.status_code == 303 and response.headers["Location"] == "/"
    for path in CONSOLE_PAGES:
        page = client.get(path)
        assert page.status_code == 200, path
        assert b"alice" in page.data


def test_wrong_password_fails_and_unknown_user_looks_the_same(app, accounts):
    accounts("alice")
    client = app.test_client()
    wrong = login(client, "alice", "not-her-password")
    assert wrong.status_code == 401
    assert b"wrong username or password" in wrong.data
    assert client.get("/").status_code == 302
    unknown = login(client, "mallory", "whatever-password")
    assert unknown.status_code == 401
    assert b"wrong username or password" in unknown.data


def test_malformed_username_is_a_failed_login_not_an_error(app):
    for username in ["a\x00b", "x" * 64, ""]:
        response = login(app.test_client(), username, "whatever-password")
        assert response.status_code == 401, repr(username)
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    raw = client.post("/login", data=f"username=%FF%FE&password=%00&csrf_token={token}",
                      content_type="application/x-www-form-urlencoded")
    assert raw.status_code == 401


def test_login_is_rate_limited_per_client(app, accounts):
    accounts("alice")
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    statuses = [client.post("/login", data={"username": "alice", "password": "guess-%d" % i,
                                            "csrf_token": token}).status_code
                for i in range(11)]
    assert statuses[:10] == [401] * 10
    assert statuses[10] == 429
    # even the right password is refused until the window passes
    right = client.post("/login", data={"username": "alice", "password": "alice-password",
                                        "csrf_token": token})
    assert right.status_code == 429
    assert client.get("/").status_code == 302


def test_next_only_redirects_within_the_site(app, accounts):
    accounts("alice")
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    response = client.post("/login?next=//evil.example/x", data={
        "username": "alice", "password": "alice-password", "csrf_token": token})
    assert response.headers["Location"] == "/"
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    response = client.post("/login", data={"username": "alice", "password": "alice-password",
                                           "csrf_token": token, "next": "/queue/?project=web"})
    assert response.headers["Location"] == "/queue/?project=web"


def test_logout_is_a_post_with_csrf(operator):
    assert operator.get("/logout").status_code == 405
    response = operator.post("/logout", data={"csrf_token": operator.csrf})
    assert response.status_code == 303
    assert operator.get("/").status_code == 302


def test_post_without_csrf_token_is_refused_and_changes_nothing(operator, world):
    world.setup()
    response = operator.post("/projects/web/pause", data={"reason": "no token"})
    assert response.status_code == 400
    assert b"reload the page" in response.data
    htmx = operator.post("/projects/web/pause", data={"reason": "no token"},
                         headers={"HX-Request": "true"})
    assert htmx.status_code == 400 and htmx.headers["HX-Reswap"] == "none"
    assert b'hx-swap-oob="true"' in htmx.data
    wrong = operator.post("/projects/web/pause", data={"reason": "bad", "csrf_token": "forged"})
    assert wrong.status_code == 400
    assert world.conn.execute("SELECT paused_at FROM projects WHERE name='web'").fetchone()["paused_at"] is None
    assert count(world.conn, "audit_events", "action = 'pause_project'") == 0


def test_login_form_itself_needs_csrf(app):
    response = app.test_client().post("/login", data={"username": "alice", "password": "alice-password"})
    assert response.status_code == 400


def test_security_headers_and_cookie_flags(app, accounts):
    accounts("alice")
    client = app.test_client()
    response = login(client, "alice")
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie
    page = client.get("/")
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["X-Frame-Options"] == "DENY"
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Referrer-Policy"] == "same-origin"
    assert page.headers["Cache-Control"] == "no-store"
    assert "<script>" not in page.get_data(as_text=True)  # no inline script anywhere


def test_secure_cookies_from_the_environment(db_url, accounts, monkeypatch):
    accounts("alice")
    monkeypatch.setenv("PGDISPATCH_SECURE_COOKIES", "1")
    app = create_app(TEST_SETTINGS, database_url=db_url, TESTING=True)
    try:
        assert app.config["SESSION_COOKIE_SECURE"] is True
        client = app.test_client()
        response = login(client, "alice")
        assert "Secure" in response.headers["Set-Cookie"]
    finally:
        shutdown(app)


def test_disabled_account_loses_its_session(operator, world):
    world.conn.execute("UPDATE users SET disabled_at = now() WHERE username = 'alice'")
    assert operator.get("/").status_code == 302


def test_unknown_page_is_a_404_page(operator):
    response = operator.get("/no/such/page")
    assert response.status_code == 404
    assert b"no such page" in response.data
