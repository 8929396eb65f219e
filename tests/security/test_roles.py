"""Least privilege in the database itself: connected as a login of each group role
(sql/roles.sql, sql/grants.sql), PostgreSQL refuses every statement the role may not send,
and each role can still do its work. Roles are cluster-wide, so the logins are made once
per session on the shared test server (``db login`` is idempotent); grants are per
database, so the over-privileged variant is applied to a database of its own."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest

from pgdispatch.sql import Forbidden, bulk, db, explain, limits, reads, roles, transitions

from ..conftest import with_database
from ..e2e.test_scheduler_e2e import Schedulers, wait_until
from ..variants import variant_sql

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("scheduler", "web", "reader", "operator", "admin")
PASSWORD = secrets.token_urlsafe(16)


def login_url(url: str, user: str, password: str = PASSWORD) -> str:
    """``url`` with another user and password."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{quote(user)}:{quote(password)}@{host}", parts.path,
                       parts.query, parts.fragment))


@pytest.fixture(scope="session")
def logins(server_url, template_url) -> dict[str, str]:
    """One LOGIN role per group, ``pgd_test_<group>``: {group: name}."""
    made = {}
    for kind in GROUPS:
        name = f"pgd_test_{kind}"
        roles.set_login(server_url, name=name, kind=kind, password=PASSWORD)
        made[kind] = name
    return made


def _tables(conn) -> list[str]:
    return [r["tablename"] for r in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")]


def forbidden_statements(conn, kind: str) -> list[str]:
    """Every statement a login of ``kind`` must not be able to run, on this database."""
    stmts = ["SELECT password_hash FROM users", "SELECT token_hash FROM api_tokens",
             "UPDATE users SET role = 'admin'",
             "INSERT INTO api_tokens (user_id, name, token_hash) SELECT id, 'x', 'y' FROM users",
             "UPDATE jobs SET command = ARRAY['sh', '-c', 'evil']",
             "DROP TABLE audit_events", "ALTER TABLE audit_events DISABLE TRIGGER USER",
             "ALTER TABLE audit_events DISABLE TRIGGER audit_events_immutable",
             "TRUNCATE audit_events", "DELETE FROM audit_events",
             "SELECT pgd_audit('x', 'forged', 'project:web', NULL)",
             "SELECT pgd_release_slots(ARRAY[1::bigint], ARRAY[1::bigint], ARRAY[1::bigint])",
             "SELECT pgd_authorize('adm', 'admin')",
             "CREATE TABLE intruder (x int)",
             # the keys the transitions serialise on (sql/advisory.sql): held, they would stall
             # other people's claims, pauses and sign-ins
             "SELECT pg_advisory_lock(1)", "SELECT pg_try_advisory_lock(1, 2)",
             "SELECT pg_advisory_xact_lock_shared(1)",
             "CREATE FUNCTION pgd_intruder() RETURNS int LANGUAGE sql AS 'SELECT 1'",
             # supersede is the submit's own step, under its lock (sql/functions/submit.sql)
             "SELECT pgd_supersede_older(2, 1, 'production', NULL, '{}')",
             "SELECT pg_advisory_xact_lock(pgd_supersede_lock_class(), 1)"]
    for t in _tables(conn):
        column = conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                              "AND attnum > 0 AND NOT attisdropped AND attidentity = '' AND attgenerated = '' "
                              "ORDER BY attnum LIMIT 1",
                              (t,)).fetchone()["attname"]
        stmts += [f"INSERT INTO {t} DEFAULT VALUES", f'UPDATE {t} SET "{column}" = "{column}"',
                  f"DELETE FROM {t}", f"TRUNCATE {t}", f"ALTER TABLE {t} OWNER TO CURRENT_USER"]
        if kind == "scheduler":
            stmts.append(f"SELECT * FROM {t}")
    if kind in ("scheduler", "reader"):
        # steering the fleet (sql/functions/operator.sql): operators' and the console's only
        stmts += ["SELECT pgd_pause_pool('linux', 'x', NULL)", "SELECT pgd_resume_pool('linux', NULL, NULL)",
                  "SELECT pgd_drain_runner(1, NULL, 'x', NULL)", "SELECT pgd_resume_runner(1, NULL, NULL)"]
    if kind in ("web", "reader", "operator", "admin"):
        # the drain a scheduler reads with its beat: the scheduler's only
        stmts += ["SELECT * FROM pgd_runner_drain(1)"]
    if kind == "scheduler":
        stmts += ["SELECT pgd_pause_project('web', 'x', NULL)",
                  "SELECT pgd_set_pool_slots('linux', 0, 1, NULL, NULL)",
                  "SELECT * FROM pgd_submit('web', 'linux', NULL, ARRAY['true'], 0, 1, 60, 0, "
                  "false, '{}', NULL, NULL)"]
    if kind in ("reader", "operator"):
        stmts += ["SELECT pgd_set_pool_slots('linux', 0, 1, NULL, NULL)"]
    if kind in ("scheduler", "reader"):
        # the operator actions of a bulk action and a job's priority (sql/functions/bulk.sql)
        stmts += ["SELECT pgd_set_priority(1, 1, NULL, NULL)",
                  "SELECT pgd_bulk_begin('cancel', '{}', 1, false, NULL, NULL, NULL)",
                  "SELECT * FROM pgd_bulk_apply(1, ARRAY[1::bigint], NULL, NULL)"]
    if kind in ("web", "reader", "operator", "admin"):
        stmts += ["SELECT * FROM pgd_claim(1, ARRAY[1::bigint], gen_random_uuid(), 30)",
                  "SELECT pgd_register_runner('r', 'h', 1, ARRAY['linux'], 1)",
                  "SELECT * FROM pgd_heartbeat(1, 1, 30, NULL)"]
    return stmts


def not_refused(url: str, kind: str) -> list[str]:
    """The statements of ``forbidden_statements`` that PostgreSQL did not refuse with
    insufficient privilege (42501), each rolled back whatever happened."""
    with db.connect(url) as conn:
        stmts = forbidden_statements(conn, kind)
        passed = []
        for stmt in stmts:
            try:
                with conn.transaction(force_rollback=True):
                    conn.execute(stmt)
            except psycopg.errors.InsufficientPrivilege:
                continue
            except psycopg.Error as exc:
                passed.append(f"{stmt}  [got past the privilege check: {exc.sqlstate}]")
                continue
            passed.append(stmt)
        return passed


@pytest.mark.parametrize("kind", GROUPS)
def test_every_forbidden_statement_is_refused(world, db_url, logins, kind):
    world.setup(targets=("production",))
    world.job()
    world.conn.execute("INSERT INTO users (username, password_hash, role) VALUES ('adm', 'x', 'admin')")
    assert not_refused(login_url(db_url, logins[kind]), kind) == []


@pytest.mark.own_database
def test_an_over_privileged_scheduler_is_caught(world, db_url, logins):
    """The check above, against grants.sql with one line too many: it reports the writes."""
    world.setup()
    world.job()
    text = roles.GRANTS_FILE.read_text() + "\nGRANT ALL ON ALL TABLES IN SCHEMA public TO pgdispatch_scheduler;\n"
    with db.connect(db_url) as conn:
        conn.execute(text)
    leaks = not_refused(login_url(db_url, logins["scheduler"]), "scheduler")
    assert "UPDATE jobs SET command = ARRAY['sh', '-c', 'evil']" in leaks
    assert "SELECT password_hash FROM users" in leaks
    assert any(s.startswith("TRUNCATE audit_events") for s in leaks)


# plain SQL functions the reads inline (sql/grants.sql): they run as the caller, read only
PLAIN_READ_HELPERS = ("pgd_organization_running", "pgd_pool_running", "pgd_project_running",
                      "pgd_runner_login_pools", "pgd_login_is_unbound", "pgd_login_may_run",
                      "pgd_waiting_since", "pgd_live_runner_pools", "pgd_runner_is_live",
                      "pgd_job_list_match", "pgd_target_head",
                      # the job search's index expression (sql/schema.sql), EXECUTE to PUBLIC
                      "pgd_command_text")


def test_nobody_logs_in_as_the_owner_and_group_roles_cannot_log_in(conn):
    rows = conn.execute("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname = ANY (%s)",
                        (list(roles.ROLE_NAMES),)).fetchall()
    assert sorted(r["rolname"] for r in rows) == sorted(roles.ROLE_NAMES)
    assert not any(r["rolcanlogin"] for r in rows)
    owners = conn.execute("""SELECT DISTINCT pg_get_userbyid(relowner) AS o FROM pg_class
                              WHERE relnamespace = 'public'::regnamespace""").fetchall()
    assert [r["o"] for r in owners] == ["pgdispatch_owner"]
    definers = conn.execute("""SELECT proname, prosecdef, proconfig FROM pg_proc
                                WHERE pronamespace = 'public'::regnamespace
                                  AND has_function_privilege('pgdispatch_scheduler', oid, 'EXECUTE')
                                      OR has_function_privilege('pgdispatch_web', oid, 'EXECUTE')
                                      AND pronamespace = 'public'::regnamespace""").fetchall()
    # what a group may call and is not a plain read helper runs as the owner, path pinned
    for d in definers:
        if d["proname"] in PLAIN_READ_HELPERS:
            continue
        assert d["prosecdef"] and d["proconfig"] == ["search_path=public, pg_temp"], d


def actors_not_refused(db_url: str, logins: dict[str, str]) -> list[str]:
    """Who a web login or an operator's CLI login could act as, of those it must not: a
    viewer, a disabled operator, an unknown user, nobody (web); another user, a limit change
    (operator). Each try rolled back."""
    got = []
    with db.connect(login_url(db_url, logins["web"])) as web:
        for actor in ("view", "gone", "nobody", None):
            try:
                with web.transaction(force_rollback=True):
                    transitions.pause_project(web, project="web", reason="r", actor=actor)
                got.append(f"web as {actor}")
            except Forbidden:
                pass
        try:
            with web.transaction(force_rollback=True):  # an operator is not an admin
                limits.set_pool_slots(web, pool="linux", slots=5, expected_slots=100, actor="op")
            got.append("web: op changes a limit")
        except Forbidden:
            pass
    with db.connect(login_url(db_url, logins["operator"])) as op:
        try:
            with op.transaction(force_rollback=True):
                transitions.pause_project(op, project="web", reason="r", actor="adm")
            got.append("operator login as adm")
        except Forbidden:
            pass
    return got


def _users(conn) -> None:
    conn.execute("INSERT INTO users (username, password_hash, role, disabled_at) VALUES "
                 "('view', 'x', 'viewer', NULL), ('op', 'x', 'operator', NULL), "
                 "('adm', 'x', 'admin', NULL), ('gone', 'x', 'operator', now())")


@pytest.mark.own_database
def test_web_names_only_an_enabled_user_whose_role_allows(world, db_url, logins):
    world.setup()
    _users(world.conn)
    assert actors_not_refused(db_url, logins) == []
    with db.connect(login_url(db_url, logins["web"])) as web:
        transitions.pause_project(web, project="web", reason="r", actor="op")
    event = world.conn.execute("SELECT actor, login FROM audit_events WHERE action = 'pause_project'").fetchone()
    assert event == {"actor": "op", "login": logins["web"]}


@pytest.mark.own_database
def test_a_pgd_authorize_that_believes_its_caller_is_caught(world, db_url, logins):
    """The check above against a pgd_authorize that believes whatever actor it is given
    (the rule before issue 17): it reports every forged actor."""
    world.setup()
    _users(world.conn)
    world.conn.execute(variant_sql(world.conn, "pgd_authorize", [(
        "    p_actor := nullif(btrim(p_actor), '');\n",
        "    p_actor := nullif(btrim(p_actor), '');\n    RETURN coalesce(p_actor, v_login);\n")]))
    assert actors_not_refused(db_url, logins) == [
        "web as view", "web as gone", "web as nobody", "web as None",
        "web: op changes a limit", "operator login as adm"]


@pytest.mark.own_database
def test_a_cli_login_acts_as_itself(world, db_url, logins):
    world.setup()
    with db.connect(login_url(db_url, logins["operator"])) as op:
        with pytest.raises(Forbidden):  # an operator may not change limits (no EXECUTE)
            limits.set_pool_slots(op, pool="linux", slots=5, expected_slots=100, actor=None)
        transitions.pause_project(op, project="web", reason="r", actor=None)
    with db.connect(login_url(db_url, logins["admin"])) as adm:
        limits.set_pool_slots(adm, pool="linux", slots=5, expected_slots=100, actor=None)
    events = world.conn.execute("SELECT actor, login, action FROM audit_events "
                                "WHERE action IN ('pause_project', 'set_pool_slots') ORDER BY id").fetchall()
    assert events == [{"actor": logins["operator"], "login": logins["operator"], "action": "pause_project"},
                      {"actor": logins["admin"], "login": logins["admin"], "action": "set_pool_slots"}]


@pytest.mark.own_database
def test_a_bulk_action_runs_as_an_operator_login_and_not_as_another(world, db_url, logins):
    """A person's operator login previews and applies a bulk cancel as itself, and a bulk
    event is its own: another login (the console's, naming a user) cannot apply its batches;
    a reader cannot even preview it to begin one."""
    world.setup()
    ids = [world.job()["id"] for _ in range(3)]
    with db.connect(login_url(db_url, logins["operator"])) as op:
        run = bulk.run_bulk(op, action="cancel", filters={}, actor=None, dry_run=False)
        assert run["result"]["done"] == ids
        other = world.job()["id"]
        begun = run["result"]["bulk_event_id"]
    with db.connect(login_url(db_url, logins["admin"])) as adm:
        with pytest.raises(Forbidden, match="is pgd_test_operator's"):
            bulk._apply_batch(adm, bulk_event_id=begun, job_ids=[other], generations=[None], actor=None)
    with db.connect(login_url(db_url, logins["reader"])) as reader:
        with pytest.raises(Forbidden):
            bulk.apply_bulk(reader, action="cancel", job_ids=[other], actor=None)
    assert world.row("jobs", other)["state"] == "queued"
    actors = {(e["action"], e["actor"], e["login"]) for e in world.conn.execute(
        "SELECT action, actor, login FROM audit_events WHERE action IN ('bulk_cancel', 'cancel_job')")}
    assert actors == {("bulk_cancel", logins["operator"], logins["operator"]),
                      ("cancel_job", logins["operator"], logins["operator"])}


@pytest.mark.own_database
def test_the_cli_refuses_a_login_not_in_operator_in_one_line(world, db_url, logins, tmp_path):
    world.setup()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env["DATABASE_URL"] = login_url(db_url, logins["reader"])
    out = subprocess.run([sys.executable, "-m", "pgdispatch", "projects", "pause", "web",
                          "--reason", "x"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: permission denied"), out.stderr
    assert world.conn.execute("SELECT paused_at FROM projects WHERE name = 'web'").fetchone()["paused_at"] is None


@pytest.mark.own_database
def test_a_scheduler_login_runs_jobs_end_to_end(world, db_url, logins, tmp_path):
    world.setup()
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    jobs = [world.job(command=["true"])["id"] for _ in range(3)]
    procs = Schedulers(login_url(db_url, logins["scheduler"]), tmp_path)
    try:
        procs.start("runner-a", slots=2)
        wait_until(lambda: world.conn.execute(
            "SELECT count(*) = 3 AS done FROM jobs WHERE id = ANY (%s) AND state = 'succeeded'",
            (jobs,)).fetchone()["done"], what="the jobs to succeed", procs=procs)
        wait_until(lambda: world.conn.execute("SELECT count(*) AS n FROM queue_summaries")
                   .fetchone()["n"], what="a queue summary", procs=procs)
    finally:
        procs.close()
    assert "permission denied" not in procs.logs()


@pytest.mark.own_database
def test_web_and_reader_logins_read_what_the_console_shows(world, db_url, logins):
    world.setup(targets=("production",))
    job = world.job()["id"]
    runner = world.runner()
    world.claim(runner)
    world.conn.execute("INSERT INTO users (username, password_hash, role) VALUES ('adm', 'x', 'admin')")
    for kind in ("web", "reader"):
        with db.connect(login_url(db_url, logins[kind])) as c:
            assert reads.show_job(c, job_id=job)["id"] == job
            reads.list_waiting(c)
            reads.overview(c)
            reads.list_projects(c)
            reads.list_targets(c)
            reads.list_runners(c)
            reads.list_filter_choices(c)
            reads.list_recent_jobs(c)
            reads.list_recent_jobs(c, state="running")
            # the lists and shows of the CLI and the API (reads.list_jobs sets plan_cache_mode)
            assert [j["id"] for j in reads.list_jobs(c, state="running", runner_id=runner)["jobs"]] == [job]
            reads.list_jobs(c, reason="ready", organization="acme")
            assert reads.show_runner(c, runner_id=runner)["slots_used"] == 1
            reads.show_project(c, name="web")
            reads.show_pool(c, name="linux")
            reads.show_target(c, name="production")
            # the job search, both steps: the probe of the newest jobs, and the trigram index
            # (its wrapper pgd_command_text is PUBLIC's, the planner settings any login's)
            assert [j["id"] for j in reads.search_jobs(c, q="true", project="web")["jobs"]] == [job]
            probe, reads.SEARCH_PROBE_ROWS = reads.SEARCH_PROBE_ROWS, 0
            try:
                assert [j["id"] for j in reads.search_jobs(c, q="true")["jobs"]] == [job]
            finally:
                reads.SEARCH_PROBE_ROWS = probe
            explain.explain_job(c, job_id=job)
            limits.list_limits(c)
            from pgdispatch.sql import audit
            audit.list_audit_events(c)
            c.execute("SELECT * FROM queue_summaries").fetchall()
            c.execute("SELECT id, username, role, disabled_at FROM users").fetchall()


def test_the_managed_set_up_works_without_a_superuser(server_url, template_url, tmp_path):
    """docs/operations.md, "Database roles": a CREATEROLE login that owns the database
    upgrades it (the schema is then pgdispatch_owner's) and makes the logins. The group
    roles exist already on the shared test server; the set-up login is given what creating
    them would have given it (ADMIN on each) and membership in the migrator group."""
    setup, name = "pgd_test_setup", f"pgd_test_managed_{secrets.token_hex(4)}"
    with db.connect(server_url) as su:
        if su.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (setup,)).fetchone() is None:
            su.execute(f"CREATE ROLE {setup} LOGIN CREATEROLE")
        su.execute(f"ALTER ROLE {setup} PASSWORD '{PASSWORD}'")  # the server asks every login
        for group in roles.ROLE_NAMES:
            su.execute(f"GRANT {group} TO {setup} WITH ADMIN TRUE, INHERIT FALSE, SET FALSE")
        su.execute(f"GRANT pgdispatch_migrator TO {setup} WITH INHERIT TRUE, SET TRUE")
        su.execute(f"CREATE DATABASE {name} OWNER {setup}")
    try:
        url = login_url(with_database(server_url, name), setup)
        from pgdispatch.sql import migrate
        assert "0003_audit_login" in migrate.upgrade(url)
        assert roles.set_up(url)["created"] == []
        roles.set_login(url, name="pgd_test_managed_web", kind="web", password=PASSWORD)
        with db.connect(with_database(server_url, name)) as su:
            owners = su.execute("SELECT DISTINCT pg_get_userbyid(relowner) AS o FROM pg_class "
                                "WHERE relnamespace = 'public'::regnamespace").fetchall()
            assert [r["o"] for r in owners] == ["pgdispatch_owner"]
        with db.connect(login_url(with_database(server_url, name), "pgd_test_managed_web")) as web:
            reads.overview(web)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                web.execute("SELECT password_hash FROM users")
    finally:
        with db.connect(server_url) as su:
            su.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _cli(url: str, cwd: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=url, **env_extra)
    return subprocess.run([sys.executable, "-m", "pgdispatch", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, env", [
    (("db", "login", "pgd_test_cli_x", "--role", "root", "--password-env", "PW"), {"PW": "x"}),
    (("db", "login", "Bad-Name", "--role", "web", "--password-env", "PW"), {"PW": "x"}),
    (("db", "login", "pg_monitorx", "--role", "web", "--password-env", "PW"), {"PW": "x"}),
    (("db", "login", "pgdispatch_owner", "--role", "web", "--password-env", "PW"), {"PW": "x"}),
    (("db", "login", "postgres", "--role", "web", "--password-env", "PW"), {"PW": "x"}),
    (("db", "login", "pgd_test_cli_x", "--role", "web", "--password-env", "UNSET_PW"), {}),
    (("db", "login", "pgd_test_cli_x", "--role", "web", "--password-env", "PW"), {"PW": ""}),
    (("db", "login", "pgd_test_cli_x", "--role", "web", "--password", "x"), {}),
])
def test_db_login_refuses_bad_input_in_one_line(db_url, tmp_path, args, env):
    out = _cli(db_url, tmp_path, *args, **env)
    assert out.returncode in (2, 4) and out.stderr.count("\n") == 1, out.stderr
    with db.connect(db_url) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'pgd_test_cli_x'").fetchone() is None
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = 'postgres'").fetchone()["rolsuper"]


def test_db_roles_and_db_login_make_a_login_of_one_group(db_url, tmp_path):
    roles_out = _cli(db_url, tmp_path, "db", "roles", "--json")
    assert roles_out.returncode == 0, roles_out.stderr
    for kind in ("reader", "web"):  # moved from one group to the other
        out = _cli(db_url, tmp_path, "db", "login", "pgd_test_cli_moved", "--role", kind,
                   "--password-env", "PW", PW=PASSWORD)
        assert out.returncode == 0, out.stderr
    with db.connect(db_url) as conn:
        groups = conn.execute("""SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid
                                  WHERE m.member = 'pgd_test_cli_moved'::regrole""").fetchall()
        verifier = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = 'pgd_test_cli_moved'").fetchone()
    assert [g["rolname"] for g in groups] == ["pgdispatch_web"]
    assert verifier["rolpassword"].startswith("SCRAM-SHA-256$")
    # a runner host's login with a bound on its connections: one host cannot take every slot
    out = _cli(db_url, tmp_path, "db", "login", "pgd_test_cli_bounded", "--role", "scheduler",
               "--password-env", "PW", "--connection-limit", "2", PW=PASSWORD)
    assert out.returncode == 0, out.stderr
    bounded = login_url(db_url, "pgd_test_cli_bounded")
    with db.connect(bounded), db.connect(bounded):
        with pytest.raises(Exception, match="too many connections for role"):
            psycopg.connect(bounded).close()


@pytest.mark.own_database
def test_a_runner_host_cannot_hold_work_forever_nor_skip_a_release(world, db_url, logins):
    """A scheduler login calls its transitions with its own arguments: a heartbeat's lease is
    bounded as a claim's is, (0, 86400] (else the job would hold its slots and target past any
    operator's reach), and the complete it may call always releases the slots (the form
    that does not is internal)."""
    world.setup()
    world.apply({"runners": [{"login": logins["scheduler"], "pools": ["linux"]}]})
    job = world.job()["id"]
    with db.connect(login_url(db_url, logins["scheduler"])) as host:
        runner = transitions.register_runner(host, name="host", pools=["linux"], slots=1)
        claim = transitions.claim(host, runner_id=runner, pools=world.pool_ids(("linux",)),
                                  lease_seconds=30, claim_token=transitions.new_claim_token())
        assert claim.job_id == job
        for lease in ("3e9", "-1", "NaN", "0"):
            with pytest.raises(psycopg.Error, match="lease seconds must be in"):
                host.execute("SELECT * FROM pgd_heartbeat(%s, %s, %s::float8, NULL)",
                             (claim.attempt_id, claim.generation, lease))
        host.execute("SELECT * FROM pgd_heartbeat(%s, %s, 30, repeat('x', 1000000))",
                     (claim.attempt_id, claim.generation))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            host.execute("SELECT pgd_complete_attempt(%s, %s, 'succeeded', 0, NULL, NULL, 'k', 2, 300, false)",
                         (claim.attempt_id, claim.generation))
        with pytest.raises(psycopg.errors.UndefinedFunction):
            host.execute("SELECT pgd_complete(%s, %s, 'succeeded', 0, NULL, NULL, 'k', 2, 300, false)",
                         (claim.attempt_id, claim.generation))
    assert len(world.row("attempts", claim.attempt_id)["output_tail"]) == 65536
    assert world.row("jobs", job)["state"] == "running"


@pytest.mark.own_database
def test_pause_and_drain_act_as_the_authenticated_actor_and_a_viewer_may_not(world, db_url, logins):
    """The console's login names its user (an operator may, a viewer may not); a CLI login
    acts as itself; the audit log says who."""
    world.setup()
    _users(world.conn)
    runner = world.runner()
    with db.connect(login_url(db_url, logins["web"])) as web:
        with pytest.raises(Forbidden):
            transitions.pause_pool(web, pool="linux", reason="r", actor="view")
        with pytest.raises(Forbidden):
            transitions.drain_runner(web, runner_id=runner, reason="r", actor="view")
        transitions.pause_pool(web, pool="linux", reason="r", actor="op")
        transitions.drain_runner(web, runner_id=runner, reason="r", actor="op")
    with db.connect(login_url(db_url, logins["operator"])) as op:
        transitions.resume_pool(op, pool="linux", actor=None)
        transitions.resume_runner(op, runner_id=runner, actor=None)
    with db.connect(login_url(db_url, logins["reader"])) as reader:
        with pytest.raises(Forbidden):
            transitions.pause_pool(reader, pool="linux", reason="r", actor=None)
    events = [tuple(e.values()) for e in world.conn.execute(
        "SELECT actor, login, action FROM audit_events WHERE action IN "
        "('pause_pool', 'resume_pool', 'drain_runner', 'resume_runner') ORDER BY id")]
    assert events == [("op", logins["web"], "pause_pool"), ("op", logins["web"], "drain_runner"),
                      (logins["operator"], logins["operator"], "resume_pool"),
                      (logins["operator"], logins["operator"], "resume_runner")]
