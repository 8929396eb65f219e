"""POST /api/v1/jobs/bulk and POST /api/v1/jobs/{id}/priority: a dry run changes nothing; an
apply by filter takes what its preview listed; an apply to job_ids takes exactly those,
skipping with why the ones that changed; viewers may not; bad bodies are 4xx JSON and write
nothing."""

from __future__ import annotations

import pytest

from .support import count


def states(conn, ids):
    return [conn.execute("SELECT state FROM jobs WHERE id = %s", (i,)).fetchone()["state"] for i in ids]


def test_dry_run_then_apply_by_filter_and_by_ids(api, world):
    world.setup(pools=("linux", "arm"))
    linux = [world.job(command=["make", str(i)])["id"] for i in range(3)]
    arm = world.job(pool="arm")["id"]
    before = count(world.conn, "audit_events")
    dry = api("POST", "/api/v1/jobs/bulk",
              json={"action": "cancel", "filter": {"pool": "linux"}, "dry_run": True})
    assert dry.status_code == 200, dry.get_json()
    body = dry.get_json()
    assert body["result"] is None and body["preview"]["count"] == 3
    assert [j["id"] for j in body["preview"]["jobs"]] == linux
    assert body["preview"]["jobs"][0]["command"] == ["make", "0"]
    assert count(world.conn, "audit_events") == before and states(world.conn, linux) == ["queued"] * 3
    # apply exactly the previewed ids: one cancelled singly meanwhile is skipped, with why
    api("POST", f"/api/v1/jobs/{linux[1]}/cancel")
    jobs = body["preview"]["jobs"]
    applied = api("POST", "/api/v1/jobs/bulk",
                  json={"action": "cancel", "filter": {"pool": "linux"}, "dry_run": False,
                        "job_ids": jobs, "reason": "bad build"})
    assert applied.status_code == 200, applied.get_json()
    result = applied.get_json()["result"]
    assert result["done"] == [linux[0], linux[2]]
    assert [(s["job_id"], s["state"]) for s in result["skipped"]] == [(linux[1], "cancelled")]
    event = world.conn.execute("SELECT * FROM audit_events WHERE id = %s",
                               (result["bulk_event_id"],)).fetchone()
    assert (event["action"], event["actor"], event["reason"]) == ("bulk_cancel", "alice", "bad build")
    assert event["details"]["filter"] == {"pool": "linux"} and event["details"]["requested"] == 3
    assert states(world.conn, [arm]) == ["queued"]
    # by filter in one request: preview and apply together
    both = api("POST", "/api/v1/jobs/bulk", json={"action": "reprioritize", "priority": 9,
                                                 "filter": {"state": "queued"}, "dry_run": False})
    assert both.status_code == 200
    assert [j["id"] for j in both.get_json()["preview"]["jobs"]] == both.get_json()["result"]["done"] == [arm]


def test_set_priority_endpoint(api, world):
    world.setup()
    job = world.job()["id"]
    ok = api("POST", f"/api/v1/jobs/{job}/priority", json={"priority": 50, "reason": "urgent"})
    assert ok.status_code == 200 and ok.get_json()["priority"] == 50
    again = api("POST", f"/api/v1/jobs/{job}/priority", json={"priority": 50})
    assert again.status_code == 409 and "already has priority 50" in again.get_json()["error"]
    assert api("POST", f"/api/v1/jobs/{job}/priority", json={}).status_code == 422
    assert api("POST", f"/api/v1/jobs/{job}/priority", json={"priority": 1001}).status_code == 422
    assert api("POST", "/api/v1/jobs/424242/priority", json={"priority": 1}).status_code == 404
    assert api("POST", f"/api/v1/jobs/{job}/priority", user="victor",
               json={"priority": 1}).status_code == 403


@pytest.mark.parametrize("body", [
    {"action": "cancel"},
    {"action": "delete", "dry_run": True},
    {"action": "cancel", "dry_run": "yes"},
    {"action": "cancel", "dry_run": True, "filter": {"colour": "red"}},
    {"action": "cancel", "dry_run": True, "filter": {"state": "sleeping"}},
    {"action": "reprioritize", "dry_run": True},
    {"action": "cancel", "dry_run": True, "priority": 3},
    {"action": "cancel", "dry_run": False, "job_ids": []},
    {"action": "cancel", "dry_run": False, "job_ids": [{"id": 1}]},
    {"action": "cancel", "dry_run": False, "job_ids": [{"id": 1, "generation": -1}]},
    {"action": "cancel", "dry_run": False, "job_ids": [0]},
    {"action": "cancel", "dry_run": False, "job_ids": [1], "generations": [0]},
    {"action": "cancel", "dry_run": False, "job_ids": ["1"]},
])
def test_bad_bulk_bodies_are_422_and_write_nothing(api, world, body):
    world.setup()
    world.job()
    before = count(world.conn, "audit_events")
    response = api("POST", "/api/v1/jobs/bulk", json=body)
    assert response.status_code == 422, (body, response.get_json())
    assert set(response.get_json()) == {"error"}
    assert count(world.conn, "audit_events") == before


def test_an_unknown_name_in_the_filter_is_404(api, world):
    world.setup()
    response = api("POST", "/api/v1/jobs/bulk",
                   json={"action": "cancel", "dry_run": True, "filter": {"project": "nope"}})
    assert response.status_code == 404 and "unknown project" in response.get_json()["error"]


def test_a_viewer_may_not_bulk(api, world):
    world.setup()
    job = world.job()["id"]
    response = api("POST", "/api/v1/jobs/bulk", user="victor",
                   json={"action": "cancel", "dry_run": False})
    assert response.status_code == 403
    assert states(world.conn, [job]) == ["queued"]


def test_an_apply_that_finds_nothing_answers_a_result_and_writes_no_event(api, world):
    world.setup()
    world.job()
    before = count(world.conn, "audit_events")
    empty = api("POST", "/api/v1/jobs/bulk",
                json={"action": "cancel", "filter": {"state": "failed"}, "dry_run": False})
    assert empty.status_code == 200, empty.get_json()
    assert empty.get_json()["result"] == {"bulk_event_id": None, "action": "cancel",
                                          "priority": None, "requested": 0, "done": [],
                                          "skipped": []}
    unknown = api("POST", "/api/v1/jobs/bulk",
                  json={"action": "cancel", "dry_run": False, "job_ids": [900001, 900002]})
    assert unknown.status_code == 200, unknown.get_json()
    result = unknown.get_json()["result"]
    assert result["bulk_event_id"] is None and result["done"] == []
    assert [(s["job_id"], s["why"]) for s in result["skipped"]] == [(900001, "unknown job"),
                                                                    (900002, "unknown job")]
    assert count(world.conn, "audit_events") == before


@pytest.mark.parametrize("body, message", [
    ({"action": "explode"}, 'action must be one of cancel, retry, approve, reprioritize, got "explode"'),
    ({"action": "cancel", "dry_run": True, "job_ids": ["x"]}, "job_ids[0] must be a job id"),
    ({"action": "cancel", "dry_run": True, "job_ids": [{"id": 1}]}, "job_ids[0] must be a job id"),
])
def test_bad_bulk_bodies_name_what_is_wrong(api, world, body, message):
    world.setup()
    before = count(world.conn, "audit_events")
    bad = api("POST", "/api/v1/jobs/bulk", json=body)
    assert bad.status_code == 422 and message in bad.get_json()["error"], bad.get_json()
    assert count(world.conn, "audit_events") == before
