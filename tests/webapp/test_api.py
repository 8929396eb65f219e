"""The JSON API: bearer tokens, submit with validation, show, explain, actions, OpenAPI."""

from __future__ import annotations

import json
import re

from pgdispatch.sql.accounts import create_api_token
from pgdispatch.sql.explain import REASON_CODES

from .support import count, ensure_account, make_uncertain_target


def test_a_bearer_token_is_required(api, world):
    world.setup()
    for headers in ({}, {"Authorization": "Bearer pgd_not-a-real-token"},
                    {"Authorization": "Basic YWxpY2U6YWxpY2U="}, {"Authorization": "Bearer "}):
        response = api("POST", "/api/v1/jobs", user=None, headers=headers,
                       json={"project": "web", "pool": "linux", "command": ["true"]})
        assert response.status_code == 401
        assert "error" in response.get_json()
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert api("GET", "/api/v1/jobs/1", user=None).status_code == 401
    assert count(world.conn, "jobs") == 0


def test_a_console_session_is_not_an_api_credential(app, signed_in, world):
    world.setup()
    client = signed_in("alice")
    response = client.post("/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["true"]})
    assert response.status_code == 401
    assert count(world.conn, "jobs") == 0


def test_submit_show_explain(api, world):
    world.setup()
    response = api("POST", "/api/v1/jobs", json={
        "project": "web", "pool": "linux", "command": ["make", "build"], "priority": 5,
        "max_attempts": 3, "timeout_seconds": 600, "idempotency_key": "build-1"})
    assert response.status_code == 201
    job = response.get_json()
    assert isinstance(job["id"], int) and job["state"] == "queued" and job["is_new"] is True
    assert job["command"] == ["make", "build"] and job["submitted_by"] == "alice"
    assert response.headers["Location"] == f"/api/v1/jobs/{job['id']}"
    assert re.match(r"\d{4}-\d\d-\d\dT", job["created_at"])  # ISO 8601, not an HTTP date
    again = api("POST", "/api/v1/jobs", json={
        "project": "web", "pool": "linux", "command": ["make", "build"], "priority": 5,
        "max_attempts": 3, "timeout_seconds": 600, "idempotency_key": "build-1"})
    assert again.status_code == 200 and again.get_json()["id"] == job["id"]
    # the key with a different request: 409, nothing written (sql/functions/submit.sql)
    other = api("POST", "/api/v1/jobs", json={
        "project": "web", "pool": "linux", "command": ["make", "build"], "idempotency_key": "build-1"})
    assert other.status_code == 409
    assert other.get_json() == {"error": f"idempotency key already used for job {job['id']} by a "
                                         "request that differs in priority, max attempts, timeout"}
    shown = api("GET", f"/api/v1/jobs/{job['id']}", user="victor")
    assert shown.status_code == 200 and shown.get_json()["attempts"] == []
    why = api("GET", f"/api/v1/jobs/{job['id']}/explain", user="victor").get_json()
    assert why["reason"] == "no_authorized_runner"  # no runner serves linux yet
    assert {r["code"] for r in why["reasons"]} <= set(REASON_CODES)
    assert api("GET", "/api/v1/jobs/999999").status_code == 404
    assert count(world.conn, "jobs") == 1


def test_dependencies_and_approval_explained(api, world):
    world.setup()
    first = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["a"]}).get_json()
    second = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["b"],
                                               "depends_on": [first["id"]], "requires_approval": True})
    assert second.status_code == 201 and second.get_json()["state"] == "blocked"
    codes = [r["code"] for r in api("GET", f"/api/v1/jobs/{second.get_json()['id']}/explain").get_json()["reasons"]]
    assert codes[:2] == ["dependency_pending", "approval_required"]


def test_a_deployment_to_a_protected_target_waits_for_an_approval_its_submitter_cannot_give(
        api, world, app, conn):
    """POST /api/v1/jobs to production without requires_approval: blocked by the target's
    rule; alice, its submitter, is refused (403); an operator is refused where an admin is
    required; an admin approves it."""
    world.setup(targets=("production",))
    world.apply({"targets": [{"name": "production", "requires_approval": True, "approver_role": "admin"}]})
    ensure_account(conn, "bob", "bob-password-2", "operator")
    ensure_account(conn, "ada", "ada-admin-password", "admin")
    bearer = {name: create_api_token(conn, username=name, name="t") for name in ("bob", "ada")}
    posted = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["deploy"],
                                               "target": "production"})
    assert posted.status_code == 201
    job = posted.get_json()
    assert (job["state"], job["requires_approval"], job["submitted_by"]) == ("blocked", True, "alice")
    why = api("GET", f"/api/v1/jobs/{job['id']}/explain").get_json()
    assert (why["reason"], why["message"]) == (
        "approval_required", "target production requires approval by an admin; submitted by alice")
    mine = api("POST", f"/api/v1/jobs/{job['id']}/approve", json={})
    assert mine.status_code == 403
    assert mine.get_json()["error"] == (f"alice submitted job {job['id']} (a deployment to target "
                                        f"production) and cannot approve it; another admin must")
    client = app.test_client()
    as_bob = client.post(f"/api/v1/jobs/{job['id']}/approve", json={},
                         headers={"Authorization": f"Bearer {bearer['bob']}"})
    assert as_bob.status_code == 403
    assert as_bob.get_json()["error"] == "target production requires approval by an admin; bob is an operator"
    assert world.row("jobs", job["id"])["state"] == "blocked"
    as_ada = client.post(f"/api/v1/jobs/{job['id']}/approve", json={},
                         headers={"Authorization": f"Bearer {bearer['ada']}"})
    assert as_ada.status_code == 200 and world.row("jobs", job["id"])["approved_by"] == "ada"


BAD_SUBMISSIONS = [
    ({"project": "web", "pool": "linux", "command": []}, 422, "command must not be empty"),
    ({"project": "web", "pool": "linux", "command": ["true"], "priority": "abc"}, 422, "priority"),
    ({"project": "nope", "pool": "linux", "command": ["true"]}, 404, "unknown project nope"),
    ({"project": "web", "pool": "linux", "command": ["a\x00b"]}, 422, "NUL"),
    ({"project": "we\x00b", "pool": "linux", "command": ["true"]}, 422, "NUL"),
    ({"project": "web", "pool": "linux", "command": "rm -rf /"}, 422, "list"),
    ({"project": "web", "pool": "linux", "command": ["true"], "priority": 5000}, 422, "priority"),
    ({"project": "web", "pool": "linux", "command": ["true"], "priority": True}, 422, "priority"),
    ({"project": "web", "pool": "linux", "command": ["true"], "delay_seconds": "soon"}, 422, "delay"),
    ({"project": "web", "pool": "linux", "command": ["true"], "delay_seconds": 2592001}, 422,
     "delay_seconds must be between 0 and 2592000, got 2592001"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": [999999]}, 404, "dependency"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": "1"}, 422, "depends_on"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": False}, 422, "depends_on"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": 0}, 422, "depends_on"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": {}}, 422, "depends_on"),
    ({"project": "web", "pool": "linux", "command": ["true"], "depends_on": ""}, 422, "depends_on"),
    ({"project": "web", "pool": "linux", "command": ["true"], "requires_approval": "yes"}, 422, "requires_approval"),
    ({"project": "web", "pool": "linux", "command": ["true"], "target": "nowhere"}, 404, "unknown target"),
    ({"project": "web", "pool": "linux", "command": ["true"], "colour": "red"}, 422, "unknown field"),
    ({"project": "web", "command": ["true"]}, 422, "missing field 'pool'"),
    ({"project": "web", "pool": "gpu", "command": ["true"]}, 404, "unknown pool"),
]


def test_bad_submissions_are_4xx_json_and_write_nothing(api, world):
    world.setup()
    for body, status, fragment in BAD_SUBMISSIONS:
        response = api("POST", "/api/v1/jobs", json=body)
        assert response.status_code == status, (body, response.get_data(as_text=True))
        assert fragment in response.get_json()["error"], (body, response.get_json())
    for raw, content_type in [("not json", "application/json"), ("[1, 2]", "application/json"),
                              ('{"project": "web"}', "text/plain"), ("", "application/json")]:
        response = api("POST", "/api/v1/jobs", data=raw, content_type=content_type)
        assert 400 <= response.status_code < 500 and "error" in response.get_json(), raw
    huge = api("POST", "/api/v1/jobs", data=json.dumps({"command": ["x" * (2 * 1024 * 1024)]}),
               content_type="application/json")
    assert huge.status_code == 413 and "error" in huge.get_json()
    assert count(world.conn, "jobs") == 0


def test_viewer_tokens_only_read(api, world):
    world.setup()
    response = api("POST", "/api/v1/jobs", user="victor",
                   json={"project": "web", "pool": "linux", "command": ["true"]})
    assert response.status_code == 403 and "may only read" in response.get_json()["error"]
    assert api("POST", "/api/v1/projects/web/pause", user="victor", json={"reason": "x"}).status_code == 403
    assert count(world.conn, "jobs") == 0
    assert world.conn.execute("SELECT paused_at FROM projects").fetchone()["paused_at"] is None


def test_job_actions_and_conflicts(api, world):
    world.setup()
    job = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["x"],
                                            "requires_approval": True}).get_json()
    approved = api("POST", f"/api/v1/jobs/{job['id']}/approve", json={"reason": "ok"})
    assert approved.status_code == 200 and approved.get_json()["state"] == "queued"
    conflict = api("POST", f"/api/v1/jobs/{job['id']}/approve")
    assert conflict.status_code == 409 and "already approved" in conflict.get_json()["error"]
    assert api("POST", f"/api/v1/jobs/{job['id']}/cancel").get_json()["state"] == "cancelled"
    assert api("POST", f"/api/v1/jobs/{job['id']}/retry", json={}).get_json()["state"] == "queued"
    assert api("POST", f"/api/v1/jobs/{job['id']}/cancel", json=["not", "an", "object"]).status_code == 422
    assert api("POST", "/api/v1/jobs/424242/cancel").status_code == 404
    assert api("GET", f"/api/v1/jobs/{job['id']}/cancel").status_code == 405
    actors = {r["actor"] for r in world.conn.execute("SELECT actor FROM audit_events WHERE subject = %s",
                                                     (f"job:{job['id']}",)).fetchall()}
    assert actors == {"alice"}


def test_pause_resume_and_resolve(api, world):
    make_uncertain_target(world)
    assert api("POST", "/api/v1/projects/web/pause", json={}).status_code == 422
    paused = api("POST", "/api/v1/projects/web/pause", json={"reason": "freeze"})
    assert paused.status_code == 200 and paused.get_json()["paused_by"] == "alice"
    twice = api("POST", "/api/v1/projects/web/pause", json={"reason": "again"})
    assert twice.status_code == 409 and "already paused by alice" in twice.get_json()["error"]
    assert api("POST", "/api/v1/projects/web/resume").status_code == 200
    assert api("POST", "/api/v1/projects/nope/resume").status_code == 404
    assert api("POST", "/api/v1/targets/production/resolve", json={"outcome": "retry"}).status_code == 422
    resolved = api("POST", "/api/v1/targets/production/resolve", json={"outcome": "retry", "note": "rerun"})
    assert resolved.status_code == 200 and resolved.get_json()["job_state"] == "queued"
    late = api("POST", "/api/v1/targets/production/resolve", json={"outcome": "failed", "note": "x"})
    assert late.status_code == 409 and "already resolved by alice" in late.get_json()["error"]


def test_openapi_document_matches_the_routes(app, api):
    response = api("GET", "/api/v1/openapi.json", user=None)
    assert response.status_code == 200
    spec = json.loads(response.get_data(as_text=True))
    assert spec["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    routed = set()
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith("/api/v1/"):
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule[len("/api/v1"):])
            routed |= {(path, m) for m in rule.methods - {"HEAD", "OPTIONS"}}
    assert documented == routed
    refs = set(re.findall(r'"#/components/(\w+)/(\w+)"', json.dumps(spec)))
    for kind, name in refs:
        assert name in spec["components"][kind], name


def test_whole_numbers_may_be_written_as_floats(api, world):
    """JSON (and the document's "integer") has one number type: 3.0 is 3; 2.5 is refused.
    Found by the fuzz run (tests/webapp/test_fuzz.py)."""
    world.setup()
    first = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux", "command": ["a"]})
    response = api("POST", "/api/v1/jobs", json={
        "project": "web", "pool": "linux", "command": ["b"], "priority": 5.0, "max_attempts": 3.0,
        "timeout_seconds": 60.0, "depends_on": [float(first.get_json()["id"])]})
    assert response.status_code == 201, response.get_json()
    job = response.get_json()
    assert (job["priority"], job["max_attempts"], job["depends_on"]) == (5, 3, [first.get_json()["id"]])
    for field, value in [("priority", 2.5), ("max_attempts", 1e300), ("depends_on", [1.5])]:
        bad = api("POST", "/api/v1/jobs", json={"project": "web", "pool": "linux",
                                                "command": ["c"], field: value})
        assert bad.status_code == 422, (field, bad.get_json())
