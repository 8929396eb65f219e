"""``db upgrade`` through PgBouncer in transaction pooling: on a new database, on one that is
up to date, and with a function file changed (twice), as an operator runs it (the CLI) and
from two hosts at once; it leaves nothing on the server connections it shared (issue 16:
the upgrade failed on its second run behind the pooler).

What made it fail there, each shown failing below: yoyo's own connection let psycopg
prepare a statement it ran often (``SELECT to_regclass($1)``, once per locked table), which
stayed on the shared server connection, so the next upgrade's "_pg3_0" already existed; and
the session-level advisory lock that serialised upgrades was taken by whichever server
connection ran that statement, then left there for other clients, or released on another
one that did not hold it. Both are now per transaction (sql/migrate.py).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import threading
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from pgdispatch.sql import db, migrate

from ..conftest import with_database
from ..sql.test_migrations import MIGRATIONS, check_applied_once

ROOT = Path(__file__).resolve().parents[2]


def db_upgrade(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env["DATABASE_URL"] = url
    return subprocess.run([sys.executable, "-m", "pgdispatch", "db", "upgrade", *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def left_on_the_server(pooled_url: str) -> list[str]:
    """What a client of ``pooled_url`` finds on the (one) shared server connection: prepared
    statements and held advisory locks, as lines."""
    with psycopg.connect(pooled_url, prepare_threshold=None, autocommit=True) as conn:
        prepared = [f"prepared {name}: {sql}" for name, sql in conn.execute(
            "SELECT name, statement FROM pg_prepared_statements")]
        locks = [f"advisory lock {objid} held by {pid}" for objid, pid in conn.execute(
            "SELECT objid, pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")]
    return prepared + locks


def changed_functions(tmp_path: Path, n: int) -> Path:
    """A copy of sql/functions/ whose audit.sql differs from the real one (a comment ``n``)."""
    functions = tmp_path / f"functions-{n}"
    shutil.copytree(migrate.FUNCTIONS_DIR, functions)
    audit = functions / "audit.sql"
    audit.write_text(audit.read_text() + f"\n-- changed {n}\n")
    return functions


def test_db_upgrade_runs_through_the_pooler_again_and_again(new_database, pgbouncer_url, tmp_path):
    url = new_database()
    pooled = pgbouncer_url(url)
    first = db_upgrade(pooled)
    assert (first.returncode, first.stderr) == (0, "")
    assert f"applied {len(MIGRATIONS)} migration(s): {', '.join(MIGRATIONS)}" in first.stdout
    second = db_upgrade(pooled)
    assert (second.returncode, second.stderr) == (0, "")
    assert "applied 0 migration(s) (schema and functions up to date)" in second.stdout
    assert left_on_the_server(pooled) == []
    # a function file changed, twice: each upgrade loads them all through the pooler
    for n in (1, 2):
        functions = changed_functions(tmp_path, n)
        assert migrate.upgrade(pooled, functions_dir=functions).functions_reloaded
        assert left_on_the_server(pooled) == []
    assert migrate.upgrade(pooled, functions_dir=functions) == []
    assert migrate.applied_migrations(pooled) == MIGRATIONS
    assert db_upgrade(pooled).returncode == 0  # and back to the real files


def test_the_check_fails_when_yoyo_prepares_statements(new_database, pgbouncer_url, tmp_path,
                                                         monkeypatch):
    """Broken variant: yoyo's connection left to psycopg's default (prepare after 5 runs)."""
    monkeypatch.setattr(migrate, "PREPARE_THRESHOLD", 5)
    url = new_database()
    pooled = pgbouncer_url(url)
    migrate.upgrade(pooled)
    migrate.upgrade(pooled, functions_dir=changed_functions(tmp_path, 1))
    assert any(line.startswith("prepared _pg3_") for line in left_on_the_server(pooled))
    with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
        migrate.upgrade(pooled, functions_dir=changed_functions(tmp_path, 2))


def _upgrade(url: str, barrier, results) -> None:
    """One host's ``db upgrade`` (a spawned child), started with the other's at a barrier."""
    barrier.wait(60)
    try:
        results.put(("ok", list(migrate.upgrade(url))))
    except BaseException as exc:  # noqa: BLE001 - sent back to the test
        results.put(("error", repr(exc)))


@pytest.mark.parametrize("server_connections", [1, 3])
def test_two_hosts_upgrading_through_the_pooler_apply_each_migration_once(
        server_url, pgbouncer_url, pooler, server_connections):
    """Two processes upgrade a new, empty database at once through the pooler: one applies
    the baseline, the other then finds nothing to do, and no advisory lock is left on any
    server connection. With one server connection a session-level lock serialised nothing:
    the second upgrader's lock statement ran on the session that already held it."""
    through = pgbouncer_url if server_connections == 1 else pooler.url
    name = f"pgd_test_migrate_{uuid.uuid4().hex[:8]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = with_database(server_url, name)
    try:
        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_upgrade, args=(through(url), barrier, results))
                 for _ in range(2)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        check_applied_once(url, outcomes)
        with db.connect(url) as conn:
            assert conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'"
                                ).fetchone()["n"] == 0
    finally:
        with db.connect(server_url) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def upgrades_under_traffic(pooled_url: str, direct_url: str, tmp_path: Path, *, upgrades: int = 4
                           ) -> list[str]:
    """``upgrades`` upgrades, each with a changed function file, through ``pooled_url`` while
    two clients keep running short transactions through it (as live schedulers would), so
    that statements of one client land on different server connections. Returns what went
    wrong: an upgrade that failed or blocked (60 s), an advisory lock left held after one."""
    stop = threading.Event()

    def traffic() -> None:
        with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_sleep(0.003)")

    clients = [threading.Thread(target=traffic, name=f"traffic-{i}") for i in range(2)]
    for t in clients:
        t.start()
    problems: list[str] = []
    try:
        for n in range(upgrades):
            outcome: list[BaseException | None] = []
            functions = changed_functions(tmp_path, n)

            def run() -> None:
                try:
                    migrate.upgrade(pooled_url, functions_dir=functions)
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    outcome.append(exc)

            worker = threading.Thread(target=run, name=f"upgrade-{n}", daemon=True)
            worker.start()
            worker.join(60)
            if not outcome:
                problems.append(f"upgrade {n} blocked")
                break
            if outcome[0] is not None:
                problems.append(f"upgrade {n}: {type(outcome[0]).__name__}: {outcome[0]}")
            with db.connect(direct_url) as conn:
                held = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' "
                                    "AND objid = %s", (migrate.ADVISORY_LOCK_KEY % 2**32,)
                                    ).fetchone()["n"]
            if held:
                problems.append(f"after upgrade {n}: the upgrade's advisory lock is still held")
    finally:
        stop.set()
        for t in clients:
            t.join(10)
    return problems


def test_upgrades_under_traffic_through_the_pooler_leave_no_lock_behind(db_url, pooler, tmp_path):
    assert upgrades_under_traffic(pooler.url(db_url), db_url, tmp_path) == []


def test_the_check_fails_with_a_lock_that_outlives_the_transaction(db_url, pooler, tmp_path,
                                                                   monkeypatch):
    """Broken variant: a session-level advisory lock (as the upgrade took before) stays on
    the pooler's server connection after the upgrade's own connection closed."""
    monkeypatch.setattr(migrate, "UPGRADE_LOCK_SQL", "SELECT pg_advisory_lock(%s)")
    problems = upgrades_under_traffic(pooler.url(db_url), db_url, tmp_path, upgrades=1)
    assert problems == ["after upgrade 0: the upgrade's advisory lock is still held"]
