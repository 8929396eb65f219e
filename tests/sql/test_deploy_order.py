"""Deployment order per target (sql/functions/claim.sql, "Deployment order"; pgd_target_head):
deployments to one target are claimed in the target's order among the ready ones —
oldest_first or newest_ready_first, priority first — a retry keeps its place, a job that is
not ready (a delayed retry, blocked on an approval or a dependency, a paused project's) lets
the next ready one run, and a ready deployment that is not its target's head explains itself
as target_order. The "zero deploys" case GitLab's newest_first hit: a steady stream of newer
deployments that are not ready must not keep the ready ones from deploying."""

from __future__ import annotations

import pytest

from pgdispatch.sql import reads, transitions
from pgdispatch.sql.explain import explain_job

from .. import variants
from ..factories import World


def ordered(world: World, order: str, **setup) -> int:
    """Two projects on pool linux, target staging in ``order``; returns a runner id."""
    world.setup(targets=(), **setup)
    world.project("api", org="acme", pools=("linux",))
    world.apply({"targets": [{"name": "staging", "deploy_order": order}]})
    return world.runner(slots=10)


def deploy(world: World, project: str = "web", **kw) -> int:
    return world.job(project=project, target="staging", command=("deploy",), **kw)["id"]


def deploy_all(world: World, runner: int) -> list[int]:
    """Claim and succeed deployments one at a time until none is claimable; their job ids."""
    out = []
    while (c := world.claim(runner)) is not None:
        out.append(c.job_id)
        world.complete(c)
    return out


def test_oldest_first_deploys_by_priority_then_oldest(world):
    runner = ordered(world, "oldest_first")
    a, b = deploy(world), deploy(world, project="api")
    urgent = deploy(world, priority=5)
    c = deploy(world, project="api")
    assert deploy_all(world, runner) == [urgent, a, b, c]


def test_newest_ready_first_deploys_by_priority_then_newest(world):
    runner = ordered(world, "newest_ready_first")
    a, b = deploy(world), deploy(world, project="api")
    urgent = deploy(world, priority=5)
    c = deploy(world, project="api")
    assert deploy_all(world, runner) == [urgent, c, b, a]


@pytest.mark.parametrize("order", ["oldest_first", "newest_ready_first"])
def test_a_ready_deployment_that_is_not_its_targets_head_says_which_job_is_next(world, order):
    runner = ordered(world, order)
    a, b = deploy(world), deploy(world, project="api")
    head, other = (a, b) if order == "oldest_first" else (b, a)
    words = "oldest first" if order == "oldest_first" else "newest ready first"
    got = explain_job(world.conn, job_id=other)
    assert got["reason"] == "target_order"
    assert got["message"] == f"target staging deploys {words}: job {head} is next"
    assert got["reasons"][0]["details"] == {"target": "staging", "deploy_order": order, "next_job_id": head}
    assert explain_job(world.conn, job_id=head)["reason"] == "ready"
    # the head taken, the other waits for the target itself
    c = world.claim(runner)
    assert c.job_id == head
    assert explain_job(world.conn, job_id=other)["reason"] == "target_held"


def test_a_claim_never_takes_a_deployment_that_is_not_its_targets_head(world):
    """The head's project is at its bound: the target waits for it rather than deploy an
    older or newer one past it (its order is the target's, whatever the capacity)."""
    world.setup(targets=("staging",))
    world.project("api", org="acme", pools=("linux",), max_running=0)
    runner = world.runner()
    head = deploy(world, project="api")
    later = deploy(world)
    assert world.claim(runner) is None
    assert explain_job(world.conn, job_id=later)["reason"] == "target_order"
    assert explain_job(world.conn, job_id=head)["reason"] == "capacity_project"


@pytest.mark.parametrize("order", ["oldest_first", "newest_ready_first"])
def test_the_zero_deploys_case_newer_unready_deployments_never_starve_the_ready_ones(world, order):
    """A steady stream of newer deployments that are not ready — waiting for an approval,
    a dependency, a delay — arrives between claims: the ready ones still deploy, every round."""
    runner = ordered(world, order)
    build = world.job()  # a dependency that never finishes in this test
    bc = world.claim(runner)
    assert bc.job_id == build["id"]
    ready = [deploy(world) for _ in range(3)]
    deployed = []
    for i in range(6):
        deploy(world, requires_approval=True)
        deploy(world, project="api", depends_on=[build["id"]])
        deploy(world, delay_seconds=600)
        if (c := world.claim(runner)) is not None:
            deployed.append(c.job_id)
            world.complete(c)
    assert sorted(deployed) == ready


def test_a_retry_keeps_its_place_and_a_delayed_one_lets_the_next_run(world):
    runner = ordered(world, "oldest_first")
    first = deploy(world, max_attempts=2)
    second = deploy(world)
    c = world.claim(runner)
    assert c.job_id == first
    world.complete(c, outcome="failed", exit_code=1)
    row = world.row("jobs", first)
    assert row["state"] == "queued" and row["ready_at"] > row["created_at"]
    # in backoff, not ready: the next one deploys meanwhile (no idle target)
    c2 = world.claim(runner)
    assert c2.job_id == second
    world.complete(c2)
    # once ready again it is the head by its old id, ahead of a newer deployment
    third = deploy(world)
    world.conn.execute("UPDATE jobs SET ready_at = now() - interval '1 second' WHERE id = %s", (first,))
    assert explain_job(world.conn, job_id=third)["message"] == (
        f"target staging deploys oldest first: job {first} is next")
    assert world.claim(runner).job_id == first


def test_a_paused_projects_deployment_is_not_the_head(world):
    runner = ordered(world, "oldest_first")
    paused = deploy(world, project="api")
    nxt = deploy(world)
    transitions.pause_project(world.conn, project="api", reason="freeze", actor="alice")
    assert explain_job(world.conn, job_id=nxt)["reason"] == "ready"
    assert world.claim(runner).job_id == nxt
    assert explain_job(world.conn, job_id=paused)["reason"] == "project_paused"


def test_builds_and_other_targets_are_not_ordered_by_a_target(world):
    runner = ordered(world, "newest_ready_first")
    world.apply({"targets": [{"name": "prod"}]})
    d1, d2 = deploy(world), deploy(world)
    p1 = world.job(target="prod", command=("deploy",))["id"]
    b1 = world.job()["id"]
    got = [world.claim(runner).job_id for _ in range(3)]
    assert sorted(got) == sorted([d2, p1, b1]) and d1 not in got
    # a batch claims builds only, and never a deployment (unchanged)
    b2 = world.job()["id"]
    batch = transitions.claim_batch(world.conn, runner_id=runner, pools=world.pool_ids(("linux",)),
                                    claim_tokens=[transitions.new_claim_token() for _ in range(5)],
                                    lease_seconds=30)
    assert [c.job_id for c in batch] == [b2]


def test_the_target_show_lists_what_runs_next_in_order_with_reasons(world):
    runner = ordered(world, "newest_ready_first")
    a = deploy(world)
    b = deploy(world, project="api")
    gated = deploy(world, requires_approval=True)
    delayed = deploy(world, delay_seconds=600)
    t = reads.show_target(world.conn, name="staging")
    assert t["deploy_order"] == "newest_ready_first"
    nxt = t["next"]
    # what runs next first (the ready ones in the target's order), then the others
    assert [j["job_id"] for j in nxt["jobs"]] == [b, a, delayed, gated]
    assert [j["reason"] for j in nxt["jobs"]] == ["ready", "target_order", "retry_delayed",
                                                  "approval_required"]
    assert nxt["head_job_id"] == b and nxt["waiting"] == 4
    assert [j["is_head"] for j in nxt["jobs"]] == [True, False, False, False]
    assert world.claim(runner).job_id == b


def test_the_head_check_is_what_keeps_the_order(world):
    """The same claim without the head check (a deliberately broken variant) takes the
    oldest of a newest_ready_first target: the test above sees the difference."""
    runner = ordered(world, "newest_ready_first")
    a, b = deploy(world), deploy(world)
    world.conn.execute(variants.variant_sql(world.conn, "pgd_claim", [(
        "                        AND j.id = pgd_target_head(j.target_id)))",
        "                        AND true))")]))
    assert world.claim(runner).job_id == a != b
