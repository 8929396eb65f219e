"""reads.list_jobs: the one read behind the Jobs page, ``jobs list`` and GET /api/v1/jobs —
filters, keyset paging both ways, the holders of a capacity, and refusals."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput, reads, transitions
from pgdispatch.sql.errors import UnknownFilter


@pytest.fixture
def fleet(world):
    """acme/web and globex/api on linux and deploy; two runners; jobs running on each, one
    finished, some waiting (one for approval behind nothing, one for a dependency)."""
    world.setup(pools=("linux", "deploy"), targets=("staging",))
    world.apply({"organizations": [{"name": "globex", "max_running": 3}]})
    world.project("api", org="globex", pools=("linux",))
    r1 = world.runner(pools=("linux",), slots=4, name="r-one")
    r2 = world.runner(pools=("linux", "deploy"), slots=4, name="r-two")
    done = world.job(command=["echo", "done"])
    world.complete(world.claim(r1), "succeeded")
    web_running = world.job(command=["make", "web"])
    assert world.claim(r1).job_id == web_running["id"]
    api_running = world.job(project="api", command=["make", "api"])
    assert world.claim(r2).job_id == api_running["id"]
    deploying = world.job(pool="deploy", target="staging", command=["deploy"])
    assert world.claim(r2, pools=("deploy",)).job_id == deploying["id"]
    gated = world.job(project="api", requires_approval=True)
    behind = world.job(depends_on=[gated["id"]], requires_approval=True)
    queued = world.job()
    return {"r1": r1, "r2": r2, "done": done["id"], "web_running": web_running["id"],
            "api_running": api_running["id"], "deploying": deploying["id"],
            "gated": gated["id"], "behind": behind["id"], "queued": queued["id"]}


def ids(page):
    return [j["id"] for j in page["jobs"]]


def test_holders_of_each_capacity(conn, fleet):
    f = fleet
    running = reads.list_jobs(conn, state="running")
    assert ids(running) == [f["deploying"], f["api_running"], f["web_running"]]
    assert ids(reads.list_jobs(conn, state="running", organization="globex")) == [f["api_running"]]
    assert ids(reads.list_jobs(conn, state="running", project="web")) == [f["deploying"], f["web_running"]]
    assert ids(reads.list_jobs(conn, state="running", pool="deploy")) == [f["deploying"]]
    assert ids(reads.list_jobs(conn, state="running", target="staging")) == [f["deploying"]]
    assert ids(reads.list_jobs(conn, state="running", runner_id=f["r2"])) == [f["deploying"], f["api_running"]]
    # the runner filter is the latest attempt's runner, in any state
    assert ids(reads.list_jobs(conn, runner_id=f["r1"])) == [f["web_running"], f["done"]]
    row = running["jobs"][-1]
    assert (row["project"], row["organization"], row["pool"], row["runner"], row["runner_id"]) == (
        "web", "acme", "linux", "r-one", f["r1"])
    assert row["running_seconds"] >= 0 and row["claimed_at"] is not None and row["age_seconds"] >= 0
    assert row["duration_seconds"] is None


def test_finished_jobs_have_a_duration_and_waiting_ones_no_runner(conn, fleet):
    done, = reads.list_jobs(conn, state="succeeded")["jobs"]
    assert done["duration_seconds"] >= 0 and done["running_seconds"] is None
    assert done["started_at"] is not None and done["finished_at"] is not None
    queued, = reads.list_jobs(conn, state="queued")["jobs"]
    assert queued["runner"] is None and queued["attempt_no"] is None and queued["started_at"] is None


def test_keyset_pages_both_ways(conn, fleet):
    every = ids(reads.list_jobs(conn))
    assert every == sorted(every, reverse=True) and len(every) == 7
    first = reads.list_jobs(conn, limit=3)
    assert ids(first) == every[:3] and first["order"] == "newest_first"
    second = reads.list_jobs(conn, limit=3, **first["next"])
    assert ids(second) == every[3:6]
    last = reads.list_jobs(conn, limit=3, **second["next"])
    assert ids(last) == every[6:] and last["next"] is None
    # after: the oldest above the cursor, oldest first (follow new jobs)
    forward = reads.list_jobs(conn, after_id=every[6], limit=2)
    assert ids(forward) == [every[5], every[4]] and forward["order"] == "oldest_first"
    assert ids(reads.list_jobs(conn, limit=2, **forward["next"])) == [every[3], every[2]]
    # both: the window between them
    assert ids(reads.list_jobs(conn, after_id=every[5], before_id=every[1])) == [every[4], every[3], every[2]]
    assert ids(reads.list_jobs(conn, state="running", after_id=0, limit=2)) == [
        fleet["web_running"], fleet["api_running"]]


def test_age_filters(conn, world, fleet):
    conn.execute("UPDATE jobs SET created_at = now() - interval '2 hours' WHERE id = %s", (fleet["done"],))
    assert ids(reads.list_jobs(conn, older_than_seconds=3600)) == [fleet["done"]]
    assert fleet["done"] not in ids(reads.list_jobs(conn, younger_than_seconds=3600))
    assert len(ids(reads.list_jobs(conn, younger_than_seconds=3600))) == 6


def test_reason_lists_waiting_jobs_with_that_reason(conn, fleet):
    gated = reads.list_jobs(conn, reason="approval_required")
    assert gated["order"] == "oldest_first"
    # the job behind a dependency also waits for its approval (every reason counts) — the
    # read is list_waiting's, whichever reasons it matches
    assert fleet["gated"] in ids(gated)
    assert all(any(r["code"] == "approval_required" for r in j["reasons"]) for j in gated["jobs"])
    assert ids(reads.list_jobs(conn, reason="approval_required", project="api")) == [fleet["gated"]]
    assert ids(reads.list_jobs(conn, reason="dependency_pending", state="blocked")) == [fleet["behind"]]
    assert ids(reads.list_jobs(conn, reason="dependency_pending", state="running")) == []
    assert ids(reads.list_jobs(conn, reason="dependency_pending", runner_id=fleet["r1"])) == []
    first = reads.list_jobs(conn, reason="dependency_pending", limit=1)
    assert ids(first) == [fleet["behind"]] and first["next"] == {"after_id": fleet["behind"]}
    assert ids(reads.list_jobs(conn, reason="dependency_pending", **first["next"])) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"state": "paused"}, "unknown state 'paused'"),
    ({"reason": "busy"}, "unknown reason 'busy'"),
    ({"limit": 0}, "limit must be"),
    ({"before_id": -1}, "before_id must be"),
    ({"runner_id": 2**63}, "runner must be"),
    ({"older_than_seconds": float("nan")}, "older_than must be"),
    ({"younger_than_seconds": -5}, "younger_than must be"),
])
def test_out_of_range_input_is_refused(conn, world, kwargs, message):
    world.setup()
    with pytest.raises(InvalidInput, match=message):
        reads.list_jobs(conn, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"organization": "nope"}, "unknown organization 'nope'"),
    ({"project": "nope"}, "unknown project 'nope'"),
    ({"pool": "nope"}, "unknown pool 'nope'"),
    ({"target": "nope"}, "unknown target 'nope'"),
    ({"runner_id": 999999}, "unknown runner 999999"),
])
def test_unknown_names_are_refused(conn, world, kwargs, message):
    world.setup()
    with pytest.raises(UnknownFilter, match=message):
        reads.list_jobs(conn, **kwargs)


def test_cancelled_before_start_has_no_duration(conn, world):
    world.setup()
    job = world.job()
    transitions.cancel_job(conn, job_id=job["id"], actor="test")
    row, = reads.list_jobs(conn, state="cancelled")["jobs"]
    assert row["duration_seconds"] is None and row["finished_at"] is not None
