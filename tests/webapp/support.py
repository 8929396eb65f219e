"""Helpers for console and API tests: states built through the real transitions."""

from __future__ import annotations

import functools

from pgdispatch.sql import transitions
from pgdispatch.sql.accounts import hash_password


def make_uncertain_target(world, target: str = "production", *, project: str = "web") -> dict:
    """A deployment whose runner vanished: claim it, let its lease lapse (a test-only UPDATE
    moves the lease into the past), run the expiry pass. Returns the job and claim."""
    world.setup(pools=("linux", "deploy"), targets=(target,), project=project)
    runner = world.runner(pools=("deploy",), name="runner-lost")
    job = world.job(project=project, pool="deploy", target=target, command=["deploy.sh", target])
    claim = world.claim(runner, pools=("deploy",))
    assert claim is not None and claim.job_id == job["id"]
    transitions.heartbeat(world.conn, attempt_id=claim.attempt_id, generation=claim.generation,
                          lease_seconds=30)
    world.expire_now(claim.attempt_id)
    expired = transitions.expire_leases(world.conn)
    assert [e["job_id"] for e in expired] == [job["id"]]
    assert world.conn.execute("SELECT state FROM targets WHERE name = %s", (target,)).fetchone()["state"] == "uncertain"
    return {"job": job, "claim": claim}


def count(conn, table: str, where: str = "true", params: tuple = ()) -> int:
    """Rows of ``table`` matching ``where`` (test-only reads)."""
    assert table in {"jobs", "audit_events", "attempts"}
    return conn.execute(f"SELECT count(*) AS n FROM {table} WHERE {where}", params).fetchone()["n"]


@functools.lru_cache(maxsize=None)
def _password_hash(password: str) -> str:
    return hash_password(password)


def ensure_account(conn, username: str, password: str, role: str) -> None:
    """Create or update an account; each password is argon2-hashed once per test session
    (0.1–0.5 s a hash on this machine), the same stored form ``pgdispatch.sql.accounts.upsert_user``
    writes."""
    conn.execute("INSERT INTO users (username, password_hash, role) VALUES (%s, %s, %s) "
                 "ON CONFLICT (username) DO UPDATE SET password_hash = excluded.password_hash, "
                 "role = excluded.role", (username, _password_hash(password), role))
