"""Why is this job waiting? Every reason built on purpose, with its code and its numbers;
the precedence of DESIGN.md when several hold; and the overview's counts by reason."""

from __future__ import annotations

import re

from pgdispatch.sql import reads, transitions
from pgdispatch.sql.explain import REASON_CODES, explain_job

HHMMSS = r"\d\d:\d\d:\d\d UTC"


def explain(world, job_id: int) -> tuple[str, str, dict, list[str]]:
    """(first code, its message, its details, every code) for a job."""
    e = explain_job(world.conn, job_id=job_id)
    first = e["reasons"][0]
    return first["code"], first["message"], first["details"], [r["code"] for r in e["reasons"]]


def fill(world, runner: int, n: int, **job) -> list:
    """Submit and claim ``n`` jobs; returns the claims."""
    claims = []
    for _ in range(n):
        world.job(**job)
        claims.append(world.claim(runner, pools=(job.get("pool", "linux"),)))
        assert claims[-1] is not None
    return claims


def test_dependency_pending_names_the_pending_job(world):
    world.setup()
    world.runner()
    build = world.job()
    deploy = world.job(depends_on=[build["id"]])
    code, message, details, _ = explain(world, deploy["id"])
    assert code == "dependency_pending"
    assert message == f"waiting for job {build['id']} (queued)"
    assert details == {"pending": 1, "jobs": [build["id"]]}


def test_approval_required(world):
    world.setup()
    world.runner()
    job = world.job(requires_approval=True)
    # no actor named: the database records the login that submitted it (pgd_authorize)
    login = world.conn.execute("SELECT session_user AS u").fetchone()["u"]
    assert explain(world, job["id"])[:2] == ("approval_required",
                                             f"waiting for an operator's approval (asked for at submission by {login})")


def test_approval_required_names_the_protected_targets_rule(world):
    """A protected target's rule, not the submission, blocks the deployment; the reason says
    whose rule it is and who submitted it."""
    world.setup()
    world.apply({"targets": [{"name": "production", "requires_approval": True, "approver_role": "admin"},
                             {"name": "staging", "requires_approval": True}]})
    world.runner()
    job = transitions.submit(world.conn, project="web", pool="linux", target="production",
                             command=["deploy"], submitted_by="alice")
    assert job["state"] == "blocked" and job["requires_approval"]
    code, message, details, _ = explain(world, job["id"])
    assert (code, message) == ("approval_required",
                               "target production requires approval by an admin; submitted by alice")
    assert details == {"target": "production", "approver_role": "admin", "submitted_by": "alice"}
    staging = transitions.submit(world.conn, project="web", pool="linux", target="staging",
                                 command=["deploy"], submitted_by="bob", requires_approval=False)
    assert explain(world, staging["id"])[1] == "target staging requires approval by an operator; submitted by bob"
    # the queue's rows say the same
    rows = {j["id"]: j for j in reads.list_waiting(world.conn)["jobs"]}
    assert rows[job["id"]]["reasons"][0]["message"] == message


def test_project_paused_says_who_when_and_why(world):
    world.setup()
    world.runner()
    job = world.job()
    transitions.pause_project(world.conn, project="web", reason="release freeze", actor="alice")
    code, message, details, _ = explain(world, job["id"])
    assert code == "project_paused"
    assert re.fullmatch(rf"project web paused by alice at {HHMMSS}: release freeze", message), message
    assert details["paused_by"] == "alice" and details["reason"] == "release freeze"


def test_retry_delayed_after_a_delay_and_after_a_failure(world):
    world.setup()
    runner = world.runner()
    delayed = world.job(delay_seconds=600)
    code, message, details, _ = explain(world, delayed["id"])
    assert code == "retry_delayed"
    assert re.fullmatch(rf"delayed until {HHMMSS} \(in 600 s\)", message), message

    retried = world.job(max_attempts=3)
    c = world.claim(runner)
    assert c.job_id == retried["id"]
    world.complete(c, "failed", exit_code=2, backoff_base_seconds=300, backoff_cap_seconds=300)
    code, message, details, _ = explain(world, retried["id"])
    assert code == "retry_delayed"
    # equal jitter: between half and all of the 300 s base delay
    assert 149 <= details["seconds"] <= 300 and details["failures"] == 1
    assert re.fullmatch(rf"delayed until {HHMMSS} \(in \d+ s\) after 1 failed attempt", message), message


def test_no_authorized_runner_without_a_runner_with_a_stale_one_and_without_a_grant(world):
    world.setup()
    job = world.job()
    assert explain(world, job["id"])[:2] == ("no_authorized_runner", "no live runner serves pool linux")

    runner = world.runner()
    assert explain(world, job["id"])[0] == "ready"
    world.conn.execute("UPDATE runners SET last_heartbeat_at = now() - interval '5 minutes' WHERE id = %s",
                       (runner,))
    assert explain(world, job["id"])[:2] == ("no_authorized_runner", "no live runner serves pool linux")

    transitions.beat_runner(world.conn, runner_id=runner, is_draining=True)
    assert explain(world, job["id"])[:2] == ("no_authorized_runner", "no live runner serves pool linux")

    transitions.beat_runner(world.conn, runner_id=runner)
    world.project("web", org="acme", pools=())  # the grant is revoked after the job was queued
    assert explain(world, job["id"])[:2] == ("no_authorized_runner", "project web is not granted pool linux")


def test_capacity_organization_with_numbers(world):
    world.setup(org_limit=5)
    runner = world.runner(slots=8)
    fill(world, runner, 5)
    job = world.job()
    code, message, details, _ = explain(world, job["id"])
    assert (code, message) == ("capacity_organization", "organization acme: 5 of 5 running")
    assert details == {"organization": "acme", "running": 5, "limit": 5,
                       "holders": {"organization": "acme"}}


def test_capacity_project_with_numbers(world):
    world.setup(project_limit=2)
    runner = world.runner()
    fill(world, runner, 2)
    job = world.job()
    code, message, details, _ = explain(world, job["id"])
    assert (code, message) == ("capacity_project", "project web: 2 of 2 running")
    assert details == {"project": "web", "running": 2, "limit": 2, "holders": {"project": "web"}}


def test_capacity_pool_with_numbers(world):
    world.setup(pool_slots=8)
    runner = world.runner(slots=8)
    fill(world, runner, 8)
    job = world.job()
    code, message, details, _ = explain(world, job["id"])
    assert (code, message) == ("capacity_pool", "pool linux: 8 of 8 pool slots taken")
    assert details == {"pool": "linux", "running": 8, "slots": 8, "holders": {"pool": "linux"}}


def test_target_held_names_the_holder_and_its_project(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    (holder,) = fill(world, runner, 1, pool="deploy", target="production")
    waiting = world.job(pool="deploy", target="production")
    code, message, details, _ = explain(world, waiting["id"])
    assert code == "target_held"
    assert re.fullmatch(rf"target production held by job {holder.job_id} \(project web\) since {HHMMSS}",
                        message), message
    assert details["holder_job_id"] == holder.job_id and details["holder_project"] == "web"
    assert details["holders"] == {"target": "production"}


def test_target_uncertain_for_the_lost_deployment_and_for_the_next_one(world):
    world.setup(pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    (lost,) = fill(world, runner, 1, pool="deploy", target="production")
    world.expire_now(lost.attempt_id)
    transitions.expire_leases(world.conn)
    waiting = world.job(pool="deploy", target="production")
    code, message, _, codes = explain(world, lost.job_id)
    assert (code, codes) == ("target_uncertain", ["target_uncertain"])
    assert message.startswith("deployment to target production was lost with its runner")
    code, message, details, _ = explain(world, waiting["id"])
    assert code == "target_uncertain"
    assert message == (f"target production is uncertain: job {lost.job_id} (project web) was lost "
                       f"mid-deployment; an operator must resolve it")
    assert details == {"target": "production", "holder_job_id": lost.job_id}


def test_ready(world):
    world.setup()
    runner = world.runner()
    job = world.job()
    assert explain(world, job["id"])[:3] == ("ready", "next in line for a runner of pool linux "
                                                      "(4 of 4 runner slots free)",
                                             {"pool": "linux", "runner_slots": 4, "free_runner_slots": 4,
                                              "runner_ids": [runner]})


def test_runners_busy_when_every_runner_of_the_pool_is_busy(world):
    """Limits with room, but the pool's live runners (2 and 1 slots, one also serving mac)
    have every slot running a job: the job waits for a runner slot (runners_busy, formerly
    "ready"), and the message tells runner slots from pool slots. A draining runner's free
    slots do not count; one slot freed anywhere makes it next in line."""
    world.setup(pools=("linux", "mac"))
    small, shared = world.runner(slots=2), world.runner(pools=("linux", "mac"), slots=1)
    busy = fill(world, small, 2) + fill(world, shared, 1, pool="mac")
    spare = world.runner(slots=3)
    transitions.beat_runner(world.conn, runner_id=spare, is_draining=True)
    job = world.job()
    code, message, details, codes = explain(world, job["id"])
    assert (code, codes) == ("runners_busy", ["runners_busy"])
    assert message == ("every runner serving pool linux is busy: 3 of 3 runner slots running jobs "
                       "on 2 runners (pool slots: 2 of 100 taken); claimed when a runner slot frees")
    assert details == {"pool": "linux", "runner_slots": 3, "free_runner_slots": 0,
                       "pool_running": 2, "pool_slots": 100, "runner_ids": sorted([small, shared])}
    world.complete(busy[2])
    assert explain(world, job["id"])[:2] == (
        "ready", "next in line for a runner of pool linux (1 of 3 runner slots free)")


def test_running_and_finished_jobs_have_no_reason(world):
    world.setup()
    runner = world.runner()
    world.job()
    c = world.claim(runner)
    assert explain_job(world.conn, job_id=c.job_id)["reasons"] == []
    world.complete(c)
    assert explain_job(world.conn, job_id=c.job_id)["reason"] is None


def test_precedence_paused_before_pool_before_target(world):
    world.setup(pool_slots=1, pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    fill(world, runner, 1, pool="deploy", target="production")
    waiting = world.job(pool="deploy", target="production")
    transitions.pause_project(world.conn, project="web", reason="incident", actor="bob")
    code, _, _, codes = explain(world, waiting["id"])
    assert code == "project_paused"
    assert codes == ["project_paused", "capacity_pool", "target_held"]


def test_precedence_with_every_blocker_at_once_follows_design_order(world):
    """Blocked on a dependency and an approval, paused, no live runner, organization,
    project and pool full, target held: every reason, in DESIGN.md's order."""
    world.setup(org_limit=1, project_limit=1, pool_slots=1, pools=("deploy",), targets=("production",))
    runner = world.runner(pools=("deploy",))
    (holder,) = fill(world, runner, 1, pool="deploy", target="production")
    job = world.job(pool="deploy", target="production", depends_on=[holder.job_id], requires_approval=True)
    transitions.pause_project(world.conn, project="web", reason="incident", actor="bob")
    transitions.pause_pool(world.conn, pool="deploy", reason="incident", actor="bob")
    world.conn.execute("UPDATE runners SET last_heartbeat_at = now() - interval '1 hour'")
    _, _, _, codes = explain(world, job["id"])
    assert codes == ["dependency_pending", "approval_required", "project_paused", "pool_paused",
                     "no_authorized_runner",
                     "capacity_organization", "capacity_project", "capacity_pool", "target_held"]
    assert codes == sorted(codes, key=REASON_CODES.index)


def test_overview_counts_every_reason_and_the_primary_ones_as_the_jobs_explain_them(world):
    """The summary's counts under every reason and under the primary (first) one, and the
    oldest waiting per (pool, primary reason), equal what the waiting jobs' own explanations
    give, one by one; the job waiting for a dependency and an approval counts under both."""
    world.apply({
        "organizations": [{"name": "acme", "max_running": 100}, {"name": "globex", "max_running": 0}],
        "pools": [{"name": "linux", "slots": 100}, {"name": "deploy", "slots": 100},
                  {"name": "mac", "slots": 0}, {"name": "arm", "slots": 10},
                  {"name": "gpu", "slots": 10}],
        "projects": [
            {"name": "web", "organization": "acme", "pools": ["linux", "deploy"]},
            {"name": "api", "organization": "acme", "pools": ["linux"]},
            {"name": "lib", "organization": "acme", "pools": ["linux"], "max_running": 0},
            {"name": "ios", "organization": "acme", "pools": ["mac"]},
            {"name": "embedded", "organization": "acme", "pools": ["arm"]},
            {"name": "shop", "organization": "globex", "pools": ["linux"]},
            {"name": "ml", "organization": "acme", "pools": ["gpu"]},
        ],
        "targets": [{"name": "production"}, {"name": "staging"}],
    })
    runner = world.runner(pools=("linux", "deploy", "mac", "gpu"), slots=10)
    (build,) = fill(world, runner, 1)
    fill(world, runner, 1, pool="deploy", target="production")
    (lost,) = fill(world, runner, 1, pool="deploy", target="staging")
    world.expire_now(lost.attempt_id)
    assert len(transitions.expire_leases(world.conn)) == 1

    for _ in range(2):
        world.job()                                                      # ready
    world.job(delay_seconds=600)                                         # retry_delayed
    gated = world.job(depends_on=[build.job_id], requires_approval=True) # dependency_pending + approval
    world.job(requires_approval=True)                                    # approval_required
    world.job(pool="deploy", target="production")                        # target_held
    world.job(pool="deploy", target="production")                        # target_order (+ held)
    world.job(pool="deploy", target="staging")                           # target_uncertain (+ the lost one)
    for _ in range(2):
        world.job(project="api")                                         # project_paused
    world.job(project="lib")                                             # capacity_project
    for _ in range(2):
        world.job(project="ios", pool="mac")                             # capacity_pool
    for _ in range(3):
        world.job(project="embedded", pool="arm")                        # no_authorized_runner
    world.job(project="shop")                                            # capacity_organization
    world.job(project="ml", pool="gpu")                                  # pool_paused
    world.job(project="ml", pool="gpu", delay_seconds=600)               # pool_paused (delayed too)
    world.job(project="ml", pool="gpu", requires_approval=True)          # approval + pool_paused
    transitions.pause_project(world.conn, project="api", reason="freeze", actor="alice")
    transitions.pause_pool(world.conn, pool="gpu", reason="driver update", actor="alice")

    transitions.summarize_queue(world.conn)
    data = reads.overview(world.conn)
    assert data["primary_counts"] == {
        "dependency_pending": 1, "approval_required": 2, "project_paused": 2, "pool_paused": 2,
        "retry_delayed": 1,
        "no_authorized_runner": 3, "capacity_organization": 1, "capacity_project": 1,
        "capacity_pool": 2, "target_order": 1, "target_held": 1, "target_uncertain": 2,
        "runners_busy": 0, "ready": 2,
    }
    assert data["reason_counts"]["approval_required"] == 3
    assert data["reason_counts"]["pool_paused"] == 3
    assert data["reason_counts"]["target_held"] == 2
    assert data["waiting"] == sum(data["primary_counts"].values()) == 21
    # each waiting job's own reasons agree with the summary's counts, both ways of counting
    jobs = reads.list_waiting(world.conn, limit=100)["jobs"]
    firsts = [j["reasons"][0]["code"] for j in jobs]
    every = [r["code"] for j in jobs for r in j["reasons"]]
    assert {code: firsts.count(code) for code in REASON_CODES} == data["primary_counts"]
    assert {code: every.count(code) for code in REASON_CODES} == data["reason_counts"]
    # and the filter lists a job under any of its reasons, saying which matched
    approvals = reads.list_waiting(world.conn, reason="approval_required")["jobs"]
    assert len(approvals) == 3 and gated["id"] in [j["id"] for j in approvals]
    row = next(j for j in approvals if j["id"] == gated["id"])
    assert (row["reason"], row["matched_reason"]) == ("dependency_pending", "approval_required")
    assert [(r["code"], r["is_primary"], r["is_match"]) for r in row["reasons"]] == [
        ("dependency_pending", True, False), ("approval_required", False, True)]
    # the oldest waiting per (pool, primary reason): blocked since created, queued since ready;
    # a delayed job is not waiting yet, a lost deployment is the uncertain target's
    truth: dict = {}
    for j in jobs:
        if j["state"] == "uncertain" or j["ready_at"] > data["now"] and j["state"] == "queued":
            continue
        key = (j["pool"], j["reasons"][0]["code"])
        since = j["created_at"] if j["state"] == "blocked" else j["ready_at"]
        truth[key] = min(truth.get(key, since), since)
    assert {(o["pool"], o["reason"]): o["since"] for o in data["oldest_waiting"]} == truth
    assert all(o["seconds"] >= 0 for o in data["oldest_waiting"])
