"""The schema has the invariants DESIGN.md says the database enforces, and they bite; and
``db upgrade`` run by two processes at once on an empty database applies each migration once."""

from __future__ import annotations

import multiprocessing
import re
import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest

from sql import db, migrate, transitions
from sql.validate import JOB_STATES

from ..conftest import with_database
from ..faults import consistency

MIGRATIONS = ["0001_initial", "0002_transitions", "0003_batches", "0004_hot_path", "0005_history",
             "0006_wakeups", "0007_hot_rows_last", "0008_slot_rows", "0009_lean_job_indexes",
             "0010_refusals_say_why", "0011_shared_project_claims",
             "0012_idempotency_conflicts", "0013_scarcity_by_free_slots",
             "0014_capacity_stripes"]

# DESIGN.md, "Entities and states"
STATES = {
    "jobs": {"blocked", "queued", "running", "succeeded", "failed", "cancelled", "uncertain"},
    "attempts": {"running", "succeeded", "failed", "expired", "cancelled", "lost"},
    "targets": {"free", "held", "uncertain"},
}


def sqlstate_of(conn, statement: str, params=()) -> str:
    """Run a statement that must fail; return its SQLSTATE."""
    with pytest.raises(Exception) as info:
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
    # organizations and pools count their held slots (migration 0008; in stripes since 0014),
    # projects their running jobs (migration 0011): no running counter is stored anywhere
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
    (0014's header): each cap is its held count plus an even share of what the limit leaves,
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
    assert types == {"organization_stripe": "smallint", "pool_stripe": "smallint"}
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
        # what `running` said before 0008: the jobs running, above the limit or not
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
    """Both processes find both migrations pending; the second to create the tables fails
    (duplicate key in pg_type), and the check reports it."""
    url, outcomes = race_upgrades(server_url, _upgrade_without_locks)
    drop_databases.append(url)
    assert any(kind == "error" for kind, _ in outcomes), outcomes
    with pytest.raises(AssertionError):
        check_applied_once(url, outcomes)


def upgrade_to(url: str, last: str) -> list[str]:
    """Apply the migrations up to ``last`` included, as `db upgrade` of that release did;
    returns the ids applied."""
    from yoyo import get_backend, read_migrations

    backend = get_backend(migrate._yoyo_url(url))
    try:
        migrations = read_migrations(str(migrate.MIGRATIONS_DIR)).filter(lambda m: m.id <= last)
        with backend.lock():
            pending = backend.to_apply(migrations)
            backend.apply_migrations(pending)
        return [m.id for m in pending]
    finally:
        backend.connection.close()


def database_at(server_url: str, drop_databases: list[str], last: str) -> str:
    """A new database (dropped after the test) migrated up to ``last``; returns its URL."""
    name = f"pgd_test_migrate_{uuid.uuid4().hex[:8]}"
    with db.connect(server_url) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = with_database(server_url, name)
    drop_databases.append(url)
    assert upgrade_to(url, last) == MIGRATIONS[:MIGRATIONS.index(last) + 1]
    return url


def acme_on_linux(conn, projects: tuple[str, ...] = ("web",)) -> None:
    """Organization acme (4 running), pool linux (4 slots), ``projects`` granted the pool,
    written directly (the schema of an older migration)."""
    conn.execute("INSERT INTO organizations (name, max_running) VALUES ('acme', 4)")
    conn.execute("INSERT INTO pools (name, slots) VALUES ('linux', 4)")
    conn.execute("INSERT INTO projects (name, organization_id) "
                 "SELECT p, o.id FROM organizations o, unnest(%s::text[]) p", (list(projects),))
    conn.execute("INSERT INTO project_pools (project_id, pool_id) SELECT p.id, q.id FROM projects p, pools q")


def test_upgrading_to_slot_rows_gives_each_running_job_its_slots(server_url, drop_databases):
    """A database at 0007 with running jobs, upgraded to 0008 (and on to 0013, the last with
    slot rows): each running job holds one slot of its organization and one of its pool
    (numbered from 1 by job id), the free slots fill up to each limit (or what is over it is
    owed back), and the held slots say what the dropped ``running`` columns said, even for an
    organization already above its limit; jobs that hold no capacity (finished, or uncertain
    after a lost deployment) hold no slot. Upgraded on to 0014, the same slots are held in
    stripes, and the database goes on."""
    url = database_at(server_url, drop_databases, "0007_hot_rows_last")

    with db.connect(url) as conn:
        conn.execute("INSERT INTO organizations (name, max_running) VALUES ('acme', 4), ('globex', 2)")
        conn.execute("INSERT INTO pools (name, slots) VALUES ('linux', 4), ('mac', 1)")
        conn.execute("INSERT INTO projects (name, organization_id) "
                     "SELECT CASE name WHEN 'acme' THEN 'web' ELSE 'shop' END, id FROM organizations")
        conn.execute("INSERT INTO project_pools (project_id, pool_id) "
                     "SELECT p.id, q.id FROM projects p, pools q")
        conn.execute("INSERT INTO targets (name) VALUES ('production')")
        pool_ids = {r["name"]: r["id"] for r in conn.execute("SELECT id, name FROM pools")}
        runner = transitions.register_runner(conn, name="r", pools=["linux", "mac"], slots=8)

        def claim(pool: str):
            c = transitions.claim(conn, runner_id=runner, pools=[pool_ids[pool]],
                                  claim_token=transitions.new_claim_token(), lease_seconds=30)
            assert c is not None
            return c

        def complete(c):
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)

        for _ in range(3):
            transitions.submit(conn, project="web", pool="linux", command=["true"])
        transitions.submit(conn, project="web", pool="linux", command=["true"], target="production")
        transitions.submit(conn, project="shop", pool="mac", command=["true"])
        transitions.submit(conn, project="shop", pool="mac", command=["true"])  # stays queued
        done, web1, web2, deploy = (claim("linux") for _ in range(4))
        shop = claim("mac")
        complete(done)
        conn.execute("UPDATE attempts SET lease_expires_at = now() - interval '1 second' "
                     "WHERE id = %s", (deploy.attempt_id,))
        transitions.expire_leases(conn, backoff_base_seconds=0.001, backoff_cap_seconds=0.001)
        assert conn.execute("SELECT state FROM jobs WHERE id = %s", (deploy.job_id,)
                            ).fetchone() == {"state": "uncertain"}
        # acme's limit lowered below what runs: 0007 let the counter stay above it
        conn.execute("UPDATE organizations SET max_running = 1 WHERE name = 'acme'")
        before = {r["name"]: r["running"] for r in conn.execute(
            "SELECT name, running FROM organizations UNION ALL SELECT name, running FROM pools")}
        assert before == {"acme": 2, "globex": 1, "linux": 2, "mac": 1}

    assert upgrade_to(url, "0013_scarcity_by_free_slots") == MIGRATIONS[7:13]

    with db.connect(url) as conn:
        after = {r["name"]: r["running"] for r in conn.execute(
            "SELECT name, pgd_organization_running(id) AS running FROM organizations "
            "UNION ALL SELECT name, pgd_pool_running(id) FROM pools")}
        assert after == before

        def held(table: str, owner: str) -> dict[str, list]:
            rows = conn.execute(f"SELECT o.name, s.slot_no, s.job_id FROM {table} s "
                                f"JOIN {owner} o ON o.id = s.{owner.removesuffix('s')}_id "
                                f"ORDER BY 1, 2").fetchall()
            out: dict[str, list] = {}
            for r in rows:
                out.setdefault(r["name"], []).append((r["slot_no"], r["job_id"]))
            return out

        assert held("organization_slots", "organizations") == {
            "acme": [(1, web1.job_id), (2, web2.job_id)],   # above its limit of 1: no free slot
            "globex": [(1, shop.job_id), (2, None)]}
        assert held("pool_slots", "pools") == {
            "linux": [(1, web1.job_id), (2, web2.job_id), (3, None), (4, None)],
            "mac": [(1, shop.job_id)]}
        # acme runs 2 against its limit of 1: one slot is owed back
        assert conn.execute("SELECT kind, owed FROM slot_retirements").fetchall() == [
            {"kind": "organization", "owed": 1}]

    # the slot rows as stripes (0014): the same slots held, the same slot owed
    assert migrate.upgrade(url) == MIGRATIONS[13:]

    with db.connect(url) as conn:
        assert consistency.violations(conn) == []
        assert {r["name"]: r["running"] for r in conn.execute(
            "SELECT name, pgd_organization_running(id) AS running FROM organizations "
            "UNION ALL SELECT name, pgd_pool_running(id) FROM pools")} == before
        assert owner_stripes(conn) == {
            "acme": {"caps": 2, "held": 2, "room": 0},    # full: one slot owed
            "globex": {"caps": 2, "held": 1, "room": 1},
            "linux": {"caps": 4, "held": 2, "room": 2},
            "mac": {"caps": 1, "held": 1, "room": 0}}
        assert conn.execute("SELECT kind, owed FROM capacity_debts").fetchall() == [
            {"kind": "organization", "owed": 1}]
        # the running attempts record their stripes; the lost deployment's and the finished
        # job's attempts record none
        stripes_of = {r["job_id"]: (r["o"], r["q"]) for r in conn.execute(
            "SELECT job_id, organization_stripe AS o, pool_stripe AS q FROM attempts")}
        for c in (web1, web2, shop):
            assert None not in stripes_of[c.job_id]
        assert stripes_of[done.job_id] == stripes_of[deploy.job_id] == (None, None)

        # the upgraded database goes on: the completions free the slots the upgrade gave, and
        # the first of acme's is retired
        for c in (web1, web2, shop):
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)
        assert consistency.violations(conn) == []
        assert owner_stripes(conn) == {
            "acme": {"caps": 1, "held": 0, "room": 1},
            "globex": {"caps": 2, "held": 0, "room": 2},
            "linux": {"caps": 4, "held": 0, "room": 4},
            "mac": {"caps": 1, "held": 0, "room": 1}}
        assert conn.execute("SELECT count(*) AS n FROM capacity_debts").fetchone() == {"n": 0}


def owner_stripes(conn) -> dict[str, dict[str, int]]:
    """Per organization or pool (by name): the sum of its stripes' caps, held slots and room."""
    return {r["name"]: {"caps": r["caps"], "held": r["held"], "room": r["room"]} for r in conn.execute(
        "SELECT o.name, sum(s.cap)::int AS caps, sum(s.held)::int AS held, "
        "       sum(s.cap - s.held)::int AS room "
        "  FROM capacity_stripes s "
        "  JOIN (SELECT 'organization' AS kind, id, name FROM organizations "
        "        UNION ALL SELECT 'pool', id, name FROM pools) o "
        "    ON (o.kind, o.id) = (s.kind, s.owner_id) "
        " GROUP BY o.name")}


def test_upgrading_to_lean_job_indexes_keeps_every_key_unique(server_url, drop_databases):
    """A database at 0008 with jobs with and without keys, upgraded to 0009: a key submitted
    before the upgrade still returns its job, the same key in another project is its own, and
    a duplicate written past pgd_submit is still refused."""
    url = database_at(server_url, drop_databases, "0008_slot_rows")

    def submit(conn, project: str, key: str | None) -> dict:
        return transitions.submit(conn, project=project, pool="linux", command=["true"],
                                  idempotency_key=key)

    with db.connect(url) as conn:
        acme_on_linux(conn, ("web", "api"))
        keyed = submit(conn, "web", "deploy-7")
        unkeyed = [submit(conn, "web", None)["id"] for _ in range(2)]

    assert migrate.upgrade(url) == MIGRATIONS[8:]

    with db.connect(url) as conn:
        again = submit(conn, "web", "deploy-7")
        assert (again["id"], again["is_new"]) == (keyed["id"], False)
        other = submit(conn, "api", "deploy-7")
        assert other["is_new"] and other["id"] != keyed["id"]
        assert len(set(unkeyed + [submit(conn, "web", None)["id"]])) == 3
        assert sqlstate_of(conn, "INSERT INTO jobs (project_id, pool_id, state, command, idempotency_key) "
                                 "SELECT project_id, pool_id, 'queued', command, idempotency_key "
                                 "FROM jobs WHERE id = %s", (keyed["id"],)) == "23505"


def held_across_an_upgrade(url: str, table: str, call, upgrade: str, *, warm=None) -> dict:
    """Run ``call(conn)`` on its own connection in a thread while another holds ``table`` in
    ACCESS EXCLUSIVE mode; once the call waits for that lock (inside a function's old body),
    apply ``upgrade``, then release the lock. ``warm(conn)``, if given, runs first on the
    same connection (a long-lived session has the old body's plans cached). Returns
    {"value": ...} or {"error": ...}."""
    got: dict = {}
    warmed, go = threading.Event(), threading.Event()

    def run() -> None:
        with db.connect(url, application_name="inflight-call") as conn:
            try:
                if warm is not None:
                    warm(conn)
                warmed.set()
                assert go.wait(30), "the holder never took its lock"
                got["value"] = call(conn)
            except Exception as exc:  # reported by the caller, with its type
                got["error"] = exc
                warmed.set()

    caller = threading.Thread(target=run, name="racer-call")
    caller.start()
    assert warmed.wait(30), "the warm-up never ended"
    with db.connect(url) as holder, db.connect(url) as watcher:
        holder.execute("BEGIN")
        holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        go.set()
        deadline = time.monotonic() + 30
        while not watcher.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE "
                                  "application_name = 'inflight-call' AND wait_event_type = 'Lock'"
                                  ).fetchone()["n"]:
            assert time.monotonic() < deadline, "the call never reached the lock"
            time.sleep(0.02)
        assert upgrade_to(url, upgrade) == [upgrade]
        holder.execute("COMMIT")
        caller.join(timeout=30)
    assert not caller.is_alive()
    return got


def test_a_submit_running_while_0009_commits_is_retried_not_failed(server_url, drop_databases):
    """A submit whose pgd_submit started before 0009 committed runs the old body, whose
    ON CONFLICT names the unique constraint 0009 replaces: its INSERT fails with 42P10, and
    the transition retries it on the new body (sql.db.RETRYABLE) instead of failing. The
    submit is held inside pgd_submit by a lock on ``pools`` while the upgrade commits."""
    url = database_at(server_url, drop_databases, "0008_slot_rows")
    with db.connect(url) as conn:
        acme_on_linux(conn)

    got = held_across_an_upgrade(
        url, "pools", lambda conn: transitions.submit(conn, project="web", pool="linux", command=["true"],
                                                      idempotency_key="deploy-1"),
        "0009_lean_job_indexes")
    assert "error" not in got, repr(got.get("error"))
    assert got["value"]["is_new"]
    with db.connect(url) as conn:
        assert transitions.submit(conn, project="web", pool="linux", command=["true"],
                                  idempotency_key="deploy-1")["id"] == got["value"]["id"]


def test_upgrading_to_shared_project_claims_keeps_every_running_count(server_url, drop_databases):
    """A database at 0010 with running jobs in two projects (one bounded and full, one
    paused), upgraded to 0011: the running counts are the same numbers, the full project
    takes no claim, the paused one none either, and after its jobs end and it is resumed
    every queued job can be claimed."""
    url = database_at(server_url, drop_databases, "0010_refusals_say_why")
    with db.connect(url) as conn:
        acme_on_linux(conn, ("web", "api"))
        conn.execute("UPDATE projects SET max_running = 2 WHERE name = 'web'")
        runner = transitions.register_runner(conn, name="r", pools=["linux"], slots=4, hostname="h")
        pools = [conn.execute("SELECT id FROM pools").fetchone()["id"]]
        for project in ("web", "web", "web", "api", "api"):
            transitions.submit(conn, project=project, pool="linux", command=["true"])

        def claim():
            return transitions.claim(conn, runner_id=runner, pools=pools,
                                     claim_token=transitions.new_claim_token(), lease_seconds=60)
        claims = [claim() for _ in range(3)]
        transitions.pause_project(conn, project="api", reason="freeze", actor="test")
        before = {r["name"]: r["running"] for r in conn.execute("SELECT name, running FROM projects")}
        assert before == {"web": 2, "api": 1}

    assert migrate.upgrade(url) == MIGRATIONS[10:]

    with db.connect(url) as conn:
        after = {r["name"]: r["n"] for r in conn.execute(
            "SELECT name, pgd_project_running(id) AS n FROM projects")}
        assert after == before
        assert consistency.violations(conn) == []
        assert claim() is None  # web is at its bound, api is paused
        for c in claims:
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)
        transitions.resume_project(conn, project="api", reason="thaw", actor="test")
        assert sorted(claim().job_id is not None for _ in range(2)) == [True, True]
        assert consistency.violations(conn) == []


@pytest.mark.parametrize("session", ["new", "long-lived"])
def test_a_claim_running_while_0011_commits_is_retried_not_failed(server_url, drop_databases, session):
    """A claim whose pgd_claim started before 0011 committed runs the old body, which reads
    the project's `running` column 0011 drops: it fails with 42703, and the transition
    retries it on the new body (sql.db.RETRYABLE) instead of failing. The claim is held
    inside pgd_claim, before it touches ``projects``, by a lock on ``runners``. In a session
    that has claimed before (a scheduler's), the old body's cached plans skip the bound test
    on a project without one and first call pgd_fairer_candidate_exists by its 0010
    signature: 0011 keeps that signature (found by an adversarial run: it had been dropped,
    and the call failed with 42883, which is not retried)."""
    url = database_at(server_url, drop_databases, "0010_refusals_say_why")
    with db.connect(url) as conn:
        acme_on_linux(conn)
        runner = transitions.register_runner(conn, name="r", pools=["linux"], slots=4, hostname="h")
        pools = [conn.execute("SELECT id FROM pools").fetchone()["id"]]
        first, job = (transitions.submit(conn, project="web", pool="linux", command=["true"])
                      for _ in range(2))

    def claim(conn):
        return transitions.claim(conn, runner_id=runner, pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=60)

    def warm(conn):
        c = claim(conn)
        assert c.job_id == first["id"]
        transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                             outcome="succeeded", receipt_key=c.receipt_key)

    got = held_across_an_upgrade(url, "runners", claim, "0011_shared_project_claims",
                                 warm=warm if session == "long-lived" else None)
    assert "error" not in got, repr(got.get("error"))
    assert got["value"].job_id == (job if session == "long-lived" else first)["id"]


def test_upgrading_to_capacity_stripes_holds_exactly_the_running_jobs(server_url, drop_databases):
    """A database at 0013 with jobs running (acme 11 against a limit lowered to 5, pool mac 2
    against 1, so slot_retirements owes 6 and 1), upgraded to 0014: each running attempt
    records a stripe of its organization and one of its pool, each stripe holds exactly the
    running attempts recording it (spread round robin), what was owed is carried over as
    capacity_debts with every stripe of those owners full, and the finished attempts record
    none. Then no claim is admitted while an owner runs at or above its limit, the
    completions retire what is owed, and once all have ended the claims admitted are exactly
    the limits, not one more."""
    url = database_at(server_url, drop_databases, "0013_scarcity_by_free_slots")

    with db.connect(url) as conn:
        conn.execute("INSERT INTO organizations (name, max_running) VALUES ('acme', 12), ('globex', 3)")
        conn.execute("INSERT INTO pools (name, slots) VALUES ('linux', 20), ('mac', 2)")
        conn.execute("INSERT INTO projects (name, organization_id) "
                     "SELECT CASE name WHEN 'acme' THEN 'web' ELSE 'shop' END, id FROM organizations")
        conn.execute("INSERT INTO project_pools (project_id, pool_id) "
                     "SELECT p.id, q.id FROM projects p JOIN pools q "
                     "  ON (p.name, q.name) IN (('web', 'linux'), ('shop', 'mac'))")
        pool_ids = {r["name"]: r["id"] for r in conn.execute("SELECT id, name FROM pools")}
        runner = transitions.register_runner(conn, name="r", pools=["linux", "mac"], slots=32)

        def claim(pool: str):
            return transitions.claim(conn, runner_id=runner, pools=[pool_ids[pool]],
                                     claim_token=transitions.new_claim_token(), lease_seconds=300)

        for _ in range(12):
            transitions.submit(conn, project="web", pool="linux", command=["true"])
        for _ in range(3):
            transitions.submit(conn, project="shop", pool="mac", command=["true"])
        web = [claim("linux") for _ in range(12)]
        shop = [claim("mac") for _ in range(2)]
        assert None not in web + shop and claim("mac") is None  # mac's 2 slots are held
        finished = web.pop(0)
        transitions.complete(conn, attempt_id=finished.attempt_id, generation=finished.generation,
                             outcome="succeeded", receipt_key=finished.receipt_key)
        conn.execute("UPDATE organizations SET max_running = 5 WHERE name = 'acme'")
        conn.execute("UPDATE pools SET slots = 1 WHERE name = 'mac'")
        for _ in range(8):  # queued for acme after the upgrade
            transitions.submit(conn, project="web", pool="linux", command=["true"])
        owed_before = conn.execute("SELECT kind, owner_id, owed FROM slot_retirements "
                                   "ORDER BY 1, 2").fetchall()
        assert [r["owed"] for r in owed_before] == [6, 1]  # acme: 11 of 5; mac: 2 of 1
        before = {r["name"]: r["running"] for r in conn.execute(
            "SELECT name, pgd_organization_running(id) AS running FROM organizations "
            "UNION ALL SELECT name, pgd_pool_running(id) FROM pools")}
        assert before == {"acme": 11, "globex": 2, "linux": 11, "mac": 2}

    assert migrate.upgrade(url) == MIGRATIONS[13:]

    with db.connect(url) as conn:
        assert consistency.violations(conn) == []
        running = {r["name"]: r["running"] for r in conn.execute(
            "SELECT name, pgd_organization_running(id) AS running FROM organizations "
            "UNION ALL SELECT name, pgd_pool_running(id) FROM pools")}
        assert running == before
        # each running attempt records a stripe of each kind; the finished one none
        recorded_by = {r["id"]: (r["o"], r["q"]) for r in conn.execute(
            "SELECT id, organization_stripe AS o, pool_stripe AS q FROM attempts")}
        assert all(1 <= o <= 8 and 1 <= q <= 8 for o, q in
                   (recorded_by[c.attempt_id] for c in web + shop))
        assert recorded_by[finished.attempt_id] == (None, None)
        # per stripe: held = the running attempts recording it (an owner's stripes absent
        # from the attempts hold nothing)
        per_stripe = conn.execute("""
            SELECT s.kind, s.owner_id, s.stripe_no, s.cap, s.held,
                   (SELECT count(*) FROM attempts a JOIN jobs j ON j.id = a.job_id
                      JOIN projects p ON p.id = j.project_id
                     WHERE a.state = 'running'
                       AND CASE s.kind WHEN 'organization'
                                THEN p.organization_id = s.owner_id AND a.organization_stripe = s.stripe_no
                                ELSE j.pool_id = s.owner_id AND a.pool_stripe = s.stripe_no END
                   )::int AS attempts
              FROM capacity_stripes s ORDER BY 1, 2, 3""").fetchall()
        assert len(per_stripe) == 4 * 8
        assert [r["held"] for r in per_stripe] == [r["attempts"] for r in per_stripe]
        names = {("organization", r["id"]): r["name"] for r in conn.execute("SELECT id, name FROM organizations")}
        names |= {("pool", r["id"]): r["name"] for r in conn.execute("SELECT id, name FROM pools")}
        by_owner: dict[str, list] = {}
        for r in per_stripe:
            by_owner.setdefault(names[(r["kind"], r["owner_id"])], []).append((r["cap"], r["held"]))
        # round robin: acme's (and linux's) 11 slots over the 8 stripes, 2 on the first 3
        assert sorted((h for _, h in by_owner["acme"]), reverse=True) == [2, 2, 2, 1, 1, 1, 1, 1]
        assert sorted((h for _, h in by_owner["linux"]), reverse=True) == [2, 2, 2, 1, 1, 1, 1, 1]
        # the debts carried over, their owners' stripes full; the others split the limit
        assert conn.execute("SELECT kind, owner_id, owed FROM capacity_debts ORDER BY 1, 2"
                            ).fetchall() == owed_before
        assert all(cap == held for cap, held in by_owner["acme"] + by_owner["mac"])
        assert sum(cap for cap, _ in by_owner["linux"]) == 20
        assert sum(cap for cap, _ in by_owner["globex"]) == 3

        def claim(pool: str):
            return transitions.claim(conn, runner_id=runner, pools=[pool_ids[pool]],
                                     claim_token=transitions.new_claim_token(), lease_seconds=300)

        def complete(c) -> None:
            transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                 outcome="succeeded", receipt_key=c.receipt_key)

        def capacity(kind: str, name: str) -> dict[str, int]:
            return conn.execute(
                "SELECT sum(s.held)::int AS held, sum(s.cap - s.held)::int AS room, "
                "       coalesce((SELECT d.owed FROM capacity_debts d "
                "                  WHERE (d.kind, d.owner_id) = (s.kind, s.owner_id)), 0) AS owed "
                "  FROM capacity_stripes s "
                " WHERE s.kind = %s AND s.owner_id = (SELECT id FROM " + ("organizations" if kind == "organization" else "pools")
                + " WHERE name = %s) GROUP BY s.kind, s.owner_id", (kind, name)).fetchone()

        # no claim while acme runs at or above its limit of 5: each completion retires a
        # slot owed, then the running jobs come down to the limit with no room
        for n in range(11, 5, -1):
            assert capacity("organization", "acme") == {"held": n, "room": 0, "owed": n - 5}
            assert claim("linux") is None
            complete(web.pop())
        assert capacity("organization", "acme") == {"held": 5, "room": 0, "owed": 0}
        assert claim("linux") is None
        assert consistency.violations(conn) == []
        while web:
            complete(web.pop())
        assert claim("mac") is None  # mac runs 2 against 1
        complete(shop.pop())
        assert capacity("pool", "mac") == {"held": 1, "room": 0, "owed": 0}
        assert claim("mac") is None
        complete(shop.pop())
        assert consistency.violations(conn) == []

        # back to the limits: acme (5) admits 5 of a batch of 8 and then none; mac (1) one
        assert capacity("organization", "acme") == {"held": 0, "room": 5, "owed": 0}
        batch = transitions.claim_batch(conn, runner_id=runner, pools=[pool_ids["linux"]],
                                        claim_tokens=[transitions.new_claim_token() for _ in range(8)],
                                        lease_seconds=300)
        assert len(batch) == 5
        assert claim("linux") is None
        assert claim("mac") is not None and claim("mac") is None
        assert capacity("organization", "acme") == {"held": 5, "room": 0, "owed": 0}
        assert capacity("pool", "mac") == {"held": 1, "room": 0, "owed": 0}
        assert consistency.violations(conn) == []


def test_a_migration_that_deadlocks_with_a_transition_in_flight_is_tried_again(server_url, drop_databases):
    """0014 locks the tables it changes up front; a transaction that has read `attempts`
    (as a completion does first) and then reads `organizations` closes a cycle with it. The
    migration waited first, so PostgreSQL aborts it (40P01); `db upgrade` rolls it back,
    tries again once the other transaction has committed, and applies it. Without the retry
    the upgrade raised (found by an adversarial run under live claims)."""
    url = database_at(server_url, drop_databases, "0013_scarcity_by_free_slots")
    result: dict = {}
    with db.connect(url, application_name="inflight-completion") as inflight, \
            db.connect(url) as watcher:
        deadlocks = watcher.execute("SELECT deadlocks FROM pg_stat_database"
                                    " WHERE datname = current_database()").fetchone()["deadlocks"]
        inflight.execute("BEGIN")
        inflight.execute("SELECT count(*) FROM attempts")

        def upgrade() -> None:
            try:
                result["applied"] = migrate.upgrade(url)
            except Exception as exc:  # asserted below, with its type
                result["error"] = exc

        upgrader = threading.Thread(target=upgrade, name="racer-upgrade")
        upgrader.start()
        deadline = time.monotonic() + 30
        while not watcher.execute(
                "SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE organizations%'").fetchone()["n"]:
            assert time.monotonic() < deadline, "the migration never waited for attempts"
            time.sleep(0.02)
        inflight.execute("SELECT count(*) FROM organizations")  # the cycle: the migration is aborted
        inflight.execute("COMMIT")
        upgrader.join(60)
        assert not upgrader.is_alive()
        assert "error" not in result, result
        assert result["applied"] == ["0014_capacity_stripes"]
        after = watcher.execute("SELECT deadlocks FROM pg_stat_database"
                                " WHERE datname = current_database()").fetchone()["deadlocks"]
        assert after > deadlocks, "no deadlock happened: the test did not exercise the retry"
    assert migrate.applied_migrations(url)[-1] == "0014_capacity_stripes"
