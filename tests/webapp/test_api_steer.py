"""POST /api/v1/pools/{name}/pause|resume and /api/v1/runners/{id}/drain|resume: an operator's
token may, a viewer's may not (403, nothing changed); conditional (409 with who and when);
bad bodies 4xx JSON; the lists and shows say the pause and the drain."""

from __future__ import annotations

from pgdispatch.sql import transitions


def _audit(conn, subject):
    return [(r["actor"], r["action"]) for r in conn.execute(
        "SELECT actor, action FROM audit_events WHERE subject = %s ORDER BY id", (subject,))]


def test_pause_and_resume_a_pool(api, world):
    world.setup()
    assert api("POST", "/api/v1/pools/linux/pause", user="victor",
               json={"reason": "x"}).status_code == 403
    assert api("POST", "/api/v1/pools/linux/pause", json={}).status_code == 422
    assert api("POST", "/api/v1/pools/linux/pause", json={"reason": "  "}).status_code == 422
    assert api("POST", "/api/v1/pools/linux/pause", json={"reason": "x", "why": 1}).status_code == 422
    assert world.conn.execute("SELECT paused_at FROM pools").fetchone()["paused_at"] is None
    paused = api("POST", "/api/v1/pools/linux/pause", json={"reason": "kernel upgrade"})
    assert paused.status_code == 200
    assert paused.get_json()["paused_by"] == "alice" and paused.get_json()["pause_reason"] == "kernel upgrade"
    twice = api("POST", "/api/v1/pools/linux/pause", json={"reason": "again"})
    assert twice.status_code == 409 and "already paused by alice at " in twice.get_json()["error"]
    shown = api("GET", "/api/v1/pools/linux", user="victor").get_json()
    assert shown["paused_by"] == "alice" and shown["pause_reason"] == "kernel upgrade"
    listed = api("GET", "/api/v1/pools", user="victor").get_json()["pools"]
    assert listed[0]["paused_at"] is not None
    job = world.job()
    assert api("GET", f"/api/v1/jobs/{job['id']}/explain").get_json()["reason"] == "pool_paused"
    overview = api("GET", "/api/v1/overview", user="victor").get_json()
    assert [(q["name"], q["paused_by"]) for q in overview["paused_pools"]] == [("linux", "alice")]
    assert api("POST", "/api/v1/pools/linux/resume", user="victor").status_code == 403
    assert api("POST", "/api/v1/pools/linux/resume", json={"reason": "done"}).status_code == 200
    again = api("POST", "/api/v1/pools/linux/resume")
    assert again.status_code == 409 and "resumed by alice at " in again.get_json()["error"]
    assert api("POST", "/api/v1/pools/nope/pause", json={"reason": "x"}).status_code == 404
    assert _audit(world.conn, "pool:linux") == [("alice", "pause_pool"), ("alice", "resume_pool")]


def test_drain_and_resume_a_runner(api, world):
    world.setup()
    runner = world.runner()
    url = f"/api/v1/runners/{runner}"
    assert api("POST", f"{url}/drain", user="victor", json={"reason": "x"}).status_code == 403
    for bad in ({}, {"reason": ""}, {"reason": "x", "deadline_seconds": -1},
                {"reason": "x", "deadline_seconds": 604801}, {"reason": "x", "deadline_seconds": 1.5},
                {"reason": "x", "deadline_seconds": "60"}, {"reason": "x", "deadline_seconds": True}):
        response = api("POST", f"{url}/drain", json=bad)
        assert response.status_code == 422, (bad, response.get_json())
    assert world.row("runners", runner)["drain_requested_at"] is None
    drained = api("POST", f"{url}/drain", json={"reason": "reboot", "deadline_seconds": 60.0})
    assert drained.status_code == 200, drained.get_json()
    body = drained.get_json()
    assert body["drain_requested_by"] == "alice" and body["drain_deadline"] is not None
    twice = api("POST", f"{url}/drain", json={"reason": "again"})
    assert twice.status_code == 409 and "already draining (drain asked by alice at " in twice.get_json()["error"]
    shown = api("GET", url, user="victor").get_json()
    assert shown["drain_state"] == "drained" and shown["drain_reason"] == "reboot"
    assert api("POST", f"{url}/resume", user="victor").status_code == 403
    assert api("POST", f"{url}/resume", json={}).status_code == 200
    assert api("POST", f"{url}/resume").status_code == 409
    assert api("POST", "/api/v1/runners/424242/drain", json={"reason": "x"}).status_code == 404
    assert api("POST", f"/api/v1/runners/{2**64}/drain", json={"reason": "x"}).status_code == 404
    transitions.stop_runner(world.conn, runner_id=runner)
    stopped = api("POST", f"{url}/drain", json={"reason": "x"})
    assert stopped.status_code == 409 and "is stopped" in stopped.get_json()["error"]
    assert _audit(world.conn, f"runner:{runner}") == [("alice", "drain_runner"), ("alice", "resume_runner")]
