"""When the database is unreachable or the pooler in front of it misbehaves, the console and
the API answer 503 with a one-line message (never a 500, never a traceback), and the CLI
exits 5 with one line (issue 16, item 2: "/healthz and pages answer 503 with a clear message,
never 500"; sql/errors.py, translate).

Every case is real: a PgBouncer of the test's own (conftest.py) that cannot reach its server,
that is out of client connections, whose only server connection is taken, that is PAUSEd,
that is killed while a request waits on it; and a PostgreSQL server of the test's own,
stopped. The errors the server itself sends (57P01, 57014, 25P03, 26000, 42P05, 25006) are
provoked on a real server and translated; genuine bugs stay what they are (a 500)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from pgdispatch.sql import DatabaseUnavailable, accounts, db, errors, migrate, transitions
from pgdispatch.sql.errors import translate
from pgdispatch.webapp import create_app, shutdown

from ..webapp.conftest import PASSWORDS, TEST_SETTINGS, login
from ..webapp.support import ensure_account

# A pooler gives up on a query after this long (seconds), and the console on a connection
# after DB_POOL_TIMEOUT: both short, so that every case answers within a second or two.
QUERY_WAIT_TIMEOUT = 1
DB_POOL_TIMEOUT = 0.5


class Console:
    """The real app on ``url``: a signed-in client (signed in through ``sign_in_url``, the
    database directly, when ``url`` may already be broken) and a bearer token."""

    def __init__(self, url: str, *, sign_in_url: str | None = None):
        self.app = create_app(TEST_SETTINGS, database_url=url, TESTING=True,
                              DB_POOL_TIMEOUT_SECONDS=DB_POOL_TIMEOUT)
        with db.connect(sign_in_url or url) as conn:
            ensure_account(conn, "alice", PASSWORDS["alice"], "operator")
            self.token = accounts.create_api_token(conn, username="alice", name="outage")
        self.client = self.app.test_client()
        if sign_in_url is None:
            assert login(self.client, "alice").status_code == 303
        else:
            helper = create_app(TEST_SETTINGS, database_url=sign_in_url, TESTING=True)
            try:
                signer = helper.test_client()
                assert login(signer, "alice").status_code == 303
                cookie = signer.get_cookie("pgdispatch_session")
                self.client.set_cookie("pgdispatch_session", cookie.value)
            finally:
                shutdown(helper)

    def get(self, path: str, headers: dict | None = None):
        headers = dict(headers or {})
        if path.startswith("/api/"):
            headers["Authorization"] = f"Bearer {self.token}"
        return self.client.get(path, headers=headers)

    def close(self) -> None:
        shutdown(self.app)


@pytest.fixture
def consoles():
    made: list[Console] = []

    def make(url: str, **kwargs) -> Console:
        made.append(Console(url, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


def unavailable(response) -> str:
    """The one-line message of a 503 answer, after checking it is one."""
    body = response.get_data(as_text=True)
    assert response.status_code == 503, (response.status_code, body[:500])
    assert "Traceback" not in body and "psycopg" not in body, body[:500]
    if response.is_json:
        payload = response.get_json()
        message = payload["error"]
    else:
        message = body
    assert "database" in message, message
    return message


def assert_console_unavailable(console: Console) -> list[str]:
    """/healthz, a page (and its htmx poll) and an API call each answer 503 with a clear
    message; returns them."""
    health = console.get("/healthz")
    messages = [unavailable(health)]
    assert health.get_json()["status"] == "unavailable"
    page = console.get("/")
    messages.append(unavailable(page))
    poll = console.get("/", headers={"HX-Request": "true"})  # the overview's htmx polling
    assert "database" in unavailable(poll) and poll.headers["HX-Reswap"] == "none"
    api = console.get("/api/v1/jobs/1")
    assert api.is_json
    messages.append(unavailable(api))
    for m in messages:
        assert "\n" not in m.strip(), m
    return messages


def assert_console_ok(console: Console) -> None:
    # the pool reconnects in the background after an outage, with its own backoff
    wait_until(lambda: console.get("/healthz").status_code == 200, 20)
    assert console.get("/").status_code == 200
    assert console.get("/api/v1/jobs/1").status_code == 404  # no such job: the database answered


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATABASE_URL": url}
    return subprocess.run([sys.executable, "-m", "pgdispatch", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def assert_cli_unavailable(url: str) -> str:
    proc = cli(url, "jobs", "show", "1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 5, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: database unavailable"), proc.stderr
    return lines[0]


# --- PgBouncer misbehaving ---------------------------------------------------------------------

def test_a_pooler_that_cannot_reach_its_server(db_url, make_bouncer, consoles):
    bouncer = make_bouncer(nowhere=True, server_login_retry=1, query_wait_timeout=QUERY_WAIT_TIMEOUT)
    console = consoles(bouncer.url(db_url), sign_in_url=db_url)
    assert_console_unavailable(console)
    assert "query_wait_timeout" in assert_cli_unavailable(bouncer.url(db_url))


def test_a_pooler_out_of_client_connections(db_url, make_bouncer, consoles):
    bouncer = make_bouncer(max_client_conn=2)
    url = bouncer.url(db_url)
    held = [psycopg.connect(url) for _ in range(2)]
    try:
        console = consoles(url, sign_in_url=db_url)
        assert_console_unavailable(console)
        assert "no more connections allowed" in assert_cli_unavailable(url)
    finally:
        for c in held:
            c.close()
    assert_console_ok(console)


def test_a_pooler_whose_only_server_connection_is_taken(db_url, make_bouncer, consoles):
    bouncer = make_bouncer(default_pool_size=1, query_wait_timeout=QUERY_WAIT_TIMEOUT)
    url = bouncer.url(db_url)
    holder = psycopg.connect(url)
    holder.execute("SELECT 1")  # a transaction left open holds the server connection
    try:
        console = consoles(url, sign_in_url=db_url)
        assert_console_unavailable(console)
    finally:
        holder.close()
    assert_console_ok(console)  # and the console recovers once the pooler does


def test_a_paused_pooler(db_url, make_bouncer, consoles):
    bouncer = make_bouncer(query_wait_timeout=QUERY_WAIT_TIMEOUT)
    url = bouncer.url(db_url)
    console = consoles(url)
    assert_console_ok(console)
    bouncer.admin("PAUSE")
    try:
        assert any("query_wait_timeout" in m or "did not answer in time" in m
                   for m in assert_console_unavailable(console))
        assert "query_wait_timeout" in assert_cli_unavailable(url)
    finally:
        bouncer.admin("RESUME")
    assert_console_ok(console)


def test_a_pooler_killed_while_a_request_waits_on_it(db_url, world, make_bouncer, consoles):
    world.setup()
    bouncer = make_bouncer()
    url = bouncer.url(db_url)
    console = consoles(url)
    assert_console_ok(console)
    answers = []
    with db.connect(db_url) as blocker, blocker.transaction():
        # the submit waits for this row lock (its job row's key-share on the project)
        blocker.execute("SELECT 1 FROM projects WHERE name = 'web' FOR UPDATE")
        post = threading.Thread(target=lambda: answers.append(console.client.post(
            "/api/v1/jobs", headers={"Authorization": f"Bearer {console.token}"},
            json={"project": "web", "pool": "linux", "command": ["true"]})))
        post.start()
        wait_for_lock_wait(world.conn)
        bouncer.kill()
        post.join(30)
    assert not post.is_alive()
    message = unavailable(answers[0])
    assert "server closed the connection" in message or "database unavailable" in message
    assert_console_unavailable(console)
    assert_cli_unavailable(url)
    # the submit's transaction never committed: its server session ends with the pooler's
    wait_until(lambda: world.conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'").fetchone()["n"] == 0)
    assert world.conn.execute("SELECT count(*) AS n FROM jobs").fetchone()["n"] == 0


def wait_for_lock_wait(conn, timeout_s: float = 10.0) -> None:
    wait_until(lambda: conn.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'").fetchone()["n"] > 0, timeout_s)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- the server stopped ------------------------------------------------------------------------

def test_the_server_stopped(own_server, make_bouncer, consoles):
    url = own_server.create_database("pgd_outage")
    migrate.upgrade(url)
    with db.connect(url) as conn:
        config_world(conn)
    direct = consoles(url)
    bouncer = make_bouncer(upstream_url=url, server_login_retry=1,
                           query_wait_timeout=QUERY_WAIT_TIMEOUT)
    pooled = consoles(bouncer.url(url))
    for console in (direct, pooled):
        assert_console_ok(console)

    # a request in flight when the server stops: terminated (57P01), answered 503
    answers = []
    blocker = db.connect(url)
    blocker.execute("BEGIN")
    blocker.execute("SELECT 1 FROM projects WHERE name = 'web' FOR UPDATE")
    post = threading.Thread(target=lambda: answers.append(direct.client.post(
        "/api/v1/jobs", headers={"Authorization": f"Bearer {direct.token}"},
        json={"project": "web", "pool": "linux", "command": ["true"]})))
    post.start()
    with db.connect(url) as watcher:
        wait_for_lock_wait(watcher)
    own_server.stop("fast")
    post.join(30)
    blocker.close()
    assert "57P01" in unavailable(answers[0])

    assert_console_unavailable(direct)
    unavailable(pooled.get("/healthz"))  # the rest as for a pooler that cannot reach its server
    assert_cli_unavailable(url)
    assert_cli_unavailable(bouncer.url(url))
    own_server.start()
    assert_console_ok(direct)


def config_world(conn) -> None:
    from ..factories import World

    World(conn).setup()


# --- what the server sends, translated ---------------------------------------------------------

def raised(fn) -> BaseException:
    try:
        fn()
    except psycopg.Error as exc:
        return exc
    raise AssertionError("no error")


def terminated(url):
    with db.connect(url) as victim, db.connect(url) as killer:
        pid = victim.info.backend_pid
        threading.Timer(0.3, lambda: killer.execute("SELECT pg_terminate_backend(%s)", (pid,))).start()
        return raised(lambda: victim.execute("SELECT pg_sleep(5)"))


def set_up_then(setup: str, statement: str):
    """Provoke an error: on one connection, ``setup``, then ``statement``, which fails."""
    def provoke(url):
        with db.connect(url) as conn:
            conn.execute(setup)
            return raised(lambda: conn.execute(statement))
    return provoke


def idle_in_transaction(url):
    with db.connect(url) as conn:
        conn.execute("SET idle_in_transaction_session_timeout = '100ms'")
        conn.execute("BEGIN")
        conn.execute("SELECT 1")
        time.sleep(0.4)
        return raised(lambda: conn.execute("SELECT 1"))


def unknown_statement(url):
    with db.connect(url) as conn:
        return raised(lambda: conn.execute("EXECUTE pgd_never_prepared"))


SERVER_ERRORS = {
    "57P01": terminated,
    "57014": set_up_then("SET statement_timeout = '50ms'", "SELECT pg_sleep(1)"),
    "25P03": idle_in_transaction,
    "26000": unknown_statement,
    "42P05": set_up_then("PREPARE pgd_twice AS SELECT 1", "PREPARE pgd_twice AS SELECT 1"),
    # as a standby answers
    "25006": set_up_then("SET default_transaction_read_only = on", "CREATE TABLE pgd_never (x int)"),
}


@pytest.mark.parametrize("state", SERVER_ERRORS)
def test_what_the_server_sends_when_it_cannot_serve_is_unavailable(db_url, state):
    exc = SERVER_ERRORS[state](db_url)
    assert exc.sqlstate == state
    ours = translate(exc)
    assert isinstance(ours, DatabaseUnavailable) and ours.http_status == 503
    assert str(ours).startswith("database unavailable: ") and f"(SQLSTATE {state})" in str(ours)


@pytest.mark.parametrize("state", ["26000", "42P05", "25P03", "25006"])
def test_without_its_entry_such_an_error_would_be_a_500(db_url, state, monkeypatch):
    """The check above can fail: without its entry in UNAVAILABLE_STATES, each of these
    (which psycopg does not call operational) passes through untranslated: a 500."""
    exc = SERVER_ERRORS[state](db_url)
    monkeypatch.delitem(errors.UNAVAILABLE_STATES, state)
    assert translate(exc) is exc


@pytest.mark.parametrize("sql", ["SELECT pgd_no_such_function()", "SELEKT 1",
                                 "SELECT 1 / 0", "SELECT no_such_column FROM jobs"])
def test_a_genuine_bug_is_not_unavailable(conn, sql):
    exc = raised(lambda: conn.execute(sql))
    assert not isinstance(translate(exc), DatabaseUnavailable)


def test_prepared_statements_mixed_up_by_a_pooler_are_unavailable(db_url, world, make_bouncer):
    """Clients that prepare (psycopg's threshold 0; pgdispatch never does: sql/db.py) share
    one server connection through PgBouncer: what they meet is DatabaseUnavailable, which the
    scheduler retries on a fresh connection and the console answers with a 503."""
    world.setup()
    bouncer = make_bouncer(default_pool_size=1)
    url = bouncer.url(db_url)
    met, conns = [], []
    try:
        for _ in range(2):
            try:
                conns.append(db.connect(url, prepare_threshold=0))
            except Exception as exc:  # noqa: BLE001 - the connection's own set-up statement
                met.append(exc)
        for _ in range(4):
            for conn in conns:
                for call in (lambda: transitions.submit(conn, project="web", pool="linux",
                                                        command=["true"]),
                             lambda: db.ping_database(conn)):
                    try:
                        call()
                    except Exception as exc:  # noqa: BLE001 - every kind is asserted below
                        met.append(exc)
    finally:
        for conn in conns:
            conn.close()
    assert met, "the clients never tripped over each other's statements"
    assert all(isinstance(e, DatabaseUnavailable) for e in met), [repr(e) for e in met]
    assert any("prepared statement" in str(e) for e in met), [str(e) for e in met]
    assert all("\n" not in str(e) for e in met)


def test_healthz_answers_within_seconds_while_the_pooler_holds_every_query(db_url, make_bouncer,
                                                                           consoles):
    """A PAUSEd PgBouncer with its default query_wait_timeout (two minutes) answers nothing:
    /healthz still answers 503 within seconds (the pool's check and the ping are bounded by
    sql/db.py's CHECK_DEADLINE_SECONDS), where a load balancer's probe is still waiting
    (found by an adversarial run: 32 s, one whole statement deadline)."""
    bouncer = make_bouncer()
    console = consoles(bouncer.url(db_url))
    assert_console_ok(console)
    bouncer.admin("PAUSE")
    try:
        began = time.monotonic()
        health = console.get("/healthz")
        waited = time.monotonic() - began
        assert health.status_code == 503, health.get_data(as_text=True)[:300]
        # not a speed claim: the bound tells "answered" (5 s, and the cancel's grace) from
        # "waited out the statement deadline" (30 s)
        assert db.CHECK_DEADLINE_SECONDS < 15 < db.STATEMENT_DEADLINE_SECONDS
        assert waited < 15, waited
    finally:
        bouncer.admin("RESUME")
    assert_console_ok(console)
