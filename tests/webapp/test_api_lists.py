"""The API's lists: GET /api/v1/jobs (filters, keyset with a `next` cursor) and the lists and
shows of projects, pools, targets, runners and the audit log, for a read-only token; bad
query parameters are 422, a name that does not exist 404."""

from __future__ import annotations

import pytest

from pgdispatch.sql import transitions

from . import test_api

# the fixtures: bearer tokens for alice (operator) and victor (viewer), and a client
tokens, api = test_api.tokens, test_api.api


@pytest.fixture
def looked_at(world):
    world.setup(pools=("linux",), targets=("staging",))
    runner = world.runner(name="r-api", slots=2)
    running = world.job(command=["make"])
    world.claim(runner)
    waiting = [world.job(requires_approval=True)["id"] for _ in range(3)]
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    return {"runner": runner, "running": running["id"], "waiting": waiting}


def test_jobs_list_filters_and_pages_with_next(api, looked_at):
    held = api("GET", "/api/v1/jobs?state=running&organization=acme", user="victor")
    assert held.status_code == 200
    job, = held.get_json()["jobs"]
    assert (job["id"], job["runner"], job["runner_id"], job["organization"]) == (
        looked_at["running"], "r-api", looked_at["runner"], "acme")
    assert job["running_seconds"] >= 0
    first = api("GET", "/api/v1/jobs?limit=2&state=blocked", user="victor").get_json()
    assert [j["id"] for j in first["jobs"]] == looked_at["waiting"][:0:-1]
    assert first["next"] == {"before_id": looked_at["waiting"][1]} and first["order"] == "newest_first"
    rest = api("GET", first["next_url"], user="victor").get_json()
    assert [j["id"] for j in rest["jobs"]] == looked_at["waiting"][:1] and rest["next"] is None
    gated = api("GET", "/api/v1/jobs?reason=approval_required&limit=2", user="victor").get_json()
    assert [j["id"] for j in gated["jobs"]] == looked_at["waiting"][:2]
    assert gated["next"] == {"after_id": looked_at["waiting"][1]} and "reason=approval_required" in gated["next_url"]
    assert gated["jobs"][0]["reasons"][0]["code"] == "approval_required"


@pytest.mark.parametrize("query, status, message", [
    ("organization=nope", 404, "unknown organization 'nope'"),
    ("runner=424242", 404, "unknown runner 424242"),
    ("state=paused", 422, "state must be one of"),
    ("limit=0", 422, "limit must be between 1 and 500"),
    ("older_than=-1", 422, "older_than must be between 0 and"),
    ("project=a%20b", 422, "is not a name"),
    ("state=queued&state=running", 422, "given more than once"),
    ("colour=red", 422, "unknown query parameter 'colour'"),
])
def test_jobs_list_bad_queries(api, world, query, status, message):
    world.setup()
    response = api("GET", f"/api/v1/jobs?{query}", user="victor")
    assert response.status_code == status and message in response.get_json()["error"]


def test_lists_and_shows(api, looked_at):
    def get(path):
        response = api("GET", path, user="victor")
        assert response.status_code == 200, response.get_json()
        return response.get_json()

    web, = get("/api/v1/projects")["projects"]
    assert (web["name"], web["running"], web["pause_reason"]) == ("web", 1, "freeze")
    shown = get("/api/v1/projects/web")
    assert [j["id"] for j in shown["running_jobs"]] == [looked_at["running"]]
    assert shown["audit"][0]["action"] == "pause_project"
    linux, = get("/api/v1/pools")["pools"]
    assert (linux["slots"], linux["running"], linux["runner_slots"], linux["free_runner_slots"]) == (100, 1, 2, 1)
    assert [r["name"] for r in get("/api/v1/pools/linux")["runners"]] == ["r-api"]
    assert [t["name"] for t in get("/api/v1/targets")["targets"]] == ["staging"]
    assert get("/api/v1/targets/staging")["state"] == "free"
    assert [r["name"] for r in get("/api/v1/runners")["runners"]] == ["r-api"]
    runner = get(f"/api/v1/runners/{looked_at['runner']}")
    assert runner["slots_used"] == 1 and [j["id"] for j in runner["running_jobs"]] == [looked_at["running"]]
    events = get("/api/v1/audit?actor=alice&limit=1")
    assert [e["action"] for e in events["events"]] == ["pause_project"]
    assert events["next"] == {"before_id": events["events"][0]["id"]}
    for path in ("/api/v1/projects/nope", "/api/v1/pools/nope", "/api/v1/targets/nope",
                 "/api/v1/runners/424242", "/api/v1/runners/99999999999999999999"):
        response = api("GET", path, user="victor")
        assert response.status_code == 404 and "unknown" in response.get_json()["error"]
    assert api("GET", "/api/v1/projects", user=None).status_code == 401
    assert api("GET", "/api/v1/audit?limit=abc", user="victor").status_code == 422

