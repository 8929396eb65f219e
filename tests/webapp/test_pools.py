"""The pools page: slots and the pause; pausing (reason mandatory) and resuming from the
console: roles, audit, htmx fragments, conflicts, the poll."""

from __future__ import annotations

from .support import count


def _pool(conn, name="linux"):
    return conn.execute("SELECT * FROM pools WHERE name = %s", (name,)).fetchone()


def test_the_page_lists_pools_with_slots_and_the_nav_links_it(viewer, world):
    world.setup(pool_slots=8)
    page = viewer.get("/pools/").get_data(as_text=True)
    assert "<h1>Pools</h1>" in page and "linux" in page and "0 of 8 taken" in page
    assert 'href="/pools/" aria-current="page">Pools</a>' in page
    assert "no live runner" in page


def test_htmx_poll_gets_only_the_fragment(viewer, world):
    world.setup()
    response = viewer.get("/pools/", headers={"HX-Request": "true"})
    body = response.get_data(as_text=True)
    assert "<html" not in body and 'id="pools-table"' in body and 'hx-trigger="every 2s"' in body
    assert "HX-Request" in response.headers["Vary"]


def test_viewer_sees_no_buttons_and_cannot_pause(viewer, world):
    world.setup()
    page = viewer.get("/pools/").get_data(as_text=True)
    assert "Pause" not in page and "/pools/linux/pause" not in page
    response = viewer.post("/pools/linux/pause", data={"reason": "sneaky", "csrf_token": viewer.csrf})
    assert response.status_code == 403
    assert _pool(world.conn)["paused_at"] is None
    assert count(world.conn, "audit_events", "action = 'pause_pool'") == 0


def test_operator_pauses_and_resumes_and_it_is_audited(operator, world):
    world.setup()
    response = operator.post("/pools/linux/pause",
                             data={"reason": "kernel upgrade", "csrf_token": operator.csrf})
    assert response.status_code == 303 and response.headers["Location"] == "/pools/"
    row = _pool(world.conn)
    assert row["paused_by"] == "alice" and row["pause_reason"] == "kernel upgrade"
    page = operator.get("/pools/").get_data(as_text=True)
    assert "pool linux paused" in page and "by <strong>alice</strong>" in page
    assert "kernel upgrade" in page and "Resume" in page
    htmx = operator.post("/pools/linux/resume", data={"csrf_token": operator.csrf},
                         headers={"HX-Request": "true"})
    body = htmx.get_data(as_text=True)
    assert htmx.status_code == 200 and body.lstrip().startswith(f'<tr id="pool-{row["id"]}"')
    assert 'hx-swap-oob="true"' in body and "Pause" in body
    assert _pool(world.conn)["paused_at"] is None
    assert [e["action"] for e in world.conn.execute(
        "SELECT action FROM audit_events WHERE subject = 'pool:linux' ORDER BY id")] == [
        "pause_pool", "resume_pool"]


def test_pause_needs_a_reason(operator, world):
    world.setup()
    response = operator.post("/pools/linux/pause", data={"reason": "  ", "csrf_token": operator.csrf})
    assert response.status_code == 422 and b"reason is required" in response.data
    assert _pool(world.conn)["paused_at"] is None


def test_second_operator_gets_409_with_who_paused(signed_in, world):
    world.setup()
    alice, bob = signed_in("alice"), signed_in("bob")
    assert alice.post("/pools/linux/pause", data={"reason": "first", "csrf_token": alice.csrf}).status_code == 303
    htmx = bob.post("/pools/linux/pause", data={"reason": "second", "csrf_token": bob.csrf},
                    headers={"HX-Request": "true"})
    body = htmx.get_data(as_text=True)
    assert htmx.status_code == 409 and "already paused by alice at" in body
    assert "by <strong>alice</strong>" in body
    assert _pool(world.conn)["pause_reason"] == "first"


def test_unknown_pool_is_404(operator, world):
    world.setup()
    assert operator.post("/pools/nope/pause", data={"reason": "x", "csrf_token": operator.csrf}
                         ).status_code == 404


def test_the_overview_lists_a_paused_pool_with_who_when_why(operator, world):
    world.setup()
    operator.post("/pools/linux/pause", data={"reason": "kernel upgrade", "csrf_token": operator.csrf})
    page = operator.get("/").get_data(as_text=True)
    assert 'id="paused-pools"' in page and "paused by alice" in page and "kernel upgrade" in page
    operator.post("/pools/linux/resume", data={"csrf_token": operator.csrf})
    assert 'id="paused-pools"' not in operator.get("/").get_data(as_text=True)
