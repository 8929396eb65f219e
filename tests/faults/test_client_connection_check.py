"""What ``client_connection_check_interval`` does for a claim whose client vanished while it
waited for a lock (the deployment guide, docs/operations.md, recommends setting it).

A claim blocked on its project's claim lock does not notice that its client is gone: with the
setting off (PostgreSQL's default) the orphaned session waits on, takes the lock when it is
released and commits the claim for nobody. With the setting on, the server polls the client's
socket while the statement runs and ends the session within about one interval, so the claim
never commits. Direct, and through a real PgBouncer in transaction pooling (PgBouncer closes the
server connection of a client that leaves in the middle of a query, which the server then
sees). Lost-claim recovery (sql/functions/claim.sql, pgd_recover_claims) makes the outcome
safe either way; the setting only frees the session, its locks and its slot sooner.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import pytest

from pgdispatch.sql import db, transitions

from ..pooling.conftest import pgbouncer_url  # noqa: F401 - the fixture
from ..scheduler.conftest import wait_until
from .conftest import upstream_of
from .proxy import CommitDroppingProxy


def blocked_claim_backends(conn) -> list[int]:
    return [r["pid"] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE '%pgd_claim(%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")]


def cut_a_blocked_claim(world, db_url: str, route_url: str, *, check: bool) -> tuple[bool, int]:
    """Block a claim (through ``route_url`` via a cuttable proxy) on its project's claim
    lock, cut its client, wait 4 s, release the lock. Returns (whether the orphaned session
    was still there after the wait, how many attempts were committed)."""
    name = urlsplit(db_url).path.lstrip("/")
    world.conn.execute(f"ALTER DATABASE {name} SET client_connection_check_interval = "
                       f"'{'500ms' if check else '0'}'")
    world.setup()
    runner = world.runner()
    world.job()
    project = world.conn.execute("SELECT id FROM projects WHERE name = 'web'").fetchone()["id"]
    proxy = CommitDroppingProxy(upstream_of(route_url))
    holder = db.connect(db_url, application_name="pgd-test-holder")
    try:
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(pgd_claim_lock_class(), pgd_claim_lock_key(%s))",
                       (project,))
        claimer = db.connect(proxy.url(urlsplit(route_url).path.lstrip("/")),
                             statement_deadline_seconds=None)
        errors: list[BaseException] = []

        def claim():
            try:
                transitions.claim(claimer, runner_id=runner, pools=world.pool_ids(("linux",)),
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
            except BaseException as exc:  # noqa: BLE001 - the cut connection, expected
                errors.append(exc)

        t = threading.Thread(target=claim, daemon=True)
        t.start()
        wait_until(lambda: blocked_claim_backends(world.conn), timeout=10,
                   what="the claim blocked on the claim lock")
        proxy.close_clients()
        t.join(10)
        assert errors, "the claim's client should have seen its connection cut"
        time.sleep(4)
        still_there = bool(blocked_claim_backends(world.conn))
        holder.execute("COMMIT")
        time.sleep(0.5)  # an orphan still there takes the lock and commits now
        attempts = world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"]
        return still_there, attempts
    finally:
        holder.close()
        proxy.close()


@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_the_setting_ends_a_claim_whose_client_is_gone(route, world, db_url, request):
    url = db_url if route == "direct" else request.getfixturevalue("pgbouncer_url")(db_url)
    still_there, attempts = cut_a_blocked_claim(world, db_url, url, check=True)
    assert (still_there, attempts) == (False, 0)


@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_without_it_the_orphaned_claim_commits_for_nobody(route, world, db_url, request):
    url = db_url if route == "direct" else request.getfixturevalue("pgbouncer_url")(db_url)
    still_there, attempts = cut_a_blocked_claim(world, db_url, url, check=False)
    assert (still_there, attempts) == (True, 1)
