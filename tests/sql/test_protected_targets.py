"""Approval is a property of the target (sql/functions/operator.sql, pgd_approver_refusal):
a deployment to a protected target is blocked for approval whatever its submission says;
its submitter cannot approve it; its approver holds the target's approver_role, as a console
user (the users row) or as a database login acting as itself (its group). Refused by
PostgreSQL itself: the function is called directly, not only through Python. Each refusal is
also run against a variant without the check, to show the test sees the difference."""

from __future__ import annotations

import psycopg
import pytest

from pgdispatch.sql import Forbidden, db, transitions

from .. import variants
from ..factories import World
from ..logins import Logins

PASSWORDS = {"ALICE_PW": "alice-password", "BOB_PW": "bob-password", "CAROL_PW": "carol-password",
             "VERA_PW": "vera-password"}
NO_SELF_CHECK = ("IF v.submitted_by = p_actor THEN", "IF false THEN")
NO_ROLE_CHECK = ("IF t.requires_approval THEN\n        v_role", "IF false THEN\n        v_role")


def protected(world: World) -> None:
    world.setup(targets=("staging",))
    world.apply({"targets": [{"name": "production", "requires_approval": True, "approver_role": "admin"},
                             {"name": "qa", "requires_approval": True}],
                 "users": [{"username": "alice", "role": "operator", "password_env": "ALICE_PW"},
                           {"username": "bob", "role": "operator", "password_env": "BOB_PW"},
                           {"username": "carol", "role": "admin", "password_env": "CAROL_PW"},
                           {"username": "vera", "role": "viewer", "password_env": "VERA_PW"}]},
                env=PASSWORDS)


def deploy(world, target: str, by: str = "alice", **kw) -> dict:
    return transitions.submit(world.conn, project="web", pool="linux", target=target,
                              command=["deploy"], submitted_by=by, **kw)


def approve_in_sql(conn, job_id: int, actor: str):
    """pgd_approve_job called as any client could, with no Python check in between."""
    return conn.execute("SELECT pgd_approve_job(%s, NULL, %s) AS answer", (job_id, actor)).fetchone()["answer"]


def test_a_protected_target_blocks_every_deployment_for_approval(world):
    protected(world)
    for asked in (False, True):
        job = deploy(world, "production", requires_approval=asked)
        assert (job["state"], job["requires_approval"]) == ("blocked", True)
    # an unprotected target: the submission may still ask for one, and only add it
    assert deploy(world, "staging")["state"] == "queued"
    assert deploy(world, "staging", requires_approval=True)["state"] == "blocked"


@pytest.mark.parametrize("check", ["real", "over-privileged"])
def test_the_submitter_cannot_approve_their_own_deployment(world, check):
    protected(world)
    job = deploy(world, "qa", by="alice")
    if check == "over-privileged":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_approver_refusal", [NO_SELF_CHECK]))
        assert approve_in_sql(world.conn, job["id"], "alice")["state"] == "queued"  # the test would fail
        return
    with pytest.raises(psycopg.Error) as refused, world.conn.transaction():
        approve_in_sql(world.conn, job["id"], "alice")
    assert refused.value.sqlstate == "PD403"
    assert refused.value.diag.message_primary == (
        f"alice submitted job {job['id']} (a deployment to target qa) and cannot approve it; "
        f"another operator must")
    with pytest.raises(Forbidden), world.conn.transaction():
        transitions.approve_job(world.conn, job_id=job["id"], actor="alice")
    # even an unprotected target's deployment that asked for approval
    own = deploy(world, "staging", by="bob", requires_approval=True)
    with pytest.raises(Forbidden), world.conn.transaction():
        transitions.approve_job(world.conn, job_id=own["id"], actor="bob")
    assert world.row("jobs", job["id"])["state"] == "blocked"
    assert transitions.approve_job(world.conn, job_id=job["id"], actor="bob")["state"] == "queued"
    assert world.row("jobs", job["id"])["approved_by"] == "bob"


@pytest.mark.parametrize("check", ["real", "over-privileged"])
def test_an_operator_cannot_approve_where_an_admin_is_required(world, check):
    protected(world)
    job = deploy(world, "production", by="alice")
    if check == "over-privileged":
        world.conn.execute(variants.variant_sql(world.conn, "pgd_approver_refusal", [NO_ROLE_CHECK]))
        assert approve_in_sql(world.conn, job["id"], "bob")["state"] == "queued"  # the test would fail
        return
    for actor, role in (("bob", "is an operator"), ("vera", "is a viewer"), ("mallory", "has no role")):
        with pytest.raises(psycopg.Error) as refused, world.conn.transaction():
            approve_in_sql(world.conn, job["id"], actor)
        assert refused.value.sqlstate == "PD403"
        assert refused.value.diag.message_primary == (
            f"target production requires approval by an admin; {actor} {role}")
    assert transitions.approve_job(world.conn, job_id=job["id"], actor="carol")["state"] == "queued"
    qa = deploy(world, "qa", by="alice")
    assert transitions.approve_job(world.conn, job_id=qa["id"], actor="bob")["state"] == "queued"


def test_a_disabled_user_holds_no_role(world):
    protected(world)
    job = deploy(world, "production")
    world.conn.execute("UPDATE users SET disabled_at = now() WHERE username = 'carol'")
    with pytest.raises(Forbidden), world.conn.transaction():
        transitions.approve_job(world.conn, job_id=job["id"], actor="carol")


@pytest.mark.own_database
def test_a_database_login_approves_with_its_groups_role(conn, db_url):
    """A person's own login acting as itself (the actor is session_user): its group decides."""
    w = World(conn)
    protected(w)
    logins = Logins(db_url)
    try:
        op, op_url = logins.make("dana", groups=("pgdispatch_operator",))
        adm, adm_url = logins.make("erin", groups=("pgdispatch_admin",))
        job = deploy(w, "production")
        with db.connect(op_url) as c:
            with pytest.raises(Forbidden) as refused:
                transitions.approve_job(c, job_id=job["id"], actor=op)
            assert str(refused.value) == f"target production requires approval by an admin; {op} is an operator"
        with db.connect(adm_url) as c:
            assert transitions.approve_job(c, job_id=job["id"], actor=adm)["state"] == "queued"
    finally:
        logins.drop()


@pytest.mark.parametrize("how", ["retry", "resolve"])
def test_an_operators_rerun_of_a_protected_deployment_waits_for_a_new_approval(world, how):
    """An approval covers its submission (and the automatic retries of its max_attempts); an
    operator's retry, or a resolution asking for a re-run, is a new deployment to the
    protected target and waits for a new approval (docs/operations.md)."""
    protected(world)
    job = deploy(world, "qa", by="alice", max_attempts=1)
    approve_in_sql(world.conn, job["id"], "bob")
    runner = world.runner()
    claim = world.claim(runner)
    assert claim.job_id == job["id"]
    if how == "retry":
        transitions.complete(world.conn, attempt_id=claim.attempt_id, generation=claim.generation,
                             outcome="failed", receipt_key=claim.receipt_key, exit_code=1)
        answer = transitions.retry_job(world.conn, job_id=job["id"], actor="bob")
    else:
        world.conn.execute("UPDATE attempts SET lease_expires_at = now() - interval '1 second' "
                           "WHERE id = %s", (claim.attempt_id,))
        transitions.expire_one(world.conn)
        assert world.row("jobs", job["id"])["state"] == "uncertain"
        answer = transitions.resolve_target(world.conn, target="qa", outcome="retry",
                                            note="rerun it", actor="bob")
        assert answer["job_state"] == "blocked"
    row = world.row("jobs", job["id"])
    assert (row["state"], row["requires_approval"], row["approved_at"]) == ("blocked", True, None)
    with pytest.raises(psycopg.Error, match="cannot approve it"):  # still not its submitter's
        with world.conn.transaction():
            approve_in_sql(world.conn, job["id"], "alice")
    assert approve_in_sql(world.conn, job["id"], "carol")["state"] == "queued"
    if how == "retry":
        assert answer["state"] == "blocked"
