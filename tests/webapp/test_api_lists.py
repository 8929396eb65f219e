"""The API's lists: GET /api/v1/jobs (filters, keyset with a `next` cursor), the lists and
shows of projects, pools, targets, runners and the audit log (a job's own trail too), and
the overview, for a read-only token; bad query parameters (unknown ones on every read,
numbers not in ASCII digits) are 422, a name that does not exist 404."""

from __future__ import annotations

import pytest

from pgdispatch.sql import audit, transitions

from .support import make_uncertain_target

# the fixtures tokens and api (bearer tokens for alice, operator, and victor, viewer, and a
# client) are tests/webapp/conftest.py's


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



def test_a_shows_audit_is_its_own_subject_only(api, looked_at, world):
    """project:web's show lists project:web's events, never project:web-legacy's (the
    subject was matched as a prefix); the same for targets."""
    world.apply({"projects": [{"name": "web-legacy", "organization": "acme", "pools": ["linux"]}],
                 "targets": [{"name": "staging-old"}]})
    transitions.pause_project(world.conn, project="web-legacy", reason="not ours", actor="mallory")
    audit.record_event(world.conn, actor="mallory", action="note", subject="target:staging-old",
                       reason="not ours")
    web = api("GET", "/api/v1/projects/web", user="victor").get_json()
    assert [e["subject"] for e in web["audit"]] == ["project:web"] and "mallory" not in str(web["audit"])
    staging = api("GET", "/api/v1/targets/staging", user="victor").get_json()
    assert all(e["subject"] == "target:staging" for e in staging["audit"]) and "mallory" not in str(staging)
    # the audit list's subject filter stays a prefix, as documented
    both = api("GET", "/api/v1/audit?subject=project:web", user="victor").get_json()["events"]
    assert {e["subject"] for e in both} == {"project:web", "project:web-legacy"}


def test_a_window_between_two_ids_keeps_its_upper_bound(api, world):
    world.setup()
    ids = [world.job()["id"] for _ in range(8)]
    low, high = ids[1], ids[6]  # the window: ids[2..5]
    first = api("GET", f"/api/v1/jobs?before_id={high}&after_id={low}&limit=3", user="victor").get_json()
    assert [j["id"] for j in first["jobs"]] == ids[2:5] and first["order"] == "oldest_first"
    assert first["next"] == {"after_id": ids[4], "before_id": high}
    assert f"before_id={high}" in first["next_url"] and f"after_id={ids[4]}" in first["next_url"]
    rest = api("GET", first["next_url"], user="victor").get_json()
    assert [j["id"] for j in rest["jobs"]] == [ids[5]] and rest["next"] is None


def test_a_jobs_own_audit_trail_and_resolution(api, world):
    made = make_uncertain_target(world)
    job = made["job"]["id"]
    transitions.resolve_target(world.conn, target="production", outcome="failed",
                               note="checked: not deployed", actor="alice")
    other = world.job(requires_approval=True)["id"]
    transitions.approve_job(world.conn, job_id=other, actor="alice", reason="ok")
    shown = api("GET", f"/api/v1/jobs/{job}", user="victor").get_json()
    assert shown["resolution"]["outcome"] == "failed" and shown["resolution"]["actor"] == "alice"
    assert shown["resolution"]["note"] == "checked: not deployed"
    assert [e["action"] for e in shown["audit"]][-1] == "resolve_target"
    trail = api("GET", f"/api/v1/audit?job={job}", user="victor").get_json()
    assert "resolve_target" in [e["action"] for e in trail["events"]]
    assert all(e["id"] in {a["id"] for a in shown["audit"]} for e in trail["events"])
    assert [e["action"] for e in api("GET", f"/api/v1/audit?job={other}", user="victor").get_json()[
        "events"]] == ["approve_job", "submit_job"]
    missing = api("GET", "/api/v1/audit?job=424242", user="victor")
    assert missing.status_code == 404 and missing.get_json()["error"] == "unknown job 424242"


@pytest.mark.parametrize("path", ["/api/v1/projects", "/api/v1/pools", "/api/v1/targets",
                                  "/api/v1/runners", "/api/v1/overview", "/api/v1/projects/web",
                                  "/api/v1/pools/linux", "/api/v1/jobs", "/api/v1/audit"])
def test_every_list_refuses_an_unknown_parameter_without_echoing_it_whole(api, looked_at, path):
    response = api("GET", f"{path}?{'k' * 5000}=1", user="victor")
    message = response.get_json()["error"]
    assert response.status_code == 422 and message.startswith("unknown query parameter 'kkk")
    assert "…" in message and len(message) < 400, message
    assert api("GET", f"{path}?colour=red", user="victor").status_code == 422


@pytest.mark.parametrize("query", ["limit=1_0", "limit=%D9%A1%D9%A0", "older_than=1_000",
                                   "older_than=%D9%A1", "older_than=%201", "older_than=1e3x",
                                   "before_id=%EF%BC%91"])
def test_numbers_are_ascii_digits_only(api, world, query):
    world.setup()
    response = api("GET", f"/api/v1/jobs?{query}", user="victor")
    assert response.status_code == 422, response.get_json()
    assert len(response.get_json()["error"]) < 200


def test_overview_answers_how_long_the_oldest_job_has_waited(api, looked_at, world):
    transitions.summarize_queue(world.conn)
    o = api("GET", "/api/v1/overview", user="victor").get_json()
    assert o["waiting"] == 3 and o["primary_counts"]["approval_required"] == 3
    assert o["reason_counts"]["project_paused"] == 3 and sum(o["primary_counts"].values()) == 3
    oldest, = o["oldest_waiting"]
    assert (oldest["pool"], oldest["reason"]) == ("linux", "approval_required") and oldest["seconds"] >= 0
    assert o["pools"] == [{"name": "linux", "slots": 100, "running": 1, "runner_slots": 2,
                           "free_runner_slots": 1, "live_runners": 1, "waiting": 3}]
    assert [(p["name"], p["paused_by"], p["pause_reason"]) for p in o["paused_projects"]] == [
        ("web", "alice", "freeze")]
    assert o["organizations"][0]["running"] == 1 and o["uncertain_targets"] == []


def test_a_targets_show_says_what_runs_next_and_what_was_superseded(api, world):
    """GET /api/v1/targets/{name}: the deploy order, the next list with each one's reason,
    the superseded summary; the answer is what the OpenAPI document's TargetDetail says."""
    import jsonschema_rs

    from pgdispatch.webapp.openapi import SPEC

    world.setup(targets=())
    world.apply({"targets": [{"name": "staging", "supersede": True}]})
    old = world.job(target="staging", command=["deploy"])["id"]
    world.apply({"targets": [{"name": "staging", "supersede": True, "deploy_order": "newest_ready_first"}]})
    new = world.job(target="staging", command=["deploy"])["id"]
    world.apply({"targets": [{"name": "staging", "deploy_order": "newest_ready_first"}]})
    newest = world.job(target="staging", command=["deploy"])["id"]
    world.runner()
    got = api("GET", "/api/v1/targets/staging", user="victor").get_json()
    assert got["deploy_order"] == "newest_ready_first" and got["supersede"] is False
    assert got["next"]["head_job_id"] == newest and got["next"]["waiting"] == 2
    assert [(j["job_id"], j["reason"]) for j in got["next"]["jobs"]] == [(newest, "ready"), (new, "target_order")]
    assert got["superseded"]["total"] == 1
    assert [(s["job_id"], s["superseded_by"]) for s in got["superseded"]["latest"]] == [(old, new)]
    root = {"$ref": "#/components/schemas/TargetDetail", "components": SPEC["components"]}
    assert list(jsonschema_rs.Draft202012Validator(root).iter_errors(got)) == []
