"""Every transition against a real PostgreSQL, including its refusals."""

from __future__ import annotations

import pytest

from pgdispatch.sql import AlreadyResolved, Conflict, FencedOut, InvalidInput, NotFound, transitions
from pgdispatch.sql.explain import explain_job


def test_claim_runs_the_job_and_reserves_capacity(world):
    world.setup(org_limit=5, pool_slots=8)
    runner = world.runner()
    job = world.job(command=["echo", "hi"])
    assert job["state"] == "queued"
    c = world.claim(runner)
    assert c is not None and c.job_id == job["id"]
    assert c.generation == 1 and c.attempt_no == 1 and c.command == ["echo", "hi"]
    assert world.row("jobs", job["id"])["state"] == "running"
    assert world.counters() == {"org": 1, "project": 1, "pool": 1, "attempts": 1}
    assert world.claim(runner) is None


def test_complete_releases_everything_and_is_idempotent_by_receipt(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    c = world.claim(runner)
    first = world.complete(c, "succeeded", exit_code=0, output_tail="done\n")
    assert first["job_state"] == "succeeded" and first["repeated"] is False
    again = world.complete(c, "failed", exit_code=1)
    assert again["repeated"] is True and again["job_state"] == "succeeded"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert world.row("jobs", job["id"])["finished_at"] is not None


def test_heartbeat_extends_lease_and_fenced_heartbeat_is_refused(world):
    world.setup()
    runner = world.runner()
    world.job()
    c = world.claim(runner, lease_seconds=5)
    lease = transitions.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation,
                                  lease_seconds=60)
    assert lease.lease_expires_at > c.lease_expires_at
    with pytest.raises(FencedOut):
        transitions.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation + 1,
                              lease_seconds=60)


def test_failure_retries_with_backoff_then_fails(world):
    world.setup()
    runner = world.runner()
    job = world.job(max_attempts=2)
    c = world.claim(runner)
    r = world.complete(c, "failed", exit_code=3)
    assert r["job_state"] == "queued"
    row = world.row("jobs", job["id"])
    assert row["ready_at"] > row["created_at"]
    assert world.claim(runner) is None  # delayed
    assert explain_job(world.conn, job_id=job["id"])["reason"] == "retry_delayed"
    world.conn.execute("UPDATE jobs SET ready_at = now() WHERE id = %s", (job["id"],))
    c2 = world.claim(runner)
    assert c2.generation == 2 and c2.attempt_no == 2
    # the old attempt's late completion is fenced out
    with pytest.raises(FencedOut), world.conn.transaction():
        world.complete(c, "succeeded", receipt_key="other-key")
    r2 = world.complete(c2, "failed", exit_code=3)
    assert r2["job_state"] == "failed"


def test_expire_requeues_build_and_makes_deployment_uncertain(world):
    world.setup(pools=("linux", "deploy"), targets=("production",))
    runner = world.runner(pools=("linux", "deploy"))
    build = world.job(max_attempts=3)
    deploy = world.job(pool="deploy", target="production")
    c1 = world.claim(runner, pools=("linux", "deploy"))
    c2 = world.claim(runner, pools=("linux", "deploy"))
    assert {c1.job_id, c2.job_id} == {build["id"], deploy["id"]}
    world.expire_now(c1.attempt_id)
    world.expire_now(c2.attempt_id)
    done = transitions.expire_leases(world.conn)
    assert len(done) == 2
    assert world.row("jobs", build["id"])["state"] == "queued"
    assert world.row("jobs", deploy["id"])["state"] == "uncertain"
    t = world.conn.execute("SELECT * FROM targets WHERE name='production'").fetchone()
    assert t["state"] == "uncertain" and t["holder_job_id"] == deploy["id"]
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    # another deployment to the same target does not start
    d2 = world.job(pool="deploy", target="production")
    assert explain_job(world.conn, job_id=d2["id"])["reason"] == "target_uncertain"
    # the late heartbeat of the lost attempt is refused
    cd = c1 if c1.job_id == deploy["id"] else c2
    with pytest.raises(FencedOut), world.conn.transaction():
        transitions.heartbeat(world.conn, attempt_id=cd.attempt_id, generation=cd.generation, lease_seconds=30)
    # resolve: one operator wins, the other hears who did it
    r = transitions.resolve_target(world.conn, target="production", outcome="succeeded",
                                   note="checked the dashboard", actor="alice")
    assert r["job_state"] == "succeeded"
    with pytest.raises(AlreadyResolved, match="alice"), world.conn.transaction():
        transitions.resolve_target(world.conn, target="production", outcome="retry", note="x", actor="bob")
    c3 = world.claim(runner, pools=("deploy",))
    assert c3 is not None and c3.job_id == d2["id"]


def test_paused_project_is_not_claimed(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    assert world.claim(runner) is None
    assert explain_job(world.conn, job_id=job["id"])["reason"] == "project_paused"
    with pytest.raises(AlreadyResolved), world.conn.transaction():
        transitions.pause_project(world.conn, project="web", reason="again", actor="bob")
    transitions.resume_project(world.conn, project="web", actor="alice")
    assert world.claim(runner).job_id == job["id"]


def test_full_pool_and_held_target(world):
    world.setup(pool_slots=1, pools=("linux",), targets=("staging",))
    runner = world.runner()
    a = world.job()
    b = world.job()
    assert world.claim(runner).job_id == a["id"]
    assert world.claim(runner) is None
    e = explain_job(world.conn, job_id=b["id"])
    assert e["reason"] == "capacity_pool"
    assert "1 of 1" in e["reasons"][0]["message"]


def test_dependencies_and_approval(world):
    world.setup()
    runner = world.runner()
    build = world.job()
    deploy = world.job(depends_on=[build["id"]], requires_approval=True)
    assert deploy["state"] == "blocked"
    e = explain_job(world.conn, job_id=deploy["id"])
    assert [r["code"] for r in e["reasons"]][:2] == ["dependency_pending", "approval_required"]
    c = world.claim(runner)
    world.complete(c, "succeeded")
    assert explain_job(world.conn, job_id=deploy["id"])["reason"] == "approval_required"
    transitions.approve_job(world.conn, job_id=deploy["id"], actor="alice")
    assert world.row("jobs", deploy["id"])["state"] == "queued"
    with pytest.raises(Conflict):
        transitions.approve_job(world.conn, job_id=deploy["id"], actor="bob")


def test_failed_dependency_cancels_dependents(world):
    world.setup()
    runner = world.runner()
    build = world.job()
    test = world.job(depends_on=[build["id"]])
    deploy = world.job(depends_on=[test["id"]])
    world.complete(world.claim(runner), "failed", exit_code=1)
    assert world.row("jobs", test["id"])["state"] == "cancelled"
    assert world.row("jobs", deploy["id"])["state"] == "cancelled"
    with pytest.raises(InvalidInput, match="dependency"):
        world.job(depends_on=[build["id"]])


def test_submit_rejects_bad_input_and_writes_nothing(world):
    world.setup()
    n = world.conn.execute("SELECT count(*) AS n FROM jobs").fetchone()["n"]
    with pytest.raises(NotFound), world.conn.transaction():
        world.job(project="nope")
    with pytest.raises(InvalidInput), world.conn.transaction():
        world.job(command=[])
    with pytest.raises(InvalidInput), world.conn.transaction():
        world.job(command=["a\x00b"])
    with pytest.raises(InvalidInput), world.conn.transaction():
        world.job(priority=5000)
    with pytest.raises(NotFound), world.conn.transaction():
        world.job(depends_on=[999999])
    assert world.conn.execute("SELECT count(*) AS n FROM jobs").fetchone()["n"] == n


def test_cancel_running_job_is_seen_by_heartbeat(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    c = world.claim(runner)
    transitions.cancel_job(world.conn, job_id=job["id"], actor="alice", reason="wrong branch")
    lease = transitions.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation, lease_seconds=30)
    assert lease.is_cancel_requested
    r = world.complete(c, "cancelled", exit_code=-15)
    assert r["job_state"] == "cancelled"
    assert world.counters()["org"] == 0


def test_late_build_report_after_expiry_counts_when_nobody_claimed_since(world):
    world.setup()
    runner = world.runner()
    job = world.job(max_attempts=3)
    c = world.claim(runner)
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    assert world.row("jobs", job["id"])["state"] == "queued"
    r = world.complete(c, "succeeded", exit_code=0)
    assert r["is_late_report"] is True and r["job_state"] == "succeeded"
    assert world.row("attempts", c.attempt_id)["state"] == "succeeded"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_late_build_report_is_fenced_once_the_job_was_claimed_again(world):
    world.setup()
    runner = world.runner()
    world.job(max_attempts=3, )
    c = world.claim(runner)
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    world.conn.execute("UPDATE jobs SET ready_at = now() WHERE id = %s", (c.job_id,))
    c2 = world.claim(runner)
    assert c2.job_id == c.job_id and c2.generation == 2
    with pytest.raises(FencedOut), world.conn.transaction():
        world.complete(c, "succeeded", exit_code=0)
    assert world.row("jobs", c.job_id)["state"] == "running"


def test_late_failed_report_of_a_lost_deployment_counts_one_failure(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    job = world.job(pool="deploy", target="production", max_attempts=2)
    c = world.claim(runner, pools=("deploy",))
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    r = world.complete(c, "failed", exit_code=1)
    row = world.row("jobs", job["id"])
    assert r["is_late_report"] and (row["state"], row["failures"]) == ("queued", 1)


def test_cancel_cascade_reaches_a_dependent_submitted_while_it_waited(world, db_url):
    """A is queued, B depends on A; C (depending on B) is being submitted while A is
    cancelled. The cascade waits for C's submit (it holds B FOR SHARE) and must then see
    C's edge: C ends cancelled, not blocked forever."""
    import threading

    from pgdispatch.sql import db

    world.setup()
    a = world.job()
    b = world.job(depends_on=[a["id"]])
    submitter = db.connect(db_url)
    canceller = db.connect(db_url)
    try:
        tx = submitter.transaction()
        tx.__enter__()
        c = transitions.submit(submitter, project="web", pool="linux", command=["true"],
                               depends_on=[b["id"]])
        done = threading.Event()
        t = threading.Thread(target=lambda: (transitions.cancel_job(
            canceller, job_id=a["id"], actor="bob"), done.set()))
        t.start()
        # the cancel is now waiting for B's row lock held by the open submit
        assert not done.wait(1.0)
        tx.__exit__(None, None, None)
        t.join(10)
        assert done.is_set()
    finally:
        submitter.close()
        canceller.close()
    states = {j: world.row("jobs", j)["state"] for j in (a["id"], b["id"], c["id"])}
    assert states == {a["id"]: "cancelled", b["id"]: "cancelled", c["id"]: "cancelled"}
