"""A bulk cancel while scheduler processes claim from the same set (issue 20, item 4).

Two real ``pgdispatch scheduler`` processes drain 300 short jobs; while they claim, the test
previews a bulk cancel of every queued job, waits a little (so that the schedulers claim some
of the previewed jobs meanwhile), and applies it to exactly the previewed ids in batches of
20. Every job that ran wrote its id into a file, from its own process. Afterwards, from the
database and that file:

* every job ended either cancelled (no attempt, never ran) or claimed and run (succeeded,
  one attempt, in the file) — never both, and no running job was cancelled as if queued;
* the counts add up: done + skipped = previewed, done = the cancelled jobs, every skipped job
  was claimed since the preview and ran; the race happened (both are non-empty);
* one bulk_cancel audit event, and one cancel_job event per cancelled job naming it.

The same run against a broken bulk (pgd_bulk_refusal without its state and generation checks:
it cancels a job whatever it is doing) is caught by the same checks. And two operators'
bulk cancels of overlapping sets, at once: each job cancelled by exactly one of them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pgdispatch.sql import bulk

from ..variants import variant_sql
from . import processes
from .harness import run_together

JOBS = 300
DEADLINE_S = 120.0
BROKEN = [("IF p_generation IS NOT NULL AND v.generation <> p_generation THEN", "IF false THEN"),
          ("IF p_action IN ('cancel', 'reprioritize') AND v.state NOT IN ('blocked', 'queued') THEN",
           "IF false THEN")]


def start_schedulers(db_url: str, tmp_path: Path) -> processes.Procs:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_LEASE_SECONDS="10",
               PGDISPATCH_HEARTBEAT_SECONDS="2", PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.1",
               PGDISPATCH_CLAIM_IDLE_CAP_SECONDS="1", PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.5",
               PGDISPATCH_SUMMARY_INTERVAL_SECONDS="2", PGDISPATCH_DATA_DIR=str(tmp_path / "data"))
    return processes.start_schedulers(env, tmp_path, 2, lambda i: [
        "--pool", "linux", "--slots", "3", "--name", f"s{i}"])


def race(world, db_url, tmp_path) -> dict:
    """Submit, start the schedulers, preview and apply a bulk cancel while they claim, let
    them finish; returns what happened (preview, result, jobs, attempts, the ran file)."""
    world.setup(pool_slots=100)
    ran = tmp_path / "ran.txt"
    command = ["sh", "-c", f'echo "$PGDISPATCH_JOB_ID" >> {ran}; sleep 0.05']
    with world.conn.transaction():
        ids = [world.job(command=command)["id"] for _ in range(JOBS)]
    procs = start_schedulers(db_url, tmp_path)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] < 10:
            assert time.monotonic() < deadline, processes.logs(procs)
            time.sleep(0.05)
        preview = bulk.preview_bulk(world.conn, action="cancel", filters={"project": "web"})
        time.sleep(0.5)  # the schedulers claim some of the previewed jobs meanwhile
        result = bulk.apply_bulk(world.conn, action="cancel",
                                 job_ids=[j["id"] for j in preview["jobs"]],
                                 generations=[j["generation"] for j in preview["jobs"]],
                                 filters=preview["filter"], reason="race", actor="alice",
                                 batch_size=20)
        while world.conn.execute("SELECT count(*) AS n FROM jobs WHERE finished_at IS NULL"
                                 ).fetchone()["n"]:
            dead = [path.name for p, path in procs if p.poll() is not None]
            assert not dead, f"schedulers exited: {dead}\n{processes.logs(procs)}"
            assert time.monotonic() < deadline, f"jobs left\n{processes.logs(procs)}"
            time.sleep(0.1)
    finally:
        exit_codes = processes.stop(procs)
    assert exit_codes == [0, 0], processes.logs(procs)
    jobs = {r["id"]: r for r in world.conn.execute("SELECT * FROM jobs")}
    attempts: dict[int, list] = {}
    for a in world.conn.execute("SELECT * FROM attempts ORDER BY id"):
        attempts.setdefault(a["job_id"], []).append(a)
    ran_ids = [int(line) for line in ran.read_text().split()] if ran.exists() else []
    return {"ids": ids, "preview": preview, "result": result, "jobs": jobs,
            "attempts": attempts, "ran": ran_ids}


def violations(world, r: dict) -> list[str]:
    """Every broken promise of the race's outcome (the module's docstring), as lines."""
    out = []
    ran = set(r["ran"])
    if len(r["ran"]) != len(ran):
        out.append("a job ran twice")
    previewed = [j["id"] for j in r["preview"]["jobs"]]
    done, skipped = r["result"]["done"], r["result"]["skipped"]
    for job_id, job in r["jobs"].items():
        tries = r["attempts"].get(job_id, [])
        if job["state"] == "cancelled":
            if tries or job_id in ran:
                out.append(f"job {job_id} cancelled and run ({len(tries)} attempts)")
        elif job["state"] == "succeeded":
            if len(tries) != 1 or job_id not in ran:
                out.append(f"job {job_id} succeeded with {len(tries)} attempts, ran: {job_id in ran}")
            if job["cancel_requested_at"] is not None:
                out.append(f"job {job_id} ran and was asked to cancel")
        else:
            out.append(f"job {job_id} ended {job['state']}")
    cancelled = sorted(i for i, j in r["jobs"].items() if j["state"] == "cancelled")
    if sorted(done) != cancelled:
        out.append(f"done {len(done)} jobs but {len(cancelled)} are cancelled")
    if len(done) + len(skipped) != len(previewed):
        out.append(f"done {len(done)} + skipped {len(skipped)} != previewed {len(previewed)}")
    for s in skipped:
        if s["job_id"] not in ran or "claimed since the preview" not in s["why"]:
            out.append(f"skipped {s}, but it did not run after a claim")
    [event] = world.conn.execute("SELECT * FROM audit_events WHERE action = 'bulk_cancel'").fetchall()
    trail = world.conn.execute("SELECT job_id, details FROM audit_events WHERE action = 'cancel_job' "
                               "ORDER BY job_id").fetchall()
    if [e["job_id"] for e in trail] != sorted(done) or any(
            e["details"].get("bulk_event_id") != event["id"] for e in trail):
        out.append("the per-job trail does not match the jobs done")
    if event["details"]["requested"] != len(previewed):
        out.append("the bulk event's count is not the preview's")
    return out


def test_a_bulk_cancel_racing_claiming_schedulers_cancels_or_runs_each_job_never_both(
        world, db_url, tmp_path):
    r = race(world, db_url, tmp_path)
    assert violations(world, r) == []
    # the race happened: some previewed jobs were claimed before the apply reached them
    assert r["result"]["done"] and r["result"]["skipped"], (len(r["result"]["done"]),
                                                            len(r["result"]["skipped"]))
    assert len(r["ran"]) + len(r["result"]["done"]) == JOBS


def test_a_bulk_cancel_without_its_state_checks_is_caught(world, db_url, tmp_path):
    world.conn.execute(variant_sql(world.conn, "pgd_bulk_refusal", BROKEN))
    r = race(world, db_url, tmp_path)
    found = violations(world, r)
    assert any("cancelled and run" in line for line in found), found


def test_two_operators_bulk_cancelling_overlapping_sets_each_job_once(world, db_url):
    """Alice and Bob confirm bulk cancels of overlapping previews at once, on real connections:
    every job is cancelled by exactly one of them (its one cancel_job event names that
    operator's bulk event), and the other's report skips it saying who cancelled it."""
    world.setup()
    ids = [world.job()["id"] for _ in range(120)]
    sets = {"alice": ids[:90], "bob": ids[30:]}
    outcomes = run_together(db_url, [
        lambda conn, who=who: bulk.apply_bulk(conn, action="cancel", job_ids=sets[who],
                                              actor=who, batch_size=10)
        for who in sets])
    results = {}
    for who, o in zip(sets, outcomes):
        assert o.error is None, o.error
        results[who] = o.value
    done = results["alice"]["done"] + results["bob"]["done"]
    assert sorted(done) == ids  # each once, none left
    for who, other in (("alice", "bob"), ("bob", "alice")):
        r = results[who]
        assert len(r["done"]) + len(r["skipped"]) == len(sets[who])
        for s in r["skipped"]:
            assert s["job_id"] in results[other]["done"]
            assert f"cancelled by {other}" in s["why"], s
    trail = world.conn.execute("SELECT job_id, actor, details FROM audit_events "
                               "WHERE action = 'cancel_job' ORDER BY job_id").fetchall()
    assert [e["job_id"] for e in trail] == ids
    for e in trail:
        assert e["details"]["bulk_event_id"] == results[e["actor"]]["bulk_event_id"]
