"""Every ``pgdispatch`` command that talks to the database, as an operator runs it, with
DATABASE_URL through PgBouncer in transaction pooling (one server connection, so that each
command's session follows the last one's on it): apply, submit, jobs list / show / explain /
approve / cancel / retry, projects pause / resume, expire, targets resolve, tokens create,
db upgrade. Each exits 0 and did what it says. With PGDISPATCH_PREPARE_THRESHOLD=0 the second
command already fails; a bad value of it, and a bad ``--listen-url``, are refused in one line.
"""

from __future__ import annotations

import json

from ..cli.support import CONFIG, run_pgdispatch


def test_every_database_command_works_through_the_pooler(world, db_url, pgbouncer_url, tmp_path):
    pooled = pgbouncer_url(db_url)
    (tmp_path / "config.toml").write_text(CONFIG)

    def ok(*args: str) -> str:
        proc = run_pgdispatch(pooled, tmp_path, *args)
        assert (proc.returncode, proc.stderr) == (0, ""), (args, proc.stderr)
        return proc.stdout

    assert "changed_rows" in ok("apply", "config.toml", "--json")
    job = json.loads(ok("submit", "--project", "web", "--pool", "linux", "--requires-approval",
                        "--", "make", "build"))
    assert job["state"] == "blocked"
    jid = str(job["id"])
    assert json.loads(ok("jobs", "approve", jid, "--json"))["state"] == "queued"
    assert json.loads(ok("jobs", "show", jid, "--json"))["id"] == job["id"]
    assert json.loads(ok("jobs", "explain", jid, "--json"))["reason"] == "no_authorized_runner"
    assert [j["id"] for j in json.loads(ok("jobs", "list", "--json"))["jobs"]] == [job["id"]]
    assert ok("jobs", "cancel", jid, "--reason", "pooled").strip() == f"job {jid}: cancelled"
    assert ok("jobs", "retry", jid).strip() == f"job {jid}: queued"
    assert ok("projects", "pause", "web", "--reason", "pooled").strip() == "project web paused"
    assert ok("projects", "resume", "web").strip() == "project web resumed"
    # a deployment whose runner was lost: claimed and lapsed here, expired by the CLI
    deployment = json.loads(ok("submit", "--project", "web", "--pool", "deploy", "--target",
                               "production", "--", "deploy.sh"))
    runner = world.runner(pools=("deploy",))
    claim = world.claim(runner, pools=("deploy",))
    assert claim.job_id == deployment["id"]
    world.expire_now(claim.attempt_id)
    assert [e["job_id"] for e in json.loads(ok("expire", "--json"))] == [deployment["id"]]
    assert "resolved (failed)" in ok("targets", "resolve", "production", "--outcome", "failed",
                                     "--note", "checked: not deployed")
    # the looks of issue 19 (reads.list_jobs, overview, the shows and their audit trails)
    for args in (("overview",), ("projects", "list"), ("projects", "show", "web"), ("pools", "list"),
                 ("pools", "show", "linux"), ("targets", "list"), ("targets", "show", "production"),
                 ("runners", "list"), ("runners", "show", str(runner)),
                 ("jobs", "list", "--state", "running", "--pool", "deploy"),
                 ("jobs", "list", "--reason", "no_authorized_runner")):
        assert json.loads(ok(*args, "--json")), args
    trail = json.loads(ok("audit", "list", "--job", str(deployment["id"]), "--json"))["events"]
    assert "resolve_target" in {e["action"] for e in trail}, trail
    assert ok("tokens", "create", "--user", "alice").startswith("pgd_")
    assert "applied 0 migration(s)" in ok("db", "upgrade")
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE actor = %s",
                              (world.conn.info.user,)).fetchone()["n"] >= 8


def test_the_cli_check_fails_with_server_side_prepared_statements(db_url, pgbouncer_url, tmp_path):
    """Broken variant: each command prepares its statements as "_pg3_0", "_pg3_1"… on the
    server connection it shares with the command before it."""
    pooled = pgbouncer_url(db_url)
    (tmp_path / "config.toml").write_text(CONFIG)
    procs = [run_pgdispatch(pooled, tmp_path, *args, PGDISPATCH_PREPARE_THRESHOLD="0")
             for args in (("apply", "config.toml"), ("jobs", "list"))]
    assert procs[-1].returncode != 0 and "prepared statement" in procs[-1].stderr, procs


def test_bad_pooling_settings_are_refused_in_one_line(db_url, tmp_path):
    for args, env, message in (
            (("jobs", "list"), {"PGDISPATCH_PREPARE_THRESHOLD": "often"},
             "error: PGDISPATCH_PREPARE_THRESHOLD must be off (never prepare statements on the "
             "server) or a whole number of runs from 0 to 1000000, got 'often'\n"),
            (("scheduler", "--pool", "linux", "--slots", "1", "--listen-url", "nonsense"), {},
             "error: --listen-url (PGDISPATCH_LISTEN_URL) is not a valid database URL: missing "
             "\"=\" after \"nonsense\" in connection info string\n")):
        proc = run_pgdispatch(db_url, tmp_path, *args, **env)
        assert (proc.returncode, proc.stderr) == (2, message)
