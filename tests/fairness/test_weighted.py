"""Test 2: with weights 3:1 the running share converges to 3:1 — claimed one at a time, and
with real concurrent claimers — and a claim that queued behind another chooses with that
claim's count (no pile-up on a project that only looked least served)."""

from __future__ import annotations

import threading
import time

import pytest

from pgdispatch.sql import db, transitions

from .checks import WEIGHTED_SLOTS, check_three_to_one, run_weighted
from .workload import drive_concurrent, install_global_order, install_single_read, setup, weighted


def test_running_share_converges_to_three_to_one(conn):
    """One runner, 8 slots, random durations (seeded), 400 claims: after 100 claims of warm-up
    the mean running ratio heavy:light is 3.0 ± 0.5 (measured: 3.00, i.e. 6 and 2 at every
    claim), the completed ratio too (measured: ~3.0), Jain's index of weighted share ~1."""
    figures = run_weighted(conn, claims=400)
    check_three_to_one(figures)
    assert figures["jain_mean"] >= 0.95, figures["jain_mean"]


def test_a_global_fifo_claim_fails_the_three_to_one_check(conn):
    """The check can fail: a global FIFO across the interleaved backlogs runs them ~1:1."""
    install_global_order(conn)
    figures = run_weighted(conn, claims=200)
    assert abs(figures["running_ratio"] - 1.0) < 0.5, figures["running_ratio"]
    with pytest.raises(AssertionError, match="is not 3.0"):
        check_three_to_one(figures)


def run_threads(conn, db_url, *, seconds: float = 3.0, pool_slots: int = WEIGHTED_SLOTS) -> dict:
    """12 claim loops on their own connections for a pool of 8 slots (or ``pool_slots``; the
    runner keeps 8), each claim -> sleep 40-120 ms -> complete; a sampler reads the running
    counters every 4 ms. 1 s warm-up."""
    workload = weighted(jobs_each=3000, slots=WEIGHTED_SLOTS)
    world = setup(conn, workload.projects, slots=workload.slots, interleave=True, bulk_insert=True)
    conn.execute("UPDATE pools SET slots = %s", (pool_slots,))
    report = drive_concurrent(db_url, runner_id=world["runner_id"], pool_ids=world["pool_ids"],
                                    names=world["names"], loops=12, seconds=seconds + 1.0,
                                    warmup_seconds=1.0, hold_seconds=(0.04, 0.12), seed=3)
    assert not report.errors, report.errors
    mean = report.mean_running()
    assert len(report.samples) > 100, len(report.samples)
    return {"mean_running": mean, "running_ratio": mean["heavy"] / mean["light"],
            "completed": report.completed,
            "completed_ratio": report.completed["heavy"] / max(report.completed["light"], 1),
            "claims": report.claims, "samples": len(report.samples)}


def test_running_share_converges_to_three_to_one_with_concurrent_claimers(conn, db_url):
    """Real concurrency: the sampled mean running ratio and the completed ratio are
    3.0 ± 0.5 (measured: 2.98-3.00 running, 2.87-2.94 completed). The claim as it was before,
    choosing its project from one lock-free read, measured 2.6 here and 2.2 in the benchmark
    (shorter holds): inside this tolerance, so the race that causes it is checked exactly by
    test_a_claim_queued_behind_another_chooses_with_its_count."""
    figures = run_threads(conn, db_url)
    check_three_to_one(figures)


def test_concurrent_global_fifo_fails_the_three_to_one_check(conn, db_url):
    """The same threaded check fails for a global FIFO claim."""
    install_global_order(conn)
    figures = run_threads(conn, db_url, seconds=1.5)
    with pytest.raises(AssertionError, match="is not 3.0"):
        check_three_to_one(figures)


def test_with_capacity_to_spare_a_claim_decides_from_its_read(conn, db_url):
    """The re-check runs only while capacity is scarce (sql/functions/claim.sql): with a pool
    of 100 slots for a runner of 8, B takes light's claim lock shared beside A
    (sql/functions/capacity.sql), passes the stripes A holds (SKIP LOCKED, pgd_take_slots),
    does not wait for A at all, and takes light as its read said (light 2 beside heavy 2).
    No claim could be refused capacity for it; the concurrent check below bounds what it
    costs the shares."""
    assert _claim_behind_an_open_claim(conn, db_url, pool_slots=100) == ("light", "light")


def test_running_share_stays_three_to_one_with_capacity_to_spare(conn, db_url):
    """12 concurrent claim loops on a pool of 100 slots (never scarce for them): the claims
    decide from their lock-free reads, and the running ratio converges near 3:1, within 3.0 ±
    0.8 — a looser bound than the scarce case's ± 0.5 (test above), because the lock-free
    reads overshoot towards the light project by how long a claim takes: measured when the
    project claim lock went in, 6 runs each, 2.80-2.87 running and 2.79-2.94 completed over
    6 s; on 2026-12-03, a machine 2-4 times slower, 2.50-2.67 running in 8 alternated runs of
    the code before and after the project running stripes alike (so not a change of the
    policy), and 2.34 once in CI beside the end of the parallel part. A policy that ignored
    the weights would aim at 1.0 (equal running counts). Runs 10 s, which narrows the spread."""
    figures = run_threads(conn, db_url, pool_slots=100, seconds=10.0)
    check_three_to_one(figures, tolerance=0.8)


def _claim_behind_an_open_claim(conn, db_url, *, pool_slots: int = 8) -> tuple[str, str]:
    """heavy (weight 3) runs 2, light (weight 1) runs 0. Claim A, in an open transaction,
    takes light (share 0 < 2/3). Claim B starts meanwhile. The one runner has 8 slots: with a
    pool of 8 capacity is scarce, so B waits for light's claim lock, which A holds
    exclusively (sql/functions/claim.sql), then A commits and B re-checks under the lock; with
    ``pool_slots`` 100 it is not (pgd_capacity_scarce), and B claims while A is still open (its
    claim lock is shared, and it takes its slots from stripes A does not hold). Returns the
    projects A and B got."""
    world = setup(conn, weighted(jobs_each=20).projects, slots=8, interleave=True,
                        bulk_insert=True)
    conn.execute("UPDATE pools SET slots = %s", (pool_slots,))
    pools, runner = world["pool_ids"], world["runner_id"]
    names = world["names"]
    # heavy starts two jobs: with light idle the claim alternates, so light runs one in
    # between; complete that one to leave heavy 2, light 0
    started = [transitions.claim(conn, runner_id=runner, pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=60)
               for _ in range(3)]
    assert sorted(names[c.project_id] for c in started) == ["heavy", "heavy", "light"]
    for c in started:
        if names[c.project_id] == "light":
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)
    running = {r["name"]: r["running"]
               for r in conn.execute("SELECT name, pgd_project_running(id) AS running FROM projects")}
    assert running == {"heavy": 2, "light": 0}

    got: dict[str, object] = {}

    def claim_b() -> None:
        try:
            with db.connect(db_url, application_name="bench-claim-b") as conn_b:
                got["pid"] = conn_b.info.backend_pid
                c = transitions.claim(conn_b, runner_id=runner, pools=pools,
                                      claim_token=transitions.new_claim_token(), lease_seconds=60)
                got["b"] = names[c.project_id]
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            got["error"] = exc

    with db.connect(db_url, application_name="claim-a") as conn_a:
        with conn_a.transaction():
            a = transitions.claim(conn_a, runner_id=runner, pools=pools,
                                  claim_token=transitions.new_claim_token(), lease_seconds=60)
            thread = threading.Thread(target=claim_b, name="bench-claim-b")
            thread.start()
            if pool_slots > 8:  # to spare: B does not wait for A
                thread.join(30)
                assert "b" in got or "error" in got, "claim B waited for claim A"
            deadline = time.monotonic() + 30
            while "b" not in got:  # B has read its candidates and now waits for the lock A holds
                waiting = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                       (got.get("pid"),)).fetchone()
                if waiting and waiting["wait_event_type"] == "Lock":
                    break
                assert "error" not in got, got["error"]
                assert time.monotonic() < deadline, "claim B never queued behind claim A"
                time.sleep(0.01)
        # A commits here
    thread.join(30)
    assert not thread.is_alive()
    if "error" in got:
        raise got["error"]  # type: ignore[misc]
    return names[a.project_id], got["b"]  # type: ignore[return-value]


def test_a_claim_queued_behind_another_chooses_with_its_count(conn, db_url):
    """Claim B read the candidates while A's claim of light was uncommitted (so light looked
    least served: 0 < 2/3), but it chooses its project only after A commits, under the
    project's claim lock: light now has 1 running (share 1 > 2/3), so B takes heavy."""
    assert _claim_behind_an_open_claim(conn, db_url) == ("light", "heavy")


def test_a_claim_choosing_from_its_first_read_piles_onto_the_same_project(conn, db_url):
    """The check can fail: pgd_claim as it was before (project chosen from the one lock-free
    read) gives B light too — light 2 running beside heavy 2, against weights 3:1."""
    install_single_read(conn)
    assert _claim_behind_an_open_claim(conn, db_url) == ("light", "light")
