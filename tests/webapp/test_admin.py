"""The admin area: accounts, API tokens and limits — admins only, conditional, audited."""

from __future__ import annotations

import json
import re
import threading

from pgdispatch.sql import AlreadyResolved, Conflict, db, limits
from pgdispatch.sql.accounts import create_api_token, set_user_role, token_digest

from .conftest import csrf_from, login
from .support import count

ADMIN_PAGES = ["/admin/", "/admin/limits"]


def _post(client, path: str, data: dict | None = None, *, htmx: bool = False):
    headers = {"HX-Request": "true"} if htmx else {}
    return client.post(path, data={**(data or {}), "csrf_token": client.csrf}, headers=headers)


def _events(conn, action: str) -> list[dict]:
    return conn.execute("SELECT actor, action, subject, reason, details FROM audit_events "
                        "WHERE action = %s ORDER BY id", (action,)).fetchall()


def test_operators_and_viewers_get_403_everywhere_in_the_admin_area(app, signed_in, world):
    world.setup()
    posts = [rule for rule in app.url_map.iter_rules()
             if rule.endpoint.startswith("admin.") and "POST" in rule.methods]
    assert len(posts) == 10
    for path in ADMIN_PAGES:  # signed out: sent to sign in first
        assert app.test_client().get(path).headers["Location"].startswith("/login?next=/admin")
    for name in ("alice", "victor"):
        client = signed_in(name)
        assert 'href="/admin/"' not in client.get("/").get_data(as_text=True)  # no nav link
        for path in ADMIN_PAGES:
            assert client.get(path).status_code == 403, (name, path)
        for rule in posts:
            path = rule.build({"username": "victor", "token_id": 1, "name": "web"})[1]
            response = _post(client, path, {"username": "mallory", "password": "long-enough-pw",
                                             "role": "admin", "expected_role": "viewer",
                                             "slots": "1", "expected_slots": "100"})
            assert response.status_code == 403, (name, path)
    assert count(world.conn, "audit_events", "action NOT IN ('sign_in', 'apply_config')") == 0
    assert world.conn.execute("SELECT count(*) AS n FROM users").fetchone()["n"] == 2
    assert world.conn.execute("SELECT slots FROM pools").fetchone()["slots"] == 100


def test_admin_creates_an_account_that_can_sign_in(app, admin, world):
    page = admin.get("/admin/").get_data(as_text=True)
    assert 'href="/admin/"' in page and "ada" in page
    created = _post(admin, "/admin/users", {"username": "carol", "role": "operator",
                                            "password": "carol-password", "reason": "new on call"})
    assert created.status_code == 303 and created.headers["Location"] == "/admin/"
    assert "user carol created as operator" in admin.get("/admin/").get_data(as_text=True)
    [event] = _events(world.conn, "create_user")
    assert (event["actor"], event["subject"], event["reason"]) == ("ada", "user:carol", "new on call")
    assert event["details"] == {"role": "operator"}
    stored = world.conn.execute("SELECT password_hash FROM users WHERE username = 'carol'").fetchone()
    assert stored["password_hash"].startswith("$argon2id$")
    assert login(app.test_client(), "carol", "carol-password").status_code == 303
    again = _post(admin, "/admin/users", {"username": "carol", "role": "viewer",
                                          "password": "other-password"}, htmx=True)
    assert again.status_code == 409 and b"user carol already exists" in again.data
    for bad, message in [({"username": "x y", "role": "viewer", "password": "long-enough"}, b"username"),
                         ({"username": "dave", "role": "root", "password": "long-enough"}, b"role must be"),
                         ({"username": "dave", "role": "viewer", "password": "short"}, b"at least 8"),
                         ({"username": "dave", "role": "viewer"}, b"password is required")]:
        response = _post(admin, "/admin/users", bad, htmx=True)
        assert response.status_code == 422 and message in response.data, bad
    assert len(_events(world.conn, "create_user")) == 1


def test_role_change_is_conditional_takes_effect_at_once_and_is_audited(admin, signed_in, world):
    world.setup()
    victor = signed_in("victor")
    assert victor.post("/projects/web/pause", data={"reason": "x", "csrf_token": victor.csrf}).status_code == 403
    changed = _post(admin, "/admin/users/victor/role", {"role": "operator", "expected_role": "viewer"},
                    htmx=True)
    assert changed.status_code == 200
    body = changed.get_data(as_text=True)
    assert body.lstrip().startswith('<div id="admin-users"') and "victor is now operator" in body
    # the same stale form again (it still says viewer): refused, says who changed it and to what
    stale = _post(admin, "/admin/users/victor/role", {"role": "admin", "expected_role": "viewer"},
                  htmx=True)
    assert stale.status_code == 409
    assert re.search(rb"victor is already operator \(last change by ada at [0-9-]+ [0-9:]+ UTC\)",
                     stale.data)
    assert b'<div id="admin-users"' in stale.data  # the loser sees the current state
    assert world.conn.execute("SELECT role FROM users WHERE username = 'victor'").fetchone()["role"] == "operator"
    # no new sign-in needed: the role is re-read on every request
    assert victor.post("/projects/web/pause", data={"reason": "x", "csrf_token": victor.csrf}).status_code == 303
    [event] = _events(world.conn, "set_user_role")
    assert event["details"] == {"from": "viewer", "to": "operator"} and event["actor"] == "ada"


def test_an_admin_cannot_lock_themself_out(admin, world):
    demote = _post(admin, "/admin/users/ada/role", {"role": "operator", "expected_role": "admin"})
    assert demote.status_code == 422 and b"cannot demote yourself" in demote.data
    disable = _post(admin, "/admin/users/ada/disable")
    assert disable.status_code == 422 and b"cannot disable your own account" in disable.data
    assert world.conn.execute("SELECT role, disabled_at FROM users WHERE username = 'ada'").fetchone() \
        == {"role": "admin", "disabled_at": None}


def test_two_admins_demoting_each_other_at_once_leave_one_admin(db_url, world):
    """The admin rows are locked (id order) before the last-admin check: the second demotion
    waits for the first, then sees only one admin left and is refused."""
    for name in ("ada", "grace"):
        world.conn.execute("INSERT INTO users (username, password_hash, role) VALUES (%s, 'x', 'admin')",
                           (name,))
    first = db.connect(db_url)
    outcome: dict = {}
    try:
        with first.transaction():
            set_user_role(first, username="grace", role="operator", expected_role="admin",
                          actor="ada")

            def second():
                with db.connect(db_url) as conn:
                    try:
                        set_user_role(conn, username="ada", role="operator",
                                      expected_role="admin", actor="grace")
                        outcome["second"] = "demoted"
                    except Conflict as exc:
                        outcome["second"] = str(exc)

            thread = threading.Thread(target=second)
            thread.start()
            thread.join(1.0)
            assert thread.is_alive(), "the second demotion must wait for the first's locks"
        thread.join(30)
    finally:
        first.close()
    assert outcome["second"] == "ada is the last active admin; make another admin first"
    roles = {r["username"]: r["role"] for r in world.conn.execute("SELECT username, role FROM users")}
    assert roles == {"ada": "admin", "grace": "operator"}


def test_disabling_ends_sessions_and_revokes_tokens_and_enabling_revives_neither(app, admin, signed_in,
                                                                                 world):
    world.setup()
    alice = signed_in("alice")
    token = create_api_token(world.conn, username="alice", name="ci")
    api = app.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    assert api.get("/api/v1/jobs/1", headers=auth).status_code == 404
    assert _post(admin, "/admin/users/alice/disable", {"reason": "left the team"}).status_code == 303
    assert alice.get("/").status_code == 302
    assert api.get("/api/v1/jobs/1", headers=auth).status_code == 401
    assert login(app.test_client(), "alice").status_code == 401
    twice = _post(admin, "/admin/users/alice/disable", htmx=True)
    assert twice.status_code == 409 and b"alice is already disabled (last change by ada" in twice.data
    assert _post(admin, "/admin/users/alice/enable").status_code == 303
    # the token was revoked with the disable, and the old session ended: neither comes back
    assert api.get("/api/v1/jobs/1", headers=auth).status_code == 401
    assert alice.get("/").status_code == 302
    assert world.conn.execute("SELECT revoked_at IS NOT NULL AS r FROM api_tokens WHERE name = 'ci'"
                              ).fetchone()["r"]
    assert login(app.test_client(), "alice").status_code == 303
    assert [e["action"] for e in world.conn.execute(
        "SELECT action FROM audit_events WHERE subject = 'user:alice' AND actor = 'ada' ORDER BY id")] \
        == ["disable_user", "enable_user"]


def test_setting_a_password_signs_out_that_users_other_sessions(app, admin, signed_in, world):
    victor = signed_in("victor")
    assert victor.get("/").status_code == 200
    response = _post(admin, "/admin/users/victor/password", {"password": "a brand new password"})
    assert response.status_code == 303
    assert victor.get("/").status_code == 302  # the password change moved the session generation on
    assert login(app.test_client(), "victor").status_code == 401
    assert login(app.test_client(), "victor", "a brand new password").status_code == 303
    [event] = _events(world.conn, "set_user_password")
    assert event["details"] == {} and "brand new" not in json.dumps(event)
    short = _post(admin, "/admin/users/victor/password", {"password": "short"}, htmx=True)
    assert short.status_code == 422
    assert _post(admin, "/admin/users/nobody/password", {"password": "long enough pw"}).status_code == 404


def test_api_token_is_shown_once_stored_hashed_and_revocable(app, admin, accounts, world):
    accounts("alice")
    page = _post(admin, "/admin/tokens", {"username": "alice", "name": "deploy-bot"})
    assert page.status_code == 200 and page.headers["Cache-Control"] == "no-store"
    html = page.get_data(as_text=True)
    token = re.search(r'<code class="token" id="new-token-value">(pgd_[A-Za-z0-9_-]+)</code>', html).group(1)
    assert "copy it now" in html
    assert token not in admin.get("/admin/").get_data(as_text=True)  # shown once
    stored = world.conn.execute("SELECT id, token_hash FROM api_tokens").fetchone()
    assert stored["token_hash"] == token_digest(token)
    api = app.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    assert api.post("/api/v1/projects/nope/pause", headers=auth, json={"reason": "x"}).status_code == 404
    htmx = _post(admin, "/admin/tokens", {"username": "alice", "name": "second"}, htmx=True)
    assert htmx.status_code == 200 and b'id="new-token-value"' in htmx.data
    assert b'hx-swap-oob="true"' in htmx.data
    revoked = _post(admin, f"/admin/tokens/{stored['id']}/revoke", htmx=True)
    assert revoked.status_code == 200 and f"token {stored['id']} of alice revoked".encode() in revoked.data
    assert api.post("/api/v1/projects/nope/pause", headers=auth, json={"reason": "x"}).status_code == 401
    again = _post(admin, f"/admin/tokens/{stored['id']}/revoke", htmx=True)
    assert again.status_code == 409 and b"token deploy-bot of alice is already revoked" in again.data
    assert _post(admin, "/admin/tokens/999999/revoke").status_code == 404
    assert _post(admin, "/admin/tokens", {"username": "nobody"}).status_code == 404
    events = world.conn.execute("SELECT action, details::text AS d FROM audit_events "
                                "WHERE action LIKE '%api_token' ORDER BY id").fetchall()
    assert [e["action"] for e in events] == ["create_api_token", "create_api_token", "revoke_api_token"]
    assert all(token not in e["d"] and stored["token_hash"] not in e["d"] for e in events)


def test_limits_are_conditional_audited_and_shown_on_the_overview(admin, world):
    world.setup(org_limit=5, pool_slots=4, project_limit=3, weight=2)
    page = admin.get("/admin/limits").get_data(as_text=True)
    assert 'aria-label="Slots of linux"' in page and 'aria-label="Limit of acme"' in page
    ok = _post(admin, "/admin/pools/linux/slots", {"slots": "6", "expected_slots": "4",
                                                   "reason": "two more hosts"}, htmx=True)
    assert ok.status_code == 200 and ok.get_data(as_text=True).lstrip().startswith('<div id="admin-limits"')
    assert b"pool linux: 6 slots (0 running)" in ok.data
    stale = _post(admin, "/admin/pools/linux/slots", {"slots": "8", "expected_slots": "4"}, htmx=True)
    assert stale.status_code == 409
    assert re.search(rb"pool linux now has 6 slots \(last change by ada at ", stale.data)
    assert _post(admin, "/admin/organizations/acme/limit",
                 {"max_running": "7", "expected_max_running": "5"}).status_code == 303
    assert _post(admin, "/admin/projects/web/limits",
                 {"max_running": "", "weight": "5", "expected_max_running": "3",
                  "expected_weight": "2"}).status_code == 303
    row = world.conn.execute("SELECT p.max_running, p.weight, o.max_running AS org, q.slots "
                             "FROM projects p, organizations o, pools q").fetchone()
    assert row == {"max_running": None, "weight": 5, "org": 7, "slots": 6}
    # stale project form: it still says bound 3
    stale = _post(admin, "/admin/projects/web/limits",
                  {"max_running": "1", "weight": "5", "expected_max_running": "3",
                   "expected_weight": "5"}, htmx=True)
    assert stale.status_code == 409 and b"bound none, weight 5" in stale.data
    for path, data in [("/admin/pools/linux/slots", {"slots": "-1", "expected_slots": "6"}),
                       ("/admin/pools/linux/slots", {"slots": "many", "expected_slots": "6"}),
                       ("/admin/pools/linux/slots", {"slots": "3"}),
                       ("/admin/organizations/acme/limit", {"max_running": "100001", "expected_max_running": "7"}),
                       ("/admin/projects/web/limits", {"max_running": "2", "weight": "0",
                                                       "expected_max_running": "", "expected_weight": "5"}),
                       # digits of another script: int() alone read this as 2 (fresh-user run)
                       ("/admin/projects/web/limits", {"max_running": "\u0662", "weight": "5",
                                                       "expected_max_running": "", "expected_weight": "5"})]:
        response = _post(admin, path, data, htmx=True)
        assert response.status_code == 422, (path, data, response.data)
    assert _post(admin, "/admin/pools/gpu/slots", {"slots": "1", "expected_slots": "1"}).status_code == 404
    # saving what is already there changes nothing and audits nothing
    same = _post(admin, "/admin/projects/web/limits",
                 {"max_running": "", "weight": "5", "expected_max_running": "", "expected_weight": "5"},
                 htmx=True)
    assert same.status_code == 200 and b"project web: bound none, weight 5 (unchanged)" in same.data
    details = [(e["subject"], e["details"], e["reason"]) for e in world.conn.execute(
        "SELECT subject, details, reason FROM audit_events WHERE actor = 'ada' AND action LIKE 'set_%' "
        "ORDER BY id")]
    assert details == [
        ("pool:linux", {"from": {"slots": 4}, "to": {"slots": 6}}, "two more hosts"),
        ("organization:acme", {"from": {"max_running": 5}, "to": {"max_running": 7}}, None),
        ("project:web", {"from": {"max_running": 3, "weight": 2}, "to": {"max_running": None, "weight": 5}}, None),
    ]
    overview = admin.get("/").get_data(as_text=True)
    assert re.search(r'<meter min="0" max="6" value="0"[^>]*>0 of 6</meter>', overview)
    assert re.search(r'<meter min="0" max="7" value="0"[^>]*>0 of 7</meter>', overview)


def test_concurrent_limit_edits_have_one_winner(db_url, world):
    world.setup(pool_slots=4)
    results: list[str] = []
    barrier = threading.Barrier(2)

    def edit(slots: int) -> None:
        with db.connect(db_url) as conn:
            barrier.wait()
            try:
                limits.set_pool_slots(conn, pool="linux", slots=slots, expected_slots=4,
                                      actor=f"admin-{slots}")
                results.append("won")
            except AlreadyResolved as exc:
                results.append(str(exc))

    threads = [threading.Thread(target=edit, args=(n,)) for n in (5, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results)[-1] == "won" and sorted(results)[0].startswith("pool linux now has ")
    assert count(world.conn, "audit_events", "action = 'set_pool_slots'") == 1


def test_admin_pages_work_as_plain_forms_too(admin, world):
    world.setup(targets=("production",))
    for page in ADMIN_PAGES:
        html = admin.get(page).get_data(as_text=True)
        assert csrf_from(html)
        forms = re.findall(r"<form[^>]*>", html)
        assert len(forms) >= 3, page
        for form in forms:
            if 'action="/logout"' in form or 'role="search"' in form:
                continue  # sign-out, and the top bar's job search (a GET: it changes nothing)
            assert 'method="post"' in form and "hx-post=" in form, form
