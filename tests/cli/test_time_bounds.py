"""``jobs show`` and ``jobs explain`` of a job whose ready_at Python cannot hold (past year
9999: issue 16, "timestamp too large"), and a delay that would put it there, refused in one
line (sql/timestamps.py, pgd_submit in sql/functions/submit.sql)."""

from __future__ import annotations

import json

from .test_cli import count, pgd  # noqa: F401  (the fixture)


def test_jobs_show_and_explain_a_job_ready_past_year_9999(pgd, conn):  # noqa: F811
    job = json.loads(pgd("submit", "--project", "web", "--pool", "linux", "--", "true").stdout)
    conn.execute("UPDATE jobs SET ready_at = '12000-01-01' WHERE id = %s", (job["id"],))
    shown = json.loads(pgd("jobs", "show", str(job["id"]), "--json").stdout)
    assert shown["ready_at"] == "9999-12-30T00:00:00+00:00"
    explained = json.loads(pgd("jobs", "explain", str(job["id"]), "--json").stdout)
    assert explained["reason"] == "retry_delayed"


def test_a_delay_past_thirty_days_is_one_line(pgd, conn):  # noqa: F811
    proc = pgd("submit", "--project", "web", "--pool", "linux", "--delay", "1e12", "--", "true",
               check=False)
    assert proc.returncode == 2
    # refused by the option's own range (the bound pgd_submit enforces), before any connection
    assert proc.stderr.strip().splitlines() == [
        "error: Invalid value for '--delay': 1000000000000.0 is not in the range 0<=x<=2592000."]
    assert count(conn, "jobs") == 0
