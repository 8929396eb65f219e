"""The state transitions, as thin typed functions over the named statements.

Each function takes the connection first. On an idle (autocommit) connection it runs as its
own short transaction, retried after deadlock or serialization failure; inside the caller's
``with conn.transaction():`` it runs once and the caller owns the retry (``pgdispatch.sql.db``).
Every time is the database's (DESIGN.md, "Transitions").
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from . import explain, history, metrics
from .db import transition
from .errors import FencedOut, IncompatibleDatabase, InvalidInput
from .audit import check_actor
from .queries import Q
from .settings import MAX_DUTY_SECONDS
from .validate import check_command, check_int, check_lease_seconds, check_number, check_text

log = logging.getLogger(__name__)

OUTCOMES = ("succeeded", "failed", "cancelled", "handed_back", "lost")
RESOLUTIONS = ("succeeded", "failed", "retry")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claimed job: the attempt to run, its fence generation and lease (database time)."""

    job_id: int
    attempt_id: int
    attempt_no: int
    generation: int
    lease_expires_at: dt.datetime
    project_id: int
    pool_id: int
    target_id: int | None
    command: list[str]
    timeout_seconds: int
    claim_token: str
    # whether the claim that took it saw more work waiting for this runner (pgd_more_waiting:
    # a hint; False for a recovered claim), not part of what the claim is
    more_waiting: bool = dataclasses.field(default=False, compare=False)
    # the pool's name and how long the job waited, ready_at to claimed_at (seconds), as the
    # claim answered them (None for a recovered claim): the wait-time histogram's observation
    pool: str | None = dataclasses.field(default=None, compare=False)
    wait_seconds: float | None = dataclasses.field(default=None, compare=False)

    @property
    def is_deployment(self) -> bool:
        return self.target_id is not None

    @property
    def receipt_key(self) -> str:
        """The delivery receipt key for this attempt's completion (stable across retries)."""
        return f"{self.claim_token}:complete"


@dataclasses.dataclass(frozen=True)
class Lease:
    """A heartbeat's answer: the new expiry (database time) and whether cancel was asked."""

    lease_expires_at: dt.datetime
    is_cancel_requested: bool


def clean_report(output_tail: str | None, error: str | None) -> tuple[str | None, str | None]:
    """A completion's texts as the database takes them: NUL (which text and jsonb cannot
    hold) replaced by U+FFFD, the error cut to 2,000 characters. Returns (output_tail, error)."""
    if output_tail is not None:
        output_tail = output_tail.replace("\x00", "\ufffd")
    if error is not None:
        error = error.replace("\x00", "\ufffd")[:2000]
    return output_tail, error


def new_claim_token() -> str:
    """A fresh claim token (UUID4 text)."""
    return str(uuid.uuid4())


def _claim_from(row: dict[str, Any], claim_token: str) -> Claim:
    return Claim(job_id=row["job_id"], attempt_id=row["attempt_id"], attempt_no=row["attempt_no"],
                 generation=row["generation"], lease_expires_at=row["lease_expires_at"],
                 project_id=row["project_id"], pool_id=row["pool_id"], target_id=row["target_id"],
                 command=list(row["command"]), timeout_seconds=row["timeout_seconds"],
                 claim_token=str(claim_token), more_waiting=bool(row.get("more_waiting")),
                 pool=row.get("pool"), wait_seconds=row.get("wait_seconds"))


@transition("claim", one_statement=True)
def claim(conn, *, runner_id: int, pools: Sequence[int], claim_token: str,
          lease_seconds: float) -> Claim | None:
    """Claim the next eligible job for ``runner_id`` on any of ``pools`` (pool ids).

    One transaction (pgd_claim, sql/functions/claim.sql): the job taken with SKIP LOCKED, a
    deployment's free target, the project claim lock, then a slot of the organization and
    one of the pool from capacity stripes with room (SKIP LOCKED); the generation bumped and
    the attempt inserted with a lease of ``lease_seconds`` (seconds, from the database's
    clock). Returns None when nothing is eligible; the claim's ``more_waiting`` says whether
    more work looked waiting for this runner (a hint: pgd_more_waiting).

    Raises:
        NotFound: unknown runner. InvalidInput: bad lease. Conflict: claim token reused, or
        voided by ``recover_claims`` (nothing of the claim committed).
    """
    started = time.perf_counter()
    row = Q.claim(conn, runner_id=runner_id, pool_ids=list(pools),
                  claim_token=str(claim_token), lease_seconds=float(lease_seconds))
    metrics.CLAIM_SECONDS.observe(time.perf_counter() - started)
    return None if row is None else _claim_from(row, claim_token)


@transition("claim_batch", one_statement=True)
def claim_batch(conn, *, runner_id: int, pools: Sequence[int], claim_tokens: Sequence[str],
                lease_seconds: float) -> list[Claim]:
    """Claim up to ``len(claim_tokens)`` build jobs of one (project, pool) in one transaction
    (pgd_claim_batch, sql/functions/claim.sql): same fairness, lock order and capacity
    checks as ``claim``; deployments are left to ``claim``. Returns the claims (maybe none),
    each with the batch's ``more_waiting``.

    Raises:
        InvalidInput: 0 or more than 1000 tokens, bad lease. NotFound: unknown runner.
        Conflict: a token reused, or voided by ``recover_claims`` (nothing committed).
    """
    tokens = [str(t) for t in claim_tokens]
    started = time.perf_counter()
    rows = list(Q.claim_batch(conn, runner_id=runner_id, pool_ids=list(pools),
                              claim_tokens=tokens, lease_seconds=float(lease_seconds)))
    metrics.CLAIM_SECONDS.observe(time.perf_counter() - started)
    return [_claim_from(r, r["claim_token"]) for r in rows]


@transition("complete_batch", one_statement=True)
def complete_batch(conn, *, items: Sequence[dict[str, Any]], backoff_base_seconds: float = 2.0,
                   backoff_cap_seconds: float = 300.0) -> list[dict[str, Any]]:
    """Record several outcomes in one transaction (pgd_complete_batch,
    sql/functions/complete.sql): jobs, targets and attempts locked first, by id; the builds
    that succeeded completed together, set-based, every other item as ``complete`` would, one
    by one; then the slots of them all released at once, last (organization stripes, then
    pool stripes: the lock order).

    ``items``: dicts with attempt_id, generation, outcome, receipt_key and optionally
    exit_code, error, output_tail. Returns one answer per item, in order; a fenced item answers
    {"status": "fenced", ...} instead of raising.
    Raises:
        InvalidInput: a bad outcome or receipt key, more than 1000 items.
    """
    clean = []
    for item in items:
        if item.get("outcome") not in OUTCOMES:
            raise InvalidInput(f"outcome must be one of {', '.join(OUTCOMES)}, got {item.get('outcome')!r}")
        check_text("receipt key", item.get("receipt_key"), max_len=200)
        row = {k: item.get(k) for k in ("attempt_id", "generation", "outcome", "receipt_key",
                                         "exit_code", "error", "output_tail")}
        row["output_tail"], row["error"] = clean_report(row["output_tail"], row["error"])
        clean.append(row)
    rows = Q.complete_batch(conn, items=json.dumps(clean), backoff_base_seconds=backoff_base_seconds,
                            backoff_cap_seconds=backoff_cap_seconds)
    return [r["answer"] for r in rows]


@transition("recover_claims", one_statement=True)
def recover_claims(conn, *, claim_tokens: Sequence[str], runner_id: int) -> list[tuple[Claim, str]]:
    """After the answer to a claim was lost: settle for good whether it committed.

    ``claim_tokens`` are exactly the tokens of one claim: the one token of ``claim``, or
    every token of one ``claim_batch``, in the order they were sent (the first keys the lock
    both sides take). One statement (pgd_recover_claims, sql/functions/claim.sql): a
    tombstone for every token, recorded as voided by ``runner_id``, then a wait for a claim
    with these tokens that is past its tombstone check (about to commit; a claim blocked
    before that, on a lock, is not waited for), then the attempts that carry the tokens.
    It never needs the lost server session, which behind a pooler is not the client's.

    Returns:
        (claim, attempt state) for each token whose claim committed, in token order. Every
        token not returned is void: no claim with it can commit any more. Asking again
        gives the same answer.
    Raises:
        InvalidInput: no tokens, or more than 1000.
    """
    tokens = [str(t) for t in claim_tokens]
    if not 1 <= len(tokens) <= 1000:
        raise InvalidInput(f"a recovery names 1 to 1000 claim tokens, got {len(tokens)}")
    rows = Q.recover_claims(conn, claim_tokens=tokens, runner_id=runner_id)
    return [(_claim_from(r, r["claim_token"]), r["state"]) for r in rows]


@transition("capacity_waiting", one_statement=True)
def capacity_waiting(conn, *, runner_id: int, pools: Sequence[int]) -> bool:
    """Whether work for ``runner_id`` in ``pools`` (pool ids) waits for capacity that running
    jobs hold: a queued, ready job whose project is at its bound, or whose organization or
    pool has no free slot (pgd_capacity_waiting, sql/functions/claim.sql). A scheduler asks
    after a claim found nothing while it runs jobs: a completion of one of them then claims at
    once. A hint: true may be followed by one empty claim.

    Raises:
        NotFound: unknown runner. Forbidden: the runner is another login's.
    """
    return bool(Q.capacity_waiting(conn, runner_id=runner_id, pool_ids=list(pools)))


@transition("heartbeat")
def heartbeat(conn, *, attempt_id: int, generation: int, lease_seconds: float,
              output_tail: str | None = None) -> Lease:
    """Extend the lease of a running attempt by ``lease_seconds`` from the database's now.

    A conditional UPDATE: only if the attempt is still running with that generation.
    ``output_tail``, when given, replaces the attempt's stored output so far (evidence for an
    operator if the runner is lost).

    Raises:
        FencedOut: no such running attempt with that generation; stop the work now.
        InvalidInput: ``lease_seconds`` not in (0, 86400] (sql.validate.check_lease_seconds).
    """
    lease_seconds = check_lease_seconds(lease_seconds)
    if output_tail is not None:
        output_tail = output_tail.replace("\x00", "\ufffd")
    row = Q.heartbeat(conn, attempt_id=attempt_id, generation=generation,
                      lease_seconds=lease_seconds, output_tail=output_tail)
    if row is None:
        raise FencedOut(f"attempt {attempt_id} generation {generation} is fenced out")
    return Lease(row["lease_expires_at"], row["is_cancel_requested"])


@transition("heartbeat_batch", one_statement=True)
def heartbeat_batch(conn, *, beats: Sequence[tuple[int, int, str | None]],
                    lease_seconds: float) -> dict[int, Lease]:
    """Extend the leases of several running attempts in one transaction, each on exactly
    ``heartbeat``'s conditions (pgd_heartbeat_batch, sql/functions/runners.sql).

    ``beats``: (attempt_id, generation, output_tail or None) for each, at most 1000.
    Returns the Lease of every attempt renewed, by attempt id; an attempt missing from it is
    fenced out (stop its work now), as ``heartbeat`` raising FencedOut says for one.
    Raises:
        InvalidInput: ``lease_seconds`` not in (0, 86400], or more than 1000 beats.
    """
    lease_seconds = check_lease_seconds(lease_seconds)
    if len(beats) > 1000:
        raise InvalidInput(f"a heartbeat batch names at most 1000 attempts, got {len(beats)}")
    if not beats:
        return {}
    rows = Q.heartbeat_batch(
        conn, attempt_ids=[int(b[0]) for b in beats], generations=[int(b[1]) for b in beats],
        lease_seconds=lease_seconds,
        output_tails=[None if b[2] is None else b[2].replace("\x00", "\ufffd") for b in beats])
    return {r["attempt_id"]: Lease(r["lease_expires_at"], r["is_cancel_requested"]) for r in rows}


@transition("complete", one_statement=True)
def complete(conn, *, attempt_id: int, generation: int, outcome: str, receipt_key: str,
             exit_code: int | None = None, error: str | None = None,
             output_tail: str | None = None, backoff_base_seconds: float = 2.0,
             backoff_cap_seconds: float = 300.0) -> dict[str, Any]:
    """Record an attempt's outcome once and release every reservation it holds (pgd_complete,
    sql/functions/complete.sql).

    ``outcome`` is one of succeeded, failed, cancelled, handed_back, lost. A repeated
    ``receipt_key`` returns the first answer with ``repeated: true``. A failure with attempts
    left re-queues the job after backoff (seconds, equal jitter; pgd_backoff_seconds).

    Returns:
        {"status", "job_id", "attempt_id", "job_state", "attempt_state", "ready_at",
         "is_late_report", "repeated"}.
    Raises:
        FencedOut: the attempt is not the job's current one. NotFound: unknown attempt.
        InvalidInput: unknown outcome or bad receipt key.
    """
    if outcome not in OUTCOMES:
        raise InvalidInput(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
    check_text("receipt key", receipt_key, max_len=200)
    output_tail, error = clean_report(output_tail, error)
    return Q.complete(conn, attempt_id=attempt_id, generation=generation, outcome=outcome,
                      exit_code=exit_code, error=error, output_tail=output_tail,
                      receipt_key=receipt_key, backoff_base_seconds=backoff_base_seconds,
                      backoff_cap_seconds=backoff_cap_seconds)


@transition("expire_one")
def expire_one(conn, *, backoff_base_seconds: float = 2.0, backoff_cap_seconds: float = 300.0,
               pool_ids: Sequence[int] | None = None) -> dict[str, Any] | None:
    """End one lapsed lease (pgd_expire_one, sql/functions/expire.sql): a build is queued
    again after backoff (seconds) or fails, a deployment becomes uncertain and keeps its
    target. Returns {"attempt_id", "job_id", "job_state", "is_deployment"}, with "failed"
    (a list of {"attempt_id", "job_id", "sqlstate", "error"}) when a lease before it could
    not be ended; only {"failed": [...]} when none could; None when no lease has lapsed.
    ``pool_ids``: only the jobs of those pools (None: every pool)."""
    result = Q.expire_one(conn, backoff_base_seconds=backoff_base_seconds,
                          backoff_cap_seconds=backoff_cap_seconds,
                          pool_ids=None if pool_ids is None else list(pool_ids))
    if result is not None and "attempt_id" in result:
        metrics.LEASE_EXPIRATIONS.labels(
            kind="deployment" if result["is_deployment"] else "build").inc()
    return result


def expire_leases(conn, *, limit: int = 1000, backoff_base_seconds: float = 2.0,
                  backoff_cap_seconds: float = 300.0,
                  pool_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One expiry pass: end lapsed leases one per transaction, at most ``limit`` of them.

    A lease that cannot be ended (an error on its row) does not stop the pass: it is logged
    once per pass, counted in ``pgdispatch_lease_expiry_failures_total``, named in its job's
    last_error by the database, and the other leases are ended. Returns the leases ended.
    ``pool_ids``: only the jobs of those pools (None: every pool).
    """
    done, failed = [], set()
    while len(done) < limit:
        result = expire_one(conn, backoff_base_seconds=backoff_base_seconds,
                            backoff_cap_seconds=backoff_cap_seconds, pool_ids=pool_ids)
        if result is None:
            break
        for f in result.get("failed", ()):
            if f["attempt_id"] not in failed:
                failed.add(f["attempt_id"])
                metrics.EXPIRY_FAILURES.inc()
                log.error("could not end the lapsed lease of attempt %s (job %s): %s (SQLSTATE %s)",
                          f["attempt_id"], f["job_id"], f["error"], f["sqlstate"])
        if "attempt_id" not in result:
            break  # every lapsed lease left failed
        done.append(result)
    return done


@transition("submit")
def submit(conn, *, project: str, pool: str, command: Sequence[str], target: str | None = None,
           priority: int = 0, max_attempts: int = 1, timeout_seconds: int = 3600,
           delay_seconds: float = 0.0, requires_approval: bool = False,
           depends_on: Sequence[int] = (), idempotency_key: str | None = None,
           submitted_by: str | None = None) -> dict[str, Any]:
    """Enqueue one job and audit it (``submit_job`` by ``submitted_by``, the authenticated
    identity, or the database login when None; pgd_authorize, 'operator'; in the same
    transaction; pgd_submit, sql/functions/submit.sql); returns the job
    as ``get_job`` does, plus ``is_new``. A repeated key records nothing.

    Limits: command 1–256 arguments, 64 KiB in all, no NUL; priority −1000…1000;
    max_attempts 1–100; timeout_seconds 1–604800; delay_seconds 0–2592000.

    A repeated ``idempotency_key`` (per project) returns the job of the first submit with
    ``is_new`` False when the request is the same (pool, target, command, priority,
    max_attempts, timeout_seconds, requires_approval, the set of depends_on; not the delay).

    Raises:
        InvalidInput, NotFound: bad values, unknown project/pool/target/dependency, pool not
        granted, a dependency that already failed. Nothing is written then.
        Conflict: the idempotency key was used for a job with a different request; nothing
        is written.
    """
    command = check_command(command)
    check_text("project", project, max_len=63)
    check_text("pool", pool, max_len=63)
    if target is not None:
        check_text("target", target, max_len=63)
    priority = check_int("priority", priority, -1000, 1000, strict=True)
    max_attempts = check_int("max attempts", max_attempts, 1, 100, strict=True)
    timeout_seconds = check_int("timeout", timeout_seconds, 1, 604800, strict=True)
    delay_seconds = check_number("delay", delay_seconds, 0, 2592000)
    if isinstance(depends_on, (str, bytes)) or not isinstance(depends_on, Sequence):
        raise InvalidInput("depends_on must be a list of job ids")
    deps = [check_int("dependency id", d, 1, 2**63 - 1, strict=True) for d in depends_on]
    if idempotency_key is not None:
        check_text("idempotency key", idempotency_key, max_len=200)
    submitted_by = check_actor(submitted_by)
    row = Q.submit(conn, project=project, pool=pool, target=target, command=command,
                   priority=priority, max_attempts=max_attempts,
                   timeout_seconds=timeout_seconds, delay_seconds=delay_seconds,
                   requires_approval=bool(requires_approval), depends_on=deps,
                   idempotency_key=idempotency_key, submitted_by=submitted_by)
    job = Q.get_job(conn, job_id=row["job_id"])
    job["is_new"] = row["is_new"]
    return job


def _operator_text(kind: str, value: str | None, *, required: bool) -> str | None:
    if value is None or value.strip() == "":
        if required:
            raise InvalidInput(f"a {kind} is required")
        return None
    return check_text(kind, value, max_len=1000)


# The operator actions: ``actor`` is the console's signed-in user, or None for a CLI login,
# which acts as itself; the database decides whether that login, or that user, may act
# (pgd_authorize, sql/functions/audit.sql) and raises Forbidden (PD403) when not.
@transition("pause_project")
def pause_project(conn, *, project: str, reason: str, actor: str | None) -> dict[str, Any]:
    """Pause a project with a mandatory reason; audited.

    Raises: NotFound; AlreadyResolved when it is already paused (says by whom).
    """
    check_text("project", project, max_len=63)
    return Q.pause_project(conn, project=project, actor=check_actor(actor),
                           reason=_operator_text("reason", reason, required=True))


@transition("resume_project")
def resume_project(conn, *, project: str, actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Resume a paused project; audited. Raises NotFound, Conflict when not paused."""
    check_text("project", project, max_len=63)
    return Q.resume_project(conn, project=project, actor=check_actor(actor),
                            reason=_operator_text("reason", reason, required=False))


@transition("pause_pool")
def pause_pool(conn, *, pool: str, reason: str, actor: str | None) -> dict[str, Any]:
    """Pause a pool with a mandatory reason: no claim takes from it until it is resumed
    (its running jobs go on); audited.

    Returns {"pool", "paused_at" (the database's clock once the claims in flight were
    fenced), "paused_by", "pause_reason"}.
    Raises: InvalidInput (no reason); NotFound; AlreadyResolved when it is already paused
    (says by whom, when and why).
    """
    check_text("pool", pool, max_len=63)
    return Q.pause_pool(conn, pool=pool, actor=check_actor(actor),
                        reason=_operator_text("reason", reason, required=True))


@transition("resume_pool")
def resume_pool(conn, *, pool: str, actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Resume a paused pool; audited; its listening schedulers are woken.

    Returns {"pool", "paused_at": None}.
    Raises: NotFound; AlreadyResolved when it is not paused (says who resumed it).
    """
    check_text("pool", pool, max_len=63)
    return Q.resume_pool(conn, pool=pool, actor=check_actor(actor),
                         reason=_operator_text("reason", reason, required=False))


MAX_DRAIN_DEADLINE_SECONDS = 604800  # a week: pgd_drain_runner's own bound


@transition("drain_runner")
def drain_runner(conn, *, runner_id: int, reason: str, actor: str | None,
                 deadline_seconds: int | None = None) -> dict[str, Any]:
    """Drain a runner: its claims take nothing from now on, it finishes what it runs; after
    ``deadline_seconds`` (None: no deadline; 0..604800) its scheduler hands its running
    builds back (deployments are never cut). The scheduler learns it on its next beat.
    Audited.

    Returns {"runner_id", "name", "drain_requested_at", "drain_requested_by",
    "drain_reason", "drain_deadline"} (database times).
    Raises: InvalidInput (no reason, a deadline out of range); NotFound; Conflict for a
    stopped runner; AlreadyResolved when it is already draining (says by whom and when).
    """
    if deadline_seconds is not None:
        deadline_seconds = check_int("deadline seconds", deadline_seconds, 0,
                                     MAX_DRAIN_DEADLINE_SECONDS)
    return Q.drain_runner(conn, runner_id=check_int("runner id", runner_id, 1, 2**63 - 1),
                          deadline_seconds=deadline_seconds, actor=check_actor(actor),
                          reason=_operator_text("reason", reason, required=True))


@transition("resume_runner")
def resume_runner(conn, *, runner_id: int, actor: str | None,
                  reason: str | None = None) -> dict[str, Any]:
    """Resume a drained runner: it claims again (woken at once when it listens, else at its
    next beat); audited.

    Returns {"runner_id", "name", "drain_requested_at": None}.
    Raises: NotFound; AlreadyResolved when it is not drained (says who resumed it).
    """
    return Q.resume_runner(conn, runner_id=check_int("runner id", runner_id, 1, 2**63 - 1),
                           actor=check_actor(actor),
                           reason=_operator_text("reason", reason, required=False))


@transition("approve_job")
def approve_job(conn, *, job_id: int, actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Approve a job that requires approval; audited. Raises NotFound, Conflict."""
    return Q.approve_job(conn, job_id=check_int("job id", job_id, 1, 2**63 - 1),
                         actor=check_actor(actor),
                         reason=_operator_text("reason", reason, required=False))


@transition("cancel_job")
def cancel_job(conn, *, job_id: int, actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Cancel a waiting job now, or ask a running job's runner to stop it; audited."""
    return Q.cancel_job(conn, job_id=check_int("job id", job_id, 1, 2**63 - 1),
                        actor=check_actor(actor),
                        reason=_operator_text("reason", reason, required=False))


@transition("retry_job")
def retry_job(conn, *, job_id: int, actor: str | None, reason: str | None = None) -> dict[str, Any]:
    """Queue a failed or cancelled job again now; audited. Raises NotFound, Conflict."""
    return Q.retry_job(conn, job_id=check_int("job id", job_id, 1, 2**63 - 1),
                       actor=check_actor(actor),
                       reason=_operator_text("reason", reason, required=False))


@transition("set_priority")
def set_priority(conn, *, job_id: int, priority: int, actor: str | None,
                 reason: str | None = None) -> dict[str, Any]:
    """Set the priority (-1000..1000, higher first within its project) of a waiting job
    (blocked or queued); audited with the old and the new one. Returns {"job_id", "state",
    "priority", "previous_priority"}.

    Raises: InvalidInput (a priority out of range), NotFound, AlreadyResolved (the job is
    no longer waiting, or already has that priority).
    """
    return Q.set_priority(conn, job_id=check_int("job id", job_id, 1, 2**63 - 1),
                          priority=check_int("priority", priority, -1000, 1000, strict=True),
                          actor=check_actor(actor),
                          reason=_operator_text("reason", reason, required=False))


@transition("resolve_target")
def resolve_target(conn, *, target: str, outcome: str, note: str, actor: str | None) -> dict[str, Any]:
    """Resolve an uncertain target: the lost deployment succeeded, failed, or should retry.

    Raises:
        InvalidInput: bad outcome or empty note. NotFound: unknown target.
        AlreadyResolved: the target is no longer uncertain (says who resolved it, when).
    """
    if outcome not in RESOLUTIONS:
        raise InvalidInput(f"outcome must be one of {', '.join(RESOLUTIONS)}, got {outcome!r}")
    check_text("target", target, max_len=63)
    return Q.resolve_target(conn, target=target, outcome=outcome,
                            note=_operator_text("note", note, required=True),
                            actor=check_actor(actor))


@transition("register_runner")
def register_runner(conn, *, name: str, pools: Sequence[str], slots: int, hostname: str = "",
                    pid: int | None = None) -> int:
    """Insert this scheduler's runner row; returns its id.

    Raises: NotFound when a pool name is unknown; InvalidInput for bad slots;
    IncompatibleDatabase when the session's transactions do not run in READ COMMITTED (a
    default set for the database or role), where claims and their recovery refuse to run
    (sql/functions/claim.sql): a scheduler would start and never claim.
    """
    isolation = Q.transaction_isolation(conn)
    if isolation != "read committed":
        raise IncompatibleDatabase(
            f"this session's transactions run in {isolation.upper()}; claims need READ "
            "COMMITTED: ALTER ROLE <role> SET default_transaction_isolation = 'read committed' "
            "(or RESET it for the database)")
    check_text("runner name", name, max_len=200)
    slots = check_int("slots", slots, 1, 10000)
    pools = [check_text("pool", p, max_len=63) for p in pools]
    if not pools:
        raise InvalidInput("a runner needs at least one pool")
    runner_id = Q.register_runner(conn, name=name, hostname=hostname, pid=pid,
                                  pools=list(dict.fromkeys(pools)), slots=slots)
    if runner_id is None:
        from .errors import NotFound
        raise NotFound(f"unknown pool among {', '.join(pools)}")
    return runner_id


@transition("beat_runner")
def beat_runner(conn, *, runner_id: int, is_draining: bool = False, beat_seconds: float = 15.0,
                duty_lease_seconds: float = 20.0) -> list[dict[str, Any]]:
    """Mark the runner alive now (database time) and carry the duty election: renew the
    duties it holds and take over the lapsed ones for ``duty_lease_seconds``, or, draining,
    release its own (pgd_beat_runner, sql/functions/runners.sql). ``beat_seconds``: the
    longest this runner goes between beats (the cleanup duty counts silence in it).

    Returns every duty, by name: {"duty", "runner_id", "runner_name", "term", "held_since",
    "expires_at", "last_done_at", "is_mine", "db_now", "leases_overdue",
    "next_lease_expiry", "drain_requested_at", "drain_requested_by", "drain_reason",
    "drain_deadline"} (database times; leases_overdue: a lease of this runner's pools
    lapsed more than ``duty_lease_seconds`` ago, whoever holds the expiry duty;
    next_lease_expiry: when the first running lease lapses, None when none runs; drain_*:
    an operator's drain of this runner, the same on every row, None when not drained).
    Raises: InvalidInput for a beat or lease outside (0, 300] seconds.
    """
    beat_seconds = check_number("beat seconds", beat_seconds, 0, MAX_DUTY_SECONDS)
    duty_lease_seconds = check_number("duty lease seconds", duty_lease_seconds, 0,
                                      MAX_DUTY_SECONDS)
    return list(Q.beat_runner(conn, runner_id=runner_id, draining=is_draining,
                              beat_seconds=beat_seconds, duty_lease_seconds=duty_lease_seconds))


@transition("stop_runner")
def stop_runner(conn, *, runner_id: int) -> None:
    """Mark the runner stopped and release the duties it holds (the next beat of another
    runner takes them over)."""
    Q.stop_runner(conn, runner_id=runner_id)


@transition("run_summaries")
def run_summaries(conn, *, runner_id: int, term: int, live_seconds: float = 90.0) -> bool:
    """The summaries duty in one transaction, fenced: queue_summaries and the current minute
    of queue_history (pgd_run_summaries, sql/functions/summaries.sql), then the waiting jobs
    by primary reason, counted here with ``explain.summary_reason_counts`` from what
    pgd_read_summary_inputs returns (a runner login reads no table), into the minute of
    queue_reason_history. True when done; False when ``runner_id`` does not hold the duty in
    ``term`` (then nothing is written). ``live_seconds``: as for read_world."""
    if not Q.run_summaries(conn, runner_id=runner_id, term=term):
        return False
    # the stamp above locked the duty's row until this transaction ends: no takeover can
    # come between it and the fenced calls below
    inputs = Q.read_summary_inputs(conn, runner_id=runner_id, term=term,
                                   live_seconds=live_seconds)
    if inputs is None:
        return False
    summaries, world = history.world_from_inputs(inputs)
    # the uncertain jobs, not in the summary, are added by pgd_record_reason_counts
    counts = explain.summary_reason_counts(summaries, world)
    return history.record_reason_counts(conn, runner_id=runner_id, term=term, counts=counts)


@transition("expiry_done")
def expiry_done(conn, *, runner_id: int, term: int) -> bool:
    """Stamp the expiry duty done after a pass over every pool: True, or False when
    ``runner_id`` does not hold the duty in ``term`` (pgd_expiry_done)."""
    return bool(Q.expiry_done(conn, runner_id=runner_id, term=term))


@transition("run_cleanup")
def run_cleanup(conn, *, runner_id: int, term: int, batch: int = 100) -> dict[str, Any] | None:
    """One batch of the cleanup duty, fenced (pgd_run_cleanup, sql/functions/runners.sql):
    silent runners marked lost, at most ``batch``, and queue_history past its 7-day
    retention deleted, at most 10 * ``batch`` rows. Returns {"lost": [runner ids], "pruned":
    n}, or None when ``runner_id`` does not hold the duty in ``term``.
    Raises: InvalidInput for a batch outside 1..10000."""
    batch = check_int("batch", batch, 1, 10000)
    return Q.run_cleanup(conn, runner_id=runner_id, term=term, batch=batch)


@transition("summarize_queue")
def summarize_queue(conn) -> None:
    """Refresh queue_summaries from the waiting jobs (no job row is written)."""
    Q.summarize_queue(conn)
