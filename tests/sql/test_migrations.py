"""The schema has the invariants DESIGN.md says the database enforces, and they bite; and
``db upgrade`` run by two processes at once on an empty database applies each migration once."""

from __future__ import annotations

import multiprocessing
import re
import uuid
from urllib.parse import urlsplit

import pytest

from pgdispatch.sql import db, migrate, transitions
from pgdispatch.sql.validate import JOB_STATES

from ..conftest import MIGRATIONS, with_database


# DESIGN.md, "Entities and states"
STATES = {
    "jobs": {"blocked", "queued", "running", "succeeded", "failed", "cancelled", "uncertain",
             "superseded"},
    "attempts": {"running", "succeeded", "failed", "expired", "cancelled", "lost"},
    "targets": {"free", "held", "uncertain"},
}


def sqlstate_of(conn, statement: str, params=()) -> str:
    """Run a statement that must fail; return its SQLSTATE."""
    with pytest.raises(Exception) as info, conn.transaction():  # a savepoint when rolled back
        conn.execute(statement, params)
    state = getattr(info.value, "sqlstate", None)
    assert state, f"not a database error: {info.value!r}"
    return state


def constraints(conn, table: str, contype: str) -> list[dict]:
    return conn.execute(
        "SELECT conname, pg_get_constraintdef(c.oid) AS def, "
        "       ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(n, i) "
        "             JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n "
        "             ORDER BY k.i)::text[] AS cols "
        "  FROM pg_constraint c WHERE c.conrelid = %s::regclass AND c.contype = %s",
        (table, contype)).fetchall()


def index(conn, name: str) -> dict:
    return conn.execute(
        "SELECT i.indisunique AS is_unique, t.relname AS table, "
        "       pg_get_expr(i.indpred, i.indrelid) AS predicate, "
        "       ARRAY(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY k(n, o) "
        "             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n "
        "             ORDER BY k.o)::text[] AS cols "
        "  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid "
        " WHERE c.relname = %s", (name,)).fetchone()


def test_every_state_column_has_a_check_with_exactly_the_design_states(conn):
    for table, states in STATES.items():
        checks = [c["def"] for c in constraints(conn, table, "c")
                  if re.match(r"CHECK \(\(state = ANY \(ARRAY\[", c["def"])]
        assert len(checks) == 1, (table, checks)
        assert set(re.findall(r"'(\w+)'::text", checks[0])) == states, table
    # the list the console's and the CLI's state filters offer (sql.validate.JOB_STATES)
    assert set(JOB_STATES) == STATES["jobs"] and len(JOB_STATES) == len(STATES["jobs"])


def test_state_checks_refuse_an_unknown_state(world):
    world.setup(targets=("production",))
    job = world.job()
    assert sqlstate_of(world.conn, "UPDATE jobs SET state = 'paused' WHERE id = %s", (job["id"],)) == "23514"
    assert sqlstate_of(world.conn, "UPDATE targets SET state = 'broken'") == "23514"
    c = world.claim(world.runner())
    assert sqlstate_of(world.conn, "UPDATE attempts SET state = 'zombie' WHERE id = %s",
                       (c.attempt_id,)) == "23514"


def test_attempts_are_unique_per_job_number_generation_and_claim_token(conn):
    uniques = {tuple(c["cols"]) for c in constraints(conn, "attempts", "u")}
    assert {("job_id", "attempt_no"), ("job_id", "generation"), ("claim_token",)} <= uniques


def test_one_running_attempt_per_job_and_one_holder_per_target_are_unique_indexes(conn):
    running = index(conn, "attempts_one_running_per_job")
    assert running == {"is_unique": True, "table": "attempts", "cols": ["job_id"],
                       "predicate": "(state = 'running'::text)"}
    holder = index(conn, "jobs_one_holder_per_target")
    assert holder["is_unique"] and holder["table"] == "jobs" and holder["cols"] == ["target_id"]
    assert "'running'" in holder["predicate"] and "'uncertain'" in holder["predicate"]


def test_the_unique_indexes_bite(world):
    """A second running attempt for a job, or a second holder of a target, is refused even
    when written directly, past the transitions."""
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    first = world.job(pool="deploy", target="production")
    second = world.job(pool="deploy", target="production")
    c = world.claim(runner, pools=("deploy",))
    assert c.job_id == first["id"]
    assert sqlstate_of(world.conn, "UPDATE jobs SET state = 'running' WHERE id = %s", (second["id"],)) == "23505"
    assert sqlstate_of(
        world.conn,
        "INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state, lease_expires_at) "
        "VALUES (%s, 2, 2, %s, %s, 'running', now())", (c.job_id, runner, str(uuid.uuid4()))) == "23505"
    assert sqlstate_of(
        world.conn,
        "INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state, "
        "lease_expires_at, finished_at) VALUES (%s, 2, 2, %s, %s, 'failed', now(), now())",
        (c.job_id, runner, c.claim_token)) == "23505"  # the claim token is taken


def test_limits_refuse_negative_values_and_no_counter_is_left(world):
    world.setup(project_limit=3)
    for table, limit in (("organizations", "max_running"), ("projects", "max_running"), ("pools", "slots")):
        assert sqlstate_of(world.conn, f"UPDATE {table} SET {limit} = -1") == "23514"
    # organizations and pools count their held slots (in stripes), projects their running
    # jobs (sql/functions/capacity.sql): no running counter is stored anywhere
    columns = world.conn.execute(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_name IN ('organizations', 'pools', 'projects') AND column_name = 'running'").fetchall()
    assert columns == []


def stripes(conn, kind: str) -> list[tuple[int, int]]:
    """(cap, held) of each stripe of the only organization or pool, in stripe order."""
    return [(r["cap"], r["held"]) for r in conn.execute(
        "SELECT cap, held FROM capacity_stripes WHERE kind = %s ORDER BY stripe_no", (kind,))]


def recorded(conn, kind: str) -> list[int]:
    """Per stripe of the only organization or pool (kind), the running attempts recording it."""
    column = {"organization": "organization_stripe", "pool": "pool_stripe"}[kind]
    n = {r["s"]: r["n"] for r in conn.execute(
        f"SELECT {column} AS s, count(*) AS n FROM attempts WHERE state = 'running' GROUP BY 1")}
    return [n.get(k, 0) for k in range(1, 9)]


def split(held: list[int], limit: int) -> list[tuple[int, int]]:
    """(cap, held) of each stripe after a limit change to ``limit`` with ``held`` per stripe
    (sql/functions/capacity.sql's header): each cap is its held count plus an even share of what the limit leaves,
    the first stripes one more; nothing more when the held slots reach the limit."""
    spare = max(limit - sum(held), 0)
    return [(h + spare // 8 + (k <= spare % 8), h) for k, h in enumerate(held, start=1)]


def test_stripes_are_numbered_one_to_eight_and_hold_zero_to_their_cap(world):
    world.setup(org_limit=2, pool_slots=2)
    assert {c["def"] for c in constraints(world.conn, "capacity_stripes", "c")} == {
        "CHECK ((kind = ANY (ARRAY['organization'::text, 'pool'::text])))",
        "CHECK (((stripe_no >= 1) AND (stripe_no <= 8)))",
        "CHECK (((held >= 0) AND (held <= cap)))"}
    for kind in ("organization", "pool"):
        for change in ("stripe_no = 0 WHERE stripe_no = 1", "stripe_no = 9 WHERE stripe_no = 8",
                       "held = -1 WHERE stripe_no = 1", "held = cap + 1 WHERE stripe_no = 1",
                       "held = 1 WHERE stripe_no = 8"):  # stripe 8 has no slot: cap 0
            assert sqlstate_of(world.conn, f"UPDATE capacity_stripes SET {change} AND kind = %s",
                               (kind,)) == "23514", change
        assert sqlstate_of(world.conn, "UPDATE capacity_stripes SET kind = 'project' WHERE kind = %s",
                           (kind,)) == "23514"
        assert stripes(world.conn, kind) == [(1, 0), (1, 0)] + [(0, 0)] * 6


def test_a_running_attempt_holds_one_slot_of_its_organization_and_one_of_its_pool(world):
    """A running attempt records the stripe of each slot it holds (one column per kind, so at
    most one slot of each); the stripe's held count is its running attempts; an owner has
    one row per stripe number (the primary key)."""
    assert [tuple(c["cols"]) for c in constraints(world.conn, "capacity_stripes", "p")] == [
        ("kind", "owner_id", "stripe_no")]
    types = {r["column_name"]: r["data_type"] for r in world.conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_name = 'attempts' AND column_name LIKE '%%_stripe'")}
    assert types == {"organization_stripe": "smallint", "pool_stripe": "smallint",
                     "project_stripe": "smallint"}
    world.setup(org_limit=3, pool_slots=3)
    runner = world.runner()
    world.job()
    c = world.claim(runner)
    assert c is not None
    row = world.conn.execute("SELECT organization_stripe AS o, pool_stripe AS q FROM attempts "
                             "WHERE id = %s", (c.attempt_id,)).fetchone()
    for kind, no in (("organization", row["o"]), ("pool", row["q"])):
        assert no is not None and 1 <= no <= 8
        assert [h for _, h in stripes(world.conn, kind)] == [int(k == no) for k in range(1, 9)]
        assert recorded(world.conn, kind) == [h for _, h in stripes(world.conn, kind)]
        assert sqlstate_of(world.conn, "INSERT INTO capacity_stripes (kind, owner_id, stripe_no, cap) "
                                       "SELECT kind, owner_id, stripe_no, 1 FROM capacity_stripes "
                                       "WHERE kind = %s AND stripe_no = %s", (kind, no)) == "23505"
    assert world.conn.execute("SELECT pgd_organization_running(id) AS o FROM organizations"
                              ).fetchone() == {"o": 1}
    assert world.conn.execute("SELECT pgd_pool_running(id) AS q FROM pools").fetchone() == {"q": 1}


def test_stripes_follow_the_limit_and_keep_held_slots_above_it(world):
    """A limit of n with h held slots is split over the stripes: each cap its held count plus
    an even share of max(n - h, 0), so the room is max(n - h, 0), and max(h - n, 0) owed
    (every stripe full meanwhile): raising it adds room, lowering it takes room away and
    never a held slot."""
    world.setup(org_limit=3, pool_slots=3)
    runner = world.runner(slots=8)
    claims = []
    for _ in range(3):
        world.job()
        claims.append(world.claim(runner))
    world.complete(claims[0])
    for table, limit, running, kind in (
            ("organizations", "max_running", "pgd_organization_running", "organization"),
            ("pools", "slots", "pgd_pool_running", "pool")):

        def owed() -> int | None:
            row = world.conn.execute("SELECT owed FROM capacity_debts WHERE kind = %s",
                                     (kind,)).fetchone()
            return row and row["owed"]

        held = recorded(world.conn, kind)  # the stripes of the 2 running attempts
        assert sum(held) == 2
        assert [h for _, h in stripes(world.conn, kind)] == held
        assert sum(cap for cap, _ in stripes(world.conn, kind)) == 3
        world.conn.execute(f"UPDATE {table} SET {limit} = 5")
        assert stripes(world.conn, kind) == split(held, 5) and owed() is None
        world.conn.execute(f"UPDATE {table} SET {limit} = 1")
        assert stripes(world.conn, kind) == [(h, h) for h in held] and owed() == 1
        world.conn.execute(f"UPDATE {table} SET {limit} = 0")
        assert stripes(world.conn, kind) == [(h, h) for h in held] and owed() == 2
        # the jobs running, above the limit or not
        assert world.conn.execute(f"SELECT {running}(id) AS n FROM {table}").fetchone() == {"n": 2}
        world.conn.execute(f"UPDATE {table} SET {limit} = 3")
        assert stripes(world.conn, kind) == split(held, 3) and owed() is None
        assert sum(cap - h for cap, h in stripes(world.conn, kind)) == 1
    world.complete(claims[1])
    world.complete(claims[2])
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    for kind in ("organization", "pool"):
        assert [h for _, h in stripes(world.conn, kind)] == [0] * 8
        assert sum(cap for cap, _ in stripes(world.conn, kind)) == 3


def test_ownership_is_enforced_by_foreign_keys(conn):
    refs = {(t, tuple(c["cols"]), re.search(r"REFERENCES (\w+)", c["def"]).group(1))
            for t in ("projects", "project_pools", "jobs", "attempts", "job_dependencies",
                      "delivery_receipts", "targets", "api_tokens")
            for c in constraints(conn, t, "f")}
    assert refs >= {
        ("projects", ("organization_id",), "organizations"),
        ("project_pools", ("project_id",), "projects"),
        ("project_pools", ("pool_id",), "pools"),
        ("jobs", ("project_id",), "projects"),
        ("jobs", ("pool_id",), "pools"),
        ("jobs", ("target_id",), "targets"),
        ("attempts", ("job_id",), "jobs"),
        ("attempts", ("runner_id",), "runners"),
        ("job_dependencies", ("job_id",), "jobs"),
        ("job_dependencies", ("depends_on_job_id",), "jobs"),
        ("delivery_receipts", ("attempt_id",), "attempts"),
        ("targets", ("holder_job_id",), "jobs"),
        ("api_tokens", ("user_id",), "users"),
    }


def test_receipts_and_audit_events_refuse_update_and_delete(world):
    world.setup()
    world.job()
    c = world.claim(world.runner())
    world.complete(c)
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    key = c.receipt_key
    assert [r["def"] for r in constraints(world.conn, "delivery_receipts", "p")] == ["PRIMARY KEY (key)"]
    for statement, params in (
        ("UPDATE delivery_receipts SET outcome = 'failed' WHERE key = %s", (key,)),
        ("UPDATE delivery_receipts SET key = 'other' WHERE key = %s", (key,)),
        ("DELETE FROM delivery_receipts WHERE key = %s", (key,)),
        ("UPDATE audit_events SET actor = 'mallory'", ()),
        ("DELETE FROM audit_events", ()),
    ):
        assert sqlstate_of(world.conn, statement, params) == "PDIMM", statement
    receipt = world.conn.execute("SELECT outcome FROM delivery_receipts WHERE key = %s", (key,)).fetchone()
    assert receipt == {"outcome": "succeeded"}
    actors = [r["actor"] for r in world.conn.execute("SELECT actor FROM audit_events ORDER BY id")]
    assert actors[-1] == "alice" and "mallory" not in actors
    # a second receipt with the same key is refused
    assert sqlstate_of(world.conn, "INSERT INTO delivery_receipts (key, attempt_id, outcome, response) "
                       "VALUES (%s, %s, 'failed', '{}')", (key, c.attempt_id)) == "23505"


def _upgrade(url: str, barrier, results) -> None:
    """One process's `db upgrade` (run in a spawned child)."""
    barrier.wait(60)
    try:
        results.put(("ok", migrate.upgrade(url)))
    except BaseException as exc:  # noqa: BLE001 - sent back to the test
        results.put(("error", repr(exc)))


def _upgrade_without_locks(url: str, barrier, results) -> None:
    """A deliberately broken `db upgrade`: no advisory lock, no yoyo lock; each process
    decides what is pending, then both apply it."""
    from yoyo import get_backend, read_migrations

    try:
        backend = get_backend(migrate._yoyo_url(url))
        pending = backend.to_apply(read_migrations(str(migrate.MIGRATIONS_DIR)))
        barrier.wait(60)
        backend.apply_migrations(pending)
        results.put(("ok", [m.id for m in pending]))
    except BaseException as exc:  # noqa: BLE001 - sent back to the test
        barrier.abort()
        results.put(("error", repr(exc)))


def race_upgrades(server_url: str, upgrade) -> tuple[str, list]:
    """Two spawned processes run ``upgrade`` at once on a new, empty database (created from
    template1, not from the migrated template). Returns its URL and what each reported."""
    name = f"pgd_test_migrate_{uuid.uuid4().hex[:8]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = with_database(server_url, name)
    assert migrate.applied_migrations(url) == []
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=upgrade, args=(url, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return url, outcomes


def check_applied_once(url: str, outcomes: list) -> None:
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    applied = sorted((ids for _, ids in outcomes), key=len)
    assert applied == [[], MIGRATIONS]  # one did the work, the other found nothing to do
    assert migrate.applied_migrations(url) == MIGRATIONS
    with db.connect(url) as conn:
        log = conn.execute("SELECT migration_id, count(*) AS n FROM _yoyo_log "
                           "WHERE operation = 'apply' GROUP BY 1 ORDER BY 1").fetchall()
        assert log == [{"migration_id": m, "n": 1} for m in MIGRATIONS]
        assert conn.execute("SELECT to_regprocedure('pgd_claim(bigint, bigint[], uuid, double precision)') "
                            "IS NOT NULL AS ok").fetchone()["ok"]


@pytest.fixture
def drop_databases(server_url):
    urls: list[str] = []
    yield urls
    with db.connect(server_url) as conn:
        for url in urls:
            conn.execute(f"DROP DATABASE IF EXISTS {urlsplit(url).path.lstrip('/')} WITH (FORCE)")


def test_two_processes_upgrading_an_empty_database_apply_each_migration_once(server_url, drop_databases):
    url, outcomes = race_upgrades(server_url, _upgrade)
    drop_databases.append(url)
    check_applied_once(url, outcomes)
    assert migrate.upgrade(url) == []  # and a third run is a no-op


def test_the_check_catches_an_upgrade_without_locks(server_url, drop_databases):
    """Both processes find the baseline pending; the second to create the tables fails
    (duplicate key in pg_type), and the check reports it."""
    url, outcomes = race_upgrades(server_url, _upgrade_without_locks)
    drop_databases.append(url)
    assert any(kind == "error" for kind, _ in outcomes), outcomes
    with pytest.raises(AssertionError):
        check_applied_once(url, outcomes)


def project_counts(conn) -> dict[str, tuple[int, int]]:
    """Per project: (pgd_project_running, its jobs in state running)."""
    return {r["name"]: (r["counted"], r["running"]) for r in conn.execute(
        "SELECT p.name, pgd_project_running(p.id) AS counted, "
        "       (SELECT count(*) FROM jobs j WHERE j.project_id = p.id AND j.state = 'running') AS running "
        "  FROM projects p ORDER BY p.name")}


def test_0017_counts_the_jobs_running_when_it_runs(world):
    """0017_project_running_stripes on a database with running jobs and no count kept yet
    (the state before it: its table and column dropped again) counts each project's running
    jobs on stripe 1 and gives their attempts that stripe, so their completions bring every
    count back to 0; a claim after it counts on."""
    world.setup(org_limit=10, pool_slots=10)
    world.project("api", org="acme", pools=("linux",))
    runner = world.runner(slots=10)
    for project in ("web", "web", "api"):
        world.job(project=project)
    claims = [world.claim(runner) for _ in range(3)]
    assert all(claims)
    world.conn.execute("DROP TABLE project_running_stripes")
    world.conn.execute("ALTER TABLE attempts DROP COLUMN project_stripe")
    text = (migrate.MIGRATIONS_DIR / "0017_project_running_stripes.sql").read_text()
    world.conn.execute(text)
    assert project_counts(world.conn) == {"api": (1, 1), "web": (2, 2)}
    assert world.conn.execute("SELECT count(*) AS n FROM attempts WHERE state = 'running' "
                              "AND project_stripe = 1").fetchone()["n"] == 3
    world.job(project="api")
    claims.append(world.claim(runner))
    assert project_counts(world.conn) == {"api": (2, 2), "web": (2, 2)}
    for c in claims:
        world.complete(c)
    assert project_counts(world.conn) == {"api": (0, 0), "web": (0, 0)}


def test_a_project_count_never_goes_below_zero_on_a_stripe(world):
    """A stripe's count is what its own attempts added (a release subtracts from the stripe
    its attempt recorded), so it is never negative: the CHECK refuses it."""
    world.setup()
    runner = world.runner()
    world.job()
    c = world.claim(runner)
    row = world.conn.execute("SELECT project_stripe AS s FROM attempts WHERE id = %s",
                             (c.attempt_id,)).fetchone()
    assert row["s"] is not None and 1 <= row["s"] <= 8
    assert sqlstate_of(world.conn, "UPDATE project_running_stripes SET running = running - 2 "
                                   "WHERE stripe_no = %s", (row["s"],)) == "23514"
    world.complete(c)
    assert project_counts(world.conn) == {"web": (0, 0)}
