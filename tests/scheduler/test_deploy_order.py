"""A real scheduler deploying to a newest-ready-first target while a steady stream of newer
deployments that are not ready (waiting for an approval, a dependency, a delay) keeps
arriving: every ready one deploys, newest first, one at a time (the "zero deploys" case of
GitLab's newest_first; sql/functions/claim.sql, "Deployment order")."""

from __future__ import annotations

import time

import pytest

from .. import variants

# GitLab's newest_first: the newest waiting deployment is next, ready or not
NEWEST_WAITING = [("j.state = 'queued'", "j.state IN ('queued', 'blocked')"),
                  ("j.ready_at <= now()", "true")]


@pytest.mark.parametrize("variant", ["real", "newest waiting first"])
def test_a_scheduler_deploys_every_ready_deployment_newest_first_through_a_stream_of_unready_ones(
        world, start_scheduler, variant):
    """And against a deliberately broken head (the newest *waiting* deployment, as GitLab's
    newest_first) the same run deploys nothing: the check sees the starvation."""
    if variant != "real":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_target_head", NEWEST_WAITING))
    world.setup(targets=())
    world.apply({"targets": [{"name": "staging", "deploy_order": "newest_ready_first"}]})
    gate = world.job(requires_approval=True)  # a dependency that is never approved here
    ready = [world.job(target="staging", command=["sleep", "0.2"])["id"] for _ in range(3)]

    def newer_unready() -> int:
        world.job(target="staging", command=["true"], requires_approval=True)
        world.job(target="staging", command=["true"], depends_on=[gate["id"]])
        world.job(target="staging", command=["true"], delay_seconds=600)
        return 3

    # the first newer unready ones before the scheduler starts: the broken head must never
    # meet a moment in which the newest waiting deployment happens to be a ready one
    unready = newer_unready()
    _, signals = start_scheduler(slots=2)
    deadline = time.monotonic() + (20 if variant == "real" else 6)
    while time.monotonic() < deadline:
        unready += newer_unready()
        done = world.conn.execute("SELECT count(*) AS n FROM jobs WHERE id = ANY (%s) "
                                  "AND state = 'succeeded'", (ready,)).fetchone()["n"]
        if done == len(ready):
            break
        time.sleep(0.1)
    claimed = [r["job_id"] for r in world.conn.execute(
        "SELECT job_id FROM attempts ORDER BY claimed_at").fetchall()]
    if variant != "real":
        assert claimed == [], claimed  # zero deploys
        return
    assert claimed == ready[::-1], (claimed, ready)
    assert unready >= 9  # the stream ran while they deployed
    waiting = world.conn.execute("SELECT count(*) AS n FROM jobs WHERE target_id IS NOT NULL "
                                 "AND state IN ('queued', 'blocked')").fetchone()["n"]
    assert waiting == unready
