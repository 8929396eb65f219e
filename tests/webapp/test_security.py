"""Whole-application checks, enumerated from ``app.url_map`` so a new route cannot slip by:
every POST is audited, every console POST needs the CSRF token (htmx included), every
response carries the security headers; and no open redirect, no password in a log."""

from __future__ import annotations

import logging
import re

import pytest

from pgdispatch.sql import transitions
from pgdispatch.sql.accounts import create_api_token, token_digest

from .conftest import PASSWORDS, csrf_from, login
from .support import make_uncertain_target

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}
SAMPLE_ARGS = {"job_id": 1, "name": "web", "username": "victor", "token_id": 1, "runner_id": 1}


def post_rules(app):
    return sorted((rule for rule in app.url_map.iter_rules() if "POST" in rule.methods),
                  key=lambda r: r.rule)


def get_rules(app):
    return sorted((rule for rule in app.url_map.iter_rules() if "GET" in rule.methods),
                  key=lambda r: r.rule)


def path_of(rule, **args) -> str:
    return rule.build({**SAMPLE_ARGS, **args}, append_unknown=False)[1]


def last_event_id(conn) -> int:
    return conn.execute("SELECT coalesce(max(id), 0) AS n FROM audit_events").fetchone()["n"]


@pytest.fixture
def stage(world, accounts):
    """Something for every action to act on: an uncertain target, a paused project, jobs
    waiting for approval, queued and cancelled, a user and an API token."""
    make_uncertain_target(world)
    for name in ("api", "ops", "tools"):
        world.project(name, org="acme", pools=("linux",))
    for name in ("api", "tools"):
        transitions.pause_project(world.conn, project=name, reason="freeze", actor="test")
    accounts("alice", "bob", "victor", "ada")
    jobs = {name: world.job(requires_approval=(name.endswith("approve")))["id"]
            for name in ("console_approve", "console_cancel", "console_retry",
                         "api_approve", "api_cancel", "api_retry", "console_bulk", "api_bulk",
                         "console_priority", "api_priority")}
    for name in ("console_retry", "api_retry"):
        transitions.cancel_job(world.conn, job_id=jobs[name], actor="test")
    token_id = world.conn.execute(
        "SELECT id FROM api_tokens WHERE token_hash = %s",
        (token_digest(create_api_token(world.conn, username="victor", name="old")),)
    ).fetchone()["id"]
    return {"jobs": jobs, "alice_token": create_api_token(world.conn, username="alice"),
            "token_id": token_id}


def test_every_post_route_writes_an_audit_event(app, signed_in, stage, world):
    """Hit every POST rule of the application with valid input; each must add at least one
    audit event naming the right actor. A POST route missing from CASES fails the test."""
    operator, admin = signed_in("alice"), signed_in("ada")
    jobs = stage["jobs"]
    bearer = {"Authorization": f"Bearer {stage['alice_token']}"}
    fresh = app.test_client()
    runner = world.conn.execute("SELECT min(id) AS id FROM runners WHERE stopped_at IS NULL"
                                ).fetchone()["id"]

    def sign_in(_rule):
        return login(fresh, "bob")

    def form(client, **data):
        return lambda rule, **args: client.post(path_of(rule, **args),
                                                data={**data, "csrf_token": client.csrf})

    def api(body=None, **args):
        return lambda rule: app.test_client().post(path_of(rule, **args), headers=bearer,
                                                   json=body if body is not None else {})

    CASES = {  # endpoint: (request, actor)
        "auth.login": (sign_in, "bob"),
        "auth.logout": (lambda rule: operator.post("/logout", data={"csrf_token": operator.csrf}),
                        "alice"),
        "projects.pause": (form(operator, reason="freeze for INC-1"), "alice"),
        "projects.resume": (lambda rule: form(operator)(rule, name="api"), "alice"),
        "targets.resolve": (lambda rule: form(operator, outcome="failed", note="not deployed")(
            rule, name="production"), "alice"),
        "jobs.approve": (lambda rule: form(operator)(rule, job_id=jobs["console_approve"]), "alice"),
        "jobs.cancel": (lambda rule: form(operator)(rule, job_id=jobs["console_cancel"]), "alice"),
        "jobs.retry": (lambda rule: form(operator)(rule, job_id=jobs["console_retry"]), "alice"),
        "admin.create_user": (form(admin, username="carol", role="viewer",
                                   password="carol-password"), "ada"),
        "admin.set_role": (form(admin, role="operator", expected_role="viewer"), "ada"),
        "admin.disable": (lambda rule: form(admin)(rule, username="bob"), "ada"),
        "admin.enable": (lambda rule: form(admin)(rule, username="bob"), "ada"),
        "admin.set_password": (form(admin, password="victor-new-password"), "ada"),
        "admin.create_token": (form(admin, username="victor", name="dash"), "ada"),
        "admin.revoke_token": (lambda rule: form(admin)(rule, token_id=stage["token_id"]), "ada"),
        "admin.set_organization_limit": (lambda rule: form(
            admin, max_running="50", expected_max_running="100")(rule, name="acme"), "ada"),
        "admin.set_project_limits": (form(admin, max_running="4", weight="2",
                                          expected_max_running="", expected_weight="1"), "ada"),
        "admin.set_pool_slots": (lambda rule: form(admin, slots="7", expected_slots="100")(
            rule, name="linux"), "ada"),
        "jobs.bulk_apply": (form(operator, action="cancel", jobs=f"{jobs['console_bulk']}:0"), "alice"),
        "jobs.set_priority": (lambda rule: form(operator, priority="3")(
            rule, job_id=jobs["console_priority"]), "alice"),
        "api.bulk_jobs": (api({"action": "cancel", "dry_run": False, "job_ids": [jobs["api_bulk"]]}),
                          "alice"),
        "api.set_job_priority": (lambda rule: api({"priority": 4}, job_id=jobs["api_priority"])(rule),
                                 "alice"),
        "api.submit_job": (api({"project": "web", "pool": "linux", "command": ["make"]}), "alice"),
        "api.cancel_job": (lambda rule: api(job_id=jobs["api_cancel"])(rule), "alice"),
        "api.approve_job": (lambda rule: api(job_id=jobs["api_approve"])(rule), "alice"),
        "api.retry_job": (lambda rule: api(job_id=jobs["api_retry"])(rule), "alice"),
        "api.pause_project": (api({"reason": "freeze"}, name="ops"), "alice"),
        "api.resume_project": (api(name="tools"), "alice"),
        "api.resolve_target": None,  # set below: needs an uncertain target of its own
        # (in rule order, as they run: each pause and drain before its resume)
        "pools.pause": (lambda rule: form(operator, reason="kernel upgrade")(rule, name="linux"),
                        "alice"),
        "pools.resume": (lambda rule: form(operator)(rule, name="linux"), "alice"),
        "runners.drain": (lambda rule: form(operator, reason="reboot", deadline_seconds="60")(
            rule, runner_id=runner), "alice"),
        "runners.resume": (lambda rule: form(operator)(rule, runner_id=runner), "alice"),
        "api.pause_pool": (api({"reason": "freeze"}, name="linux"), "alice"),
        "api.resume_pool": (api(name="linux"), "alice"),
        "api.drain_runner": (lambda rule: api({"reason": "reboot"}, runner_id=runner)(rule), "alice"),
        "api.resume_runner": (lambda rule: api(runner_id=runner)(rule), "alice"),
    }
    # the console resolves "production"; the API gets a second uncertain target
    make_uncertain_target(world, "staging", project="web")
    CASES["api.resolve_target"] = (api({"outcome": "retry", "note": "rerun"}, name="staging"),
                                   "alice")
    # sign-out first in the list would end alice's session: run it last
    order = sorted(post_rules(app), key=lambda r: r.endpoint == "auth.logout")
    assert {r.endpoint for r in order} == set(CASES), "a POST route has no audit case"
    for rule in order:
        before = last_event_id(world.conn)
        call, actor = CASES[rule.endpoint]
        response = call(rule)
        assert response.status_code < 400, (rule.endpoint, response.status_code,
                                            response.get_data(as_text=True)[:300])
        events = world.conn.execute("SELECT actor, action FROM audit_events WHERE id > %s",
                                    (before,)).fetchall()
        assert events, f"{rule.endpoint} ({rule.rule}) changed state without an audit event"
        assert {e["actor"] for e in events} == {actor}, (rule.endpoint, events)


def test_every_console_post_needs_the_csrf_token_htmx_included(app, signed_in, stage, world):
    admin = signed_in("ada")
    before = last_event_id(world.conn)
    console_posts = [r for r in post_rules(app) if r.endpoint.split(".")[0] != "api"]
    assert len(console_posts) >= 18
    for rule in console_posts:
        path = path_of(rule, job_id=stage["jobs"]["console_cancel"])
        data = {"reason": "r", "outcome": "failed", "note": "n", "username": "x", "password": "y" * 9,
                "role": "viewer", "slots": "1", "expected_slots": "100"}
        # an htmx request without the X-CSRFToken header (and no form token)
        htmx = admin.post(path, data=data, headers={"HX-Request": "true"})
        assert htmx.status_code == 400, (rule.rule, htmx.status_code)
        assert htmx.headers["HX-Reswap"] == "none" and b"reload the page" in htmx.data
        # a token from another session
        forged = admin.post(path, data=data, headers={"HX-Request": "true", "X-CSRFToken": "forged"})
        assert forged.status_code == 400, rule.rule
        plain = admin.post(path, data=data)
        assert plain.status_code == 400, rule.rule
    assert last_event_id(world.conn) == before
    assert world.conn.execute("SELECT state FROM jobs WHERE id = %s",
                              (stage["jobs"]["console_cancel"],)).fetchone()["state"] == "queued"
    # the header alone is enough (that is what htmx sends)
    ok = admin.post(f"/jobs/{stage['jobs']['console_cancel']}/cancel",
                    headers={"HX-Request": "true", "X-CSRFToken": admin.csrf})
    assert ok.status_code == 200


def _assert_headers(response, what: str) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (what, name, response.status_code)
    csp = response.headers.get("Content-Security-Policy", "")
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, what


def test_every_response_carries_the_security_headers(app, signed_in, stage):
    admin = signed_in("ada")
    anonymous = app.test_client()
    seen = 0
    for rule in get_rules(app):
        path = path_of(rule, filename="app.css")
        for client, who in ((admin, "admin"), (anonymous, "anonymous")):
            for headers in ({}, {"HX-Request": "true"}):
                response = client.get(path, headers=headers)
                response.close()  # a static file's response holds the file open
                _assert_headers(response, f"{who} GET {path} {headers}")
                seen += 1
    assert seen >= 4 * 15
    victor = signed_in("victor")
    bearer = {"Authorization": f"Bearer {stage['alice_token']}"}
    extra = [
        anonymous.get("/no/such/page"),                                   # 404
        admin.get("/logout"),                                             # 405
        admin.post("/projects/web/pause", data={"reason": "x"}),          # 400 CSRF
        victor.post("/projects/web/pause", data={"reason": "x", "csrf_token": victor.csrf}),  # 403
        anonymous.post("/api/v1/jobs", json={}),                          # 401
        anonymous.post("/api/v1/jobs", headers=bearer,                    # 413
                       data="x" * (2 * 1024 * 1024), content_type="application/json"),
    ]
    assert sorted(r.status_code for r in extra) == [400, 401, 403, 404, 405, 413]
    for response in extra:
        _assert_headers(response, str(response.status_code))
    assert "Strict-Transport-Security" not in extra[0].headers  # plain HTTP: no HSTS


def test_hsts_and_secure_cookies_together(make_app, accounts):
    accounts("alice")
    app = make_app(SESSION_COOKIE_SECURE=True)
    client = app.test_client()
    response = login(client, "alice")
    assert "Secure" in response.headers["Set-Cookie"] and "HttpOnly" in response.headers["Set-Cookie"]
    assert response.headers["Strict-Transport-Security"].startswith("max-age=")


NASTY_NEXT = ["//evil.example/x", "https://evil.example/", "http:/evil.example", "/\\evil.example",
              "\\\\evil.example", "/\t/evil.example", "/\n/evil.example", "/\r\n/evil.example",
              " //evil.example", "javascript:alert(1)", "evil.example", "/\x00/evil.example",
              "/\x7f/evil.example", "///evil.example", "/ /evil.example"]


def test_next_never_leaves_the_site(app, accounts):
    accounts("alice")
    anonymous = app.test_client()
    for target in NASTY_NEXT:  # the form does not even carry it
        page = anonymous.get("/login", query_string={"next": target}).get_data(as_text=True)
        assert 'name="next"' not in page, repr(target)
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    response = client.post("/login", query_string={"next": NASTY_NEXT[0]}, data={
        "username": "alice", "password": PASSWORDS["alice"], "csrf_token": token,
        "next": NASTY_NEXT[0]})
    assert response.status_code == 303 and response.headers["Location"] == "/"
    # signed in, GET /login?next=… redirects at once (the same check as the POST's)
    for target in NASTY_NEXT:
        again = client.get("/login", query_string={"next": target})
        assert again.status_code == 302 and again.headers["Location"] == "/", repr(target)
    assert client.get("/login?next=/audit/").headers["Location"] == "/audit/"


def test_next_keeps_a_local_path_with_its_query(app, accounts):
    accounts("alice")
    client = app.test_client()
    first = client.get("/queue/?project=web&reason=ready")
    assert first.status_code == 302
    login_page = client.get(first.headers["Location"]).get_data(as_text=True)
    next_value = re.search(r'name="next" value="([^"]+)"', login_page).group(1)
    assert next_value.replace("&amp;", "&") == "/queue/?project=web&reason=ready"
    response = client.post("/login", data={"username": "alice", "password": PASSWORDS["alice"],
                                           "csrf_token": csrf_from(login_page),
                                           "next": "/queue/?project=web&reason=ready"})
    assert response.headers["Location"] == "/queue/?project=web&reason=ready"


def test_passwords_never_reach_a_log_or_the_audit_log(app, signed_in, accounts, world, caplog):
    caplog.set_level(logging.DEBUG)
    accounts("alice")
    client = app.test_client()
    assert login(client, "alice", "wrong-guess-password-123").status_code == 401
    assert login(client, "alice", "wrong-guess-password-123\x00").status_code == 401
    assert login(client, "alice").status_code == 303
    admin = signed_in("ada")
    for path, data in [("/admin/users", {"username": "carol", "role": "viewer",
                                         "password": "carols-secret-password"}),
                       ("/admin/users/carol/password", {"password": "carols-second-secret"}),
                       ("/admin/users/carol/password", {"password": "short"})]:
        admin.post(path, data={**data, "csrf_token": admin.csrf})
    text = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert "failed sign-in from" in text  # the failure is logged…
    audit = " ".join(str(row) for row in world.conn.execute("SELECT * FROM audit_events"))
    for secret in ("wrong-guess-password-123", PASSWORDS["alice"], PASSWORDS["ada"],
                   "carols-secret-password", "carols-second-secret"):
        assert secret not in text, secret  # …but never a password
        assert secret not in audit, secret
    stored = world.conn.execute("SELECT password_hash FROM users WHERE username = 'carol'").fetchone()
    assert stored["password_hash"].startswith("$argon2id$")
    assert stored["password_hash"] not in text and stored["password_hash"] not in audit


def test_sign_in_and_out_are_audited_with_the_address(app, accounts, world):
    accounts("alice")
    client = app.test_client()
    login(client, "alice")
    page = client.get("/").get_data(as_text=True)
    client.post("/logout", data={"csrf_token": csrf_from(page)})
    rows = world.conn.execute("SELECT actor, action, subject, details FROM audit_events "
                              "ORDER BY id").fetchall()
    assert [(r["actor"], r["action"], r["subject"]) for r in rows] == [
        ("alice", "sign_in", "user:alice"), ("alice", "sign_out", "user:alice")]
    assert rows[0]["details"] == {"address": "127.0.0.1"}
