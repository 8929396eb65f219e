"""Console sessions end server-side: a copied session cookie is worth nothing after its user
signs out, gets a new password, is disabled or demoted (users.session_generation, checked on
every request by pgd_session_user, sql/functions/accounts.sql)."""

from __future__ import annotations

import pytest

from ..variants import variant_sql
from .conftest import csrf_from, login
from .support import count

COOKIE = "pgdispatch_session"


def _copy_of(client, app):
    """A second client holding the same session cookie (and the page's CSRF token): what an
    attacker has who copied the cookie."""
    copy = app.test_client()
    copy.set_cookie(COOKIE, client.get_cookie(COOKIE).value)
    copy.csrf = client.csrf
    return copy


def _replay_pause(copy):
    return copy.post("/projects/web/pause", data={"reason": "replayed", "csrf_token": copy.csrf})


def _replay_refused(world, copy) -> bool:
    """The replayed pause was refused (sent to sign in), changed nothing, audited nothing."""
    before = count(world.conn, "audit_events", "action = 'pause_project'")
    response = _replay_pause(copy)
    paused = world.conn.execute("SELECT paused_at FROM projects WHERE name = 'web'").fetchone()
    return (response.status_code in (302, 401) and "/login" in response.headers.get("Location", "/login")
            and paused["paused_at"] is None
            and count(world.conn, "audit_events", "action = 'pause_project'") == before)


def test_a_copied_cookie_is_refused_after_logout(app, operator, world):
    world.setup()
    copy = _copy_of(operator, app)
    assert copy.get("/").status_code == 200  # the copy works while the session lives
    assert operator.post("/logout", data={"csrf_token": operator.csrf}).status_code == 303
    assert _replay_refused(world, copy)
    htmx = copy.post("/projects/web/pause", data={"reason": "replayed", "csrf_token": copy.csrf},
                     headers={"HX-Request": "true"})
    assert htmx.status_code == 401 and htmx.headers["HX-Redirect"].startswith("/login")
    actions = [r["action"] for r in world.conn.execute(
        "SELECT action FROM audit_events WHERE actor = 'alice' ORDER BY id")]
    assert actions == ["sign_in", "sign_out"]


def test_logout_ends_every_session_of_the_user(app, signed_in, world):
    world.setup()
    laptop, phone = signed_in("alice"), signed_in("alice")
    assert phone.post("/logout", data={"csrf_token": phone.csrf}).status_code == 303
    assert laptop.get("/").status_code == 302
    # signing in again gives a working session
    fresh = app.test_client()
    assert login(fresh, "alice").status_code == 303 and fresh.get("/").status_code == 200


@pytest.mark.parametrize("change, form", [
    ("password", {"password": "another long password"}),
    ("disable", {}),
    ("role", {"role": "viewer", "expected_role": "operator"}),
])
def test_an_admin_change_ends_the_users_sessions(app, admin, operator, world, change, form):
    world.setup()
    copy = _copy_of(operator, app)
    response = admin.post(f"/admin/users/alice/{change}", data={**form, "csrf_token": admin.csrf})
    assert response.status_code == 303
    assert operator.get("/").status_code == 302
    assert _replay_refused(world, copy)


def test_a_session_from_before_generations_is_refused(app, operator, world):
    """A session cookie whose user id is the old "id:fingerprint" form loads no user."""
    world.setup()
    with operator.session_transaction() as s:
        s["_user_id"] = s["_user_id"].split(":")[0] + ":0123456789abcdef"
    assert operator.get("/").status_code == 302


def test_broken_variant_without_the_generation_check_lets_the_replay_through(app, operator,
                                                                             world):
    """The same replay against a pgd_session_user that ignores the generation: the pause
    goes through, audited as alice — what the check above exists to refuse."""
    world.setup()
    world.conn.execute(variant_sql(world.conn, "pgd_session_user", [
        ("u.session_generation = p_session_generation", "p_session_generation IS NOT NULL")]))
    copy = _copy_of(operator, app)
    assert operator.post("/logout", data={"csrf_token": operator.csrf}).status_code == 303
    assert not _replay_refused(world, copy)
    assert count(world.conn, "audit_events", "action = 'pause_project' AND actor = 'alice'") == 1


def test_the_login_page_after_logout_offers_a_fresh_csrf_token(app, operator):
    operator.post("/logout", data={"csrf_token": operator.csrf})
    assert csrf_from(operator.get("/login").get_data(as_text=True))
