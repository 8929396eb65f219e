"""The rolled-up history the overview charts (sql/functions/summaries.sql, sql/history.py):
per pool and minute the claims and their wait from ready_at to claimed (p50 / p95), per
minute the waiting jobs by primary reason, both written by the summaries duty's holder only
(fenced, and readable for a runner login that may read no table), pruned after 7 days.

Each test runs in one rolled-back transaction, so now() stands still: a job's ready_at is
moved back by hand to give it a known wait."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest

from pgdispatch.sql import InvalidInput, db, history, reads, transitions
from pgdispatch.sql.explain import REASON_CODES, read_world
from pgdispatch.sql.queries import Q

from .. import variants
from ..logins import Logins

# The wait as the job row says it now: wrong for an attempt whose job was queued again since
WAIT_FROM_THE_JOB = ("extract(epoch FROM a.claimed_at - a.ready_at)",
                     "extract(epoch FROM a.claimed_at - (SELECT x.ready_at FROM jobs x "
                     "WHERE x.id = a.job_id))")


def summaries_term(world, runner_id: int) -> int:
    """Make ``runner_id`` the holder of every duty; the summaries duty's term."""
    rows = transitions.beat_runner(world.conn, runner_id=runner_id, beat_seconds=1.0,
                                   duty_lease_seconds=20.0)
    duty = {r["duty"]: r for r in rows}["summaries"]
    assert duty["is_mine"]
    return duty["term"]


def waiting_for(world, job_id: int, seconds: float) -> None:
    world.conn.execute("UPDATE jobs SET ready_at = now() - make_interval(secs => %s) WHERE id = %s",
                       (seconds, job_id))


def minute_row(world, pool: str = "linux") -> dict:
    return world.conn.execute(
        "SELECT h.* FROM queue_history h JOIN pools q ON q.id = h.pool_id "
        "WHERE q.name = %s AND h.at = date_trunc('minute', now())", (pool,)).fetchone()


@pytest.mark.parametrize("variant", ["real", "wait from the job row"])
def test_the_minute_keeps_each_claims_wait_even_after_its_job_is_queued_again(world, variant):
    world.setup()
    if variant != "real":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_claim_waits", [WAIT_FROM_THE_JOB]))
    runner = world.runner(slots=8)
    waits = [10.0, 20.0, 30.0, 40.0]
    jobs = [world.job(max_attempts=3) for _ in waits]
    for job, seconds in zip(jobs, waits):
        waiting_for(world, job["id"], seconds)
    claims = [world.claim(runner) for _ in waits]
    assert sorted(c.job_id for c in claims) == sorted(j["id"] for j in jobs)
    by_job = {c.job_id: c for c in claims}
    world.complete(by_job[jobs[0]["id"]], "succeeded")      # finished: found by finished_at
    world.complete(by_job[jobs[1]["id"]], "failed")         # queued again, ready_at later
    # jobs[2] and jobs[3] still run
    assert world.row("jobs", jobs[1]["id"])["state"] == "queued"

    assert transitions.run_summaries(world.conn, runner_id=runner, term=summaries_term(world, runner))
    row = minute_row(world)
    if variant != "real":
        # the re-queued job's wait reads as 0 (its ready_at is now after its claim): caught
        assert row["wait_p50_seconds"] != pytest.approx(25.0, abs=0.5)
        return
    assert row["claimed"] == 4
    assert row["running"] == 2
    assert row["wait_p50_seconds"] == pytest.approx(25.0, abs=0.5)
    assert row["wait_p95_seconds"] == pytest.approx(38.5, abs=0.5)  # percentile_cont(0.95)
    attempt = world.conn.execute("SELECT ready_at, claimed_at FROM attempts WHERE id = %s",
                                 (by_job[jobs[1]["id"]].attempt_id,)).fetchone()
    assert (attempt["claimed_at"] - attempt["ready_at"]).total_seconds() == pytest.approx(20.0, abs=0.5)


def test_claims_of_another_minute_are_not_counted_and_a_quiet_pool_has_no_wait(world):
    world.setup(pools=("linux", "macos"))
    runner = world.runner()
    job = world.job()
    claim = world.claim(runner)
    world.complete(claim, "succeeded")
    # that claim moved to two minutes ago, as if made then
    world.conn.execute("UPDATE attempts SET claimed_at = claimed_at - interval '2 minutes' "
                       "WHERE job_id = %s", (job["id"],))
    assert transitions.run_summaries(world.conn, runner_id=runner, term=summaries_term(world, runner))
    for pool in ("linux", "macos"):
        row = minute_row(world, pool)
        assert (row["claimed"], row["wait_p50_seconds"], row["wait_p95_seconds"]) == (0, None, None)


def test_the_duty_records_the_waiting_jobs_by_primary_reason_as_the_overview_counts_them(world):
    world.setup(pools=("linux", "macos"))
    runner = world.runner()  # serves linux only: macos jobs have no runner
    world.job(), world.job()
    world.job(pool="macos")
    upstream = world.job()
    world.job(depends_on=[upstream["id"]], requires_approval=True)
    term = summaries_term(world, runner)
    assert transitions.run_summaries(world.conn, runner_id=runner, term=term)

    recorded = {r["reason"]: r["waiting"] for r in world.conn.execute(
        "SELECT reason, waiting FROM queue_reason_history WHERE at = date_trunc('minute', now())")}
    shown = reads.overview(world.conn, live_seconds=90.0)["primary_counts"]
    assert recorded == shown
    assert recorded["ready"] == 3 and recorded["no_authorized_runner"] == 1
    assert recorded["dependency_pending"] == 1

    # the minute keeps its snapshot with the most waiting: two claims later, still 3 ready
    world.claim(runner), world.claim(runner)
    assert transitions.run_summaries(world.conn, runner_id=runner, term=term)
    again = {r["reason"]: r["waiting"] for r in world.conn.execute(
        "SELECT reason, waiting FROM queue_reason_history WHERE at = date_trunc('minute', now())")}
    assert again["ready"] == 3


def test_a_runner_that_does_not_hold_the_duty_records_nothing(world):
    world.setup()
    holder, other = world.runner(name="holder"), world.runner(name="other")
    term = summaries_term(world, holder)
    world.job()
    assert transitions.run_summaries(world.conn, runner_id=other, term=term) is False
    assert Q.read_summary_inputs(world.conn, runner_id=other, term=term, live_seconds=90.0) is None
    assert history.record_reason_counts(world.conn, runner_id=other, term=term,
                                        counts={"ready": 5}) is False
    assert history.record_reason_counts(world.conn, runner_id=holder, term=term + 1,
                                        counts={"ready": 5}) is False
    assert world.conn.execute("SELECT count(*) AS n FROM queue_reason_history").fetchone()["n"] == 0
    assert world.conn.execute("SELECT count(*) AS n FROM queue_history").fetchone()["n"] == 0


def minute_reasons(world) -> dict[str, int]:
    return {r["reason"]: r["waiting"] for r in world.conn.execute(
        "SELECT reason, waiting FROM queue_reason_history WHERE at = date_trunc('minute', now())")}


# 50,000 keys that look like codes (lower case and _), none of them one
JUNK = json.dumps({"junk_" + "".join(chr(97 + i // 26 ** k % 26) for k in range(4)): 0
                   for i in range(50_000)})


@pytest.mark.parametrize("counts", ['[1]', '{"ready": -1}', '{"ready": 1.5}', '{"ready": "2"}',
                                    '{"Robert); DROP": 1}', '{"nosuch": 0}', '{"ready": 3}',
                                    '{"ready": 1, "capacity_pool": 1, "target_held": 1}',
                                    pytest.param(JUNK, id="50000 junk keys")])
def test_reason_counts_that_are_not_counts_are_refused_and_nothing_is_written(world, counts):
    """Only reason codes, only whole numbers, and no more jobs than the summary has waiting
    (2 here); 50,000 junk keys are refused as one."""
    world.setup()
    runner = world.runner()
    world.job(), world.job()
    term = summaries_term(world, runner)
    transitions.summarize_queue(world.conn)
    assert history.record_reason_counts(world.conn, runner_id=runner, term=term,
                                        counts={"ready": 1, "capacity_pool": 1})
    with pytest.raises(InvalidInput), world.conn.transaction():
        history.record_reason_counts(world.conn, runner_id=runner, term=term, counts=counts)
    assert {k: v for k, v in minute_reasons(world).items() if v} == {"ready": 1, "capacity_pool": 1}


def test_the_sql_list_of_reason_codes_is_explains(world):
    """pgd_record_reason_counts accepts the codes of pgd_reason_codes, a copy of
    explain.REASON_CODES: the two must not drift."""
    assert world.conn.execute("SELECT pgd_reason_codes() AS c").fetchone()["c"] == list(REASON_CODES)


def test_a_minute_holds_one_snapshot_when_the_primary_reasons_flip(world):
    """Three jobs waiting for a runner slot, then (the pool's limit reached) for the pool:
    the minute's stack is 3, not 6."""
    world.setup()
    runner = world.runner()
    for _ in range(3):
        world.job()
    term = summaries_term(world, runner)
    transitions.summarize_queue(world.conn)

    def record(counts):
        assert history.record_reason_counts(world.conn, runner_id=runner, term=term, counts=counts)
        return {k: v for k, v in minute_reasons(world).items() if v}

    assert record({"runners_busy": 3}) == {"runners_busy": 3}
    assert record({"capacity_pool": 3}) == {"capacity_pool": 3}  # as many: the latest
    assert record({"capacity_pool": 1, "ready": 1}) == {"capacity_pool": 3}  # fewer: dropped
    assert record({"ready": 1, "capacity_pool": 2}) == {"ready": 1, "capacity_pool": 2}
    assert sorted(minute_reasons(world)) == sorted(REASON_CODES)  # zeros too: every code


def test_the_duty_reads_the_same_world_as_the_console(world):
    """pgd_read_summary_inputs mirrors read_world's named statements (its only copy of them):
    any drift between the two shows here."""
    world.setup(pools=("linux", "macos"), project_limit=3)
    world.project("api", org="acme", pools=("linux",), max_running=None)
    runner = world.runner(pools=("linux", "macos"), slots=3)
    world.job(), world.job(pool="macos")
    world.claim(runner)
    transitions.pause_project(world.conn, project="api", reason="freeze", actor="test")
    term = summaries_term(world, runner)
    transitions.summarize_queue(world.conn)

    inputs = Q.read_summary_inputs(world.conn, runner_id=runner, term=term, live_seconds=90.0)
    summaries, duty_world = history.world_from_inputs(inputs)
    console = read_world(world.conn, live_seconds=90.0)
    for field in dataclasses.fields(console):
        if field.name == "targets":
            continue  # a summary row's probe has no target
        assert getattr(duty_world, field.name) == getattr(console, field.name), field.name
    wanted = [{k: v for k, v in s.items() if k in summaries[0]}
              for s in Q.read_queue_summaries(world.conn)]
    assert sorted(summaries, key=lambda s: (s["project_id"], s["pool_id"])) == \
        sorted(wanted, key=lambda s: (s["project_id"], s["pool_id"]))


@pytest.mark.own_database
def test_a_runner_login_runs_the_whole_duty_and_another_login_cannot_act_for_it(world, db_url):
    """A runner host's login may read no table: the duty reads through its entry points.
    Another host's login, with the holder's runner id and term (small numbers, easy to
    guess), reads nothing and writes nothing."""
    logins = Logins(db_url)
    try:
        login, url = logins.make("summaries", groups=("pgdispatch_scheduler",))
        other_login, other_url = logins.make("other", groups=("pgdispatch_scheduler",))
        world.apply({"organizations": [{"name": "acme", "max_running": 5}],
                     "pools": [{"name": "linux", "slots": 5}],
                     "projects": [{"name": "web", "organization": "acme", "pools": ["linux"]}],
                     "runners": [{"login": login, "pools": ["linux"]},
                                 {"login": other_login, "pools": ["linux"]}]})
        world.job()
        with db.connect(url) as host, db.connect(other_url) as other:
            runner = transitions.register_runner(host, name="h", pools=["linux"], slots=2,
                                                 hostname="h")
            rows = transitions.beat_runner(host, runner_id=runner, beat_seconds=1.0,
                                           duty_lease_seconds=20.0)
            term = {r["duty"]: r for r in rows}["summaries"]["term"]
            transitions.register_runner(other, name="o", pools=["linux"], slots=2, hostname="o")
            transitions.summarize_queue(world.conn)  # a summary with the waiting job

            assert Q.read_summary_inputs(other, runner_id=runner, term=term,
                                         live_seconds=90.0) is None
            assert history.record_reason_counts(other, runner_id=runner, term=term,
                                                counts={"ready": 1}) is False
            assert transitions.run_summaries(other, runner_id=runner, term=term) is False
            assert world.conn.execute("SELECT count(*) AS n FROM queue_reason_history"
                                      ).fetchone()["n"] == 0

            assert Q.read_summary_inputs(host, runner_id=runner, term=term,
                                         live_seconds=90.0)["projects"][0]["name"] == "web"
            assert transitions.run_summaries(host, runner_id=runner, term=term) is True
        n = world.conn.execute("SELECT waiting FROM queue_reason_history "
                               "WHERE reason = 'ready'").fetchone()
        assert n["waiting"] == 1
    finally:
        logins.drop()


def test_the_cleanup_prunes_reason_history_past_seven_days(world):
    world.setup()
    runner = world.runner()
    world.conn.execute("INSERT INTO queue_reason_history (at, reason, waiting) VALUES "
                       "(now() - interval '8 days', 'ready', 1), (now() - interval '6 days', 'ready', 2)")
    cleanup_term = {r["duty"]: r for r in transitions.beat_runner(
        world.conn, runner_id=runner, beat_seconds=1.0, duty_lease_seconds=20.0)}["cleanup"]["term"]
    done = transitions.run_cleanup(world.conn, runner_id=runner, term=cleanup_term)
    assert done["pruned"] == 1
    left = [r["waiting"] for r in world.conn.execute("SELECT waiting FROM queue_reason_history")]
    assert left == [2]


def test_the_chart_read_buckets_a_day_by_ten_minutes(world):
    world.setup()
    pool = world.pool_ids(("linux",))[0]
    now = world.conn.execute("SELECT now() AS now").fetchone()["now"]
    bucket = dt.datetime.fromtimestamp(int(now.timestamp()) // 600 * 600, dt.timezone.utc)
    previous = bucket - dt.timedelta(minutes=10)
    # two minutes of the previous bucket, and one an hour before it
    for at, waiting, claimed, p50, p95 in [(previous, 3, 1, 10.0, 10.0),
                                          (previous + dt.timedelta(minutes=1), 5, 3, 2.0, 4.0),
                                          (previous - dt.timedelta(hours=1), 7, 0, None, None)]:
        world.conn.execute(
            "INSERT INTO queue_history (at, pool_id, waiting, running, claimed, wait_p50_seconds, "
            "wait_p95_seconds) VALUES (%s, %s, %s, 1, %s, %s, %s)", (at, pool, waiting, claimed, p50, p95))
    # the reasons flip within the bucket: it shows the minute with the most waiting, whole
    # (6 = 5 + 1), never the most of each reason (5 + 4 = 9 of 6 jobs)
    world.conn.execute("INSERT INTO queue_reason_history (at, reason, waiting) VALUES "
                       "(%(a)s, 'ready', 5), (%(a)s, 'capacity_pool', 1), "
                       "(%(b)s, 'ready', 1), (%(b)s, 'capacity_pool', 4)",
                       {"a": previous, "b": previous + dt.timedelta(minutes=2)})
    day = history.read_queue_history(world.conn, span="day")
    assert len(day["points"]) == 144 and day["points"][-1] == bucket
    merged = day["pools"]["linux"][-2]
    assert (merged["waiting"], merged["claimed"]) == (5, 4)
    assert merged["wait_p50_seconds"] == pytest.approx((10.0 + 3 * 2.0) / 4)  # claim-weighted
    assert merged["wait_p95_seconds"] == 10.0  # the worst minute
    assert day["pools"]["linux"][-8]["waiting"] == 7
    assert day["pools"]["linux"][-1] is None
    assert (day["reasons"]["ready"][-2], day["reasons"]["capacity_pool"][-2]) == (5, 1)
    hour = history.read_queue_history(world.conn, span="hour")
    assert len(hour["points"]) == 60 and hour["step_seconds"] == 60
    i = hour["points"].index(previous)  # by the minute: each minute its own
    assert hour["reasons"]["capacity_pool"][i:i + 3] == [1, None, 4]
    with pytest.raises(InvalidInput):
        history.read_queue_history(world.conn, span="week")
