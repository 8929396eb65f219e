"""Pausing a pool and draining a runner (issue 20, item 3): the transitions one by one, with
their refusals, what claims and explain make of them, and the audit trail. The races with
claims in flight are in tests/concurrency/test_steer_races.py; a real scheduler drained
under load in tests/scheduler/test_operator_drain.py."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from pgdispatch.sql import AlreadyResolved, Conflict, InvalidInput, NotFound, reads, transitions
from pgdispatch.sql.explain import explain_job
from pgdispatch.sql.queries import Q

HHMMSS = r"\d\d:\d\d:\d\d UTC"
_ts = dt.datetime.fromisoformat


def _batch(world, runner, n=5, pools=("linux",)):
    return transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(pools),
                                   claim_tokens=[transitions.new_claim_token() for _ in range(n)],
                                   lease_seconds=30)


def _events(world, subject):
    return [(e["actor"], e["action"], e["reason"]) for e in
            world.conn.execute("SELECT * FROM audit_events WHERE subject = %s ORDER BY id",
                               (subject,)).fetchall()]


def test_a_paused_pool_is_claimed_by_neither_claim_and_its_jobs_say_who_when_why(world):
    world.setup(pools=("linux", "mac"))
    runner = world.runner(pools=("linux", "mac"))
    job = world.job()
    other = world.job(pool="mac")
    paused = transitions.pause_pool(world.conn, pool="linux", reason="kernel upgrade", actor="alice")
    assert paused["paused_by"] == "alice" and paused["pause_reason"] == "kernel upgrade"
    assert _batch(world, runner, pools=("linux",)) == []
    c = world.claim(runner, pools=("linux", "mac"))
    assert c.job_id == other["id"]  # the other pool still runs
    assert world.claim(runner, pools=("linux", "mac")) is None
    why = explain_job(world.conn, job_id=job["id"])
    assert why["reason"] == "pool_paused"
    assert re.fullmatch(rf"pool linux paused by alice at {HHMMSS}: kernel upgrade", why["message"])
    assert why["reasons"][0]["details"]["paused_by"] == "alice"
    row = next(j for j in reads.list_waiting(world.conn)["jobs"] if j["id"] == job["id"])
    assert row["reasons"][0]["code"] == "pool_paused"
    q = next(p for p in reads.list_pools(world.conn) if p["name"] == "linux")
    assert q["paused_by"] == "alice" and q["pause_reason"] == "kernel upgrade"

    transitions.resume_pool(world.conn, pool="linux", reason="done", actor="bob")
    assert world.claim(runner).job_id == job["id"]
    assert _events(world, "pool:linux") == [("alice", "pause_pool", "kernel upgrade"),
                                            ("bob", "resume_pool", "done")]


def test_pause_and_resume_are_conditional_and_the_loser_hears_who_and_when(world):
    world.setup()
    transitions.pause_pool(world.conn, pool="linux", reason="maintenance", actor="alice")
    with pytest.raises(AlreadyResolved,
                       match=r"pool linux is already paused by alice at .* UTC: maintenance"), \
            world.conn.transaction():
        transitions.pause_pool(world.conn, pool="linux", reason="me too", actor="bob")
    transitions.resume_pool(world.conn, pool="linux", actor="alice")
    with pytest.raises(AlreadyResolved, match=r"pool linux is not paused \(resumed by alice at .* UTC\)"), \
            world.conn.transaction():
        transitions.resume_pool(world.conn, pool="linux", actor="bob")
    # nothing half-applied by the refusals: one pause, one resume on record
    assert [a for _, a, _ in _events(world, "pool:linux")] == ["pause_pool", "resume_pool"]


@pytest.mark.parametrize("call, error", [
    (lambda c: transitions.pause_pool(c, pool="linux", reason="", actor="a"), InvalidInput),
    (lambda c: transitions.pause_pool(c, pool="linux", reason=None, actor="a"), InvalidInput),
    (lambda c: transitions.pause_pool(c, pool="nope", reason="x", actor="a"), NotFound),
    (lambda c: transitions.resume_pool(c, pool="nope", actor="a"), NotFound),
    (lambda c: transitions.pause_pool(c, pool="x" * 64, reason="x", actor="a"), InvalidInput),
    (lambda c: transitions.drain_runner(c, runner_id=10**6, reason="x", actor="a"), NotFound),
    (lambda c: transitions.drain_runner(c, runner_id=1, reason="", actor="a"), InvalidInput),
    (lambda c: transitions.drain_runner(c, runner_id=1, reason="x", deadline_seconds=-1, actor="a"),
     InvalidInput),
    (lambda c: transitions.drain_runner(c, runner_id=1, reason="x", deadline_seconds=604801,
                                        actor="a"), InvalidInput),
    (lambda c: transitions.drain_runner(c, runner_id=1, reason="x", deadline_seconds="1.5",
                                        actor="a"), InvalidInput),
    (lambda c: transitions.resume_runner(c, runner_id=0, actor="a"), InvalidInput),
])
def test_bad_input_is_refused_and_changes_nothing(world, call, error):
    world.setup()
    world.runner()
    with pytest.raises(error), world.conn.transaction():
        call(world.conn)
    assert world.conn.execute(
        "SELECT count(*) AS n FROM audit_events WHERE action IN "
        "('pause_pool', 'resume_pool', 'drain_runner', 'resume_runner')").fetchone()["n"] == 0
    assert world.conn.execute("SELECT count(*) AS n FROM pools WHERE paused_at IS NOT NULL"
                              ).fetchone()["n"] == 0


def test_an_approval_on_a_paused_pool_works_and_the_job_then_waits_on_the_pause(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    job = world.job(pool="deploy", target="production", requires_approval=True, submitted_by="carol")
    transitions.pause_pool(world.conn, pool="deploy", reason="change freeze", actor="alice")
    assert [r["code"] for r in explain_job(world.conn, job_id=job["id"])["reasons"]] == [
        "approval_required", "pool_paused"]
    assert transitions.approve_job(world.conn, job_id=job["id"], actor="bob")["state"] == "queued"
    assert explain_job(world.conn, job_id=job["id"])["reason"] == "pool_paused"
    assert world.claim(runner, pools=("deploy",)) is None
    transitions.resume_pool(world.conn, pool="deploy", actor="alice")
    assert world.claim(runner, pools=("deploy",)).job_id == job["id"]


def test_a_drained_runner_claims_nothing_finishes_what_it_runs_and_shows_drained(world):
    world.setup()
    runner = world.runner(slots=4)
    other = world.runner(slots=4)
    running = [world.job() for _ in range(2)]
    first = world.claim(runner)
    assert first.job_id == running[0]["id"]
    d = transitions.drain_runner(world.conn, runner_id=runner, reason="host reboot",
                                 deadline_seconds=600, actor="alice")
    assert d["drain_requested_by"] == "alice" and d["drain_reason"] == "host reboot"
    assert (_ts(d["drain_deadline"]) - _ts(d["drain_requested_at"])).total_seconds() == 600
    assert world.claim(runner) is None
    assert _batch(world, runner) == []
    r = reads.show_runner(world.conn, runner_id=runner)
    assert r["drain_requested_by"] == "alice" and r["slots_used"] == 1
    # the running job goes on: its heartbeat and its report are the runner's as before
    world.complete(first, "succeeded", exit_code=0)
    assert world.row("jobs", first.job_id)["state"] == "succeeded"
    # its own beat (not draining) never clears an operator's drain, and carries it
    rows = transitions.beat_runner(world.conn, runner_id=runner, is_draining=False)
    assert {r["drain_reason"] for r in rows} == {"host reboot"}
    assert world.row("runners", runner)["drain_requested_at"] is not None
    assert all(r["drain_requested_at"] is None for r in
               transitions.beat_runner(world.conn, runner_id=other, is_draining=False))
    # the other runner takes the waiting job
    assert world.claim(other).job_id == running[1]["id"]
    transitions.resume_runner(world.conn, runner_id=runner, reason="back", actor="bob")
    world.job()
    assert world.claim(runner) is not None
    assert _events(world, f"runner:{runner}") == [("alice", "drain_runner", "host reboot"),
                                                  ("bob", "resume_runner", "back")]


def test_jobs_of_a_pool_served_only_by_drained_runners_have_no_authorized_runner(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    transitions.drain_runner(world.conn, runner_id=runner, reason="r", actor="alice")
    why = explain_job(world.conn, job_id=job["id"], live_seconds=60)
    assert why["reason"] == "no_authorized_runner"
    assert why["message"] == "no live runner serves pool linux"


def test_drain_and_resume_are_conditional_and_a_stopped_runner_cannot_be_drained(world):
    world.setup()
    runner = world.runner()
    gone = world.runner()
    transitions.stop_runner(world.conn, runner_id=gone)
    transitions.drain_runner(world.conn, runner_id=runner, reason="disk", actor="alice")
    with pytest.raises(AlreadyResolved,
                       match=rf"runner {runner} is already draining \(drain asked by alice at .* UTC: disk\)"), \
            world.conn.transaction():
        transitions.drain_runner(world.conn, runner_id=runner, reason="me too", actor="bob")
    with pytest.raises(Conflict, match=rf"runner {gone} is stopped"), world.conn.transaction():
        transitions.drain_runner(world.conn, runner_id=gone, reason="x", actor="bob")
    transitions.resume_runner(world.conn, runner_id=runner, actor="alice")
    with pytest.raises(AlreadyResolved, match=rf"runner {runner} is not drained \(resumed by alice"), \
            world.conn.transaction():
        transitions.resume_runner(world.conn, runner_id=runner, actor="bob")
    assert [a for _, a, _ in _events(world, f"runner:{runner}")] == ["drain_runner", "resume_runner"]


def test_a_drain_without_a_deadline_has_none_and_zero_means_at_once(world):
    world.setup()
    a, b = world.runner(), world.runner()
    assert transitions.drain_runner(world.conn, runner_id=a, reason="x", actor="o")["drain_deadline"] is None
    d = transitions.drain_runner(world.conn, runner_id=b, reason="x", deadline_seconds=0, actor="o")
    assert d["drain_deadline"] == d["drain_requested_at"]


def test_another_login_reads_no_drain_with_the_beat(world):
    world.setup()
    runner = world.runner()
    transitions.drain_runner(world.conn, runner_id=runner, reason="x", actor="o")
    # pgd_runner_drain answers the runner's own login (or an unbound one) only
    assert list(world.conn.execute("SELECT * FROM pgd_runner_drain(%s)", (runner,))) != []
    assert Q.get_runner(world.conn, runner_id=runner, live_seconds=30)["drain_reason"] == "x"
