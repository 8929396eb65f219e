"""Bulk actions (sql/bulk.py, sql/functions/bulk.sql): the preview lists what the action
would take and changes nothing; the apply takes exactly the previewed ids, in batches of
their own transactions, skipping (with why) every job that changed since the preview; one
audit event per bulk action and each job's own event pointing at it. Each test commits (a
bulk action commits batch by batch), so each has a database of its own."""

from __future__ import annotations

import json

import pytest

from pgdispatch.sql import AlreadyResolved, InvalidInput, NotFound, bulk, transitions

pytestmark = pytest.mark.own_database


def events(conn, **where):
    sql = "SELECT * FROM audit_events"
    if where:
        sql += " WHERE " + " AND ".join(f"{k} = %({k})s" for k in where)
    return list(conn.execute(sql + " ORDER BY id", where))


def test_preview_lists_what_a_bulk_cancel_takes_and_changes_nothing(world):
    world.setup(pools=("linux", "arm"))
    queued = [world.job(command=["make", f"t{i}"])["id"] for i in range(3)]
    other_pool = world.job(pool="arm")["id"]
    approval = world.job(requires_approval=True)["id"]
    runner = world.runner()
    claimed = world.job()["id"]
    # the oldest queued job is claimed first: claim until the one we meant is running
    running = {c.job_id for c in iter(lambda: world.claim(runner), None)}
    assert claimed in running
    before = events(world.conn)
    p = bulk.preview_bulk(world.conn, action="cancel", filters={"pool": "linux"})
    assert p["count"] == 1 and not p["truncated"] and p["states"] == ["blocked", "queued"]
    assert [j["id"] for j in p["jobs"]] == [approval]
    assert p["jobs"][0]["reason"] == "approval_required"
    assert "approval" in p["jobs"][0]["message"]
    assert set(p["jobs"][0]) >= {"id", "generation", "project", "command", "reason", "state"}
    assert events(world.conn) == before
    assert not set(queued) - running  # all claimed above: none listed
    assert other_pool not in [j["id"] for j in p["jobs"]]


def test_bulk_cancel_applies_in_batches_with_one_bulk_event_and_each_jobs_trail(world):
    world.setup()
    ids = [world.job(command=["sleep", str(i)])["id"] for i in range(7)]
    p = bulk.preview_bulk(world.conn, action="cancel", filters={"project": "web"})
    assert [j["id"] for j in p["jobs"]] == ids
    r = bulk.apply_bulk(world.conn, action="cancel", job_ids=[j["id"] for j in p["jobs"]],
                        generations=[j["generation"] for j in p["jobs"]], filters=p["filter"],
                        reason="bad release", actor="alice", batch_size=3)
    assert r["done"] == ids and r["skipped"] == [] and r["requested"] == 7
    assert {world.row("jobs", i)["state"] for i in ids} == {"cancelled"}
    [event] = events(world.conn, action="bulk_cancel")
    assert event["id"] == r["bulk_event_id"] and event["actor"] == "alice"
    assert event["subject"] == "jobs" and event["reason"] == "bad release"
    assert event["details"] == {"filter": {"project": "web"}, "requested": 7, "truncated": False}
    trail = events(world.conn, action="cancel_job")
    assert [e["job_id"] for e in trail] == ids
    assert {e["details"]["bulk_event_id"] for e in trail} == {event["id"]}
    assert {e["actor"] for e in trail} == {"alice"} and {e["reason"] for e in trail} == {"bad release"}


def test_a_job_that_changed_between_preview_and_apply_is_skipped_with_why(world):
    world.setup()
    ids = [world.job()["id"] for _ in range(4)]
    p = bulk.preview_bulk(world.conn, action="cancel", filters={})
    assert [j["id"] for j in p["jobs"]] == ids
    runner = world.runner()
    first = world.claim(runner)                      # ids[0]: running now
    second = world.claim(runner)                     # ids[1]: claimed, failed, queued again
    world.complete(second, outcome="failed", error="boom")
    world.conn.execute("UPDATE jobs SET state = 'queued', finished_at = NULL, ready_at = now() "
                       "WHERE id = %s", (second.job_id,))
    transitions.cancel_job(world.conn, job_id=ids[2], actor="bob")  # ids[2]: cancelled by bob
    r = bulk.apply_bulk(world.conn, action="cancel", job_ids=[j["id"] for j in p["jobs"]],
                        generations=[j["generation"] for j in p["jobs"]], actor="alice")
    assert r["done"] == [ids[3]]
    why = {s["job_id"]: (s["state"], s["why"]) for s in r["skipped"]}
    assert set(why) == {first.job_id, second.job_id, ids[2]}
    assert why[first.job_id][0] == "running" and "claimed since the preview" in why[first.job_id][1]
    assert why[second.job_id][0] == "queued" and "claimed since the preview" in why[second.job_id][1]
    assert why[ids[2]] == ("cancelled", "cancelled: cancelled by bob, at " + why[ids[2]][1].split(", at ")[1])
    assert world.row("jobs", first.job_id)["state"] == "running"
    assert world.row("jobs", first.job_id)["cancel_requested_at"] is None
    assert world.row("jobs", second.job_id)["state"] == "queued"
    # without generations only the state is checked: the re-queued job is taken
    r2 = bulk.apply_bulk(world.conn, action="cancel", job_ids=[second.job_id, first.job_id, 999999],
                         actor="alice")
    assert r2["done"] == [second.job_id]
    assert [(s["job_id"], s["state"]) for s in r2["skipped"]] == [(first.job_id, "running"),
                                                                  (999999, None)]
    assert r2["skipped"][1]["why"] == "unknown job"


def test_bulk_retry_approve_and_reprioritize(world):
    world.setup()
    failed = []
    runner = world.runner()
    for _ in range(2):
        world.job()
        c = world.claim(runner)
        world.complete(c, outcome="failed", error="flaky")
        failed.append(c.job_id)
    p = bulk.preview_bulk(world.conn, action="retry", filters={"state": "failed"})
    assert [j["id"] for j in p["jobs"]] == failed and p["jobs"][0]["message"] == "flaky"
    r = bulk.apply_bulk(world.conn, action="retry", job_ids=failed, actor="alice")
    assert r["done"] == failed and {world.row("jobs", i)["state"] for i in failed} == {"queued"}

    waiting = [world.job(requires_approval=True, submitted_by="carol")["id"] for _ in range(2)]
    own = world.job(requires_approval=True, submitted_by="alice")["id"]
    p = bulk.preview_bulk(world.conn, action="approve", filters={"reason": "approval_required"})
    assert [j["id"] for j in p["jobs"]] == [*waiting, own]
    r = bulk.apply_bulk(world.conn, action="approve", job_ids=[j["id"] for j in p["jobs"]],
                        actor="alice")
    # not a deployment: the submitter rule is a target's, so alice approves her own job too
    assert r["done"] == [*waiting, own] and r["skipped"] == []
    assert {world.row("jobs", i)["state"] for i in r["done"]} == {"queued"}
    p = bulk.preview_bulk(world.conn, action="reprioritize", filters={"state": "queued"}, priority=5)
    assert [j["id"] for j in p["jobs"]] == [*failed, *waiting, own]
    r = bulk.apply_bulk(world.conn, action="reprioritize", job_ids=[j["id"] for j in p["jobs"]],
                        priority=5, actor="alice", reason="release day")
    assert {world.row("jobs", i)["priority"] for i in r["done"]} == {5}
    [event] = events(world.conn, action="bulk_reprioritize")
    assert event["details"]["priority"] == 5
    moved = events(world.conn, action="set_priority")
    assert {(e["details"]["from"], e["details"]["to"]) for e in moved} == {(0, 5)}
    # a second pass has nothing to do, and says so per job
    assert bulk.preview_bulk(world.conn, action="reprioritize", filters={}, priority=5)["count"] == 0
    r = bulk.apply_bulk(world.conn, action="reprioritize", job_ids=[own], priority=5, actor="alice")
    assert r["done"] == [] and r["skipped"][0]["why"] == "already has priority 5"


def test_a_protected_deployment_is_skipped_when_the_approver_submitted_it(world):
    world.setup(pools=("deploy",))
    world.apply({"targets": [{"name": "production", "requires_approval": True,
                              "approver_role": "operator"}]})
    mine = world.job(pool="deploy", target="production", submitted_by="alice")["id"]
    r = bulk.apply_bulk(world.conn, action="approve", job_ids=[mine], actor="alice")
    assert r["done"] == [] and "alice submitted job" in r["skipped"][0]["why"]
    assert world.row("jobs", mine)["approved_at"] is None


def test_preview_is_bounded_and_says_when_more_matched(world):
    world.setup()
    ids = [world.job()["id"] for _ in range(5)]
    p = bulk.preview_bulk(world.conn, action="cancel", filters={}, limit=3)
    assert [j["id"] for j in p["jobs"]] == ids[:3] and p["truncated"]
    r = bulk.apply_bulk(world.conn, action="cancel", job_ids=[j["id"] for j in p["jobs"]],
                        truncated=p["truncated"], actor="alice")
    assert r["done"] == ids[:3] and world.row("jobs", ids[3])["state"] == "queued"
    [event] = events(world.conn, action="bulk_cancel")
    assert event["details"]["truncated"] is True and event["details"]["requested"] == 3


def test_set_priority_is_conditional_and_audited(world):
    world.setup()
    job = world.job(priority=1)["id"]
    r = transitions.set_priority(world.conn, job_id=job, priority=7, actor="alice", reason="hotfix")
    assert r == {"job_id": job, "state": "queued", "priority": 7, "previous_priority": 1}
    [e] = events(world.conn, action="set_priority")
    assert e["job_id"] == job and e["details"] == {"from": 1, "to": 7} and e["reason"] == "hotfix"
    with pytest.raises(AlreadyResolved, match="already has priority 7"):
        transitions.set_priority(world.conn, job_id=job, priority=7, actor="bob")
    world.claim(world.runner())
    with pytest.raises(AlreadyResolved, match="is running and its priority cannot change"):
        transitions.set_priority(world.conn, job_id=job, priority=2, actor="bob")
    with pytest.raises(InvalidInput):
        transitions.set_priority(world.conn, job_id=job, priority=1001, actor="bob")
    with pytest.raises(NotFound):
        transitions.set_priority(world.conn, job_id=job + 1000, priority=2, actor="bob")


@pytest.mark.parametrize("call, message", [
    (dict(action="delete"), "unknown bulk action"),
    (dict(action="reprioritize"), "needs a priority"),
    (dict(action="cancel", priority=3), "only reprioritize"),
    (dict(action="reprioritize", priority=5000), "between -1000 and 1000"),
    (dict(action="cancel", filters={"colour": "red"}), "unknown filter"),
    (dict(action="cancel", filters={"state": "sleeping"}), "unknown state"),
    (dict(action="cancel", filters={"project": "nope"}), "unknown project"),
    (dict(action="cancel", job_ids=[]), "job_ids"),
    (dict(action="cancel", job_ids=list(range(1, 10002))), "at most 10000"),
    (dict(action="cancel", job_ids=[1], generations=[1, 2]), "as long as job_ids"),
    # the apply records its filter in the bulk event: a name that does not exist is refused
    (dict(action="cancel", job_ids=[1], filters={"pool": "nope"}), "unknown pool"),
    (dict(action="cancel", job_ids=[1], filters={"runner_id": 99}), "unknown runner 99"),
])
def test_bad_input_is_refused_before_anything_is_written(world, call, message):
    world.setup()
    world.job()
    before = events(world.conn)
    call = {"filters": {}, **call}
    with pytest.raises(InvalidInput, match=message):
        if "job_ids" in call:
            bulk.apply_bulk(world.conn, actor="alice", **call)
        else:
            bulk.preview_bulk(world.conn, **call)
    assert events(world.conn) == before
    assert json.dumps(before, default=str)


def test_the_preview_reads_the_action_states_range_not_the_history(world):
    """With 20,000 finished jobs beside a few queued ones, the preview's read
    (list_bulk_candidates) walks jobs_state_idx in the states the action takes: no scan of
    the jobs table, and about as many rows read as it returns."""
    from pgdispatch.sql.queries import Q

    from .plans import analyze_all, pin_planner, plan_nodes, quiet_autovacuum

    world.setup()
    queued = [world.job()["id"] for _ in range(5)]
    world.conn.execute(
        "INSERT INTO jobs (project_id, pool_id, state, command, finished_at) "
        "SELECT p.id, q.id, 'succeeded', ARRAY['true'], now() FROM projects p, pools q, "
        "generate_series(1, 20000)")
    quiet_autovacuum(world.conn)
    analyze_all(world.conn)
    pin_planner(world.conn)
    params = dict(states=["blocked", "queued"], after_id=0, limit=1000, job_ids=None,
                  project_ids=None, pool_id=None, target_id=None, runner_id=None,
                  older_than_seconds=None, younger_than_seconds=None)
    sql = Q.list_bulk_candidates.sql
    plan = world.conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
    nodes = list(plan_nodes(plan))
    scans = [(n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == "jobs"]
    assert scans and all(t != "Seq Scan" for t, _ in scans), scans
    assert ("Index Scan", "jobs_state_idx") in scans, scans
    assert sum(n.get("Rows Removed by Filter", 0) for n in nodes) < 100
    assert [j["id"] for j in bulk.preview_bulk(world.conn, action="cancel", filters={})["jobs"]] == queued
