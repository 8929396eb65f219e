"""Through PgBouncer in transaction pooling, every statement works: several clients whose
transactions share one server connection claim and complete jobs with the real transitions,
and every job ends with its true outcome (issue 16: psycopg's server-side prepared
statements made succeeded jobs end failed behind the pooler; sql/db.py, PREPARE_THRESHOLD)."""

from __future__ import annotations

from pgdispatch.sql import db, transitions

CLIENTS, ROUNDS = 3, 8


def run_through_the_pooler(world, url: str, **connect_kwargs) -> tuple[list[str], int]:
    """CLIENTS connections through the pooler take turns, ROUNDS times each: submit a job,
    claim it, complete it as succeeded; then one lease lapses and an expiry pass ends it.
    Returns (errors, jobs that ended succeeded)."""
    world.setup()
    runner = world.runner(slots=CLIENTS)
    pools = world.pool_ids(("linux",))
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
                    # the audited submit, the claim, the completion: every step through the pooler
                    transitions.submit(conn, project="web", pool="linux", command=["true"],
                                       submitted_by="pooled")
                    c = transitions.claim(conn, runner_id=runner, pools=pools,
                                          claim_token=transitions.new_claim_token(), lease_seconds=60)
                    transitions.complete(conn, attempt_id=c.attempt_id, generation=c.generation,
                                         outcome="succeeded", receipt_key=c.receipt_key)
                except Exception as exc:  # noqa: BLE001 - what the pooler does to us, asserted
                    errors.append(str(exc).splitlines()[0])
        # and the expiry pass: a lease that lapsed is ended through the pooler too
        if conns and not errors:
            transitions.submit(conns[0], project="web", pool="linux", command=["sleep", "60"])
            lost = transitions.claim(conns[1 % len(conns)], runner_id=runner, pools=pools,
                                     claim_token=transitions.new_claim_token(), lease_seconds=0.01)
            world.conn.execute("SELECT pg_sleep(0.05)")
            expired = transitions.expire_leases(conns[-1], backoff_base_seconds=0.01,
                                                backoff_cap_seconds=0.01)
            if [e["attempt_id"] for e in expired] != [lost.attempt_id]:
                errors.append(f"expiry through the pooler ended {expired}")
    finally:
        for conn in conns:
            conn.close()
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
