"""Pausing and resuming projects from the console: roles, audit, htmx fragments, conflicts."""

from __future__ import annotations

from .support import count


def _project(conn, name="web"):
    return conn.execute("SELECT * FROM projects WHERE name = %s", (name,)).fetchone()


def test_viewer_sees_no_buttons_and_cannot_pause(viewer, world):
    world.setup()
    page = viewer.get("/projects/").get_data(as_text=True)
    assert "web" in page
    assert "Pause" not in page and "/projects/web/pause" not in page
    response = viewer.post("/projects/web/pause", data={"reason": "sneaky", "csrf_token": viewer.csrf})
    assert response.status_code == 403
    htmx = viewer.post("/projects/web/pause", data={"reason": "sneaky", "csrf_token": viewer.csrf},
                       headers={"HX-Request": "true"})
    assert htmx.status_code == 403 and b"only view" in htmx.data
    assert _project(world.conn)["paused_at"] is None
    assert count(world.conn, "audit_events", "action = 'pause_project'") == 0


def test_operator_pauses_with_a_plain_form_and_it_is_audited(operator, world):
    world.setup()
    response = operator.post("/projects/web/pause",
                             data={"reason": "release freeze", "csrf_token": operator.csrf})
    assert response.status_code == 303 and response.headers["Location"] == "/projects/"
    row = _project(world.conn)
    assert row["paused_at"] is not None and row["paused_by"] == "alice"
    assert row["pause_reason"] == "release freeze"
    event = world.conn.execute("SELECT * FROM audit_events WHERE action = 'pause_project'").fetchone()
    assert event["actor"] == "alice" and event["subject"] == "project:web"
    assert event["reason"] == "release freeze"
    page = operator.get("/projects/").get_data(as_text=True)
    assert "project web paused" in page  # the flash after the redirect
    assert "by <strong>alice</strong>" in page and "release freeze" in page
    assert "Resume" in page


def test_pause_needs_a_reason(operator, world):
    world.setup()
    response = operator.post("/projects/web/pause", data={"reason": "   ", "csrf_token": operator.csrf})
    assert response.status_code == 422
    assert b"reason is required" in response.data
    assert _project(world.conn)["paused_at"] is None


def test_htmx_pause_returns_the_row_and_an_out_of_band_flash(operator, world):
    world.setup()
    pid = _project(world.conn)["id"]
    response = operator.post("/projects/web/pause", data={"reason": "incident 42", "csrf_token": operator.csrf},
                             headers={"HX-Request": "true"})
    assert response.status_code == 200
    body = response.get_data(as_text=True)
    assert body.lstrip().startswith(f'<tr id="project-{pid}"')
    assert 'id="flash"' in body and 'hx-swap-oob="true"' in body
    assert "<html" not in body
    assert "HX-Request" in response.headers["Vary"]


def test_second_operator_gets_409_with_who_paused(signed_in, world):
    world.setup()
    alice, bob = signed_in("alice"), signed_in("bob")
    assert alice.post("/projects/web/pause", data={"reason": "first", "csrf_token": alice.csrf}).status_code == 303
    plain = bob.post("/projects/web/pause", data={"reason": "second", "csrf_token": bob.csrf})
    assert plain.status_code == 409
    assert b"already paused by alice at" in plain.data
    htmx = bob.post("/projects/web/pause", data={"reason": "second", "csrf_token": bob.csrf},
                    headers={"HX-Request": "true"})
    assert htmx.status_code == 409
    body = htmx.get_data(as_text=True)
    assert "already paused by alice at" in body
    assert "by <strong>alice</strong>" in body  # the row as it is now, beside the message
    assert _project(world.conn)["pause_reason"] == "first"
    assert count(world.conn, "audit_events", "action = 'pause_project'") == 1


def test_resume_and_unknown_project(operator, world):
    world.setup()
    assert operator.post("/projects/web/resume", data={"csrf_token": operator.csrf}).status_code == 409
    operator.post("/projects/web/pause", data={"reason": "x", "csrf_token": operator.csrf})
    response = operator.post("/projects/web/resume", data={"csrf_token": operator.csrf})
    assert response.status_code == 303
    assert _project(world.conn)["paused_at"] is None
    assert count(world.conn, "audit_events", "action = 'resume_project' AND actor = 'alice'") == 1
    missing = operator.post("/projects/nope/pause", data={"reason": "x", "csrf_token": operator.csrf})
    assert missing.status_code == 404 and b"unknown project nope" in missing.data
    nul = operator.post("/projects/web/pause", data={"reason": "a\x00b", "csrf_token": operator.csrf})
    assert nul.status_code == 422
    assert operator.get("/projects/web/pause").status_code == 405
