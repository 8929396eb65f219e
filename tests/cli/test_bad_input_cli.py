"""Bad input to the ``pgdispatch`` command line, as an operator might type it or a script
might pass it: each is one line on stderr, exit 2, no traceback, and nothing changed.

Every run is a real process (tests/cli/support.py). NUL bytes cannot be passed on a
command line at all (the kernel's argv is NUL-terminated), so they are tried in files only.
"""

from __future__ import annotations

import pytest

from pgdispatch.sql import transitions
from pgdispatch.sql.config import apply_config

from .support import ALICE_PASSWORD, CONFIG, run_pgdispatch

HUGE = str(2**64)
LONG = "x" * 100_000  # under Linux's 128 KiB bound for one argument
NOT_UTF8 = "caf\udce9"  # the byte 0xE9 alone: Latin-1 "café", passed through as bytes


def state(conn) -> tuple:
    """What a command could change (test-only reads)."""
    return tuple(
        [tuple(r.values()) for r in conn.execute(query)]
        for query in ("SELECT count(*) FROM audit_events",
                      "SELECT id, state, priority, approved_at FROM jobs ORDER BY id",
                      "SELECT name, paused_at, weight, max_running FROM projects ORDER BY id",
                      "SELECT name, slots, paused_at FROM pools ORDER BY id",
                      "SELECT id, drain_requested_at FROM runners ORDER BY id",
                      "SELECT name, max_running FROM organizations ORDER BY id",
                      "SELECT name, state FROM targets ORDER BY id",
                      "SELECT username, role, password_hash FROM users ORDER BY id",
                      "SELECT count(*) FROM api_tokens"))


@pytest.fixture
def pgd(db_url, tmp_path, conn):
    """``pgd(*args)`` runs pgdispatch on a database with CONFIG applied and one job (id 1)."""
    def run(*args: str):
        return run_pgdispatch(db_url, tmp_path, *args)

    # set up in this process (the commands under test run as processes; a setup by two more
    # CLI processes per case cost the suite minutes)
    apply_config(conn, CONFIG, env={"ALICE_PASSWORD": ALICE_PASSWORD})
    transitions.submit(conn, project="web", pool="linux", command=["make"])
    run.tmp = tmp_path
    return run


def assert_one_line_exit_2(proc, fragment: str = "", code: int = 2) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(lines[0]) < 500, lines[0][:500]
    assert fragment in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout[:300]


COMMANDS = [
    # submit
    (["submit", "--project", "web", "--pool", "linux", "--priority", "abc", "--", "x"], "priority"),
    (["submit", "--project", "web", "--pool", "linux", "--priority", HUGE, "--", "x"], "priority"),
    (["submit", "--project", "web", "--pool", "linux", "--priority", "-5000", "--", "x"], "priority"),
    (["submit", "--project", "web", "--pool", "linux", "--priority", "9" * 5000, "--", "x"], "priority"),
    (["submit", "--project", "web", "--pool", "linux", "--max-attempts", "0", "--", "x"], "attempts"),
    (["submit", "--project", "web", "--pool", "linux", "--timeout", "-1", "--", "x"], "timeout"),
    (["submit", "--project", "web", "--pool", "linux", "--delay", "nan", "--", "x"], "delay"),
    (["submit", "--project", "web", "--pool", "linux", "--delay", "inf", "--", "x"], "delay"),
    (["submit", "--project", "web", "--pool", "linux", "--delay", "1e400", "--", "x"], "delay"),
    (["submit", "--project", "web", "--pool", "linux", "--delay", "-1", "--", "x"], "delay"),
    (["submit", "--project", "web", "--pool", "linux", "--depends-on", "0", "--", "x"], "depend"),
    (["submit", "--project", "web", "--pool", "linux", "--depends-on", HUGE, "--", "x"], "depend"),
    (["submit", "--project", LONG, "--pool", "linux", "--", "x"], "project"),
    (["submit", "--project", NOT_UTF8, "--pool", "linux", "--", "x"], "UTF-8"),
    (["submit", "--project", "web", "--pool", NOT_UTF8, "--", "x"], "UTF-8"),
    (["submit", "--project", "web", "--pool", "linux", "--", NOT_UTF8], "UTF-8"),
    (["submit", "--project", "web", "--pool", "linux", "--", "x", LONG], "longer than"),
    (["submit", "--project", "web", "--pool", "linux", "--", " "], "program"),
    (["submit", "--project", "web", "--pool", "linux", "--target", LONG, "--", "x"], "target"),
    (["submit", "--project", "web", "--pool", "linux", "--idempotency-key", "k" * 201, "--", "x"], "idempotency"),
    (["submit", "--project", "web", "--pool", "linux", "--idempotency-key", NOT_UTF8, "--", "x"], "UTF-8"),
    (["submit", "--project", "web", "--pool", "linux"], "COMMAND"),
    # jobs
    (["jobs", "show", "abc"], "JOB_ID"),
    (["jobs", "show", "9" * 5000], "JOB_ID"),
    (["jobs", "show", "-1"], ""),
    (["jobs", "show", HUGE], "unknown job"),  # 3, as the API's 404: no such job can exist
    (["jobs", "explain", HUGE], "unknown job"),
    (["jobs", "list", "--limit", "0"], "limit"),
    (["jobs", "list", "--limit", HUGE], "limit"),
    (["jobs", "list", "--before-id", "0"], "before-id"),
    (["jobs", "list", "--before-id", HUGE], "before"),
    (["jobs", "list", "--state", "lost"], "state"),
    (["jobs", "search", "ab"], "too short"),
    (["jobs", "search", LONG], "longer than 200"),
    (["jobs", "search", NOT_UTF8], "UTF-8"),
    (["jobs", "search", "make", "--project", LONG], "project"),
    (["jobs", "search", "make", "--submitter", LONG], "submitter"),
    (["jobs", "search", "make", "--submitter", NOT_UTF8], "UTF-8"),
    (["jobs", "search", "make", "--before", HUGE], "before"),
    (["jobs", "search", "make", "--limit", "501"], "limit"),
    (["jobs", "search", "#" + HUGE], "job id must be between 1 and"),
    (["jobs", "search", "#0"], "job id must be between 1 and"),
    (["jobs", "cancel", HUGE], "job id must be between 1 and"),
    (["jobs", "approve", "1", "--reason", LONG], "reason"),
    (["jobs", "cancel", "1", "--reason", NOT_UTF8], "UTF-8"),
    (["jobs", "retry", "-5"], ""),
    # bulk actions and priorities: refused before anything is written (job 1 is queued)
    (["jobs", "bulk", "delete"], "delete"),
    (["jobs", "bulk", "reprioritize", "--yes"], "needs a priority"),
    (["jobs", "bulk", "reprioritize", "--priority", "5000", "--yes"], "priority"),
    (["jobs", "bulk", "cancel", "--priority", "5", "--yes"], "only reprioritize"),
    (["jobs", "bulk", "cancel", "--reason-code", "bored", "--yes"], "unknown reason"),
    (["jobs", "bulk", "cancel", "--project", "nope", "--yes"], "unknown project"),
    (["jobs", "bulk", "cancel", "--project", LONG, "--yes"], "project"),
    (["jobs", "bulk", "cancel", "--older-than", "nan", "--yes"], "older"),
    (["jobs", "bulk", "cancel", "--runner", HUGE, "--yes"], "runner"),
    (["jobs", "bulk", "cancel", "--reason", LONG, "--yes"], "reason"),
    (["jobs", "bulk", "cancel", "--reason", NOT_UTF8, "--yes"], "UTF-8"),
    (["jobs", "bulk", "cancel", "--project", NOT_UTF8], "UTF-8"),
    (["jobs", "bulk", "retry", "--pool", NOT_UTF8, "--yes"], "UTF-8"),
    (["jobs", "bulk", "cancel", "--target", NOT_UTF8], "UTF-8"),
    (["jobs", "list", "--project", NOT_UTF8], "UTF-8"),
    (["jobs", "list", "--target", NOT_UTF8], "UTF-8"),
    (["jobs", "set-priority", "1"], "priority"),
    (["jobs", "set-priority", "1", "--priority", "1001"], "priority"),
    (["jobs", "set-priority", "1", "--priority", "x"], "priority"),
    (["jobs", "set-priority", "1", "--priority", "3", "--reason", NOT_UTF8], "UTF-8"),
    # projects, targets, tokens
    (["projects", "pause", "web", "--reason", ""], "reason"),
    (["projects", "pause", "web", "--reason", "   "], "reason"),
    (["projects", "pause", "web", "--reason", LONG], "reason"),
    (["projects", "pause", "web", "--reason", NOT_UTF8], "UTF-8"),
    (["projects", "pause", NOT_UTF8, "--reason", "freeze"], "UTF-8"),
    (["projects", "pause", LONG, "--reason", "freeze"], "project"),
    (["projects", "resume", "web", "--reason", NOT_UTF8], "UTF-8"),
    (["pools", "pause", "linux", "--reason", ""], "reason"),
    (["pools", "pause", "linux", "--reason", "   "], "reason"),
    (["pools", "pause", "linux", "--reason", LONG], "reason"),
    (["pools", "pause", "linux", "--reason", NOT_UTF8], "UTF-8"),
    (["pools", "pause", NOT_UTF8, "--reason", "x"], "UTF-8"),
    (["pools", "pause", LONG, "--reason", "x"], "pool"),
    (["pools", "pause", "linux"], "reason"),
    (["pools", "resume", "linux", "--reason", NOT_UTF8], "UTF-8"),
    (["runners", "drain", "1", "--reason", ""], "reason"),
    (["runners", "drain", "1", "--reason", NOT_UTF8], "UTF-8"),
    (["runners", "drain", "1"], "reason"),
    (["runners", "drain", "1", "--reason", "x", "--deadline", "-1"], "deadline"),
    (["runners", "drain", "1", "--reason", "x", "--deadline", "604801"], "deadline"),
    (["runners", "drain", "1", "--reason", "x", "--deadline", "1.5"], "deadline"),
    (["runners", "drain", "1", "--reason", "x", "--deadline", HUGE], "deadline"),
    (["runners", "drain", "abc", "--reason", "x"], "RUNNER_ID"),
    (["runners", "drain", HUGE, "--reason", "x"], "RUNNER_ID"),
    (["runners", "resume", "0"], "RUNNER_ID"),
    (["targets", "resolve", "production", "--outcome", "maybe", "--note", "x"], "outcome"),
    (["targets", "resolve", "production", "--outcome", "retry", "--note", ""], "note"),
    (["targets", "resolve", NOT_UTF8, "--outcome", "retry", "--note", "x"], "UTF-8"),
    (["tokens", "create", "--user", NOT_UTF8], "UTF-8"),
    (["tokens", "create", "--user", LONG], "user"),
    (["tokens", "create", "--user", "alice", "--name", LONG], "name"),
    (["tokens", "create", "--user", "alice", "--name", NOT_UTF8], "UTF-8"),
    # processes: refused before they start
    (["web", "--workers", "0"], "workers"),
    (["web", "--bind", "nowhere"], "bind"),
    (["web", "--bind", "127.0.0.1:" + HUGE], "bind"),
    (["web", "--bind", NOT_UTF8 + ":80"], "bind"),
    (["scheduler", "--pool", "linux", "--slots", "0"], "slots"),
    (["scheduler", "--pool", "linux", "--slots", "1", "--max-batch", HUGE], "max-batch"),
    (["scheduler", "--pool", "linux", "--slots", "1", "--grace-seconds", "nan"], "grace"),
    (["demo", "--duration", "-1"], "duration"),
    (["demo", "--duration", "nan"], "duration"),
    (["demo", "--duration", "inf"], "duration"),
    (["scheduler", "--pool", "linux", "--slots", "1", "--grace-seconds", "inf"], "grace"),
    (["jobs", "frobnicate"], "frobnicate"),
]


@pytest.mark.parametrize("args, fragment", COMMANDS,
                         ids=[" ".join(a)[:40].encode("ascii", "replace").decode() for a, _ in COMMANDS])
def test_a_bad_argument_is_one_line_and_exit_2(pgd, conn, args, fragment):
    before = state(conn)
    assert_one_line_exit_2(pgd(*args), fragment, 3 if fragment == "unknown job" else 2)
    assert state(conn) == before


NESTED_ARRAY = "x = " + "[" * 100_000 + "]" * 100_000
NESTED_TABLE = "x = " + "{a = " * 5_000 + "1" + "}" * 5_000
POOL = '[[pools]]\nname = "linux"\n'
PROJECT = '[[projects]]\nname = "web"\norganization = "acme"\n'

TOML = [
    (NESTED_ARRAY, "nested too deeply"),
    (NESTED_TABLE, "nested too deeply"),
    ('[[pools]]\nname = "linux"\nslots = ' + "[" * 3000 + "]" * 3000, "nested too deeply"),
    (POOL + 'slots = "8"', 'slots must be a whole number, got "8"'),
    (POOL + "slots = 8.5", "slots must be a whole number"),
    (POOL + "slots = true", "slots must be a whole number, got true"),
    (POOL + "slots = 1979-05-27", "slots must be a whole number"),
    (POOL + "slots = [8]", "slots must be a whole number"),
    (POOL + "slots = 99999999999999999999999", "between 0 and 100000"),
    (POOL + "slots = " + "9" * 5000, "not valid TOML"),
    (POOL + "slots = -1", "between 0 and 100000"),
    (POOL + "slots = inf", "slots must be a whole number"),
    (POOL + "slots = nan", "slots must be a whole number"),
    (POOL + "slots = 8\ncolour = 1", "unknown key 'colour'"),
    ('pools = { name = "linux", slots = 8 }', "[[pools]] must be an array of tables"),
    ('pools = ["linux"]', "[[pools]] must be an array of tables"),
    ('[pools]\nname = "linux"\nslots = 8', "[[pools]] must be an array of tables"),
    ("[[runnerz]]\nname = 'x'", "unknown section 'runnerz'"),
    (PROJECT + 'pools = "linux"', "pools must be a list"),
    (PROJECT + "pools = [{ name = 'linux' }]", "pool must be text"),
    (PROJECT + "weight = 0", "weight must be between 1 and 1000"),
    (PROJECT + "weight = '2'", "weight must be a whole number"),
    (PROJECT + "max_running = 1e400", "max_running must be a whole number"),
    (PROJECT + "name = 'again'", "not valid TOML"),
    ('[[projects]]\nname = 7\norganization = "acme"', "name must be a string"),
    ('[[projects]]\nname = "web"\norganization = ["acme"]', "organization must be a string"),
    ('[[projects]]\nname = "' + "w" * 100_000 + '"\norganization = "acme"', "is not allowed"),
    ('[[targets]]\nname = "prod\\u0000"', "is not allowed"),
    ('[[targets]]\nname = "prod\x00"', "not valid TOML"),
    ("[[users]]\nusername = 'bob'\nrole = ['admin']\npassword_env = 'ALICE_PASSWORD'", "role must be a string"),
    ("[[users]]\nusername = 'bob'\nrole = 'root'\npassword_env = 'ALICE_PASSWORD'", "role must be one of"),
    ("[[users]]\nusername = 'bob'\nrole = 'admin'\npassword_env = 7", "password_env must be a string"),
    ('[[organizations]]\nname = "acme"\nmax_running = 5\n' * 2, "declared twice"),
]


@pytest.mark.parametrize("text, fragment", TOML, ids=[t[:30] + "…" + t[-12:] if len(t) > 50 else t
                                                      for t, _ in TOML])
def test_a_bad_apply_file_is_one_line_and_exit_2(pgd, conn, text, fragment):
    before = state(conn)
    path = pgd.tmp / "bad.toml"
    path.write_text(text)
    assert_one_line_exit_2(pgd("apply", str(path)), fragment)
    assert state(conn) == before


@pytest.mark.parametrize("content, fragment", [
    (b'[[targets]]\nname = "caf\xe9"\n', "not UTF-8"),
    (b"\xff\xfe[\x00", "not UTF-8"),
    (b"\x00" * 100, "not valid TOML"),
])
def test_an_apply_file_that_is_not_text_is_one_line_and_exit_2(pgd, conn, content, fragment):
    before = state(conn)
    path = pgd.tmp / "bad.toml"
    path.write_bytes(content)
    assert_one_line_exit_2(pgd("apply", str(path)), fragment)
    assert state(conn) == before


def test_an_apply_file_that_never_ends_is_refused(pgd, conn):
    """/dev/zero was read whole (it is endless): now at most 16 MiB are read."""
    before = state(conn)
    assert_one_line_exit_2(pgd("apply", "/dev/zero"), "larger than 16 MiB")
    assert state(conn) == before
