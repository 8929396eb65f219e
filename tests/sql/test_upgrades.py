"""``db upgrade`` on a live database: a migration and a changed function body are swapped in
one transaction under live claims and completions, a try rolled back by a deadlock or by
its lock timeout is tried again, and a database this version cannot upgrade is refused
with one line, unchanged.

The migration here is an example, written into a temporary copy of sql/migrations/ beside
the real ones: it is what the next real migration will look like (docs/contributing.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from pgdispatch.sql import IncompatibleDatabase, PgDispatchError, db, migrate, transitions

from ..faults import consistency
from ..factories import World
from .test_migrations import MIGRATIONS

# the example comes after the real migrations, as the next real one will
NEXT = int(MIGRATIONS[-1][:4]) + 1
EXAMPLE = f"{NEXT:04d}_example"
LATER = f"{NEXT + 1:04d}"
EXAMPLE_MIGRATION = f"""\
-- {EXAMPLE}: jobs say which body of pgd_claim took them (a test's example migration).
ALTER TABLE jobs ADD COLUMN claimed_by_body text;
"""


def example_upgrade(tmp_path):
    """Copies of sql/migrations/ and sql/functions/ with the example migration added and
    pgd_claim changed to fill the new column; returns (migrations_dir, functions_dir)."""
    migrations, functions = tmp_path / "migrations", tmp_path / "functions"
    shutil.copytree(migrate.MIGRATIONS_DIR, migrations)
    shutil.copytree(migrate.FUNCTIONS_DIR, functions)
    (migrations / f"{EXAMPLE}.sql").write_text(EXAMPLE_MIGRATION)
    claim = functions / "claim.sql"
    text = claim.read_text()
    old = "                   started_at = coalesce(j.started_at, now())\n             WHERE j.id = v_job.id"
    assert text.count(old) == 1, "pgd_claim's job update not found: update this test"
    claim.write_text(text.replace(old, "                   started_at = coalesce(j.started_at, now()),\n"
                                       "                   claimed_by_body = 'new'\n"
                                       "             WHERE j.id = v_job.id"))
    return migrations, functions


def test_a_migration_and_a_new_claim_body_swap_in_under_live_claims_and_completions(db_url, tmp_path):
    """Four workers claim, run (10 ms) and complete 400 jobs while the example upgrade
    commits: no transition fails (a deadlock with the upgrade is retried, on either side),
    every job runs exactly once, the capacity books balance, and every claim asked for after
    the upgrade's commit runs the new body."""
    migrations, functions = example_upgrade(tmp_path)
    with db.connect(db_url) as conn:
        world = World(conn)
        world.setup(org_limit=3, pool_slots=3)
        runner = world.runner(slots=8)
        pools = world.pool_ids(("linux",))
        for _ in range(400):
            world.job()
    errors: list[BaseException] = []
    claimed: list[tuple[int, float]] = []
    stop = threading.Event()

    def work() -> None:
        with db.connect(db_url, application_name="live-worker") as conn:
            while not stop.is_set():
                try:
                    asked_at = time.monotonic()
                    c = transitions.claim(conn, runner_id=runner, pools=pools,
                                          claim_token=transitions.new_claim_token(), lease_seconds=60)
                    if c is None:
                        time.sleep(0.005)
                        continue
                    claimed.append((c.job_id, asked_at))
                    time.sleep(0.01)  # the job runs
                    transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                         outcome="succeeded", receipt_key=c.receipt_key)
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    errors.append(exc)
                    return

    workers = [threading.Thread(target=work, name=f"racer-worker-{i}") for i in range(4)]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 60
        while len(claimed) < 50:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        assert migrate.upgrade(db_url, migrations_dir=migrations, functions_dir=functions) == [
            EXAMPLE]
        upgraded_at = time.monotonic()
        with db.connect(db_url) as conn:
            while conn.execute("SELECT count(*) AS n FROM jobs WHERE state <> 'succeeded'"
                               ).fetchone()["n"]:
                assert time.monotonic() < deadline + 60 and not errors, errors
                time.sleep(0.02)
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert errors == []
    with db.connect(db_url) as conn:
        assert consistency.violations(conn) == []
        jobs = {r["id"]: r for r in conn.execute(
            "SELECT id, attempts_made, claimed_by_body FROM jobs")}
        # by the database's clock: every old-body claim before the upgrade, every new after
        by_claim_time = [r["b"] for r in conn.execute(
            "SELECT j.claimed_by_body AS b FROM attempts a JOIN jobs j ON j.id = a.job_id "
            "ORDER BY a.claimed_at")]
    assert sorted(job for job, _ in claimed) == sorted(jobs) and len(jobs) == 400
    assert all(j["attempts_made"] == 1 for j in jobs.values())
    bodies = by_claim_time
    assert None in bodies and "new" in bodies, "the upgrade did not land in the middle of the traffic"
    assert all(b is None for b in bodies[:50])  # claimed before the upgrade started
    # The switch is atomic: every claim asked for after the upgrade returned (its commit) ran
    # the new body. By the database's clock an old-body claim may still land after a new one:
    # a call that began before the commit, blocked by the upgrade's locks, keeps the body it
    # started with (PostgreSQL resolves a function when the call starts).
    after = [job for job, asked_at in claimed if asked_at > upgraded_at]
    assert after and all(jobs[j]["claimed_by_body"] == "new" for j in after)


def _watch_for_lock_wait(watcher, query_start: str) -> None:
    deadline = time.monotonic() + 30
    while not watcher.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                              " AND query LIKE %s", (query_start + "%",)).fetchone()["n"]:
        assert time.monotonic() < deadline, f"nothing waited on a lock at {query_start!r}"
        time.sleep(0.02)


def _upgrade_in_thread(url: str, **dirs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["applied"] = migrate.upgrade(url, **dirs)
        except Exception as exc:  # noqa: BLE001 - asserted by the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="racer-upgrade")
    thread.start()
    return thread, result


def upgrade_into_a_cycle(db_url: str, tmp_path) -> tuple[dict, int]:
    """Run the example upgrade while a transaction that has locked an attempt row (as a
    completion does after its job) goes on to lock a job row: a cycle with the upgrade,
    which holds jobs and waits for attempts. Returns what the upgrade answered and how many
    deadlocks the database counted meanwhile."""
    migrations, functions = example_upgrade(tmp_path)
    with db.connect(db_url, application_name="inflight-completion") as inflight, \
            db.connect(db_url) as watcher:
        world = World(watcher)
        world.setup()
        job = world.job()
        world.claim(world.runner())

        def deadlocks() -> int:
            return watcher.execute("SELECT deadlocks FROM pg_stat_database"
                                   " WHERE datname = current_database()").fetchone()["deadlocks"]

        before = deadlocks()
        inflight.execute("BEGIN")
        inflight.execute("SELECT 1 FROM attempts FOR NO KEY UPDATE")
        upgrader, result = _upgrade_in_thread(db_url, migrations_dir=migrations, functions_dir=functions)
        _watch_for_lock_wait(watcher, "LOCK TABLE runners, jobs")
        inflight.execute("SELECT 1 FROM jobs WHERE id = %s FOR NO KEY UPDATE", (job["id"],))
        inflight.execute("COMMIT")
        upgrader.join(60)
        assert not upgrader.is_alive()
        return result, deadlocks() - before


def test_an_upgrade_that_deadlocks_with_a_transition_in_flight_is_tried_again(db_url, tmp_path):
    """The upgrade waited first, so PostgreSQL aborts it (40P01); `db upgrade` rolls it
    back, tries again once the other transaction has committed, and applies it."""
    result, deadlocks = upgrade_into_a_cycle(db_url, tmp_path)
    assert "error" not in result, result
    assert result["applied"] == [EXAMPLE]
    assert deadlocks > 0, "no deadlock happened: the test did not exercise the retry"


def test_an_upgrade_that_times_out_behind_a_long_transaction_is_tried_again(db_url, tmp_path):
    """A transaction holding a job row for longer than the upgrade's lock timeout makes the
    first try give up (55P03) instead of queueing every transition behind it; the next try,
    after it commits, applies the upgrade."""
    migrations, functions = example_upgrade(tmp_path)
    with db.connect(db_url) as holder, db.connect(db_url) as watcher:
        World(watcher).setup()
        job = World(watcher).job()
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR NO KEY UPDATE", (job["id"],))
        upgrader, result = _upgrade_in_thread(db_url, migrations_dir=migrations, functions_dir=functions)
        _watch_for_lock_wait(watcher, "LOCK TABLE runners, jobs")
        time.sleep(5.5)  # past LOCK_TIMEOUT (5 s): the first try has given up by now
        holder.execute("COMMIT")
        upgrader.join(60)
    assert "error" not in result, result
    assert result["applied"] == [EXAMPLE]


def test_without_the_retry_the_deadlocked_upgrade_fails(db_url, tmp_path, monkeypatch):
    """The check above can fail: with one try, the same cycle makes `db upgrade` raise, and
    nothing of the upgrade is left."""
    monkeypatch.setattr(migrate, "UPGRADE_TRIES", 1)
    result, deadlocks = upgrade_into_a_cycle(db_url, tmp_path)
    assert "applied" not in result and migrate._sqlstate(result["error"]) == "40P01"
    assert deadlocks > 0
    assert migrate.applied_migrations(db_url) == MIGRATIONS
    with db.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) AS n FROM information_schema.columns "
                            "WHERE column_name = 'claimed_by_body'").fetchone()["n"] == 0


def _snapshot(conn) -> dict:
    return {
        "migrations": [r["migration_id"] for r in conn.execute(
            "SELECT migration_id FROM _yoyo_migration ORDER BY migration_id")],
        "definitions": conn.execute("SELECT digest, loaded_at FROM _pgdispatch_definitions").fetchall(),
        "claim": conn.execute("SELECT md5(pg_get_functiondef('pgd_claim'::regproc)) AS h").fetchone()["h"],
    }


@pytest.mark.parametrize("made_by", ["0001_initial", "0014_capacity_stripes"])
def test_a_database_made_before_0_1_0_is_refused_and_left_alone(db_url, tmp_path, made_by):
    """A demo's ./.pgdispatch/ from a development version records migrations 0001_initial ..
    0014_capacity_stripes: `db upgrade` refuses it in one line that says what to do, exits
    non-zero, and changes nothing, even with function files that differ."""
    _, functions = example_upgrade(tmp_path)
    with db.connect(db_url) as conn:
        conn.execute("DELETE FROM _yoyo_migration")
        conn.execute("INSERT INTO _yoyo_migration (migration_hash, migration_id, applied_at_utc) "
                     "VALUES (md5(%s), %s, now())", (made_by, made_by))
        before = _snapshot(conn)
    with pytest.raises(IncompatibleDatabase, match="before 0.1.0.*new database"):
        migrate.upgrade(db_url, functions_dir=functions)
    env = {"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pgdispatch", "db", "upgrade"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 6, proc
    assert proc.stderr.count("\n") == 1 and "development version of pgdispatch before 0.1.0" in proc.stderr
    with db.connect(db_url) as conn:
        assert _snapshot(conn) == before


def test_a_database_with_jobs_but_no_migration_record_is_refused(new_database):
    url = new_database()
    with db.connect(url) as conn:
        conn.execute("CREATE TABLE jobs (id bigint)")
    with pytest.raises(IncompatibleDatabase, match="no record of pgdispatch migrations"):
        migrate.upgrade(url)
    with db.connect(url) as conn:
        assert conn.execute("SELECT to_regclass('organizations') AS t").fetchone()["t"] is None


def test_a_lock_row_left_by_a_killed_upgrade_does_not_lock_the_database_out(db_url, tmp_path):
    """A killed upgrade of an older version left yoyo's lock row; the advisory lock (released
    with the session) is what serialises upgrades, so the next one clears it and runs."""
    _, functions = example_upgrade(tmp_path)
    with db.connect(db_url) as conn:
        conn.execute("INSERT INTO yoyo_lock (locked, ctime, pid) VALUES (1, now(), 4242)")
    started = time.monotonic()
    assert migrate.upgrade(db_url, functions_dir=functions).functions_reloaded
    assert time.monotonic() - started < 5  # yoyo would have waited 10 s, then failed


def test_a_migration_that_fails_is_named_and_changes_nothing(db_url, tmp_path):
    migrations, functions = example_upgrade(tmp_path)
    (migrations / f"{LATER}_broken.sql").write_text("ALTER TABLE jobz ADD COLUMN x text;\n")
    with pytest.raises(PgDispatchError, match=rf"^sql/migrations/{LATER}_broken: relation \"jobz\" "
                                              r"does not exist \(nothing was changed\)$"):
        migrate.upgrade(db_url, migrations_dir=migrations, functions_dir=functions)
    assert migrate.applied_migrations(db_url) == MIGRATIONS
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from pgdispatch.cli import main; main(sys.argv[1:])",
                           "db", "upgrade"], env={"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr  # the real files still upgrade it


@pytest.mark.parametrize("leftover", ["a trigger removed from its file", "a function made by hand"])
def test_what_no_file_defines_is_refused_until_a_migration_drops_it(db_url, tmp_path, leftover):
    """Removing a function or a trigger from a file would leave it in every live database;
    the upgrade refuses, naming it, and changes nothing; a migration that drops it settles it."""
    migrations, functions = example_upgrade(tmp_path)
    if leftover == "a function made by hand":
        with db.connect(db_url) as conn:
            conn.execute("CREATE FUNCTION pgd_stray() RETURNS int LANGUAGE sql AS 'SELECT 1'")
        name, drop = "pgd_stray()", "DROP FUNCTION pgd_stray();\n"
    else:
        audit = functions / "audit.sql"
        text = audit.read_text()
        statement = ("CREATE OR REPLACE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events\n"
                     "    FOR EACH STATEMENT EXECUTE FUNCTION pgd_forbid_change();\n")
        assert statement in text, "update this test with sql/functions/audit.sql"
        audit.write_text(text.replace(statement, ""))
        name = "trigger audit_events_no_truncate on audit_events"
        drop = "DROP TRIGGER audit_events_no_truncate ON audit_events;\n"
    with pytest.raises(PgDispatchError, match=f"no file in sql/functions/ defines: {re.escape(name)};"):
        migrate.upgrade(db_url, migrations_dir=migrations, functions_dir=functions)
    assert migrate.applied_migrations(db_url) == MIGRATIONS
    (migrations / f"{LATER}_drop.sql").write_text(drop)
    assert migrate.upgrade(db_url, migrations_dir=migrations, functions_dir=functions) == [
        EXAMPLE, f"{LATER}_drop"]


def test_an_editor_file_beside_the_function_files_is_not_loaded(tmp_path):
    functions = tmp_path / "functions"
    shutil.copytree(migrate.FUNCTIONS_DIR, functions)
    (functions / ".#claim.sql").write_text("not SQL")
    assert [n for n, _ in migrate.function_sources(functions)] == list(migrate.FUNCTION_FILES)
    (functions / "extra.sql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="extra.sql"):
        migrate.function_sources(functions)
