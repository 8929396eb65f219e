"""Claim tombstones one transition at a time (sql/functions/claim.sql, pgd_recover_claims and
pgd_check_tombstones): a claim arriving with a token already voided commits nothing, a
recovery's answer is final and repeatable, tombstones are pruned after a day, and the guards
(a claim's age, READ COMMITTED) refuse what the argument in claim.sql's header cannot cover.
The races, on real connections and through PgBouncer: tests/faults/test_lost_claims.py."""

from __future__ import annotations

import psycopg
import pytest

from pgdispatch.sql import Conflict, InvalidInput, transitions

from .. import variants


def setup(world, kind: str = "build"):
    world.setup(targets=("production",))
    job = world.job(target="production" if kind == "deployment" else None)
    return job, world.runner(slots=8), world.pool_ids(("linux",))


def nothing_claimed(world, job) -> None:
    row = world.row("jobs", job["id"])
    assert (row["state"], row["generation"], row["attempts_made"]) == ("queued", 0, 0)
    assert world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] == 0
    assert world.conn.execute("SELECT state FROM targets").fetchone()["state"] == "free"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}


@pytest.mark.parametrize("kind", ["build", "deployment"])
def test_a_claim_arriving_after_its_recovery_commits_nothing_and_raises(world, kind):
    """The late claim of the issue, in order: the recovery first (void), then the claim with
    that token, as a request held up on the way would arrive."""
    job, runner, pools = setup(world, kind)
    token = transitions.new_claim_token()
    assert transitions.recover_claims(world.conn, claim_tokens=[token], runner_id=runner) == []
    with pytest.raises(Conflict, match=f"claim token {token} was voided by a recovery"), \
            world.conn.transaction():
        transitions.claim(world.conn, runner_id=runner, pools=pools, claim_token=token,
                          lease_seconds=30)
    nothing_claimed(world, job)
    # the job is still there for a fresh claim
    assert world.claim(runner).job_id == job["id"]


def test_a_batch_with_any_voided_token_commits_nothing(world):
    job, runner, pools = setup(world)
    world.job()
    tokens = [transitions.new_claim_token() for _ in range(3)]
    # the second token voided (as by the recovery of another claim that carried it)
    transitions.recover_claims(world.conn, claim_tokens=[tokens[1]], runner_id=runner)
    with pytest.raises(Conflict, match="voided by a recovery"), world.conn.transaction():
        transitions.claim_batch(world.conn, runner_id=runner, pools=pools, claim_tokens=tokens,
                                lease_seconds=30)
    nothing_claimed(world, job)


def test_a_recovery_answers_the_same_every_time_and_records_its_tombstones(world):
    job, runner, pools = setup(world)
    sent = [transitions.new_claim_token() for _ in range(3)]
    claims = transitions.claim_batch(world.conn, runner_id=runner, pools=pools, claim_tokens=sent,
                                     lease_seconds=30)
    assert [c.claim_token for c in claims] == sent[:1]  # one job: the other tokens unused
    first = transitions.recover_claims(world.conn, claim_tokens=sent, runner_id=runner)
    assert first == [(claims[0], "running")]
    world.complete(claims[0])
    again = transitions.recover_claims(world.conn, claim_tokens=sent, runner_id=runner)
    assert again == [(claims[0], "succeeded")]  # the attempt's state now
    rows = world.conn.execute("SELECT claim_token::text AS t, runner_id FROM claim_tombstones "
                              "ORDER BY claim_token").fetchall()
    assert rows == [{"t": t, "runner_id": runner} for t in sorted(sent)]


def test_tombstones_older_than_a_day_are_pruned_by_a_recovery(world):
    _, runner, _ = setup(world)
    old, young = transitions.new_claim_token(), transitions.new_claim_token()
    world.conn.execute("INSERT INTO claim_tombstones (claim_token, runner_id, voided_at) VALUES "
                       "(%s, %s, now() - interval '25 hours'), (%s, %s, now() - interval '23 hours')",
                       (old, runner, young, runner))
    transitions.recover_claims(world.conn, claim_tokens=[transitions.new_claim_token()],
                               runner_id=runner)
    kept = {r["t"] for r in world.conn.execute("SELECT claim_token::text AS t FROM claim_tombstones")}
    assert old not in kept and young in kept and len(kept) == 2


@pytest.mark.parametrize("tokens", [[], ["x"] * 1001])
def test_a_recovery_names_one_to_a_thousand_tokens(world, tokens):
    _, runner, _ = setup(world)
    tokens = [transitions.new_claim_token() if t == "x" else t for t in tokens]
    with pytest.raises(InvalidInput, match="1 to 1000 claim tokens"), world.conn.transaction():
        transitions.recover_claims(world.conn, claim_tokens=tokens, runner_id=runner)


def test_a_null_token_is_refused_by_the_database_too(world):
    _, runner, _ = setup(world)
    with pytest.raises(psycopg.Error, match="none NULL") as info, world.conn.transaction():
        world.conn.execute("SELECT * FROM pgd_recover_claims(ARRAY[NULL]::uuid[], %s)", (runner,))
    assert info.value.sqlstate == "PD422"


def test_a_claim_that_ran_past_its_age_commits_nothing(world):
    """The bound that makes pruning after a day safe (claim.sql's header), shown with the
    age set to nothing: every claim has run longer than that by its last step."""
    world.conn.execute(variants.variant_sql(world.conn, "pgd_claim_max_age",
                                            [("interval '1 hour'", "interval '0'")]))
    job, runner, pools = setup(world)
    with pytest.raises(Conflict, match=r"claim ran for .* nothing of it was committed"), \
            world.conn.transaction():
        transitions.claim(world.conn, runner_id=runner, pools=pools,
                          claim_token=transitions.new_claim_token(), lease_seconds=30)
    nothing_claimed(world, job)


@pytest.mark.own_database  # SET TRANSACTION must open a transaction of its own
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_claims_and_recoveries_refuse_a_snapshot_older_than_their_locks(world, level):
    job, runner, pools = setup(world)
    for call in (lambda: transitions.recover_claims(world.conn, runner_id=runner,
                                                    claim_tokens=[transitions.new_claim_token()]),
                 lambda: transitions.claim(world.conn, runner_id=runner, pools=pools,
                                           claim_token=transitions.new_claim_token(),
                                           lease_seconds=30)):
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="run in READ COMMITTED"), \
                world.conn.transaction():
            world.conn.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
            call()
    nothing_claimed(world, job)
    assert world.conn.execute("SELECT count(*) AS n FROM claim_tombstones").fetchone()["n"] == 0
