"""Racing submits to a superseding target leave exactly one survivor (sql/functions/submit.sql:
pgd_submit takes the target's supersede lock, a transaction advisory lock, before it inserts
the job, so the submits to one target are serialised and each sees every older one committed).

Two races on real connections: a deterministic one (the first submit held open while the
second runs) and a crowd (many submits released at once by a barrier, beside claimers
taking deployments from the same target). Both are run against a deliberately broken variant
without the lock too: there the second submit neither waits nor sees the first, and two
deployments survive, which the same checks report.
"""

from __future__ import annotations

import threading
import time

import pytest

from pgdispatch.sql import db, transitions

from .. import variants
from .harness import raise_first_error, run_together

HOLD_S = 0.5
NO_LOCK = ("PERFORM pg_advisory_xact_lock(pgd_supersede_lock_class(), pgd_supersede_lock_key(v_target));",
           "NULL;  -- broken variant: no supersede lock")


def superseding(world) -> None:
    world.setup(targets=())
    world.project("api", org="acme", pools=("linux",))
    world.apply({"targets": [{"name": "staging", "supersede": True}]})


def submit(conn, project: str = "web") -> dict:
    return transitions.submit(conn, project=project, pool="linux", target="staging", command=["deploy"])


def survivors(world) -> list[int]:
    """Deployments to staging still waiting (queued or blocked)."""
    return [r["id"] for r in world.conn.execute(
        "SELECT j.id FROM jobs j JOIN targets t ON t.id = j.target_id "
        "WHERE t.name = 'staging' AND j.state IN ('queued', 'blocked') ORDER BY j.id").fetchall()]


def break_lock(world) -> None:
    world.conn.execute(variants.variant_sql(world.conn, "pgd_submit", [NO_LOCK]))


def hold_then(db_url, held, other, connect=None) -> dict:
    """Run ``held`` in an open transaction on one connection and ``other`` from a thread on
    another; commit the first after HOLD_S. ``connect(application_name)`` opens each
    (default: straight to ``db_url``). Returns both answers ("held", "other"), when the
    first committed and when the other returned (time.monotonic)."""
    got: dict = {}
    connect = connect or (lambda name: db.connect(db_url, application_name=name))

    def second() -> None:
        with connect("racer-second") as conn:
            got["other"] = other(conn)
            got["other_done"] = time.monotonic()

    with connect("racer-first") as first:
        with first.transaction():
            got["held"] = held(first)
            racer = threading.Thread(target=second, name="racer-second")
            racer.start()
            time.sleep(HOLD_S)
            got["committed"] = time.monotonic()
        racer.join(timeout=30)
    assert not racer.is_alive(), "the second transaction never returned"
    return got


def race_two(world, db_url) -> dict:
    """Submit in an open transaction on one connection; submit again from another
    (hold_then). Returns both jobs, whether the second returned only after the first
    committed, and the survivors."""
    superseding(world)
    got = hold_then(db_url, submit, lambda conn: submit(conn, project="api"))
    return {"first": got["held"], "second": got["other"], "second_done": got["other_done"],
            "committed": got["committed"], "survivors": survivors(world)}


@pytest.mark.parametrize("variant", ["real", "no lock"])
def test_two_racing_submits_leave_one_survivor_the_newer(world, db_url, variant):
    if variant == "no lock":
        superseding(world)
        break_lock(world)
    got = race_two(world, db_url)
    if variant == "real":
        assert got["survivors"] == [got["second"]["id"]] and got["second"]["id"] > got["first"]["id"]
        assert got["second_done"] >= got["committed"]  # it waited for the first's lock
        first = world.row("jobs", got["first"]["id"])
        assert (first["state"], first["last_error"]) == ("superseded", f"superseded by job {got['second']['id']}")
    else:
        # what the checks above catch: two survivors, and no waiting
        assert len(got["survivors"]) == 2
        assert got["second_done"] < got["committed"]


def crowd(world, db_url, *, submitters: int = 8, rounds: int = 3, claimers: int = 2) -> dict:
    """``rounds`` times: ``submitters`` submits to staging (two projects) and ``claimers``
    claimers taking deployments from it, released together. Returns the survivors after each round,
    the audit of every supersede, and the attempts of jobs after they were superseded."""
    superseding(world)
    runner = world.runner(slots=50)
    pools = world.pool_ids(("linux",))
    out: dict = {"survivors": [], "deadlocks": 0}

    def claimer(conn):
        taken = []
        for _ in range(5):
            c = transitions.claim(conn, runner_id=runner, pools=pools,
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
            if c is not None:
                taken.append(c)
                transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", receipt_key=c.receipt_key)
        return taken

    for _ in range(rounds):
        fns = [(lambda conn, p=("web" if i % 2 else "api"): submit(conn, p)) for i in range(submitters)]
        fns += [claimer] * claimers
        outcomes = run_together(db_url, fns)
        raise_first_error(outcomes)
        out["survivors"].append(survivors(world))
    out["superseded_then_ran"] = world.conn.execute(
        "SELECT count(*) AS n FROM attempts a JOIN jobs j ON j.id = a.job_id "
        "JOIN audit_events e ON e.job_id = j.id AND e.action = 'supersede' "
        "WHERE a.claimed_at > e.at").fetchone()["n"]
    out["by_older"] = world.conn.execute(
        "SELECT count(*) AS n FROM audit_events e WHERE e.action = 'supersede' "
        "AND (e.details ->> 'superseded_by')::bigint <= e.job_id").fetchone()["n"]
    out["superseded"] = world.conn.execute(
        "SELECT count(*) AS n FROM jobs WHERE state = 'superseded'").fetchone()["n"]
    return out


@pytest.mark.parametrize("variant", ["real", "no lock"])
def test_a_crowd_of_submits_beside_claimers_never_leaves_two_survivors(world, db_url, variant):
    if variant == "no lock":
        superseding(world)
        # without the lock, and with the time between the insert and the supersede
        # widened, so that the crowd's submits overlap there on a loaded machine too (the
        # row locks on the older deployments otherwise line most of them up)
        world.conn.execute(variants.variant_sql(world.conn, "pgd_submit", [NO_LOCK, (
            "PERFORM pgd_supersede_older(v_id,",
            "PERFORM pg_sleep(0.1); PERFORM pgd_supersede_older(v_id,")]))
    # the broken variant without claimers: a claimer taking one of two survivors before
    # they are counted would hide them
    got = crowd(world, db_url, claimers=2 if variant == "real" else 0)
    if variant == "real":
        assert all(len(s) <= 1 for s in got["survivors"]), got["survivors"]
        assert got["superseded_then_ran"] == 0 and got["by_older"] == 0
        assert got["superseded"] > 0
    else:
        assert any(len(s) > 1 for s in got["survivors"]), got["survivors"]


# --- a deployment going back to waiting while a newer one is submitted ----------------------
# (pgd_supersede_stale). Each race holds one side's transaction open while the other runs on
# a second connection, both ways round; the broken variants show what the checks catch.

SUBMIT_SKIPS_RUNNING = ("AND j.state IN ('queued', 'blocked', 'running')",
                        "AND j.state IN ('queued', 'blocked')  -- broken variant")
COMPLETE_NO_STALE = ("AND pgd_supersede_stale(v_job.id) IS NOT NULL THEN", "AND false THEN  -- broken variant")
RETRY_NO_LOCK = ("PERFORM pgd_lock_supersede_scopes(ARRAY[p_job_id]);", "NULL;  -- broken variant")


def running_deployment(world):
    superseding(world)
    runner = world.runner()
    old = transitions.submit(world.conn, project="web", pool="linux", target="staging",
                             command=["deploy"], max_attempts=3)
    c = world.claim(runner)
    assert c.job_id == old["id"]
    return c


def fail(conn, c) -> dict:
    return transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                outcome="failed", exit_code=1, receipt_key=c.receipt_key)


@pytest.mark.parametrize("variant", ["real", "submit skips running"])
def test_a_retry_held_open_is_superseded_by_the_submit_that_waited_for_it(world, db_url, variant):
    c = running_deployment(world)
    if variant != "real":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_submit", [SUBMIT_SKIPS_RUNNING]))
    got = hold_then(db_url, lambda conn: fail(conn, c), submit)
    if variant == "real":
        assert survivors(world) == [got["other"]["id"]]
        assert world.row("jobs", c.job_id)["state"] == "superseded"
    else:
        assert survivors(world) == [c.job_id, got["other"]["id"]]


@pytest.mark.parametrize("variant", ["real", "complete keeps it queued"])
def test_a_retry_after_a_submit_held_open_supersedes_itself(world, db_url, variant):
    c = running_deployment(world)
    if variant != "real":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_complete_attempt", [COMPLETE_NO_STALE]))
    got = hold_then(db_url, submit, lambda conn: fail(conn, c))
    if variant == "real":
        assert got["other"]["job_state"] == "superseded"
        assert survivors(world) == [got["held"]["id"]]
    else:
        assert survivors(world) == [c.job_id, got["held"]["id"]]


@pytest.mark.parametrize("variant", ["real", "retry without the lock"])
def test_an_operator_retry_racing_a_submit_leaves_one_survivor(world, db_url, variant):
    c = running_deployment(world)
    world.conn.execute("UPDATE jobs SET max_attempts = 1 WHERE id = %s", (c.job_id,))
    assert fail(world.conn, c)["job_state"] == "failed"
    if variant != "real":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_retry_job", [RETRY_NO_LOCK]))
    got = hold_then(db_url, submit,
                    lambda conn: transitions.retry_job(conn, job_id=c.job_id, actor="alice"))
    if variant == "real":
        assert got["other"]["state"] == "superseded"
        assert survivors(world) == [got["held"]["id"]]
    else:
        assert survivors(world) == [c.job_id, got["held"]["id"]]
