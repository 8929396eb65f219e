"""Supersede (sql/functions/submit.sql, pgd_submit and pgd_supersede_older): a newer deployment
to a superseding target ends the older ones still waiting — queued, blocked on a dependency
or an approval — as `superseded`, in the submit's transaction, audited as the system's action;
a running or uncertain one is never touched; a project-and-target pair supersedes only that
project's; a repeated idempotency key supersedes nothing. The race (two submits, one
survivor) is tests/concurrency/test_supersede_races.py."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput, Conflict, bulk, reads, transitions

from ..factories import World


def superseding(world: World, **target) -> None:
    world.setup(targets=())
    world.project("api", org="acme", pools=("linux",))
    world.apply({"targets": [{"name": "staging", "supersede": True, **target},
                             {"name": "prod"}]})


def deploy(world: World, project: str = "web", target: str = "staging", **kw) -> dict:
    return world.job(project=project, target=target, command=("deploy",), **kw)


def state(world: World, job_id: int) -> str:
    return world.row("jobs", job_id)["state"]


def test_each_deployment_supersedes_the_one_before_it(world):
    superseding(world)
    jobs = [deploy(world, project=p) for p in ("web", "api", "web")]
    assert [state(world, j["id"]) for j in jobs] == ["superseded", "superseded", "queued"]
    assert [world.row("jobs", j["id"])["last_error"] for j in jobs[:2]] == [
        f"superseded by job {jobs[1]['id']}", f"superseded by job {jobs[2]['id']}"]


def test_a_newer_deployment_supersedes_every_older_waiting_one_of_any_project(world):
    superseding(world, supersede=False)
    queued = deploy(world)
    delayed = deploy(world, project="api", delay_seconds=600)
    approval = deploy(world, requires_approval=True)
    other_target = deploy(world, target="prod")
    build = world.job()
    world.apply({"targets": [{"name": "staging", "supersede": True}]})
    newer = deploy(world, project="api")
    for old in (queued, delayed, approval):
        row = world.row("jobs", old["id"])
        assert (row["state"], row["last_error"]) == ("superseded", f"superseded by job {newer['id']}")
        assert row["finished_at"] is not None
    assert state(world, newer["id"]) == "queued"
    assert state(world, other_target["id"]) == "queued" and state(world, build["id"]) == "queued"
    events = world.conn.execute(
        "SELECT actor, action, subject, reason, details, job_id FROM audit_events "
        "WHERE action = 'supersede' ORDER BY id").fetchall()
    assert [(e["actor"], e["subject"]) for e in events] == [
        ("system", f"job:{j['id']}") for j in (queued, delayed, approval)]
    assert all(e["details"] == {"superseded_by": newer["id"], "target": "staging"} for e in events)
    assert all(e["job_id"] == int(e["subject"][4:]) for e in events)  # in the job's own trail


def test_a_running_or_uncertain_deployment_is_never_touched(world):
    superseding(world)
    runner = world.runner()
    first = deploy(world)
    c = world.claim(runner)
    assert c.job_id == first["id"]
    waiting = deploy(world)
    deploy(world)
    assert state(world, first["id"]) == "running"
    assert state(world, waiting["id"]) == "superseded"
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    assert state(world, first["id"]) == "uncertain"
    deploy(world)
    assert state(world, first["id"]) == "uncertain"


def test_dependents_of_a_superseded_deployment_are_cancelled_and_its_own_dependencies_kept(world):
    superseding(world)
    build = world.job()
    old = deploy(world, depends_on=[build["id"]])
    smoke = world.job(depends_on=[old["id"]])
    # a newer deployment that waits for an older one to the same target keeps it
    kept = deploy(world)
    newer = deploy(world, depends_on=[kept["id"]])
    assert state(world, old["id"]) == "superseded"
    smoke_row = world.row("jobs", smoke["id"])
    assert (smoke_row["state"], smoke_row["last_error"]) == ("cancelled", f"dependency {old['id']} superseded")
    assert state(world, kept["id"]) == "queued" and state(world, newer["id"]) == "blocked"


def test_a_project_and_target_pair_supersedes_only_that_projects_deployments(world):
    world.setup(targets=("staging",))
    world.apply({"projects": [{"name": "api", "organization": "acme", "pools": ["linux"],
                               "supersede_targets": ["staging"]}]})
    web_old = deploy(world)
    api_old = deploy(world, project="api")
    api_new = deploy(world, project="api")
    assert state(world, api_old["id"]) == "superseded"
    assert state(world, web_old["id"]) == "queued"
    # web has no pair: its newer deployment supersedes nothing
    deploy(world)
    assert state(world, web_old["id"]) == "queued" and state(world, api_new["id"]) == "queued"


def test_a_repeated_idempotency_key_supersedes_nothing(world):
    superseding(world)
    first = deploy(world, idempotency_key="release-1")
    other = deploy(world, idempotency_key="release-2")
    assert state(world, first["id"]) == "superseded"
    again = deploy(world, idempotency_key="release-2")
    assert not again["is_new"] and again["id"] == other["id"]
    assert state(world, other["id"]) == "queued"
    with pytest.raises(Conflict), world.conn.transaction():
        deploy(world, idempotency_key="release-2", priority=5)
    assert state(world, other["id"]) == "queued"


def test_a_target_without_supersede_keeps_every_deployment(world):
    world.setup(targets=("staging",))
    jobs = [deploy(world) for _ in range(3)]
    assert [state(world, j["id"]) for j in jobs] == ["queued"] * 3


def test_a_superseded_job_is_final_for_operators(world):
    superseding(world)
    old = deploy(world, requires_approval=True)
    new = deploy(world)
    with pytest.raises(Conflict, match=rf"job {old['id']} is superseded and cannot be cancelled "
                                       rf"\(superseded by job {new['id']}, at "), world.conn.transaction():
        transitions.cancel_job(world.conn, job_id=old["id"], actor="alice")
    with pytest.raises(Conflict, match=r"superseded"), world.conn.transaction():
        transitions.retry_job(world.conn, job_id=old["id"], actor="alice")
    with pytest.raises(Conflict, match=rf"already approved or ended \(superseded, by system at [^;]*; "
                                       rf"superseded by job {new['id']}, at "), world.conn.transaction():
        transitions.approve_job(world.conn, job_id=old["id"], actor="bob")
    listed = reads.list_jobs(world.conn, state="superseded")["jobs"]
    assert [j["id"] for j in listed] == [old["id"]]


@pytest.mark.parametrize("entry, message", [
    ({"targets": [{"name": "t", "supersede": "yes"}]}, "target t: supersede must be true or false"),
    ({"targets": [{"name": "t", "deploy_order": "newest_first"}]},
     "target t: deploy_order must be one of oldest_first, newest_ready_first"),
    ({"projects": [{"name": "web", "organization": "acme", "supersede_targets": ["nowhere"]}]},
     "project web: supersede_targets names unknown target nowhere"),
    ({"projects": [{"name": "web", "organization": "acme", "supersede_targets": "staging"}]},
     "project web supersede_targets must be a list of target names"),
])
def test_apply_refuses_bad_supersede_and_order_declarations(world, entry, message):
    world.setup(targets=("staging",))
    with pytest.raises(InvalidInput, match=message), world.conn.transaction():
        world.apply(entry)


def test_apply_declares_supersede_order_and_pairs_idempotently(world):
    world.setup(targets=())
    doc = {"targets": [{"name": "staging", "supersede": True, "deploy_order": "newest_ready_first"}],
           "projects": [{"name": "web", "organization": "acme", "pools": ["linux"],
                         "supersede_targets": ["staging"]}]}
    world.apply(doc)
    t = reads.show_target(world.conn, name="staging")
    assert (t["supersede"], t["deploy_order"], t["supersede_projects"]) == (True, "newest_ready_first", ["web"])
    from pgdispatch.sql import config
    lines = ['[[targets]]', 'name = "staging"', 'supersede = true', 'deploy_order = "newest_ready_first"',
             '[[projects]]', 'name = "web"', 'organization = "acme"', 'pools = ["linux"]',
             'supersede_targets = ["staging"]']
    assert config.apply_config(world.conn, "\n".join(lines), actor="test")["changed_rows"] == 0
    world.apply({"targets": [{"name": "staging"}],
                 "projects": [{"name": "web", "organization": "acme", "pools": ["linux"]}]})
    t = reads.show_target(world.conn, name="staging")
    assert (t["supersede"], t["deploy_order"], t["supersede_projects"]) == (False, "oldest_first", [])


# --- a deployment going back to waiting beside a newer one (retry, hand-back, re-run) -------

@pytest.mark.parametrize("outcome", ["failed", "handed_back"])
def test_a_running_deployment_sent_back_to_the_queue_is_superseded_by_a_newer_one(world, outcome):
    superseding(world)
    runner = world.runner()
    old = deploy(world, max_attempts=3)
    c = world.claim(runner)
    assert c.job_id == old["id"]
    newer = deploy(world)
    answer = world.complete(c, outcome=outcome, exit_code=1 if outcome == "failed" else None)
    assert answer["job_state"] == "superseded"
    row = world.row("jobs", old["id"])
    assert (row["state"], row["last_error"]) == ("superseded", f"superseded by job {newer['id']}")
    event = world.conn.execute(
        "SELECT actor, details FROM audit_events WHERE action = 'supersede' AND job_id = %s",
        (old["id"],)).fetchone()
    assert event == {"actor": "system", "details": {"superseded_by": newer["id"], "target": "staging"}}
    # the newer one deploys next; the old one never runs again
    assert world.claim(runner).job_id == newer["id"]


def test_a_retry_with_no_newer_deployment_stays_queued(world):
    superseding(world)
    runner = world.runner()
    old = deploy(world, max_attempts=3)
    c = world.claim(runner)
    assert world.complete(c, outcome="failed", exit_code=1)["job_state"] == "queued"
    other_target = deploy(world, target="prod")
    assert state(world, old["id"]) == "queued" and state(world, other_target["id"]) == "queued"


def test_a_retry_waited_for_by_the_newer_deployment_is_kept(world):
    superseding(world)
    runner = world.runner()
    old = deploy(world, max_attempts=3)
    c = world.claim(runner)
    build = world.job(depends_on=[old["id"]])
    newer = deploy(world, depends_on=[build["id"]])
    assert world.complete(c, outcome="failed", exit_code=1)["job_state"] == "queued"
    assert [state(world, j["id"]) for j in (old, build, newer)] == ["queued", "blocked", "blocked"]


def test_an_operator_retry_or_rerun_of_an_older_deployment_ends_superseded(world):
    superseding(world)
    runner = world.runner()
    old = deploy(world, max_attempts=1)
    c = world.claim(runner)
    newer = deploy(world)
    assert world.complete(c, outcome="failed", exit_code=1)["job_state"] == "failed"
    assert transitions.retry_job(world.conn, job_id=old["id"], actor="alice")["state"] == "superseded"
    assert state(world, newer["id"]) == "queued"
    # an uncertain deployment re-run after a newer one was submitted
    c = world.claim(runner)
    assert c.job_id == newer["id"]
    newest = deploy(world)
    world.expire_now(c.attempt_id)
    transitions.expire_leases(world.conn)
    result = transitions.resolve_target(world.conn, target="staging", outcome="retry",
                                        note="host rebooted", actor="alice")
    assert result["job_state"] == "superseded"
    assert state(world, newer["id"]) == "superseded" and state(world, newest["id"]) == "queued"


@pytest.mark.parametrize("how", ["retry", "bulk retry"])
def test_a_retried_deployment_supersedes_the_older_ones_still_waiting(world, how):
    """A retry puts a newer deployment back to waiting: like a new submit, it supersedes the
    older deployments waiting in its scope. Here supersede is declared after both were
    submitted, the older one waiting for an approval while the newer one ran and failed."""
    world.setup(targets=())
    world.apply({"targets": [{"name": "staging"}]})
    runner = world.runner()
    old = deploy(world, requires_approval=True)
    newer = deploy(world, max_attempts=1)
    c = world.claim(runner)
    assert c.job_id == newer["id"]
    assert world.complete(c, outcome="failed", exit_code=1)["job_state"] == "failed"
    world.apply({"targets": [{"name": "staging", "supersede": True}]})
    if how == "retry":
        assert transitions.retry_job(world.conn, job_id=newer["id"], actor="alice")["state"] == "queued"
    else:
        r = bulk.apply_bulk(world.conn, action="retry", job_ids=[newer["id"]], filters={},
                            reason="flaky host", actor="alice")
        assert r["done"] == [newer["id"]]
    row = world.row("jobs", old["id"])
    assert (row["state"], row["last_error"]) == ("superseded", f"superseded by job {newer['id']}")
    assert world.claim(runner).job_id == newer["id"]


def test_a_superseding_submit_keeps_its_whole_upstream_chain(world):
    superseding(world)
    old = deploy(world)
    build = world.job(depends_on=[old["id"]])
    newer = deploy(world, depends_on=[build["id"]])
    assert [state(world, j["id"]) for j in (old, build, newer)] == ["queued", "blocked", "blocked"]


def test_a_submit_cannot_wait_for_a_superseded_job(world):
    superseding(world)
    old = deploy(world)
    deploy(world)
    with pytest.raises(InvalidInput, match=rf"dependency {old['id']} is superseded"), \
            world.conn.transaction():
        world.job(depends_on=[old["id"]])
