"""The ``pgdispatch`` CLI as an operator runs it: real processes against a real database."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .support import CONFIG, run_pgdispatch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pgd(db_url, tmp_path):
    """Run ``pgdispatch ARGS`` against this test's database; returns the CompletedProcess."""

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = run_pgdispatch(db_url, tmp_path, *args)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    run("apply", str(cfg))
    run.config = cfg
    return run


def count(conn, table: str) -> int:
    return conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone()["n"]


def test_apply_is_idempotent(pgd, conn):
    out = pgd("apply", str(pgd.config), "--json")
    assert json.loads(out.stdout)["changed_rows"] == 0
    assert count(conn, "projects") == 1 and count(conn, "users") == 1


def test_submit_show_explain(pgd, conn):
    job = json.loads(pgd("submit", "--project", "web", "--pool", "linux", "--priority", "5",
                         "--", "echo", "hello world").stdout)
    assert job["id"] > 0 and job["state"] == "queued" and job["command"] == ["echo", "hello world"]
    shown = json.loads(pgd("jobs", "show", str(job["id"]), "--json").stdout)
    assert shown["priority"] == 5 and shown["attempts"] == []
    audit = conn.execute("SELECT actor, action FROM audit_events WHERE subject = %s",
                         (f"job:{job['id']}",)).fetchall()
    assert [(a["actor"], a["action"]) for a in audit] == [(conn.info.user, "submit_job")]
    explained = json.loads(pgd("jobs", "explain", str(job["id"]), "--json").stdout)
    assert explained["reason"] == "no_authorized_runner"
    assert "no live runner serves pool linux" in explained["reasons"][0]["message"]


def test_jobs_list_pages_the_newest_jobs_and_filters_by_state(pgd, conn):
    """Fresh-user run: there was no way to list jobs from the CLI."""
    ids = [json.loads(pgd("submit", "--project", "web", "--pool", "linux", "--", "echo", str(i)).stdout)["id"]
           for i in range(5)]
    pgd("jobs", "cancel", str(ids[1]), "--reason", "not needed")
    listed = pgd("jobs", "list", "--limit", "3")
    header, *lines = listed.stdout.splitlines()
    assert header.split() == ["ID", "STATE", "PROJECT", "POOL", "TARGET", "RUNNER", "AGE",
                              "RUNNING/TOOK", "COMMAND"]
    assert [int(line.split()[0]) for line in lines] == ids[:1:-1]
    assert lines[0].split()[:5] == [str(ids[4]), "queued", "acme/web", "linux", "-"]
    assert lines[0].split()[-2:] == ["echo", "4"]
    assert listed.stderr == f"more: --limit 3 --before {ids[2]}\n"
    older = json.loads(pgd("jobs", "list", "--limit", "3", "--before-id", str(ids[2]), "--json").stdout)
    assert [j["id"] for j in older["jobs"]] == [ids[1], ids[0]] and older["next"] is None
    cancelled = json.loads(pgd("jobs", "list", "--state", "cancelled", "--json").stdout)["jobs"]
    assert [(j["id"], j["state"]) for j in cancelled] == [(ids[1], "cancelled")]
    bad = pgd("jobs", "list", "--state", "paused", check=False)
    assert bad.returncode == 2 and "paused" in bad.stderr


def test_pause_resume_are_audited_and_conditional(pgd, conn):
    pgd("projects", "pause", "web", "--reason", "release freeze")
    again = pgd("projects", "pause", "web", "--reason", "x", check=False)
    assert again.returncode == 4 and f"already paused by {conn.info.user}" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    pgd("projects", "resume", "web")
    rows = conn.execute("SELECT actor, action, reason FROM audit_events WHERE subject = 'project:web' "
                        "ORDER BY id").fetchall()
    # the database login acts: the CLI has no actor flag or variable of its own
    assert [(r["actor"], r["action"]) for r in rows] == [(conn.info.user, "pause_project"),
                                                        (conn.info.user, "resume_project")]
    assert rows[0]["reason"] == "release freeze"


@pytest.mark.parametrize("args, code, message", [
    (["submit", "--project", "nope", "--pool", "linux", "--", "true"], 3, "unknown project nope"),
    (["submit", "--project", "web", "--pool", "linux", "--priority", "abc", "--", "true"], 2, "priority"),
    (["submit", "--project", "web", "--pool", "linux", "--max-attempts", "-1", "--", "true"], 2, "max attempts"),
    (["submit", "--project", "web", "--pool", "linux", "--timeout", "0", "--", "true"], 2, "timeout"),
    (["submit", "--project", "web", "--pool", "linux"], 2, "COMMAND"),
    (["submit", "--project", "web", "--pool", "linux", "--", ""], 2, "program name"),
    (["submit", "--project", "web", "--pool", "linux", "--idempotency-key", "k" * 300, "--", "true"], 2,
     "longer than 200"),
    (["submit", "--project", "web", "--pool", "linux", "--", "x" * 70000], 2, "longer than"),
    (["submit", "--project", "web", "--pool", "linux", "--depends-on", "424242", "--", "true"], 3,
     "unknown dependency"),
    (["submit", "--project", "web", "--pool", "nope", "--", "true"], 3, "unknown pool"),
    (["jobs", "show", "999"], 3, "unknown job 999"),
    (["jobs", "show", "abc"], 2, "not a valid integer"),
    (["targets", "resolve", "production", "--outcome", "succeeded", "--note", "ok"], 4, "nothing to resolve"),
    (["targets", "resolve", "production", "--outcome", "maybe", "--note", "ok"], 2, "outcome"),
    (["projects", "pause", "web", "--reason", "  "], 2, "reason is required"),
    (["scheduler", "--pool", "linux", "--slots", "0"], 2, "slots"),
    (["web", "--bind", "nonsense"], 2, "HOST:PORT"),
    (["web", "--bind", "::1:8000"], 2, "IPv6 host in brackets"),
    (["demo", "--bind", "[::1:8000"], 2, "IPv6 host in brackets"),
    (["web", "--bind", "127.0.0.1:\u00b2"], 2, "HOST:PORT"),
    (["web", "--bind", "127.0.0.1:\u0661\u0668"], 2, "HOST:PORT"),
])
def test_bad_input_is_one_line_nonzero_and_writes_nothing(pgd, conn, args, code, message):
    before = (count(conn, "jobs"), count(conn, "audit_events"))
    proc = pgd(*args, check=False)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert (count(conn, "jobs"), count(conn, "audit_events")) == before


def test_a_key_reused_for_another_command_exits_4_and_writes_nothing(pgd, conn):
    submit = ("submit", "--project", "web", "--pool", "linux", "--idempotency-key", "nightly-1", "--")
    first = json.loads(pgd(*submit, "make", "build").stdout)
    again = json.loads(pgd(*submit, "make", "build").stdout)  # the same request: the same job
    assert first["is_new"] and not again["is_new"] and again["id"] == first["id"]
    before = (count(conn, "jobs"), count(conn, "audit_events"))
    proc = pgd(*submit, "make", "deploy", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: idempotency key already used for job ")
    assert lines[0].endswith("by a request that differs in command")
    assert (count(conn, "jobs"), count(conn, "audit_events")) == before


def test_a_token_created_from_the_cli_is_audited_without_the_token(pgd, conn):
    """As from the console: a create_api_token event names the token's id and label, never
    the token (fresh-user run: tokens made with the CLI left no trace in the audit log)."""
    token = pgd("tokens", "create", "--user", "alice", "--name", "ci").stdout.strip()
    assert token.startswith("pgd_")
    events = conn.execute("SELECT actor, action, subject, details::text AS details FROM audit_events "
                          "WHERE action = 'create_api_token'").fetchall()
    stored = conn.execute("SELECT id, name FROM api_tokens").fetchall()
    assert [e["actor"] for e in events] == [conn.info.user] and events[0]["subject"] == "user:alice"
    assert json.loads(events[0]["details"]) == {"token_id": stored[0]["id"], "name": "ci",
                                                "expires_at": None}
    assert token not in events[0]["details"]
    before = (count(conn, "api_tokens"), count(conn, "audit_events"))
    proc = pgd("tokens", "create", "--user", "mallory", check=False)
    assert proc.returncode == 3 and proc.stderr.strip() == "error: unknown user mallory"
    assert (count(conn, "api_tokens"), count(conn, "audit_events")) == before


@pytest.mark.parametrize("command", ["web", "demo"])
def test_an_address_in_use_is_one_line_before_anything_starts(pgd, command):
    """Another process listens on the port: one line and exit 4, instead of gunicorn's ten
    retries over five seconds (fresh-user run)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = pgd(command, "--bind", f"127.0.0.1:{port}", check=False)
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_apply_rejects_bad_file_and_writes_nothing(pgd, conn, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[pools]]\nname = "gpu"\nslots = -3\n')
    proc = pgd("apply", str(bad), check=False)
    assert proc.returncode == 2 and "slots" in proc.stderr
    assert count(conn, "pools") == 2
    missing = pgd("apply", str(tmp_path / "missing.toml"), check=False)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_command_outside_the_checkout_says_it_creates_a_new_database():
    """No DATABASE_URL and no ./.pgdispatch: the CLI starts a new embedded server there (as
    documented) and says so on stderr, once; the next command finds it and says nothing."""
    where = Path(tempfile.mkdtemp(prefix="pgd-cli-elsewhere-", dir="/tmp"))
    where.chmod(0o755)  # the embedded server runs as its own user when we are root
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "PGDISPATCH_DATA_DIR")}
    env["PYTHONPATH"] = str(ROOT)
    try:
        # a command that fails before it needs the database creates none (adversarial run)
        missing = subprocess.run([sys.executable, "-m", "pgdispatch", "apply", "/nonexistent.toml"],
                                 env=env, capture_output=True, text=True, timeout=60, cwd=where)
        assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
            "error: cannot read /nonexistent.toml: No such file or directory"]
        assert not (where / ".pgdispatch").exists()
        runs = [subprocess.run([sys.executable, "-m", "pgdispatch", "jobs", "show", "1"], env=env,
                               capture_output=True, text=True, timeout=120, cwd=where)
                for _ in range(2)]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    first, second = (r.stderr.strip().splitlines() for r in runs)
    assert [r.returncode for r in runs] == [3, 3], runs
    assert first == [f"note: no DATABASE_URL and no database in {where / '.pgdispatch'}: "
                     "creating a new, empty one there", "error: unknown job 1"]
    assert second == ["error: unknown job 1"]


def test_unmigrated_database_says_so(server_url, tmp_path):
    from tests.conftest import MIGRATIONS, with_database
    from pgdispatch.sql import db

    name = f"pgd_test_empty_{os.getpid()}"
    with db.connect(server_url) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name}")
        c.execute(f"CREATE DATABASE {name}")
    try:
        env = {**os.environ, "DATABASE_URL": with_database(server_url, name)}
        proc = subprocess.run([sys.executable, "-m", "pgdispatch", "jobs", "show", "1"], env=env,
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and "pgdispatch db upgrade" in proc.stderr
        up = subprocess.run([sys.executable, "-m", "pgdispatch", "db", "upgrade", "--json"], env=env,
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert up.returncode == 0 and json.loads(up.stdout)["applied"] == MIGRATIONS
    finally:
        with db.connect(server_url) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_scheduler_refuses_to_start_where_claims_cannot_run(pgd, conn, db_url):
    """With REPEATABLE READ as the database's default, claims and their recovery refuse
    (sql/functions/claim.sql); the scheduler says so in one line and exits 6 instead of
    running on without claiming anything (found by an adversarial run)."""
    name = conn.execute("SELECT current_database() AS d").fetchone()["d"]
    conn.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")
    proc = pgd("scheduler", "--pool", "linux", "--slots", "1", "--no-listen", check=False)
    assert proc.returncode == 6, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("error: this session's transactions run in REPEATABLE READ; "
                                "claims need READ COMMITTED"), lines
    assert count(conn, "runners") == 0
