"""Least privilege through PgBouncer in transaction pooling: each process logs in as its own
role, and PgBouncer passes that login through (a pool per login, its password in the auth
file), as a deployment following docs/operations.md ("Database roles", "Deployment guide")
has. A real scheduler process on a scheduler login (no table privilege: only its
SECURITY DEFINER transitions) runs jobs to their end through one shared server connection;
the console and the API on the console's web login serve every page and act, as in
test_console.py; and neither login can read a table it has no grant on, pooled or not."""

from __future__ import annotations

import psycopg
import pytest

from pgdispatch.sql import Forbidden, InvalidInput, db, transitions

from ..conftest import CONSOLE_PASSWORD
from ..e2e.test_scheduler_e2e import Schedulers, wait_until
from ..security.test_roles import PASSWORD, logins  # noqa: F401 - a fixture
from ..webapp.conftest import TEST_SETTINGS
from .pgbouncer import PgBouncer
from .test_console import ROUNDS, exercise


@pytest.fixture
def bouncer(server_url, logins, console_login):  # noqa: F811 - the fixture imported above
    b = PgBouncer(server_url, pool_size=1,
                  logins={logins["scheduler"]: PASSWORD, console_login: CONSOLE_PASSWORD})
    yield b
    b.stop()


def as_client(bouncer: PgBouncer, db_url: str, login: str) -> str:
    """``db_url``'s database through ``bouncer``, logging in as ``login``."""
    return bouncer.url(db_url).replace(f"//{bouncer.user}@", f"//{login}@", 1)


def test_a_scheduler_login_runs_jobs_through_the_pooler(world, db_url, logins, bouncer, tmp_path):  # noqa: F811
    world.setup()
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    jobs = [world.job(command=["true"])["id"] for _ in range(6)]
    url = as_client(bouncer, db_url, logins["scheduler"])
    with db.connect(url, prepare_threshold=None) as c:
        assert c.execute("SELECT session_user AS u").fetchone()["u"] == logins["scheduler"]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT count(*) FROM jobs")
    procs = Schedulers(url, tmp_path)
    try:
        procs.start("pooled-host", slots=2)
        wait_until(lambda: world.conn.execute(
            "SELECT count(*) = %s AS done FROM jobs WHERE id = ANY (%s) AND state = 'succeeded'",
            (len(jobs), jobs)).fetchone()["done"], what="the jobs to succeed", procs=procs)
    finally:
        procs.close()
    assert "permission denied" not in procs.logs()
    attempts = world.conn.execute("SELECT count(*) AS n, count(DISTINCT r.login) AS logins, "
                                  "min(r.login) AS login FROM attempts a JOIN runners r "
                                  "ON r.id = a.runner_id").fetchone()
    assert (attempts["n"], attempts["logins"], attempts["login"]) == (6, 1, logins["scheduler"])


def test_the_console_on_its_web_login_through_the_pooler_never_answers_500(
        world, db_url, bouncer, console_login):
    url = as_client(bouncer, db_url, console_login)
    with db.connect(url, prepare_threshold=None) as c:
        assert c.execute("SELECT session_user AS u").fetchone()["u"] == console_login
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT password_hash FROM users")
    bad, state = exercise(world, url, TEST_SETTINGS)
    assert bad == []
    assert state == {"submitted": [{"state": "cancelled", "n": ROUNDS}], "pauses": ROUNDS,
                     "paused": False, "target": "free", "lost": "failed"}


def test_a_scheduler_login_asks_capacity_waiting_through_the_pooler(world, db_url, logins, bouncer):  # noqa: F811
    """pgd_capacity_waiting (sql/functions/claim.sql) on the scheduler login, through
    PgBouncer in transaction pooling: it answers for the login's own runner (true while a
    queued job waits for the project bound its claim holds), and refuses a runner of
    another login."""
    world.setup(project_limit=1)
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    world.job()
    world.job()
    other = world.runner()  # the test's own (owner) login
    pools = world.pool_ids(("linux",))
    url = as_client(bouncer, db_url, logins["scheduler"])
    with db.connect(url, prepare_threshold=None) as c:
        runner = transitions.register_runner(c, name="pooled-ask", pools=["linux"], slots=2,
                                             hostname="test")
        assert transitions.capacity_waiting(c, runner_id=runner, pools=pools) is False
        claim = transitions.claim(c, runner_id=runner, pools=pools,
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
        assert claim is not None
        assert transitions.capacity_waiting(c, runner_id=runner, pools=pools) is True
        with pytest.raises(Forbidden):
            transitions.capacity_waiting(c, runner_id=other, pools=pools)


def test_a_scheduler_login_renews_leases_in_a_batch_through_the_pooler(world, db_url, logins, bouncer):  # noqa: F811
    """pgd_heartbeat_batch (sql/functions/runners.sql) on the scheduler login, through
    PgBouncer in transaction pooling: one call renews the leases of the login's own running
    attempts and leaves out an attempt of another login's runner (its lease untouched), as
    pgd_heartbeat refuses one; an out-of-range lease is refused with nothing changed."""
    world.setup()
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    for _ in range(3):
        world.job()
    pools = world.pool_ids(("linux",))
    foreign = world.claim(world.runner(), lease_seconds=5)  # the test's own (owner) login
    url = as_client(bouncer, db_url, logins["scheduler"])
    with db.connect(url, prepare_threshold=None) as c:
        runner = transitions.register_runner(c, name="pooled-beat", pools=["linux"], slots=2,
                                             hostname="test")
        mine = [transitions.claim(c, runner_id=runner, pools=pools,
                                  claim_token=transitions.new_claim_token(), lease_seconds=5)
                for _ in range(2)]
        assert all(m is not None for m in mine)
        beats = [(m.attempt_id, m.generation, f"tail {m.attempt_id}") for m in mine]
        beats.append((foreign.attempt_id, foreign.generation, "not mine"))
        leases = transitions.heartbeat_batch(c, beats=beats, lease_seconds=60)
        assert set(leases) == {m.attempt_id for m in mine}
        with pytest.raises(InvalidInput):
            transitions.heartbeat_batch(c, beats=beats[:1], lease_seconds=0)
    for m in mine:
        row = world.row("attempts", m.attempt_id)
        assert row["lease_expires_at"] == leases[m.attempt_id].lease_expires_at
        assert row["lease_expires_at"] > m.lease_expires_at
        assert row["output_tail"] == f"tail {m.attempt_id}"
    row = world.row("attempts", foreign.attempt_id)
    assert row["lease_expires_at"] == foreign.lease_expires_at and row["output_tail"] != "not mine"
