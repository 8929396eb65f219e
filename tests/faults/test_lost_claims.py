"""A claim whose client is cut off while the claim is still running on the server (issue 16,
"Lost-claim recovery does nothing behind a pooler"), direct and through a real PgBouncer in
transaction pooling, for a build and for a deployment.

The reproduction from the issue: another session holds the project's claim lock, a claim
blocks on it, the claim's client socket is cut (tests/faults/proxy.py's
``close_clients(reset=True)``: its connections reset as ``ss -K`` does), the client recovers its claim — and only then is
the lock released, so the orphaned server session goes on with the claim. Recovery
(transitions.recover_claims, sql/functions/claim.sql) must answer at once, without waiting
for that session or needing to find it, and its answer must stay true: "void" means the
orphan never commits; the job is claimed afresh and run once. The mirror case: the claim
committed before the cut, and recovery finds it.

Then the two interleavings the claim token lock exists for, made deterministic with a pause
point: a claim past its tombstone check, about to commit, while the recovery runs (the
recovery waits for it and finds it), and a claim paused between its lock and its check.
Each check is shown to fail against a broken variant (tests/variants.py): a claim without
the tombstone check, a recovery without the exclusive lock, a claim that checks before it
locks. Last, the same reproduction through a real in-process scheduler (scheduler/main.py)
whose database connections all go through the relay.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from pgdispatch.scheduler.main import Scheduler
from pgdispatch.sql import DatabaseUnavailable, db, transitions

from .. import variants
from ..pooling.conftest import pgbouncer_url  # noqa: F401 - a fixture, used by `route`
from ..scheduler.conftest import FAST, Signals
from . import consistency, pause_point
from .conftest import upstream_of
from .invariants import check_invariants
from .proxy import CommitDroppingProxy

WAIT_S = 30.0
KINDS = ["build", "deployment"]


class Route:
    """How a client reaches the database: ``url`` for a connection of its own, ``upstream``
    for the relay to forward to (the same server or the same PgBouncer)."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        parts = urlsplit(url)
        self.database = parts.path.lstrip("/")
        self.upstream = upstream_of(url) if name == "direct" else ("127.0.0.1", parts.port)


@pytest.fixture(params=["direct", "pgbouncer"])
def route(request, db_url) -> Route:
    if request.param == "direct":
        return Route("direct", db_url)
    return Route("pgbouncer", request.getfixturevalue("pgbouncer_url")(db_url))


@pytest.fixture
def relay(route):
    """A proxy in front of the route: ``relay.db_url`` goes through it."""
    p = CommitDroppingProxy(route.upstream)
    p.db_url = p.url(route.database)
    yield p
    p.close()
    p.close_clients()


class Background:
    """``fn()`` on a thread of its own; ``join()`` waits for it and returns its value (or
    ``error``, what it raised)."""

    def __init__(self, fn: Callable[[], Any], name: str = "racer-background"):
        self.value: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    @property
    def is_done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float = WAIT_S) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"still running after {timeout_s} s"
        return self.value


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def sessions_waiting(conn, function: str) -> list[int]:
    """The server sessions whose statement calls ``function`` and waits for an advisory lock."""
    return [r["pid"] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND state = 'active'"
        "   AND wait_event_type = 'Lock' AND wait_event = 'advisory' AND query LIKE %s",
        (f"%{function}(%",))]


def statement_over(conn, pid: int) -> bool:
    """Whether server session ``pid`` is no longer running a statement (ended or idle)."""
    row = conn.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is None or row["state"] != "active"


class ClaimLockHolder:
    """Holds a project's claim lock (sql/functions/capacity.sql) in a transaction of its own,
    as a pause or a bound change does, until ``release``."""

    def __init__(self, url: str, project_id: int):
        self.conn = db.connect(url, application_name="pgd-test-lock-holder")
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT pg_advisory_xact_lock(pgd_claim_lock_class(), "
                          "pgd_claim_lock_key(%s))", (project_id,))

    def release(self) -> None:
        if not self.conn.closed:
            self.conn.execute("COMMIT")
            self.conn.close()


def setup_world(world, kind: str, command=("true",)) -> dict[str, Any]:
    world.setup(targets=("production",))
    job = world.job(target="production" if kind == "deployment" else None, command=command)
    return {"job": job, "runner": world.runner(slots=2), "pools": world.pool_ids(("linux",)),
            "project": world.conn.execute("SELECT id FROM projects").fetchone()["id"]}


def attempts_with(conn, token: str) -> list[dict]:
    return conn.execute("SELECT * FROM attempts WHERE claim_token = %s", (token,)).fetchall()


def target_state(conn) -> str:
    return conn.execute("SELECT state FROM targets WHERE name = 'production'").fetchone()["state"]


def recover(url: str, tokens: list[str], runner_id: int) -> list:
    with db.connect(url, application_name="pgd-test-recovery") as conn:
        return transitions.recover_claims(conn, claim_tokens=tokens, runner_id=runner_id)


def cut_off_blocked_claim(world, db_url, route, relay, w, *, commit_first: bool = False
                          ) -> dict[str, Any]:
    """The issue's reproduction up to the recovery's answer, which is returned with the
    orphaned claim's token and server session. With ``commit_first``, the claim is let go
    and commits before the cut (its answer held back by the relay): the mirror case."""
    holder = ClaimLockHolder(db_url, w["project"])
    token = transitions.new_claim_token()
    client = db.connect(relay.db_url, application_name="pgd-test-lost-claimer")
    try:
        claiming = Background(lambda: transitions.claim(
            client, runner_id=w["runner"], pools=w["pools"], claim_token=token,
            lease_seconds=60), name="racer-lost-claim")
        [orphan] = wait_for(lambda: sessions_waiting(world.conn, "pgd_claim"),
                            "the claim to block on the project's claim lock")
        if commit_first:
            relay.hold_replies()
            holder.release()
            wait_for(lambda: attempts_with(world.conn, token), "the claim to commit")
        assert relay.close_clients(reset=True) >= 1
        claiming.join()
        assert isinstance(claiming.error, DatabaseUnavailable), (claiming.value, claiming.error)
        # The recovery goes the same way (a new connection; through PgBouncer, another
        # server session than the orphan's). While the claim is blocked, it must answer
        # without waiting for it: the holder is still holding the lock.
        answer = Background(lambda: recover(route.url, [token], w["runner"]),
                            name="racer-recovery").join()
        if not commit_first:
            assert orphan in sessions_waiting(world.conn, "pgd_claim"), \
                "the orphaned claim should still be blocked when the recovery answers"
    finally:
        holder.release()
        client.close()
    wait_for(lambda: statement_over(world.conn, orphan), "the orphaned claim to end")
    return {"token": token, "orphan": orphan, "answer": answer}


def assert_claimed_once_afterwards(world, w) -> None:
    """Nothing of the lost claim is left: the job is claimable, once, and runs to its end."""
    c = world.claim(w["runner"])
    assert c is not None and c.job_id == w["job"]["id"] and c.generation == 1
    assert world.claim(w["runner"]) is None
    assert world.complete(c)["job_state"] == "succeeded"
    assert world.conn.execute("SELECT count(*) AS n FROM attempts").fetchone()["n"] == 1
    assert check_invariants(world.conn) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_cut_off_while_blocked_is_void_and_never_commits(world, db_url, route, relay, kind):
    w = setup_world(world, kind)
    lost = cut_off_blocked_claim(world, db_url, route, relay, w)
    assert lost["answer"] == []  # void
    # and it stayed void: the orphan went on when the lock was released, and failed
    assert attempts_with(world.conn, lost["token"]) == []
    job = world.row("jobs", w["job"]["id"])
    assert (job["state"], job["generation"], job["attempts_made"]) == ("queued", 0, 0)
    assert target_state(world.conn) == "free"
    assert world.counters() == {"org": 0, "project": 0, "pool": 0, "attempts": 0}
    assert consistency.violations(world.conn) == []
    # asked again, the same answer
    assert recover(route.url, [lost["token"]], w["runner"]) == []
    assert_claimed_once_afterwards(world, w)


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_that_committed_before_the_cut_is_found(world, db_url, route, relay, kind):
    w = setup_world(world, kind)
    lost = cut_off_blocked_claim(world, db_url, route, relay, w, commit_first=True)
    [(claim, state)] = lost["answer"]
    [attempt] = attempts_with(world.conn, lost["token"])
    assert (claim.attempt_id, claim.job_id, claim.generation, state) == (
        attempt["id"], w["job"]["id"], 1, "running")
    assert claim.is_deployment == (kind == "deployment")
    assert target_state(world.conn) == ("held" if kind == "deployment" else "free")
    assert world.claim(w["runner"]) is None  # nobody else takes it
    assert world.complete(claim)["job_state"] == "succeeded"
    assert target_state(world.conn) == "free"
    assert check_invariants(world.conn) == []


NO_TOMBSTONE_CHECK = [(
    "IF EXISTS (SELECT 1 FROM claim_tombstones t WHERE t.claim_token = ANY (p_claim_tokens)) THEN",
    "IF false THEN")]


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_fails_when_a_claim_ignores_the_tombstones(world, db_url, route, relay, kind):
    """The reproduction can fail: with pgd_check_tombstones not reading the tombstones, the
    recovery still answers "void", and the orphan commits the claim with that very token
    when the lock is released, as the issue saw behind PgBouncer."""
    world.conn.execute(variants.variant_sql(world.conn, "pgd_check_tombstones", NO_TOMBSTONE_CHECK))
    w = setup_world(world, kind)
    lost = cut_off_blocked_claim(world, db_url, route, relay, w)
    assert lost["answer"] == []
    [attempt] = attempts_with(world.conn, lost["token"])  # committed after "void"
    assert attempt["state"] == "running" and world.row("jobs", w["job"]["id"])["state"] == "running"
    assert target_state(world.conn) == ("held" if kind == "deployment" else "free")


# --- the two interleavings the claim token lock is for ------------------------------------

PAUSE_AT_COMMIT = f"""
CREATE FUNCTION test_pause_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({pause_point.PAUSE_KEY});
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER test_pause_at_commit AFTER INSERT ON attempts
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_pause_at_commit();
"""

LOCK = ("    PERFORM pg_advisory_xact_lock_shared(pgd_claim_token_lock_class(),\n"
        "                                         hashtext(p_claim_tokens[1]::text));\n")
CHECK_COMMENT = "    -- a statement of its own, so a snapshot taken after the lock was granted\n"
PAUSE = f"    PERFORM pg_advisory_xact_lock_shared({pause_point.PAUSE_KEY});\n"
# the claim paused between its two steps, in its own order and swapped
PAUSED_BETWEEN_LOCK_AND_CHECK = [(CHECK_COMMENT, PAUSE)]
CHECK_THEN_LOCK = [(LOCK, ""), (CHECK_COMMENT, ""),
                   ("    IF clock_timestamp() - statement_timestamp()", PAUSE + LOCK +
                    "    IF clock_timestamp() - statement_timestamp()")]
NO_EXCLUSIVE_LOCK = [("    PERFORM pg_advisory_xact_lock(pgd_claim_token_lock_class(), "
                      "hashtext(p_claim_tokens[1]::text));\n", "")]


def race_a_paused_claim(world, db_url) -> tuple[Any, list, bool]:
    """A claim that stalls at the pause point (installed by the caller somewhere after its
    attempt insert) and its recovery, started while it is stalled; the pause is opened once
    the recovery waits for a lock or has answered. Returns (the claim's Claim, the
    recovery's answer, whether the claim committed)."""
    world.setup()
    world.job()
    runner, pools = world.runner(), world.pool_ids(("linux",))
    token = transitions.new_claim_token()
    pause_point.shut(world.conn)
    claimer = db.connect(db_url, application_name="pgd-test-paused-claim")
    try:
        claiming = Background(lambda: transitions.claim(
            claimer, runner_id=runner, pools=pools, claim_token=token, lease_seconds=60))
        pause_point.wait_paused(world.conn, claimer.info.backend_pid)
        recovery = Background(lambda: recover(db_url, [token], runner))
        wait_for(lambda: recovery.is_done or sessions_waiting(world.conn, "pgd_recover_claims"),
                 "the recovery to wait for the claim token lock or to answer")
    finally:
        pause_point.open_(world.conn)
    try:
        claim, answer = claiming.join(), recovery.join()
    finally:
        claimer.close()
    assert claiming.error is None and recovery.error is None, (claiming.error, recovery.error)
    return claim, answer, bool(attempts_with(world.conn, token))


def test_a_recovery_waits_for_a_claim_about_to_commit_and_finds_it(world, db_url):
    """The claim has passed its tombstone check and waits at its commit (a deferred
    trigger); the recovery's exclusive lock waits for it, then finds it committed."""
    world.conn.execute(PAUSE_AT_COMMIT)
    claim, answer, committed = race_a_paused_claim(world, db_url)
    assert committed and answer == [(claim, "running")]


def test_the_check_fails_when_the_recovery_does_not_wait(world, db_url):
    """Without the exclusive lock the recovery answers "void" at once, and the claim it did
    not wait for commits a moment later: the answer was wrong."""
    world.conn.execute(variants.variant_sql(world.conn, "pgd_recover_claims", NO_EXCLUSIVE_LOCK))
    world.conn.execute(PAUSE_AT_COMMIT)
    claim, answer, committed = race_a_paused_claim(world, db_url)
    assert claim is not None and committed and answer == []


@pytest.mark.parametrize("order", ["lock, then check", "check, then lock"])
def test_the_claim_takes_its_lock_before_it_reads_the_tombstones(world, db_url, order):
    """Paused between its two steps. Locked first, the claim makes the recovery wait, and
    the tombstone it cannot see yet does not matter: the recovery then finds it committed.
    Checked first (a broken variant), the claim missed the tombstone, the recovery did not
    wait and said "void", and the claim commits."""
    change = PAUSED_BETWEEN_LOCK_AND_CHECK if order == "lock, then check" else CHECK_THEN_LOCK
    world.conn.execute(variants.variant_sql(world.conn, "pgd_check_tombstones", change))
    claim, answer, committed = race_a_paused_claim(world, db_url)
    assert committed
    if order == "lock, then check":
        assert answer == [(claim, "running")]
    else:
        assert answer == []  # and yet it committed


# --- through a real scheduler -------------------------------------------------------------


def start_scheduler_through(relay, slots: int = 1) -> tuple[Scheduler, Signals]:
    signals = Signals()
    s = Scheduler(FAST, database_url=relay.db_url, pools=["linux"], slots=slots,
                  name="pgd-test-cut-off", kill_grace_seconds=1.0, listen=False,
                  on_claimed=signals.claimed.put, on_completed=signals.completed.put)
    assert s.start()
    return s, signals


def run_a_scheduler_cut_off_mid_claim(world, db_url, relay, kind: str, tmp_path: Path
                                      ) -> dict[str, Any]:
    """A scheduler (all its connections through the relay) claims while the project's claim
    lock is held; the relay is cut; once the scheduler's next round has settled the lost
    claim, the lock is released. Returns the orphan's token and how many times the job's
    command ran, after the scheduler is stopped."""
    marker = tmp_path / "ran"
    w = setup_world(world, kind, command=("sh", "-c", f"echo ran >> {marker}"))
    holder = ClaimLockHolder(db_url, w["project"])
    s, signals = start_scheduler_through(relay)
    try:
        [orphan] = wait_for(lambda: sessions_waiting(world.conn, "pgd_claim"),
                            "the scheduler's claim to block on the project's claim lock")
        relay.close_clients(reset=True)
        # the next round recovers first: the token is voided while its claim still waits
        # (the first tombstone: a claim sent later on a pooled connection the cut broke
        # may be lost and voided too)
        token = wait_for(lambda: world.conn.execute(
            "SELECT claim_token::text AS t FROM claim_tombstones ORDER BY voided_at LIMIT 1"
        ).fetchone(), "the recovery")["t"]
        assert orphan in sessions_waiting(world.conn, "pgd_claim")
        holder.release()
        wait_for(lambda: statement_over(world.conn, orphan), "the orphaned claim to end")
        if not attempts_with(world.conn, token):
            result = signals.next_completed(timeout=WAIT_S)
            assert result.claim.job_id == w["job"]["id"] and result.outcome == "succeeded"
        else:  # a broken variant: wait for the orphan's lease to lapse and be expired
            wait_for(lambda: world.row("jobs", w["job"]["id"])["state"] in ("failed", "uncertain"),
                     "the expiry of the orphan's lease")
    finally:
        holder.release()
        s.stop(grace_seconds=0)
    runs = len(marker.read_text().splitlines()) if marker.exists() else 0
    return {"w": w, "token": token, "runs": runs}


@pytest.mark.parametrize("kind", KINDS)
def test_a_scheduler_cut_off_mid_claim_runs_the_job_once(world, db_url, relay, kind, tmp_path):
    got = run_a_scheduler_cut_off_mid_claim(world, db_url, relay, kind, tmp_path)
    job_id = got["w"]["job"]["id"]
    assert got["runs"] == 1
    assert attempts_with(world.conn, got["token"]) == []
    [attempt] = world.conn.execute("SELECT * FROM attempts WHERE job_id = %s", (job_id,)).fetchall()
    assert attempt["state"] == "succeeded"
    assert world.row("jobs", job_id)["state"] == "succeeded"
    assert target_state(world.conn) == "free"  # never uncertain: no lost runner
    assert check_invariants(world.conn) == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_check_fails_when_a_scheduler_claim_ignores_the_tombstones(world, db_url, kind, tmp_path):
    """With the broken claim, the scheduler forgets a claim that then commits: nobody runs
    it, its lease lapses, and the build fails without having run, the deployment leaves the
    target uncertain though it was never handed to a runner."""
    world.conn.execute(variants.variant_sql(world.conn, "pgd_check_tombstones", NO_TOMBSTONE_CHECK))
    relay = CommitDroppingProxy(upstream_of(db_url))
    relay.db_url = relay.url(urlsplit(db_url).path.lstrip("/"))
    try:
        got = run_a_scheduler_cut_off_mid_claim(world, db_url, relay, kind, tmp_path)
    finally:
        relay.close()
        relay.close_clients()
    assert got["runs"] == 0
    [attempt] = attempts_with(world.conn, got["token"])
    if kind == "deployment":
        assert attempt["state"] == "lost" and target_state(world.conn) == "uncertain"
    else:
        assert attempt["state"] == "expired"
        assert world.row("jobs", got["w"]["job"]["id"])["state"] == "failed"
