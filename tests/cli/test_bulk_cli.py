"""``pgdispatch jobs bulk`` and ``jobs set-priority`` as an operator runs them (real
processes): without --yes the preview and nothing changed; with --yes the report of done and
skipped; --json the API's object."""

from __future__ import annotations

import json

import pytest

from pgdispatch.sql import transitions
from pgdispatch.sql.config import apply_config

from .support import ALICE_PASSWORD, CONFIG, run_pgdispatch

pytestmark = pytest.mark.own_database


@pytest.fixture
def pgd(db_url, tmp_path, conn):
    apply_config(conn, CONFIG, env={"ALICE_PASSWORD": ALICE_PASSWORD})
    return lambda *args: run_pgdispatch(db_url, tmp_path, *args)


def states(conn):
    return [r["state"] for r in conn.execute("SELECT state FROM jobs ORDER BY id")]


def test_preview_then_yes_then_json(pgd, conn):
    ids = [transitions.submit(conn, project="web", pool="linux", command=["make", f"t{i}"])["id"]
           for i in range(3)]
    transitions.submit(conn, project="web", pool="deploy", target="production", command=["deploy"])
    preview = pgd("jobs", "bulk", "cancel", "--pool", "linux")
    assert preview.returncode == 0, preview.stderr
    assert preview.stdout.splitlines()[0] == "this will cancel 3 jobs (filter: pool=linux):"
    assert "make t0" in preview.stdout and "nothing changed; run it again with --yes" in preview.stdout
    assert states(conn) == ["queued"] * 4
    assert conn.execute("SELECT count(*) AS n FROM audit_events WHERE action LIKE 'bulk%'").fetchone()["n"] == 0

    transitions.cancel_job(conn, job_id=ids[0], actor="alice")
    done = pgd("jobs", "bulk", "cancel", "--pool", "linux", "--reason", "bad build", "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cancelled 2 of 2 jobs, skipped 0 (audit event ")
    assert states(conn) == ["cancelled"] * 3 + ["queued"]
    event = conn.execute("SELECT * FROM audit_events WHERE action = 'bulk_cancel'").fetchone()
    assert event["reason"] == "bad build" and event["details"]["filter"] == {"pool": "linux"}

    out = pgd("jobs", "bulk", "reprioritize", "--priority", "7", "--target", "production",
              "--yes", "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["dry_run"] is False and body["preview"]["count"] == 1
    assert body["result"]["done"] == [ids[-1] + 1] and body["result"]["priority"] == 7
    nothing = pgd("jobs", "bulk", "retry", "--state", "queued")
    assert nothing.returncode == 0 and nothing.stdout.strip() == (
        "no jobs to retry (filter: state=queued); retry takes jobs that are failed or cancelled")


def test_set_priority(pgd, conn):
    job = transitions.submit(conn, project="web", pool="linux", command=["make"])["id"]
    out = pgd("jobs", "set-priority", str(job), "--priority", "12", "--reason", "release")
    assert out.returncode == 0 and out.stdout.strip() == f"job {job}: priority 0 -> 12"
    again = pgd("jobs", "set-priority", str(job), "--priority", "12")
    assert again.returncode == 4 and "already has priority 12" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
