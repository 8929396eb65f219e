"""Records that agree: each job has its own audit trail (audit_events.job_id: every action on
it and the target resolutions that decided it), a resolved deployment reads as the
operator's outcome rather than an error, a losing retry hears who won, and a job's times come
from the database clock (sql/functions/operator.sql, sql/audit.sql, get_job in sql/jobs.sql)."""

from __future__ import annotations

import shutil

import pytest

from pgdispatch.sql import AlreadyResolved, audit, db, migrate, reads, transitions

from ..webapp.support import make_uncertain_target


def _trail(conn, job_id: int) -> list[tuple[str, str]]:
    return [(e["action"], e["subject"]) for e in reads.list_job_audit(conn, job_id=job_id)]


def test_every_action_on_a_job_is_on_its_own_trail_and_nowhere_else(world):
    world.setup()
    job = world.job(requires_approval=True, submitted_by="bob")
    other = world.job()
    transitions.approve_job(world.conn, job_id=job["id"], actor="alice", reason="ok")
    transitions.cancel_job(world.conn, job_id=job["id"], actor="alice", reason="wrong branch")
    transitions.retry_job(world.conn, job_id=job["id"], actor="carol")
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    subject = f"job:{job['id']}"
    assert _trail(world.conn, job["id"]) == [("submit_job", subject), ("approve_job", subject),
                                              ("cancel_job", subject), ("retry_job", subject)]
    assert _trail(world.conn, other["id"]) == [("submit_job", f"job:{other['id']}")]
    # the audit page's job filter reads the same trail, newest first, with the other filters
    events = audit.list_audit_events(world.conn, job_id=job["id"])
    assert [e["action"] for e in events] == ["retry_job", "cancel_job", "approve_job", "submit_job"]
    assert [e["actor"] for e in audit.list_audit_events(world.conn, job_id=job["id"],
                                                        actor="alice")] == ["alice", "alice"]
    older = audit.list_audit_events(world.conn, job_id=job["id"], before_id=events[1]["id"])
    assert [e["action"] for e in older] == ["approve_job", "submit_job"]


def test_a_target_resolution_is_on_the_trail_of_the_job_it_decided(world):
    made = make_uncertain_target(world, "staging")
    job_id = made["job"]["id"]
    transitions.resolve_target(world.conn, target="staging", outcome="succeeded",
                               note="checked the host: version 4.2 is live", actor="alice")
    assert _trail(world.conn, job_id) == [("submit_job", f"job:{job_id}"),
                                          ("resolve_target", "target:staging")]

    shown = reads.show_job(world.conn, job_id=job_id)
    # the operator's outcome, who, when and the note; not an error, not a failure
    assert shown["state"] == "succeeded"
    assert shown["last_error"] is None and shown["failures"] == 0
    assert shown["resolution"]["outcome"] == "succeeded"
    assert shown["resolution"]["actor"] == "alice"
    assert shown["resolution"]["note"] == "checked the host: version 4.2 is live"
    assert shown["resolution"]["action"] == "resolve_target" and shown["resolution"]["at"] is not None
    assert [a["state"] for a in shown["attempts"]] == ["lost"]  # what happened to the attempt stays


def test_a_deployment_resolved_as_failed_keeps_its_failure_and_its_lease_error(world):
    made = make_uncertain_target(world, "staging")
    job_id = made["job"]["id"]
    transitions.resolve_target(world.conn, target="staging", outcome="failed",
                               note="half deployed; rolled back", actor="alice")
    shown = reads.show_job(world.conn, job_id=job_id)
    assert shown["state"] == "failed" and shown["failures"] == 1
    assert shown["last_error"] == f"lease of attempt {made['claim'].attempt_id} expired"
    assert shown["resolution"]["outcome"] == "failed"


def test_a_late_report_that_frees_the_target_is_on_the_job_trail(world):
    made = make_uncertain_target(world, "staging")
    world.complete(made["claim"], "succeeded", exit_code=0)
    trail = reads.list_job_audit(world.conn, job_id=made["job"]["id"])
    assert [e["action"] for e in trail] == ["submit_job", "late_report"]
    assert trail[1]["actor"] == "runner:runner-lost"
    resolution = reads.show_job(world.conn, job_id=made["job"]["id"])["resolution"]
    assert (resolution["action"], resolution["outcome"]) == ("late_report", "succeeded")


def test_a_job_without_a_resolution_has_none(world):
    world.setup()
    job = world.job()
    assert reads.show_job(world.conn, job_id=job["id"])["resolution"] is None


def test_job_times_come_from_the_database_clock(world):
    world.setup()
    runner = world.runner()
    queued = world.job()
    blocked = world.job(requires_approval=True)
    delayed = world.job(delay_seconds=600)
    world.conn.execute("UPDATE jobs SET created_at = now() - interval '90 seconds', "
                       "ready_at = now() - interval '60 seconds' WHERE id = %s", (queued["id"],))
    world.conn.execute("UPDATE jobs SET created_at = now() - interval '30 seconds' WHERE id = %s",
                       (blocked["id"],))
    q = reads.show_job(world.conn, job_id=queued["id"])
    assert round(q["age_seconds"]) == 90 and round(q["waiting_seconds"]) == 60
    assert q["waiting_since"] == q["ready_at"]  # a queued job waits from its ready_at
    assert q["duration_seconds"] is None and q["running_seconds"] is None
    b = reads.show_job(world.conn, job_id=blocked["id"])
    assert b["waiting_since"] == b["created_at"] and round(b["waiting_seconds"]) == 30
    assert reads.show_job(world.conn, job_id=delayed["id"])["waiting_since"] is None  # not yet

    claim = world.claim(runner)
    assert claim.job_id == queued["id"]
    world.conn.execute("UPDATE attempts SET claimed_at = now() - interval '20 seconds' WHERE id = %s",
                       (claim.attempt_id,))
    r = reads.show_job(world.conn, job_id=queued["id"])
    assert r["waiting_since"] is None and round(r["running_seconds"]) == 20
    assert round(r["attempts"][0]["duration_seconds"]) == 20
    world.complete(claim, "succeeded", exit_code=0)
    done = reads.show_job(world.conn, job_id=queued["id"])
    assert done["running_seconds"] is None
    assert done["duration_seconds"] == pytest.approx(
        (done["finished_at"] - done["created_at"]).total_seconds())
    attempt = done["attempts"][0]
    assert attempt["duration_seconds"] == pytest.approx(
        (attempt["finished_at"] - attempt["claimed_at"]).total_seconds())


@pytest.mark.own_database  # the retry's audit time must follow the failed attempt's end (commits)
def test_the_losing_retry_hears_who_won_and_when(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    world.complete(world.claim(runner), "failed", exit_code=1)
    transitions.retry_job(world.conn, job_id=job["id"], actor="alice")
    with pytest.raises(AlreadyResolved, match=rf"job {job['id']} is queued and cannot be retried "
                                              r"\(already retried by alice at 20\d\d-.* UTC; "):
        transitions.retry_job(world.conn, job_id=job["id"], actor="bob")
    # once it has run and failed again, an earlier retry is history: the retry is allowed
    world.complete(world.claim(runner), "failed", exit_code=1)
    transitions.retry_job(world.conn, job_id=job["id"], actor="bob")
    # a job nobody retried says only where it is
    fresh = world.job()
    with pytest.raises(AlreadyResolved) as refused:
        transitions.retry_job(world.conn, job_id=fresh["id"], actor="bob")
    assert "already retried" not in str(refused.value)


def test_the_upgrade_links_the_events_recorded_before_it(new_database, tmp_path):
    """0011_audit_job on a database with history: the events written before the column
    existed get their job too (a generated column is computed for every existing row, and
    the rewrite does not trip the table's refusal of UPDATE)."""
    url = new_database()
    before = tmp_path / "migrations"
    shutil.copytree(migrate.MIGRATIONS_DIR, before)
    (before / "0011_audit_job.sql").unlink()
    migrate.upgrade(url, migrations_dir=before)
    with db.connect(url) as conn:
        for subject, details in [("job:41", "{}"), ("target:staging", '{"job_id": 41, "outcome": "failed"}'),
                                 ("project:web", "{}"), ("job:not-a-number", "{}")]:
            conn.execute("SELECT pgd_audit('alice', 'x', %s, NULL, %s::jsonb)", (subject, details))
    migrate.upgrade(url)
    with db.connect(url) as conn:
        rows = conn.execute("SELECT subject, job_id FROM audit_events ORDER BY id").fetchall()
    assert [(r["subject"], r["job_id"]) for r in rows] == [
        ("job:41", 41), ("target:staging", 41), ("project:web", None), ("job:not-a-number", None)]
