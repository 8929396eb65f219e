"""`pgdispatch pools pause|resume` and `runners drain|resume` as real processes: audited,
conditional (the loser exits 4 with who and when, one line), shown by list and show."""

from __future__ import annotations

import json

from pgdispatch.sql import transitions
from pgdispatch.sql.config import apply_config

from .support import ALICE_PASSWORD, CONFIG, run_pgdispatch


def _pgd(db_url, tmp_path):
    def run(*args, check=True):
        proc = run_pgdispatch(db_url, tmp_path, *args)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc
    return run


def test_pools_pause_and_resume_are_audited_conditional_and_shown(db_url, tmp_path, conn):
    apply_config(conn, CONFIG, env={"ALICE_PASSWORD": ALICE_PASSWORD})
    pgd = _pgd(db_url, tmp_path)
    assert pgd("pools", "pause", "linux", "--reason", "kernel upgrade").stdout == "pool linux paused\n"
    again = pgd("pools", "pause", "linux", "--reason", "x", check=False)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 4 and len(lines) == 1
    assert f"already paused by {conn.info.user} at " in lines[0] and "kernel upgrade" in lines[0]
    shown = json.loads(pgd("pools", "show", "linux", "--json").stdout)
    assert shown["paused_by"] == conn.info.user and shown["pause_reason"] == "kernel upgrade"
    assert "kernel upgrade" in pgd("pools", "list").stdout
    assert "kernel upgrade" in pgd("pools", "show", "linux").stdout
    overview = pgd("overview").stdout
    assert "paused pools:" in overview and "kernel upgrade" in overview
    assert json.loads(pgd("overview", "--json").stdout)["paused_pools"][0]["name"] == "linux"
    resumed = json.loads(pgd("pools", "resume", "linux", "--reason", "done", "--json").stdout)
    assert resumed == {"pool": "linux", "paused_at": None}
    twice = pgd("pools", "resume", "linux", check=False)
    assert twice.returncode == 4 and f"not paused (resumed by {conn.info.user} at " in twice.stderr
    unknown = pgd("pools", "pause", "nope", "--reason", "x", check=False)
    assert unknown.returncode == 3 and "unknown pool nope" in unknown.stderr
    rows = conn.execute("SELECT actor, action, reason FROM audit_events WHERE subject = 'pool:linux' "
                        "ORDER BY id").fetchall()
    assert [(r["actor"], r["action"], r["reason"]) for r in rows] == [
        (conn.info.user, "pause_pool", "kernel upgrade"), (conn.info.user, "resume_pool", "done")]


def test_runners_drain_and_resume_with_a_deadline(db_url, tmp_path, conn):
    apply_config(conn, CONFIG, env={"ALICE_PASSWORD": ALICE_PASSWORD})
    runner = transitions.register_runner(conn, name="host-1", pools=["linux"], slots=2,
                                         hostname="h")
    pgd = _pgd(db_url, tmp_path)
    out = pgd("runners", "drain", str(runner), "--deadline", "300", "--reason", "reboot").stdout
    assert out == (f"runner {runner} draining: it takes no new jobs and shows drained once what "
                   "it runs has finished; its builds are handed back after 300 s\n")
    again = pgd("runners", "drain", str(runner), "--reason", "x", check=False)
    assert again.returncode == 4 and f"already draining (drain asked by {conn.info.user} at " in again.stderr
    shown = json.loads(pgd("runners", "show", str(runner), "--json").stdout)
    assert shown["drain_state"] == "drained" and shown["drain_reason"] == "reboot"
    assert shown["drain_deadline"] is not None
    text = pgd("runners", "show", str(runner)).stdout
    assert "drain:" in text and "drained: by" in text and "reboot" in text
    assert "drained" in pgd("runners", "list").stdout
    assert json.loads(pgd("runners", "resume", str(runner), "--json").stdout)["drain_requested_at"] is None
    twice = pgd("runners", "resume", str(runner), check=False)
    assert twice.returncode == 4 and "not drained" in twice.stderr
    unknown = pgd("runners", "drain", "424242", "--reason", "x", check=False)
    assert unknown.returncode == 3 and "unknown runner 424242" in unknown.stderr
