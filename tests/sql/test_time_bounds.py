"""Every time pgdispatch computes stays one PostgreSQL and Python can both hold, an input that
would leave that range is refused in one line, and a stored time Python cannot hold (set by
hand, or by a release before the bounds) is still read (issue 16, "every computed time is
clamped to what PostgreSQL and Python can both hold"; sql/timestamps.py)."""

from __future__ import annotations

import datetime as dt
import math

import psycopg
import pytest
from psycopg.types.datetime import TimestamptzLoader

from pgdispatch.sql import InvalidInput, explain, reads, transitions
from pgdispatch.sql.queries import Q
from pgdispatch.sql.timestamps import EARLIEST, LATEST

from .. import variants
from .catalog import function_source

# Stored times Python's datetime cannot hold (years 1 to 9999), from both ends of
# PostgreSQL's range, and the end each is read as.
UNHOLDABLE = [("infinity", LATEST), ("12000-01-01 00:00+00", LATEST),
              ("294276-12-31 23:59:59+00", LATEST), ("-infinity", EARLIEST),
              ("0001-12-31 23:00+00 BC", EARLIEST), ("4713-01-01 00:00+00 BC", EARLIEST)]


def year(conn, sql: str, params: tuple = ()) -> float:
    return float(conn.execute(f"SELECT extract(year FROM ({sql})) AS y", params).fetchone()["y"])


@pytest.mark.parametrize("is_binary", [False, True], ids=["text", "binary"])
@pytest.mark.parametrize("stored, read_as", UNHOLDABLE)
def test_a_time_python_cannot_hold_is_read_as_the_nearest_end(conn, stored, read_as, is_binary):
    row = conn.cursor(binary=is_binary).execute("SELECT %s::timestamptz AS t", (stored,)).fetchone()
    assert row["t"] == read_as
    # either end converts to any time zone Python has (offsets under a day) and back
    for minutes in (-(24 * 60 - 1), 24 * 60 - 1):
        zone = dt.timezone(dt.timedelta(minutes=minutes))
        assert row["t"].astimezone(zone).astimezone(dt.timezone.utc) == read_as


def test_a_time_python_can_hold_is_read_as_it_is(conn):
    for text, value in [("9999-12-31 23:59:59+00", dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)),
                        ("0001-01-01 00:00+00", dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc))]:
        for is_binary in (False, True):
            got = conn.cursor(binary=is_binary).execute("SELECT %s::timestamptz AS t", (text,)).fetchone()["t"]
            assert got == value


def far_job(world, ready_at: str) -> dict:
    """A queued job whose ready_at is ``ready_at`` (as a release before the backoff clamp
    left it, or an operator's UPDATE)."""
    world.setup()
    job = world.job()
    world.conn.execute("UPDATE jobs SET ready_at = %s::timestamptz WHERE id = %s", (ready_at, job["id"]))
    return job


@pytest.mark.parametrize("stored, read_as", UNHOLDABLE[:2] + UNHOLDABLE[3:4])
def test_a_job_with_such_a_ready_at_is_shown_explained_and_listed(world, stored, read_as):
    job = far_job(world, stored)
    shown = reads.show_job(world.conn, job_id=job["id"])
    assert shown["ready_at"] == read_as
    reasons = explain.explain_job(world.conn, job_id=job["id"])["reasons"]
    waiting = reads.list_waiting(world.conn)["jobs"]
    assert [j["id"] for j in waiting] == [job["id"]]
    assert waiting[0]["ready_at"] == read_as
    if read_as is LATEST:
        assert reasons[0]["code"] == "retry_delayed"
        assert reasons[0]["details"]["ready_at"] == LATEST.isoformat()


@pytest.mark.parametrize("read", ["show_job", "list_waiting", "overview"])
def test_without_the_clamp_such_a_time_fails_every_read_of_its_row(world, read):
    """The checks above can fail: with psycopg's own loader (this connection only) the same
    reads raise DataError, as ``jobs show`` did."""
    job = far_job(world, "-infinity")
    transitions.summarize_queue(world.conn)  # the summary's oldest_ready_at is -infinity too
    world.conn.adapters.register_loader("timestamptz", TimestamptzLoader)
    call = {"show_job": lambda: reads.show_job(world.conn, job_id=job["id"]),
            "list_waiting": lambda: reads.list_waiting(world.conn),
            "overview": lambda: reads.overview(world.conn)}[read]
    with pytest.raises(psycopg.DataError, match="timestamp too small"):
        call()


# --- inputs that would leave the range are refused -------------------------------------------

SUBMIT = ("SELECT * FROM pgd_submit('web', 'linux', NULL, ARRAY['true'], 0, 1, 3600, %s, false, "
          "'{}', NULL, 'test')")


@pytest.mark.parametrize("delay", [1e12, 1e300, -1.0, math.inf, math.nan])
def test_a_delay_past_thirty_days_is_refused_by_the_function_and_the_transition(world, delay):
    world.setup()
    with pytest.raises(psycopg.Error) as info, world.conn.transaction():
        world.conn.execute(SUBMIT, (delay,))
    assert info.value.sqlstate == "PD422"
    assert str(info.value).startswith("delay must be between 0 and 2592000 seconds, got ")
    with pytest.raises(InvalidInput, match="^delay must be (between 0 and 2592000|a finite number)"):
        world.job(delay_seconds=delay)
    assert world.conn.execute("SELECT count(*) AS n FROM jobs").fetchone()["n"] == 0


def test_the_longest_delay_is_accepted(world):
    world.setup()
    job_id = world.conn.execute(SUBMIT, (2592000.0,)).fetchone()["job_id"]
    assert year(world.conn, "SELECT ready_at FROM jobs WHERE id = %s", (job_id,)) < 9999


def test_without_the_check_a_long_delay_stores_a_time_no_read_can_load(world):
    """The check above can fail: pgd_submit without it stores a year-33000 ready_at for a
    1e12 s delay, and overflows for 1e300."""
    body = function_source("pgd_submit")
    start = body.index("    IF p_delay_seconds IS NOT NULL")
    broken = body[:start] + body[body.index("    END IF;\n", start) + len("    END IF;\n"):]
    world.conn.execute(broken)
    world.setup()
    job_id = world.conn.execute(SUBMIT, (1e12,)).fetchone()["job_id"]
    assert year(world.conn, "SELECT ready_at FROM jobs WHERE id = %s", (job_id,)) > 9999
    with pytest.raises(psycopg.Error, match="out of range"), world.conn.transaction():
        world.conn.execute(SUBMIT, (1e300,))


def running_build(world):
    world.setup()
    world.job()
    return world.claim(world.runner())


@pytest.mark.parametrize("lease", [3e11, 86400.5, 0, -1, math.inf, math.nan, True, "30"])
def test_a_heartbeat_with_a_lease_out_of_range_is_refused(world, lease):
    c = running_build(world)
    before = world.row("attempts", c.attempt_id)["lease_expires_at"]
    with pytest.raises(InvalidInput, match=r"^lease seconds must be in \(0, 86400\], got "):
        transitions.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation,
                              lease_seconds=lease)
    assert world.row("attempts", c.attempt_id)["lease_expires_at"] == before
    lease_now = transitions.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation,
                                      lease_seconds=86400)
    assert lease_now.lease_expires_at - before <= dt.timedelta(days=1, seconds=60)


def test_the_database_refuses_a_heartbeat_lease_that_never_lapses(world):
    """The heartbeat's own function bounds the lease, whoever calls it (a runner host's login
    calls it directly: tests/security/test_roles.py); without that check, given 3e11 s, it
    stores a lease past year 9999 — an attempt no expiry pass would ever end."""
    c = running_build(world)
    with pytest.raises(psycopg.Error, match="lease seconds must be in"), world.conn.transaction():
        Q.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation,
                    lease_seconds=3e11, output_tail=None)
    world.conn.execute(variants.variant_sql(world.conn, "pgd_heartbeat", [(
        "PERFORM pgd_check_lease_seconds(p_lease_seconds);", "")]))
    Q.heartbeat(world.conn, attempt_id=c.attempt_id, generation=c.generation,
                lease_seconds=3e11, output_tail=None)
    assert year(world.conn, "SELECT lease_expires_at FROM attempts WHERE id = %s", (c.attempt_id,)) > 9999


# --- computed times are clamped: an expiry after many failures ------------------------------

def lapsed_after_many_failures(world):
    """A build that failed 60 times (of 100 attempts) and whose lease has lapsed, beside a
    healthy build whose lease lapsed later; returns (many-failures claim, healthy claim)."""
    world.setup()
    runner = world.runner()
    many = world.job(max_attempts=100)
    world.conn.execute("UPDATE jobs SET failures = 60 WHERE id = %s", (many["id"],))
    world.job()
    first, second = world.claim(runner), world.claim(runner)
    assert first.job_id == many["id"]
    for claim, ago in ((first, "2 minutes"), (second, "1 minute")):
        world.conn.execute(f"UPDATE attempts SET lease_expires_at = now() - interval '{ago}' "
                           "WHERE id = %s", (claim.attempt_id,))
    return first, second


def test_an_expiry_after_many_failures_queues_the_job_within_thirty_days(world):
    many, healthy = lapsed_after_many_failures(world)
    done = transitions.expire_leases(world.conn, backoff_base_seconds=1e14, backoff_cap_seconds=1e14)
    assert [d["job_id"] for d in done] == [many.job_id, healthy.job_id]
    job = reads.show_job(world.conn, job_id=many.job_id)
    now = world.conn.execute("SELECT now() AS t").fetchone()["t"]
    assert job["state"] == "queued" and job["ready_at"] - now <= dt.timedelta(days=30)


def test_without_the_backoff_clamp_that_expiry_fails_and_only_that_one(world):
    """The check above can fail: with the backoff capped only by its caller, that lease
    cannot be ended (interval out of range), and the sweep goes on to the healthy one
    (pgd_expire_one's per-row handler, tests/sql/test_sweeps.py)."""
    body = function_source("pgd_backoff_seconds")
    broken = body.replace("greatest(0, least(2592000, p_cap_seconds,", "greatest(0, least(p_cap_seconds,")
    assert broken != body, "update this test with pgd_backoff_seconds"
    world.conn.execute(broken)
    many, healthy = lapsed_after_many_failures(world)
    done = transitions.expire_leases(world.conn, backoff_base_seconds=1e14, backoff_cap_seconds=1e14)
    assert [d["job_id"] for d in done] == [healthy.job_id]
    stuck = world.row("jobs", many.job_id)
    assert stuck["state"] == "running" and "out of range" in stuck["last_error"]
