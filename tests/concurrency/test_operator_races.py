"""Operators and runners racing on real connections: resolve, pause, a repeated delivery,
and a heartbeat against the expiry pass. Each race is paired with a deliberately broken copy
of the transition that the same harness catches."""

from __future__ import annotations

import random
import time

import pytest

from pgdispatch.sql import AlreadyResolved, Conflict, FencedOut, db, transitions

from .harness import (broken_expire_one, check_now, install_broken_expire, raise_first_error,
                      run_together)

ACTORS = ("alice", "bob")


def call_broken(conn, sql: str, *args):
    """Run one broken function in a retried transaction, errors translated like the real ones."""
    return db.in_transaction(conn, lambda c: c.execute(sql, args).fetchone()["r"], tx_name="broken")


def winners_and_losers(outcomes) -> tuple[list[int], list[int]]:
    for o in outcomes:
        if o.error is not None and not isinstance(o.error, AlreadyResolved):
            raise o.error
    wins = [i for i, o in enumerate(outcomes) if o.error is None]
    losses = [i for i, o in enumerate(outcomes) if isinstance(o.error, AlreadyResolved)]
    return wins, losses


def audit_count(conn, action: str, subject: str) -> int:
    return conn.execute("SELECT count(*) AS n FROM audit_events WHERE action = %s AND subject = %s",
                        (action, subject)).fetchone()["n"]


# --- two operators resolve one uncertain target ----------------------------------------------

def make_uncertain(world, runner: int) -> int:
    """A deployment to production whose lease lapsed: job and target uncertain. Returns the job id."""
    world.job(pool="deploy", target="production", command=["deploy"])
    c = world.claim(runner, pools=("deploy",))
    assert c is not None and c.target_id is not None
    world.expire_now(c.attempt_id)
    assert [r["attempt_id"] for r in transitions.expire_leases(world.conn)] == [c.attempt_id]
    assert world.row("jobs", c.job_id)["state"] == "uncertain"
    return c.job_id


def race_resolve(world, db_url, resolve) -> dict:
    """Two operators resolve production at once; ``resolve(conn, actor, outcome)``."""
    outcomes = run_together(db_url, [lambda conn: resolve(conn, "alice", "succeeded"),
                                     lambda conn: resolve(conn, "bob", "retry")])
    wins, losses = winners_and_losers(outcomes)
    return {"wins": wins, "losses": losses, "outcomes": outcomes}


def real_resolve(conn, actor, outcome):
    return transitions.resolve_target(conn, target="production", outcome=outcome,
                                      note=f"{actor} checked the deploy log", actor=actor)


def test_two_operators_resolving_one_target_get_one_winner(world, db_url):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    for round_no in range(5):
        job_id = make_uncertain(world, runner)
        before = audit_count(world.conn, "resolve_target", "target:production")
        r = race_resolve(world, db_url, real_resolve)
        assert len(r["wins"]) == 1 and len(r["losses"]) == 1, f"round {round_no}: {r}"
        winner, loser = ACTORS[r["wins"][0]], r["outcomes"][r["losses"][0]].error
        assert f"already resolved by {winner} at " in str(loser)
        won = r["outcomes"][r["wins"][0]].value
        assert won["job_id"] == job_id
        assert world.row("jobs", job_id)["state"] == won["job_state"] == (
            "succeeded" if winner == "alice" else "queued")
        target = world.conn.execute("SELECT state, holder_job_id FROM targets").fetchone()
        assert target == {"state": "free", "holder_job_id": None}
        assert audit_count(world.conn, "resolve_target", "target:production") == before + 1
        assert check_now(world.conn) == []


BROKEN_RESOLVE_SQL = """
CREATE FUNCTION pgd_resolve_target_broken(p_target text, p_outcome text, p_note text, p_actor text,
                                          p_sleep_seconds double precision)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_target targets%ROWTYPE;
    v_state  text;
BEGIN
    -- BROKEN: the state is checked on a plain read and never re-checked under a lock
    SELECT * INTO v_target FROM targets WHERE name = p_target;
    IF v_target.state <> 'uncertain' THEN
        RAISE EXCEPTION 'target % is % (already resolved by %)', p_target, v_target.state,
            pgd_last_actor('target:' || p_target) USING ERRCODE = 'PD409';
    END IF;
    PERFORM pg_sleep(p_sleep_seconds);
    v_state := CASE p_outcome WHEN 'retry' THEN 'queued' ELSE p_outcome END;
    UPDATE jobs SET state = v_state, ready_at = now(),
                    finished_at = CASE WHEN v_state = 'queued' THEN NULL ELSE now() END
     WHERE id = v_target.holder_job_id;
    UPDATE targets SET state = 'free', holder_job_id = NULL, held_since = NULL WHERE id = v_target.id;
    PERFORM pgd_audit(p_actor, 'resolve_target', 'target:' || p_target, p_note,
                      jsonb_build_object('outcome', p_outcome, 'job_id', v_target.holder_job_id));
    RETURN jsonb_build_object('target', p_target, 'job_id', v_target.holder_job_id, 'job_state', v_state);
END;
$$;
"""


def test_harness_catches_a_resolve_that_checks_a_stale_state(world, db_url):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    world.conn.execute(BROKEN_RESOLVE_SQL)
    make_uncertain(world, runner)

    def resolve(conn, actor, outcome):
        return call_broken(conn, "SELECT pgd_resolve_target_broken('production', %s, 'note', %s, 1.0) AS r",
                           outcome, actor)

    r = race_resolve(world, db_url, resolve)
    assert len(r["wins"]) == 2 and r["losses"] == []
    assert audit_count(world.conn, "resolve_target", "target:production") == 2


def race_late_report(world, db_url, runner: int, resolve, *, report_when=None) -> dict:
    """A lost deployment's runner reports success late while an operator resolves the
    target as failed; ``resolve(conn, actor, outcome)``. ``report_when(conn)``: when given,
    the report waits until it returns true."""
    job_id = make_uncertain(world, runner)
    lost = world.conn.execute("SELECT id, generation, claim_token FROM attempts WHERE job_id = %s "
                              "ORDER BY id DESC LIMIT 1", (job_id,)).fetchone()

    def late_report(conn):
        deadline = time.monotonic() + 10
        while report_when is not None and not report_when(conn):
            assert time.monotonic() < deadline, "the report's moment never came"
            time.sleep(0.01)
        return transitions.complete(conn, attempt_id=lost["id"], generation=lost["generation"],
                                    outcome="succeeded", exit_code=0,
                                    receipt_key=f"{lost['claim_token']}:complete")

    report, resolved = run_together(db_url, [late_report, lambda conn: resolve(conn, "alice", "failed")])
    for o in (report, resolved):
        if o.error is not None and not isinstance(o.error, (FencedOut, AlreadyResolved)):
            raise o.error
    return {"report": report, "resolve": resolved, "job": world.row("jobs", job_id)["state"],
            "target": world.conn.execute("SELECT state FROM targets").fetchone()["state"]}


def test_late_report_racing_an_operator_has_one_winner(world, db_url):
    """One of them settles the target; the other is refused (FencedOut / AlreadyResolved)."""
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    for round_no in range(6):
        r = race_late_report(world, db_url, runner, real_resolve)
        report, resolve = r["report"], r["resolve"]
        assert (report.error is None) != (resolve.error is None), f"round {round_no}: {r}"
        if report.error is None:
            assert report.value["is_late_report"] and isinstance(resolve.error, AlreadyResolved)
            assert r["job"] == "succeeded"
        else:
            assert isinstance(report.error, FencedOut) and r["job"] == "failed"
        assert r["target"] == "free"
        assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_harness_catches_a_resolve_racing_a_late_report_on_a_stale_state(world, db_url):
    """The broken resolve read 'uncertain' before the late report landed, and overwrites
    the reported success with its own outcome: both 'win'."""
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    world.conn.execute(BROKEN_RESOLVE_SQL)
    # the report lands while the broken resolve sleeps between its stale read and its writes
    # (left to the threads' start order, the report sometimes came first, and the broken
    # resolve then read 'free' and refused: a check that could not fail that time)
    def resolve_is_sleeping(conn) -> bool:
        return conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                            " AND query LIKE '%pgd_resolve_target_broken%'").fetchone()["n"] > 0

    r = race_late_report(world, db_url, runner, lambda conn, actor, outcome: call_broken(
        conn, "SELECT pgd_resolve_target_broken('production', %s, 'note', %s, 1.0) AS r", outcome, actor),
        report_when=resolve_is_sleeping)
    assert r["report"].error is None and r["resolve"].error is None
    assert r["report"].value["job_state"] == "succeeded" and r["job"] == "failed"


def test_operator_beaten_by_a_late_report_is_told_so(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    # an earlier incident on the same target, resolved by alice
    make_uncertain(world, runner)
    real_resolve(world.conn, "alice", "failed")
    # a new one, settled by the runner's late report before bob gets there
    job_id = make_uncertain(world, runner)
    lost = world.conn.execute("SELECT id, generation, claim_token FROM attempts WHERE job_id = %s",
                              (job_id,)).fetchone()
    transitions.complete(world.conn, attempt_id=lost["id"], generation=lost["generation"],
                         outcome="succeeded", receipt_key=f"{lost['claim_token']}:complete")
    with pytest.raises(AlreadyResolved) as info, world.conn.transaction():
        real_resolve(world.conn, "bob", "retry")
    # not "already resolved by alice": alice resolved the previous incident, not this one
    assert "alice" not in str(info.value)
    runner_name = world.conn.execute("SELECT r.name FROM runners r JOIN attempts a ON a.runner_id = r.id "
                                     "WHERE a.id = %s", (lost["id"],)).fetchone()["name"]
    assert f"already resolved by runner:{runner_name} at " in str(info.value)


# --- two operators pause one project ---------------------------------------------------------

def race_pause(world, db_url, pause) -> dict:
    outcomes = run_together(db_url, [lambda conn, a=a: pause(conn, a) for a in ACTORS])
    wins, losses = winners_and_losers(outcomes)
    return {"wins": wins, "losses": losses, "outcomes": outcomes}


def test_two_operators_pausing_one_project_get_one_winner(world, db_url):
    world.setup()
    for round_no in range(8):
        r = race_pause(world, db_url, lambda conn, actor: transitions.pause_project(
            conn, project="web", reason=f"freeze by {actor}", actor=actor))
        assert len(r["wins"]) == 1 and len(r["losses"]) == 1, f"round {round_no}: {r}"
        winner = ACTORS[r["wins"][0]]
        assert f"already paused by {winner} at " in str(r["outcomes"][r["losses"][0]].error)
        project = world.conn.execute("SELECT paused_by, pause_reason FROM projects WHERE name = 'web'").fetchone()
        assert project == {"paused_by": winner, "pause_reason": f"freeze by {winner}"}
        assert audit_count(world.conn, "pause_project", "project:web") == round_no + 1
        # and both resume at once: one wins, the other is told who (a Conflict: see the report)
        outcomes = run_together(db_url, [lambda conn, a=a: transitions.resume_project(
            conn, project="web", actor=a) for a in ACTORS])
        ok = [i for i, o in enumerate(outcomes) if o.error is None]
        assert len(ok) == 1, f"round {round_no}: {outcomes}"
        loser = outcomes[1 - ok[0]].error
        assert isinstance(loser, Conflict) and f"resumed by {ACTORS[ok[0]]} at " in str(loser), loser
        assert world.conn.execute("SELECT paused_at FROM projects WHERE name = 'web'").fetchone()["paused_at"] is None


BROKEN_PAUSE_SQL = """
CREATE FUNCTION pgd_pause_project_broken(p_project text, p_reason text, p_actor text,
                                         p_sleep_seconds double precision)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v projects%ROWTYPE;
BEGIN
    -- BROKEN: checks paused_at on a plain read, then updates unconditionally
    SELECT * INTO v FROM projects WHERE name = p_project;
    IF v.paused_at IS NOT NULL THEN
        RAISE EXCEPTION 'project % is already paused by %', p_project,
            pgd_last_actor('project:' || p_project) USING ERRCODE = 'PD409';
    END IF;
    PERFORM pg_sleep(p_sleep_seconds);
    UPDATE projects SET paused_at = now(), pause_reason = p_reason, paused_by = p_actor WHERE id = v.id;
    PERFORM pgd_audit(p_actor, 'pause_project', 'project:' || p_project, p_reason);
    RETURN jsonb_build_object('project', p_project, 'paused_by', p_actor);
END;
$$;
"""


def test_harness_catches_a_pause_that_checks_a_stale_state(world, db_url):
    world.setup()
    world.conn.execute(BROKEN_PAUSE_SQL)
    r = race_pause(world, db_url, lambda conn, actor: call_broken(
        conn, "SELECT pgd_pause_project_broken('web', 'freeze', %s, 1.0) AS r", actor))
    assert len(r["wins"]) == 2 and r["losses"] == []
    assert audit_count(world.conn, "pause_project", "project:web") == 2


# --- one completion delivered twice at once ----------------------------------------------------

def race_same_receipt(world, db_url, runner: int, complete) -> dict:
    """Two jobs running; the first one's completion is delivered from two connections at once
    with the same receipt key. ``complete(conn, claim)`` returns the response."""
    counters_before = world.counters()
    c = world.claim(runner)
    outcomes = run_together(db_url, [lambda conn: complete(conn, c)] * 2)
    raise_first_error(outcomes)
    receipts = world.conn.execute("SELECT count(*) AS n FROM delivery_receipts WHERE key = %s",
                                  (c.receipt_key,)).fetchone()["n"]
    return {"responses": [o.value for o in outcomes], "receipts": receipts,
            "before": counters_before, "after": world.counters(), "claim": c}


def real_complete(conn, c):
    return transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                outcome="succeeded", exit_code=0, receipt_key=c.receipt_key)


def test_one_completion_delivered_twice_at_once_is_recorded_once(world, db_url):
    world.setup()
    runner = world.runner()
    for _ in range(7):
        world.job()
    world.claim(runner)  # a second running job, so a double release would show
    for round_no in range(6):
        r = race_same_receipt(world, db_url, runner, real_complete)
        first, second = r["responses"]
        assert sorted([first["repeated"], second["repeated"]]) == [False, True], f"round {round_no}: {r}"
        strip = lambda resp: {k: v for k, v in resp.items() if k != "repeated"}  # noqa: E731
        assert strip(first) == strip(second)
        assert first["job_state"] == "succeeded" and first["attempt_id"] == r["claim"].attempt_id
        assert r["receipts"] == 1
        # claimed once (+1) and released once (-1)
        assert r["after"] == r["before"], f"round {round_no}: {r['before']} -> {r['after']}"
        assert world.row("attempts", r["claim"].attempt_id)["state"] == "succeeded"
        assert check_now(world.conn) == []


# A deliberately broken completion: the receipt and the attempt are checked on plain reads
# before any lock, and a duplicate receipt is dropped instead of refused. Its writes follow
# the lock order (job, attempt, organization stripe, pool stripe) and release as
# pgd_complete does (pgd_release_slots: the slots on the stripes the job's latest
# attempt recorded), then take those stripes off that attempt, as slot rows freed by job id
# were left naming no job (see BROKEN_EXPIRE_SQL in harness.py).
BROKEN_COMPLETE_SQL = """
CREATE FUNCTION pgd_complete_broken(p_attempt_id bigint, p_generation bigint, p_receipt_key text,
                                    p_sleep_seconds double precision)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_receipt  delivery_receipts%ROWTYPE;
    v          record;
    v_response jsonb;
BEGIN
    -- BROKEN: the receipt and the attempt are checked on plain reads, before any lock ...
    SELECT * INTO v_receipt FROM delivery_receipts WHERE key = p_receipt_key;
    IF FOUND THEN
        RETURN v_receipt.response || jsonb_build_object('repeated', true);
    END IF;
    SELECT a.job_id, a.state, j.project_id, j.pool_id, p.organization_id AS org_id INTO v
      FROM attempts a JOIN jobs j ON j.id = a.job_id JOIN projects p ON p.id = j.project_id
     WHERE a.id = p_attempt_id AND a.generation = p_generation;
    IF v.state IS DISTINCT FROM 'running' THEN
        RAISE EXCEPTION 'attempt % is fenced out', p_attempt_id USING ERRCODE = 'PDF01';
    END IF;
    PERFORM pg_sleep(p_sleep_seconds);
    UPDATE jobs SET state = 'succeeded', finished_at = now() WHERE id = v.job_id;
    UPDATE attempts SET state = 'succeeded', finished_at = now(), exit_code = 0 WHERE id = p_attempt_id;
    PERFORM pgd_release_slots(ARRAY[v.org_id], ARRAY[v.pool_id], ARRAY[v.job_id]);
    UPDATE attempts SET organization_stripe = NULL, pool_stripe = NULL, project_stripe = NULL
     WHERE id = (SELECT a.id FROM attempts a WHERE a.job_id = v.job_id
                  ORDER BY a.attempt_no DESC LIMIT 1);
    v_response := jsonb_build_object('status', 'recorded', 'job_id', v.job_id, 'attempt_id', p_attempt_id,
                                     'job_state', 'succeeded', 'attempt_state', 'succeeded',
                                     'repeated', false);
    -- ... and a duplicate receipt is silently dropped instead of refused
    INSERT INTO delivery_receipts (key, attempt_id, outcome, response)
    VALUES (p_receipt_key, p_attempt_id, 'succeeded', v_response)
    ON CONFLICT (key) DO NOTHING;
    RETURN v_response;
END;
$$;
"""


def test_harness_catches_a_completion_that_checks_its_receipt_too_early(world, db_url):
    """Both deliveries pass the early receipt check and both record the completion: each
    is answered "recorded", where the second must be answered as a repeat. The first
    release gives the slots back and takes the stripes off the attempt (as slot rows freed
    by job id were left naming no job, before the stripes), and the project counts its
    running count (on the stripe the attempt recorded, taken off it too; before the stripes, a
    counter was decremented twice), so the second release finds nothing left to give back and
    the capacity stays right."""
    world.setup()
    runner = world.runner()
    world.conn.execute(BROKEN_COMPLETE_SQL)
    for _ in range(3):
        world.job()
    world.claim(runner)
    r = race_same_receipt(world, db_url, runner, lambda conn, c: call_broken(
        conn, "SELECT pgd_complete_broken(%s, %s, %s, 1.0) AS r", c.attempt_id, c.generation, c.receipt_key))
    assert [resp["repeated"] for resp in r["responses"]] == [False, False]
    assert r["after"] == {"org": 1, "project": 1, "pool": 1, "attempts": 1}  # the other job
    assert check_now(world.conn) == []


# --- a heartbeat against the expiry pass, on a lease about to lapse ---------------------------

def heartbeat_vs_expire(world, db_url, runner: int, *, expire, lease_s: float, settle_s: float,
                        hb_delay, ex_delay) -> dict:
    """Claim a job with a ``lease_s`` lease, wait ``settle_s``, then release a heartbeat
    racer (after ``hb_delay()`` s) and an expiry racer (after ``ex_delay()`` s) at once."""
    world.job()
    c = world.claim(runner, lease_seconds=lease_s)
    time.sleep(settle_s)

    def beat(conn):
        time.sleep(hb_delay())
        try:
            return transitions.heartbeat(conn, attempt_id=c.attempt_id, generation=c.generation,
                                         lease_seconds=30)
        except FencedOut:
            return None

    def expire_pass(conn):
        time.sleep(ex_delay())
        return expire(conn)

    hb, ex = run_together(db_url, [beat, expire_pass])
    raise_first_error([hb, ex])
    attempt = world.conn.execute(
        "SELECT state, lease_expires_at > clock_timestamp() + interval '20 seconds' AS fresh "
        "FROM attempts WHERE id = %s", (c.attempt_id,)).fetchone()
    return {"heartbeat_ok": hb.value is not None,
            "expired": ex.value is not None and ex.value["attempt_id"] == c.attempt_id,
            "state": attempt["state"], "fresh": attempt["fresh"],
            "violations": check_now(world.conn), "claim": c}


def finish(world, r) -> None:
    """End the round: the surviving attempt completes, so every round starts from zero."""
    if r["state"] == "running":
        world.complete(r["claim"])
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


def test_heartbeat_racing_expiry_ends_running_or_expired_never_both(world, db_url):
    world.setup()
    runner = world.runner()
    rng = random.Random()
    seen = {"running": 0, "expired": 0}
    for round_no in range(40):
        r = heartbeat_vs_expire(world, db_url, runner, expire=lambda conn: transitions.expire_one(conn),
                                lease_s=0.03, settle_s=0.0,
                                hb_delay=lambda: rng.uniform(0, 0.06),
                                ex_delay=lambda: rng.uniform(0, 0.06))
        assert r["heartbeat_ok"] != r["expired"], f"round {round_no}: {r}"
        if r["heartbeat_ok"]:
            assert r["state"] == "running" and r["fresh"], f"round {round_no}: {r}"
        else:
            assert r["state"] == "expired", f"round {round_no}: {r}"
        assert r["violations"] == [], f"round {round_no}: {r}"
        seen[r["state"]] += 1
        finish(world, r)
    # the race really went both ways
    assert seen["running"] > 0 and seen["expired"] > 0, seen


def test_harness_catches_an_expiry_that_does_not_recheck_the_lease(world, db_url):
    """The broken expiry reads the lapsed lease, sleeps while the heartbeat extends it, and
    expires the attempt anyway: the heartbeat succeeded and the attempt is expired."""
    world.setup()
    runner = world.runner()
    install_broken_expire(world.conn)
    for _ in range(3):
        r = heartbeat_vs_expire(world, db_url, runner,
                                expire=lambda conn: broken_expire_one(conn, sleep_s=0.2),
                                lease_s=0.01, settle_s=0.05,
                                hb_delay=lambda: 0.05, ex_delay=lambda: 0.0)
        assert r["heartbeat_ok"] and r["expired"] and r["state"] == "expired"
