"""Through PgBouncer in transaction pooling, every statement works: several clients whose
transactions share one server connection claim and complete jobs with the real transitions,
and every job ends with its true outcome (issue 16: psycopg's server-side prepared
statements made succeeded jobs end failed behind the pooler; sql/db.py, PREPARE_THRESHOLD)."""

from __future__ import annotations

from pgdispatch.sql import db, transitions

CLIENTS, ROUNDS = 3, 8


def take_turns(url: str, one_turn, *, then=None, **connect_kwargs) -> list[str]:
    """CLIENTS connections through the pooler take turns, ROUNDS times each, at
    ``one_turn(conn, errors)``; then, if every turn went well, ``then(conns, errors)``.
    Returns the errors: what a turn appended, and the first line of whatever was raised."""
    errors: list[str] = []
    conns = []
    try:
        for i in range(CLIENTS):
            try:
                conns.append(db.connect(url, application_name=f"pooled-{i}", **connect_kwargs))
            except Exception as exc:  # noqa: BLE001 - the connection's own set-up statement
                errors.append(str(exc).splitlines()[0])
        for _ in range(ROUNDS):
            for conn in conns:
                try:
                    one_turn(conn, errors)
                except Exception as exc:  # noqa: BLE001 - what the pooler does to us, asserted
                    errors.append(str(exc).splitlines()[0])
        if then is not None and conns and not errors:
            then(conns, errors)
    finally:
        for conn in conns:
            conn.close()
    return errors


def run_through_the_pooler(world, url: str, **connect_kwargs) -> tuple[list[str], int]:
    """CLIENTS connections through the pooler take turns, ROUNDS times each: submit a job,
    claim it, complete it as succeeded; then one lease lapses and an expiry pass ends it.
    Returns (errors, jobs that ended succeeded)."""
    world.setup()
    runner = world.runner(slots=CLIENTS)
    pools = world.pool_ids(("linux",))

    def one_turn(conn, errors: list[str]) -> None:
        # the audited submit, the claim, the completion: every step through the pooler
        transitions.submit(conn, project="web", pool="linux", command=["true"],
                           submitted_by="pooled")
        c = transitions.claim(conn, runner_id=runner, pools=pools,
                              claim_token=transitions.new_claim_token(), lease_seconds=60)
        transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                             outcome="succeeded", receipt_key=c.receipt_key)

    def expiry(conns, errors: list[str]) -> None:
        # a lease that lapsed is ended through the pooler too
        transitions.submit(conns[0], project="web", pool="linux", command=["sleep", "60"])
        lost = transitions.claim(conns[1 % len(conns)], runner_id=runner, pools=pools,
                                 claim_token=transitions.new_claim_token(), lease_seconds=0.01)
        world.conn.execute("SELECT pg_sleep(0.05)")
        expired = transitions.expire_leases(conns[-1], backoff_base_seconds=0.01,
                                            backoff_cap_seconds=0.01)
        if [e["attempt_id"] for e in expired] != [lost.attempt_id]:
            errors.append(f"expiry through the pooler ended {expired}")

    errors = take_turns(url, one_turn, then=expiry, **connect_kwargs)
    succeeded = world.conn.execute("SELECT count(*) AS n FROM jobs WHERE state = 'succeeded'"
                                   ).fetchone()["n"]
    return errors, succeeded


def test_clients_sharing_a_server_connection_run_every_transition(world, db_url, pgbouncer_url):
    errors, succeeded = run_through_the_pooler(world, pgbouncer_url(db_url))
    assert errors == []
    assert succeeded == CLIENTS * ROUNDS
    assert world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] == CLIENTS * ROUNDS + 1
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE action = 'submit_job'"
                              ).fetchone()["n"] == CLIENTS * ROUNDS + 1


def test_the_check_fails_with_server_side_prepared_statements(world, db_url, pgbouncer_url):
    """The check above can fail: with psycopg preparing every statement (threshold 0, as its
    default 5 does after five runs), the clients trip over each other's statements."""
    errors, succeeded = run_through_the_pooler(world, pgbouncer_url(db_url), prepare_threshold=0)
    assert errors and any("prepared statement" in e for e in errors), errors
    assert succeeded < CLIENTS * ROUNDS


def run_batches_through_the_pooler(world, url: str, **connect_kwargs) -> tuple[list[str], int]:
    """CLIENTS connections through the pooler take turns, ROUNDS times each: submit three
    builds, claim them in one batch (claim_batch), heartbeat each, report them in one batch
    (complete_batch: two succeeded, one failed). Returns (errors, jobs that ended with the
    outcome reported for them)."""
    world.setup()
    runner = world.runner(slots=3 * CLIENTS)
    pools = world.pool_ids(("linux",))

    def one_turn(conn, errors: list[str]) -> None:
        for _ in range(3):
            transitions.submit(conn, project="web", pool="linux", command=["true"])
        claims = transitions.claim_batch(
            conn, runner_id=runner, pools=pools, lease_seconds=60,
            claim_tokens=[transitions.new_claim_token() for _ in range(3)])
        if len(claims) != 3:
            errors.append(f"claim_batch took {len(claims)} of 3")
        for c in claims:
            lease = transitions.heartbeat(conn, attempt_id=c.attempt_id,
                                          generation=c.generation, lease_seconds=120,
                                          output_tail="still going")
            if lease.is_cancel_requested:
                errors.append(f"attempt {c.attempt_id}: a cancel no one asked for")
        answers = transitions.complete_batch(conn, items=[
            {"attempt_id": c.attempt_id, "generation": c.generation,
             "outcome": "failed" if i == 2 else "succeeded",
             "exit_code": 1 if i == 2 else 0, "receipt_key": c.receipt_key}
            for i, c in enumerate(claims)])
        if len(answers) != len(claims):
            errors.append(f"complete_batch answered {len(answers)} of {len(claims)}")

    errors = take_turns(url, one_turn, **connect_kwargs)
    true_outcomes = world.conn.execute("""
        SELECT count(*) AS n FROM jobs j JOIN attempts a ON a.job_id = j.id
         WHERE a.state = j.state AND a.last_heartbeat_at IS NOT NULL
           AND a.lease_expires_at > a.claimed_at + interval '90 seconds'
           AND (j.state, a.exit_code) IN (('succeeded', 0), ('failed', 1))""").fetchone()["n"]
    return errors, true_outcomes


def test_batches_and_heartbeats_run_through_a_shared_server_connection(world, db_url,
                                                                        pgbouncer_url):
    errors, true_outcomes = run_batches_through_the_pooler(world, pgbouncer_url(db_url))
    assert errors == []
    assert true_outcomes == 3 * CLIENTS * ROUNDS
    assert world.conn.execute("SELECT state, count(*) AS n FROM jobs GROUP BY 1 ORDER BY 1"
                              ).fetchall() == [{"state": "failed", "n": CLIENTS * ROUNDS},
                                               {"state": "succeeded", "n": 2 * CLIENTS * ROUNDS}]


def test_the_batch_check_fails_with_server_side_prepared_statements(world, db_url, pgbouncer_url):
    errors, true_outcomes = run_batches_through_the_pooler(world, pgbouncer_url(db_url),
                                                           prepare_threshold=0)
    assert errors and any("prepared statement" in e for e in errors), errors
    assert true_outcomes < 3 * CLIENTS * ROUNDS
