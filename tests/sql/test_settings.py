"""Settings are bounded when a process starts (one line naming the variable), and the retry
backoff the database computes is clamped whatever it is given, so that no computed time
overflows what PostgreSQL and Python can hold (issue 16, "No single row stops a sweep")."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest

from pgdispatch.sql import InvalidInput, Settings, transitions
from pgdispatch.sql.settings import MAX_BACKOFF_SECONDS

from .catalog import function_source


@pytest.mark.parametrize("name, value", [
    ("PGDISPATCH_BACKOFF_CAP_SECONDS", "1e14"),
    ("PGDISPATCH_BACKOFF_BASE_SECONDS", "2592001"),
    ("PGDISPATCH_LEASE_SECONDS", "86401"),
    ("PGDISPATCH_CLAIM_INTERVAL_SECONDS", "3601"),
    ("PGDISPATCH_EXPIRE_INTERVAL_SECONDS", "0"),
    ("PGDISPATCH_SUMMARY_INTERVAL_SECONDS", "nan"),
    ("PGDISPATCH_HEARTBEAT_SECONDS", "inf"),
    ("PGDISPATCH_LEASE_SECONDS", "-5"),
])
def test_an_out_of_range_setting_is_refused_naming_it(name, value):
    with pytest.raises(InvalidInput, match=f"^{name} must be more than 0 and at most"):
        Settings.from_env({name: value})


@pytest.mark.parametrize("value", ["1e-9", "0.5"])
def test_a_statement_deadline_below_a_second_is_refused(value):
    """Below a second, healthy statements on a busy server would be cancelled and every
    request would fail as "database unavailable" (found by an adversarial run: 1e-9)."""
    with pytest.raises(InvalidInput, match="^PGDISPATCH_STATEMENT_DEADLINE_SECONDS must be at "
                                           "least 1 and at most 3600 seconds"):
        Settings.from_env({"PGDISPATCH_STATEMENT_DEADLINE_SECONDS": value})
    assert Settings.from_env({"PGDISPATCH_STATEMENT_DEADLINE_SECONDS": "1"}
                             ).statement_deadline_seconds == 1


def test_a_backoff_base_above_its_cap_is_refused():
    with pytest.raises(InvalidInput, match="BASE_SECONDS .* must not be more than .*CAP_SECONDS"):
        Settings.from_env({"PGDISPATCH_BACKOFF_BASE_SECONDS": "600",
                           "PGDISPATCH_BACKOFF_CAP_SECONDS": "300"})


def test_the_bounds_themselves_are_accepted():
    s = Settings.from_env({"PGDISPATCH_BACKOFF_CAP_SECONDS": str(MAX_BACKOFF_SECONDS),
                           "PGDISPATCH_LEASE_SECONDS": "86400"})
    assert s.backoff_cap_seconds == MAX_BACKOFF_SECONDS and s.lease_seconds == 86400


def test_the_scheduler_refuses_a_bad_setting_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pgdispatch", "expire"], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PGDISPATCH_BACKOFF_CAP_SECONDS": "1e14",
                               "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: PGDISPATCH_BACKOFF_CAP_SECONDS must be more than 0 and at most 2.592e+06 "
        "seconds, got '1e14'"]


def retry_after_many_failures(world, cap_seconds: float) -> dict:
    """A build that has failed 60 times fails once more with attempts left, its backoff
    computed with ``cap_seconds``: the completion's answer."""
    world.setup()
    job = world.job(command=["false"], max_attempts=100)
    world.conn.execute("UPDATE jobs SET failures = 60 WHERE id = %s", (job["id"],))
    c = world.claim(world.runner())
    return world.complete(c, outcome="failed", exit_code=1, backoff_base_seconds=cap_seconds,
                          backoff_cap_seconds=cap_seconds)


def test_a_huge_backoff_is_clamped_to_thirty_days(world):
    answer = retry_after_many_failures(world, 1e14)
    assert answer["job_state"] == "queued"
    now = world.conn.execute("SELECT now() AS t").fetchone()["t"]
    ready_at = world.row("jobs", answer["job_id"])["ready_at"]
    assert dt.timedelta(days=15) <= ready_at - now <= dt.timedelta(days=30)
    assert world.conn.execute("SELECT max(pgd_backoff_seconds(n, 1e300, 1e300)) AS s "
                              "FROM generate_series(-5, 200) n").fetchone()["s"] <= 2592000


def test_without_the_clamp_the_retry_fails(world):
    """The check above can fail: the backoff as it was (capped only by the caller) makes the
    same completion fail, as it made an expiry pass stop at that row."""
    body = function_source("pgd_backoff_seconds")
    broken = body.replace("greatest(0, least(2592000, p_cap_seconds,", "greatest(0, least(p_cap_seconds,")
    assert broken != body, "update this test with pgd_backoff_seconds"
    world.conn.execute(broken)
    with pytest.raises(Exception, match="out of range"):
        retry_after_many_failures(world, 1e14)
