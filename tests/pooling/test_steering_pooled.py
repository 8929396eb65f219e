"""The issue-20 statements through PgBouncer in transaction pooling, each on the least
privileged login meant to send it (sql/roles.sql, sql/grants.sql; PgBouncer passes each
login through, a pool per login, as in test_roles.py):

* a bulk cancel (sql/bulk.py) on an operator login: the preview, then batches of BULK_BATCH
  jobs, each its own transaction on the one shared server connection; one bulk audit event;
* the job search (reads.search_jobs) on a reader login: its planner settings are SET LOCAL
  (sql/jobs.sql, begin_job_search), so the next transaction on the same server connection
  sees the defaults;
* pause/resume of a pool and drain/resume of a runner on an operator login, and a runner's
  claim on a scheduler login that respects both;
* a superseding submit on an operator login, and two racing from two pooled client
  connections on two server connections: exactly one survivor, because the supersede lock is
  a transaction advisory lock (sql/functions/submit.sql), which a pooler cannot carry over.

The broken variants (the settings SET for the session, the submit without its lock) are
run here too, and the same checks catch them.
"""

from __future__ import annotations


import psycopg
import pytest

from pgdispatch.sql import bulk, db, reads, transitions

from .. import variants
from ..concurrency.test_supersede_races import NO_LOCK, hold_then, survivors
from ..security.test_roles import PASSWORD, logins  # noqa: F401 - a fixture
from .pgbouncer import PgBouncer
from .test_roles import as_client

KINDS = ("operator", "reader", "scheduler")


def bouncer_for(server_url, logins, pool_size: int) -> PgBouncer:  # noqa: F811
    return PgBouncer(server_url, pool_size=pool_size,
                     logins={logins[k]: PASSWORD for k in KINDS})


@pytest.fixture
def bouncer(db_url, server_url, logins):  # noqa: F811 - the fixture imported above
    """One server connection per login (default_pool_size = 1): every client of a login
    shares it. After db_url, so that it stops before the test's database is dropped."""
    b = bouncer_for(server_url, logins, 1)
    yield b
    b.stop()


def pooled(bouncer: PgBouncer, db_url: str, logins, kind: str, **kw):  # noqa: F811
    """A client connection through ``bouncer`` as the ``kind`` login (no prepared
    statements: they are per server connection)."""
    return db.connect(as_client(bouncer, db_url, logins[kind]), prepare_threshold=None, **kw)


def server_pids(bouncer: PgBouncer, db_url: str, logins, kind: str) -> set[int]:  # noqa: F811
    with pooled(bouncer, db_url, logins, kind) as c:
        return {c.execute("SELECT pg_backend_pid() AS p").fetchone()["p"] for _ in range(3)}


def test_a_bulk_cancel_of_a_filtered_set_runs_batch_by_batch_through_the_pooler(
        world, db_url, logins, bouncer):  # noqa: F811
    world.setup()
    world.project("api", org="acme", pools=("linux",))
    n = 2 * bulk.BULK_BATCH + 37
    web = [world.job()["id"] for _ in range(n)]
    api = [world.job(project="api")["id"] for _ in range(5)]
    with pooled(bouncer, db_url, logins, "scheduler") as host:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):  # a runner's login may not
            host.execute("SELECT pgd_bulk_begin('cancel', '{}', 1, false, NULL, NULL, NULL)")
    with pooled(bouncer, db_url, logins, "operator") as op:
        preview = bulk.preview_bulk(op, action="cancel", filters={"project": "web"})
        assert [j["id"] for j in preview["jobs"]] == web and not preview["truncated"]
        assert world.conn.execute("SELECT count(*) AS n FROM jobs WHERE state = 'cancelled'"
                                  ).fetchone()["n"] == 0  # the preview changes nothing
        result = bulk.apply_bulk(op, action="cancel", job_ids=[j["id"] for j in preview["jobs"]],
                                 generations=[j["generation"] for j in preview["jobs"]],
                                 filters=preview["filter"], actor=None)
    assert result["requested"] == n and result["done"] == web and result["skipped"] == []
    states = {r["state"]: r["n"] for r in world.conn.execute(
        "SELECT state, count(*) AS n FROM jobs GROUP BY state")}
    assert states == {"cancelled": n, "queued": len(api)}
    events = world.conn.execute(
        "SELECT id, actor, login, details FROM audit_events WHERE action = 'bulk_cancel'").fetchall()
    assert len(events) == 1
    assert (events[0]["actor"], events[0]["login"]) == (logins["operator"], logins["operator"])
    assert events[0]["id"] == result["bulk_event_id"]
    per_job = world.conn.execute(
        "SELECT count(*) AS n, count(DISTINCT xmin::text) AS transactions, "
        "count(DISTINCT details ->> 'bulk_event_id') AS bulk_events, min(login) AS login "
        "FROM audit_events WHERE action = 'cancel_job'").fetchone()
    # one audit event per job, naming the bulk event, written in ceil(n / 100) transactions
    assert dict(per_job) == {"n": n, "transactions": 3, "bulk_events": 1,
                             "login": logins["operator"]}
    assert len(server_pids(bouncer, db_url, logins, "operator")) == 1


def planner_settings(c) -> tuple[str, str]:
    return (c.execute("SHOW enable_indexscan").fetchone()["enable_indexscan"],
            c.execute("SHOW enable_seqscan").fetchone()["enable_seqscan"])


@pytest.mark.parametrize("variant", ["real", "session-wide"])
def test_the_searchs_planner_settings_stay_in_its_transaction(
        world, db_url, logins, bouncer, monkeypatch, variant):  # noqa: F811
    """A search through its trigram step (begin_job_search's SET LOCAL, end_job_search), and
    one whose transaction fails between the two, leave the planner settings as they were
    for the next client of the same server connection. The session-wide variant
    (set_config(..., false), i.e. SET) leaves them off, which the same check reports."""
    world.setup()
    job = world.job(command=("deploy", "needle-42"))["id"]
    world.job()
    if variant == "session-wide":
        monkeypatch.setattr(reads.Q, "begin_job_search", _session_wide_begin)
    monkeypatch.setattr(reads, "SEARCH_PROBE_ROWS", 0)  # straight to the trigram step
    with pooled(bouncer, db_url, logins, "reader") as reader:
        pid = reader.execute("SELECT pg_backend_pid() AS p").fetchone()["p"]
        assert planner_settings(reader) == ("on", "on")
        assert [j["id"] for j in reads.search_jobs(reader, q="needle")["jobs"]] == [job]
        # a search that fails between its settings and their setting back: rolled back
        with pytest.raises(psycopg.errors.DivisionByZero):
            with reader.transaction():
                reads.Q.begin_job_search(reader)
                reader.execute("SELECT 1/0")
    with pooled(bouncer, db_url, logins, "reader") as other:
        # another client, the same server connection (one per login)
        assert other.execute("SELECT pg_backend_pid() AS p").fetchone()["p"] == pid
        shown = planner_settings(other)
    if variant == "real":
        assert shown == ("on", "on")
    else:
        assert shown == ("off", "off")


def _session_wide_begin(conn):
    """begin_job_search as a broken variant: the same settings for the whole session."""
    return conn.execute(
        "SELECT current_setting('enable_indexscan') AS indexscan, "
        "current_setting('enable_seqscan') AS seqscan, "
        "set_config('enable_indexscan', 'off', false) AS indexscan_now, "
        "set_config('enable_seqscan', 'off', false) AS seqscan_now").fetchone()


def test_pause_and_drain_through_the_pooler_stop_a_pooled_runners_claims(
        world, db_url, logins, bouncer):  # noqa: F811
    world.setup()
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    jobs = [world.job()["id"] for _ in range(3)]
    pools = world.pool_ids(("linux",))
    with pooled(bouncer, db_url, logins, "scheduler") as host, \
            pooled(bouncer, db_url, logins, "operator") as op:
        runner = transitions.register_runner(host, name="pooled-host", pools=["linux"], slots=4)

        def claim():
            return transitions.claim(host, runner_id=runner, pools=pools,
                                     claim_token=transitions.new_claim_token(), lease_seconds=30)

        # the runner's login may not steer, pooled or not (tests/security/test_roles.py)
        for stmt in ("SELECT pgd_pause_pool('linux', 'x', NULL)",
                     "SELECT pgd_drain_runner(%s, NULL, 'x', NULL)" % runner):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                host.execute(stmt)
        paused = transitions.pause_pool(op, pool="linux", reason="maintenance", actor=None)
        assert paused["paused_by"] == logins["operator"]
        assert claim() is None
        transitions.resume_pool(op, pool="linux", actor=None)
        assert claim().job_id == jobs[0]
        transitions.drain_runner(op, runner_id=runner, reason="host reboot", actor=None)
        assert claim() is None
        transitions.resume_runner(op, runner_id=runner, actor=None)
        assert claim().job_id == jobs[1]
    assert world.row("jobs", jobs[2])["state"] == "queued"
    events = [tuple(e.values()) for e in world.conn.execute(
        "SELECT action, actor, login FROM audit_events WHERE action IN "
        "('pause_pool', 'resume_pool', 'drain_runner', 'resume_runner') ORDER BY id")]
    assert events == [(a, logins["operator"], logins["operator"])
                      for a in ("pause_pool", "resume_pool", "drain_runner", "resume_runner")]


def superseding(world) -> None:
    world.setup(targets=())
    world.project("api", org="acme", pools=("linux",))
    world.apply({"targets": [{"name": "staging", "supersede": True}]})


def submit(conn, project: str = "web") -> dict:
    return transitions.submit(conn, project=project, pool="linux", target="staging",
                              command=["deploy"])


def test_a_superseding_submit_through_the_pooler_supersedes_the_older_deployment(
        world, db_url, logins, bouncer):  # noqa: F811
    superseding(world)
    with pooled(bouncer, db_url, logins, "operator") as op:
        older = submit(op)
        newer = submit(op, project="api")
    row = world.row("jobs", older["id"])
    assert (row["state"], row["last_error"]) == ("superseded", f"superseded by job {newer['id']}")
    assert survivors(world) == [newer["id"]]




@pytest.mark.parametrize("variant", ["real", "no lock"])
def test_two_superseding_submits_racing_through_the_pooler_leave_one_survivor(
        world, db_url, server_url, logins, variant):  # noqa: F811
    """Two client connections on two server connections of one operator login: the first
    submits in an open transaction, the second submits meanwhile and must wait for the
    first's commit (its transaction advisory lock), then supersede it. Without the lock
    (the broken variant) both survive, which the same checks report."""
    superseding(world)
    if variant == "no lock":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_submit", [NO_LOCK]))
    b = bouncer_for(server_url, logins, 2)
    got: dict = {}
    try:
        def submit_on(conn, key: str, **kw):
            got[key] = conn.execute("SELECT pg_backend_pid() AS p").fetchone()["p"]
            return submit(conn, **kw)

        raced = hold_then(db_url, lambda c: submit_on(c, "first_pid"),
                          lambda c: submit_on(c, "pid", project="api"),
                          connect=lambda name: pooled(b, db_url, logins, "operator",
                                                      application_name=name))
        got.update(first=raced["held"], second=raced["other"], committed=raced["committed"],
                   second_done=raced["other_done"], survivors=survivors(world))
        # then, on one pooled connection, a third submit meets no lock left behind
        with pooled(b, db_url, logins, "operator") as third:
            with third.transaction():
                third.execute("SET LOCAL lock_timeout = '2s'")
                got["third"] = submit(third)
    finally:
        b.stop()
    assert got["pid"] != got["first_pid"]  # two server connections really raced
    if variant == "real":
        assert got["second_done"] >= got["committed"]  # it waited for the first's lock
        first = world.row("jobs", got["first"]["id"])
        assert (first["state"], first["last_error"]) == (
            "superseded", f"superseded by job {got['second']['id']}")
        assert got["survivors"] == [got["second"]["id"]]
        assert survivors(world) == [got["third"]["id"]]
    else:
        # what the checks above catch: no waiting, and two survivors
        assert got["second_done"] < got["committed"]
        assert got["survivors"] == [got["first"]["id"], got["second"]["id"]]
