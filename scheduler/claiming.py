"""The claim job: fill this scheduler's free slots with claimed jobs.

APScheduler calls ``poll`` every ``claim_interval_seconds``; the scheduler also runs it at
once on a wake-up (a NOTIFY for this runner or its pools, a slot freed while work is known
to be waiting), so throughput is not bounded by the interval. Each claim is one short
transaction with fresh claim tokens; every claimed job goes to the executor.

Idle backoff. While claim rounds find nothing, ``poll`` skips ticks: after n empty rounds in
a row it waits a jittered whole number of ticks, between half and all of
min(claim_idle_cap_seconds, claim_interval_seconds * 2**n), so an idle scheduler's poll
interval doubles up to the cap (and a fleet started together spreads out). A skipped tick
costs no transaction. Any wake-up (``note_wakeup``) makes the next tick claim at once; a round
whose answer says more work waits returns it to polling every tick, and one that took a lone
job (``more_waiting`` false) goes back to the backoff it had. No ready job waits longer than the cap for a poll, whatever
made it claimable (docs/operations.md, "Idle schedulers and wake-ups", says what else
bounds each kind of wait). A round that made no claim because every slot is taken leaves
the backoff as it was.

A round opens with one ordinary claim (sql.transitions.claim): the next job under the
fairness policy, build or deployment, exactly as a scheduler without batching would take it.
Nothing eligible ends the round, so an idle scheduler polls with one transaction. Each
answer says whether more work looked waiting for this runner (``Claim.more_waiting``,
pgd_more_waiting); when it does not, the round ends there, so a lone job costs one claim
transaction. When more is waiting and two or more slots are still free, ``claim_batch``
fills them: up to ``max_batch`` builds of one (project, pool) in one transaction, repeated
while it keeps coming back full with more waiting; a batch that comes back short hands the
next pick to an ordinary claim again (another project, or a deployment, may be next in
line). Deployments are only ever claimed one at a time, by ``claim``: they take a target,
and pgd_claim_batch leaves them alone. The last answer is kept (``is_work_waiting``): after
a completion the scheduler claims again at once only when work is known to be waiting
(that answer, or a wake-up since); otherwise the next poll finds what came. Work held back
by capacity this scheduler's running jobs hold (a project at its bound, a full organization
or pool) is no candidate, so no claim's answer shows it: a round that finds nothing, or ends
on a lone job while jobs claimed before it run, asks ``capacity_waiting`` (once: a round
after one that said yes keeps that answer, and a stale yes costs one empty claim, which asks
again), and when work waits so, a completion claims at once too.

A claim whose connection broke may still have committed, or still be running on the server
and commit later (blocked on a lock, say). The tokens it carried (one for a claim, all of a
batch's, in order) are kept as one group, and the next run settles each group in one call
before claiming anything new (transitions.recover_claims: the database voids every token that
has not committed, for good, so the answer cannot change after it is given; no server session
needs to be found or ended): a claim that did commit is renewed with a heartbeat and run — or,
when the scheduler is draining, handed back at once (its command never started); a token that
did not commit is forgotten.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable

from pgdispatch.sql import DatabaseUnavailable, FencedOut, Forbidden, Settings, transitions
from pgdispatch.sql.db import checkout
from pgdispatch.sql.transitions import Claim
from pgdispatch.sql.validate import check_max_batch

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 10


class Claimer:
    """Claims work for one runner while it has free slots.

    Args:
        pool: the connection pool.
        settings: lease_seconds is granted to each claim.
        runner_id / pool_ids: who claims, for which pools (ids).
        free_slots: how many more jobs this scheduler may run now.
        launch: hands a Claim to the executor, with the ``time.monotonic()`` at which the
            request that granted its lease was sent.
        is_draining: when true, nothing more is claimed.
        max_batch: most builds claimed in one transaction (1: one claim per transaction).
        is_running: whether this scheduler runs a job now (then a round that finds nothing,
            or ends on a lone job, asks whether work waits for capacity its jobs may free:
            ``capacity_waiting``).
    Raises:
        InvalidInput: ``max_batch`` outside 1..1000.
    """

    def __init__(self, pool, settings: Settings, *, runner_id: int, pool_ids: list[int],
                 free_slots: Callable[[], int], launch: Callable[[Claim, float], None],
                 is_draining: Callable[[], bool], max_batch: int = DEFAULT_MAX_BATCH,
                 is_running: Callable[[], bool] = lambda: False):
        self.pool = pool
        self.settings = settings
        self.runner_id = runner_id
        self.pool_ids = list(pool_ids)
        self.free_slots = free_slots
        self.launch = launch
        self.is_draining = is_draining
        self.is_running = is_running
        self.max_batch = check_max_batch(max_batch)
        self._lock = threading.Lock()
        self._again = False
        # idle backoff and the last answer (the module docstring), guarded by _state
        self._state = threading.Lock()
        self._interval = settings.claim_interval_seconds
        self._cap = max(settings.claim_idle_cap_seconds, self._interval)
        self._idle_rounds = 0     # rounds in a row whose claims found nothing
        self._ticks_to_skip = 0   # polls to skip before the next round
        self._wakeups = 0         # note_wakeup calls so far
        self._work_waiting = True  # unknown at start: look
        self._held_back = False   # the last round's answer: work waits for capacity held
        self.polls_skipped = 0    # ticks that made no transaction (for tests and metrics)
        self.claims_sent = 0      # pgd_claim calls sent
        self.batches_sent = 0     # pgd_claim_batch calls sent
        self.capacity_asks = 0    # pgd_capacity_waiting calls sent
        # the tokens of each claim whose answer was lost, one list per claim (a batch's in
        # the order sent): what one recovery settles (transitions.recover_claims)
        self._pending: list[list[str]] = []

    def poll(self) -> int:
        """The periodic claim job: ``fill`` unless the idle backoff skips this tick; returns
        how many jobs were launched.

        Raises:
            DatabaseUnavailable: as ``fill``.
        """
        with self._state:
            if self._ticks_to_skip > 0:
                self._ticks_to_skip -= 1
                self.polls_skipped += 1
                return 0
        return self.fill()

    def note_wakeup(self) -> None:
        """Work is known to be waiting (a NOTIFY, or a slot freed while work was waiting):
        back to polling every tick, and the next poll claims. The caller then runs ``poll``."""
        with self._state:
            self._wakeups += 1
            self._ticks_to_skip = 0
            self._work_waiting = True

    def is_work_waiting(self) -> bool:
        """Whether work is known to be waiting for this runner: the last claim's answer said
        so (or it ended with every slot full before an answer said otherwise), or a wake-up
        came since. A completion then claims at once; otherwise it waits for the poll."""
        with self._state:
            return self._work_waiting

    def idle_seconds(self) -> float:
        """The poll interval the backoff would pick after the current run of empty rounds:
        the upper end of the jitter, min(cap, interval * 2**rounds) seconds."""
        with self._state:
            return min(self._cap, self._interval * 2 ** self._idle_rounds)

    def _after_round(self, *, asked: bool, found: bool, more: bool, wakeups: int,
                     held_back: bool = False) -> None:
        """Book-keeping at the end of a round: the backoff and the last answer (``held_back``:
        work waits for capacity this scheduler's jobs hold, so a completion claims at once,
        while the polls back off as for an empty round)."""
        with self._state:
            if self._wakeups != wakeups:
                return  # a wake-up came during the round: it decides (fast, work waiting)
            if found and more:
                self._idle_rounds = 0
                self._ticks_to_skip = 0
            elif asked:
                # Nothing (more) claimable. A round that took a lone job (more_waiting false)
                # goes back to the backoff it had before its wake-up instead of ramping up from
                # the interval again: what comes next comes with a wake-up of its own, and a
                # ramp after every lone job cost ~2 empty claims a job at 40 listeners.
                if not found:
                    self._idle_rounds = min(self._idle_rounds + 1, 64)
                step = min(self._cap, self._interval * 2 ** self._idle_rounds)
                most = max(1, int(step / self._interval + 1e-9))  # whole ticks, never past the cap
                # polls skipped before the next: the wait is ticks * interval <= step <= cap
                self._ticks_to_skip = random.randint(max(1, (most + 1) // 2), most) - 1
            if asked:
                self._work_waiting = more or held_back
                self._held_back = held_back

    def fill(self) -> int:
        """Claim until the slots are full, nothing is eligible, or draining; returns how many
        jobs were launched. A call made while another is running makes that one go round
        again instead of waiting, so a wake-up is never lost.

        Raises:
            DatabaseUnavailable: stopped early; the unanswered claim is checked next time.
        """
        # Never lost: a call that finds the lock taken leaves _again set, and the holder
        # re-checks _again after releasing the lock.
        self._again = True
        launched = 0
        while self._again and not self.is_draining():
            if not self._lock.acquire(blocking=False):
                return launched
            try:
                while self._again and not self.is_draining():
                    self._again = False
                    launched += self._fill_once()
            finally:
                self._lock.release()
        return launched

    def _fill_once(self) -> int:
        with self._state:
            wakeups = self._wakeups
        launched = self._recover_pending()
        # Batches per round are bounded (twice what filling the slots free now would take),
        # so a round that keeps finding fresh slots (jobs that end at once) still ends.
        batches_left = 0
        if self.max_batch > 1:
            batches_left = 2 * math.ceil(max(self.free_slots(), 1) / self.max_batch)
        may_batch = batches_left > 0
        # A round fills the slots free when it starts, no more: slots that free meanwhile
        # (jobs that end at once) wake the next round (ClaimWaker), which may wait for more of
        # them to free and take them in one batch. Going on claiming them one by one as they
        # freed kept a steady stream of short jobs in one endless round of single claims.
        budget = self.free_slots() + launched  # what the recovered claims took counts
        # jobs running before this round's claims hold capacity that may hold work back
        was_running = self.is_running()
        asked, more, held_back = False, True, False
        while more and not self.is_draining() and self._room(budget - launched) > 0:
            asked = True
            claims = self._claim([transitions.new_claim_token()])
            if not claims:
                more = False
                # nothing eligible; when this scheduler runs jobs, what waits may wait for the
                # capacity they hold (a project bound, a full pool): then their completion
                # claims at once (is_work_waiting) rather than leave it to the poll
                held_back = self.is_running() and self._capacity_waiting()
                break
            launched += len(claims)
            more = claims[-1].more_waiting  # false: the round ends here (a lone job)
            while more and may_batch and batches_left > 0 and not self.is_draining():
                want = min(self._room(budget - launched), self.max_batch)
                if want < 2:
                    break
                batches_left -= 1
                claims = self._claim([transitions.new_claim_token() for _ in range(want)])
                launched += len(claims)
                if not claims:
                    may_batch = False  # no build is claimable: what is left needs a claim
                    break  # (more stays true: the ordinary claim looks for it)
                more = claims[-1].more_waiting
                if len(claims) < want:
                    break  # that (project, pool) ran dry or hit a limit: the fair pick again
        if asked and launched > 0 and not more and was_running:
            # The round ended on a lone job (more_waiting false). That answer looks only at
            # jobs it could claim: one held back by a limit the jobs running before this
            # round fill (a project bound, a full pool or organization) is not among them,
            # and the completion that frees the limit must claim it at once (bench/e2e.py,
            # "project bound freed", under load). What the last round learned still holds
            # when it said so: a stale "held back" costs one empty claim, which asks again.
            held_back = self._is_held_back() or self._capacity_waiting()
        self._after_round(asked=asked, found=launched > 0, more=more, wakeups=wakeups,
                          held_back=held_back)
        return launched

    def _is_held_back(self) -> bool:
        with self._state:
            return self._held_back

    def _room(self, budget: int) -> int:
        """How many more jobs this round may claim: the free slots, at most ``budget``."""
        return min(self.free_slots(), budget)

    def _capacity_waiting(self) -> bool:
        """transitions.capacity_waiting for this runner; False when the database cannot say
        (the poll finds it then)."""
        self.capacity_asks += 1
        try:
            with checkout(self.pool) as conn:
                return transitions.capacity_waiting(conn, runner_id=self.runner_id,
                                                    pools=self.pool_ids)
        except DatabaseUnavailable:
            return False

    def _claim(self, tokens: list[str]) -> list[Claim]:
        """One claim transaction: ``claim`` for one token, ``claim_batch`` for more; launches
        what it got and returns it.

        Raises:
            DatabaseUnavailable: no answer came; every token stays pending for recovery.
        """
        answered, claims = False, []
        sent = time.monotonic()
        try:
            with checkout(self.pool) as conn:
                sent = time.monotonic()
                # Recorded before the request leaves: if its answer is lost, the next run
                # settles the claim (_recover_pending).
                self._pending.append(tokens)
                if len(tokens) == 1:
                    self.claims_sent += 1
                    claim = transitions.claim(conn, runner_id=self.runner_id,
                                              pools=self.pool_ids, claim_token=tokens[0],
                                              lease_seconds=self.settings.lease_seconds)
                    claims = [] if claim is None else [claim]
                else:
                    self.batches_sent += 1
                    claims = transitions.claim_batch(conn, runner_id=self.runner_id,
                                                     pools=self.pool_ids, claim_tokens=tokens,
                                                     lease_seconds=self.settings.lease_seconds)
                self._pending.remove(tokens)
                answered = True
        except DatabaseUnavailable:
            if not answered:
                raise  # the tokens stay pending: the next run asks whether they committed
            # answered, then the connection failed on its way back to the pool: still ours
        except Forbidden:
            # refused before anything was taken (a revoked grant or login: sql/functions/
            # claim.sql): the tokens are void, and this host claims nothing until granted again
            self._pending.remove(tokens)
            raise
        # The lease runs, for the self-fencing clock, from when the claim was sent. A claim
        # that waited long for its answer (a lock, a pooler's queue) would start a command the
        # scheduler must kill moments later — a deployment then left uncertain for nothing:
        # renew its lease first, and run only what the database renewed.
        runs = [(claim, sent) for claim in claims]
        if claims and time.monotonic() - sent > self.settings.lease_seconds / 4:
            runs = self._renew_late(claims, sent)
        for claim, renewed_at in runs:
            log.info("claimed job %d attempt %d (generation %d)%s%s: %s", claim.job_id,
                     claim.attempt_no, claim.generation,
                     f" for target {claim.target_id}" if claim.is_deployment else "",
                     f" in a batch of {len(claims)}" if len(tokens) > 1 else "",
                     " ".join(claim.command)[:200])
            self.launch(claim, renewed_at)
        return [claim for claim, _ in runs]

    def _renew_late(self, claims: list[Claim], sent: float) -> list[tuple[Claim, float]]:
        """Renew each claim whose answer came late before it runs, as a recovered claim is
        (``_renew_recovered``: handed back instead when draining); (claim, the time the lease
        now runs from) for those to run. One the database could not be asked about is not run
        (its command has not started: the lease expiry decides, as for any runner that went
        quiet)."""
        log.warning("claim answered %.1f s after it was sent; renewing the lease of %d job(s) "
                    "before running them", time.monotonic() - sent, len(claims))
        runs: list[tuple[Claim, float]] = []
        for claim in claims:
            try:
                with checkout(self.pool) as conn:
                    renewed_at = self._renew_recovered(conn, claim, "running")
            except DatabaseUnavailable as exc:
                log.error("job %d attempt %d: could not renew a late claim (%s); not running "
                          "it, the lease expiry will decide", claim.job_id, claim.attempt_no, exc)
                continue
            if renewed_at is not None:
                runs.append((claim, renewed_at))
        return runs

    def _recover_pending(self) -> int:
        """Settle the claims whose answer was lost, one call per claim; run what committed
        (hand it back when draining) and forget the rest.

        Raises:
            DatabaseUnavailable: the database could not answer; what is left stays pending.
        """
        launched = 0
        while self._pending:
            group = self._pending[0]
            ready: list[tuple[Claim, float]] = []
            try:
                with checkout(self.pool) as conn:
                    found = transitions.recover_claims(conn, claim_tokens=group,
                                                       runner_id=self.runner_id)
                    # Settled: each token of the group is committed (found) or void for good.
                    # What is left to do keeps only the committed ones; asking again about
                    # those (after an outage below) gives the same answer.
                    committed = [claim.claim_token for claim, _ in found]
                    for token in group:
                        if token not in committed:
                            log.info("claim %s did not commit; void", token)
                    group[:] = committed
                    for claim, state in found:
                        sent = self._renew_recovered(conn, claim, state)
                        if sent is not None:
                            ready.append((claim, sent))
                        group.remove(claim.claim_token)
                self._pending.remove(group)
            finally:
                for claim, sent in ready:  # renewed: run it, whatever happens to the rest
                    log.info("claimed job %d attempt %d (generation %d), recovered after a "
                             "lost connection", claim.job_id, claim.attempt_no, claim.generation)
                    self.launch(claim, sent)
                    launched += 1
        return launched

    def _renew_recovered(self, conn, claim: Claim, state: str) -> float | None:
        """A claim that committed (recovered, or answered late) whose job is now ``state``:
        renew its lease and return when the renewal was sent (``time.monotonic()``), or None
        when it is not to be run (ended since, fenced out, or handed back because we are
        draining)."""
        if state != "running":
            # Already ended (expired, cancelled): nothing of it is ours to run.
            log.info("claim %s committed as job %d attempt %d, now %s; not running it",
                     claim.claim_token, claim.job_id, claim.attempt_no, state)
            return None
        if self.is_draining():
            self._hand_back(conn, claim)
            return None
        # Its lease may be nearly gone: renew it before running, so the self-fencing clock
        # starts from this request.
        sent = time.monotonic()
        try:
            transitions.heartbeat(conn, attempt_id=claim.attempt_id, generation=claim.generation,
                                  lease_seconds=self.settings.lease_seconds)
        except FencedOut:
            log.info("claim %s committed but was fenced out since", claim.claim_token)
            return None
        return sent

    def _hand_back(self, conn, claim: Claim) -> None:
        """Give a recovered claim back unrun (we are stopping): the job is re-queued, not
        failed, and a deployment's target is freed, since its command never started."""
        try:
            transitions.complete(conn, attempt_id=claim.attempt_id, generation=claim.generation,
                                 outcome="handed_back", receipt_key=claim.receipt_key,
                                 error="scheduler stopping; recovered claim handed back unrun",
                                 backoff_base_seconds=self.settings.backoff_base_seconds,
                                 backoff_cap_seconds=self.settings.backoff_cap_seconds)
            log.info("claim %s committed as job %d attempt %d; handed back (draining)",
                     claim.claim_token, claim.job_id, claim.attempt_no)
        except FencedOut:
            log.info("claim %s committed but was fenced out since", claim.claim_token)


class ClaimWaker(threading.Thread):
    """Runs claim rounds on wake-ups, on a thread of its own (no APScheduler job per wake-up).

    ``wake()`` (a NOTIFY, a resume, a drain ended) makes the next round start at once.
    ``wake(slot_freed=True)`` (a job ended while work is known to be waiting) lets the round
    wait up to ``coalesce_seconds`` for more slots to free, so that slots freed close
    together are filled by one claim round — one ordinary claim and one ``claim_batch``
    instead of a claim each — but never longer, and not at all once ``batch_slots`` slots
    are free (nothing more to gain) or when a wake-up of the first kind comes meanwhile.
    Wake-ups that come while a round runs make one more round; none is lost.

    Args:
        fill: one claim round (``Claimer.fill``); its failures are logged, the poll retries.
        free_slots: how many slots are free now.
        batch_slots: free slots at which a round no longer waits (at least 1).
        coalesce_seconds: the longest wait of a round woken by freed slots, in seconds
            (0: none).
    """

    def __init__(self, fill: Callable[[], int], *, free_slots: Callable[[], int],
                 batch_slots: int, coalesce_seconds: float):
        super().__init__(name="claim-waker", daemon=True)
        self._fill = fill
        self._free_slots = free_slots
        self.batch_slots = max(1, batch_slots)
        self.coalesce_seconds = max(0.0, coalesce_seconds)
        self._cond = threading.Condition()
        self._is_pending = False   # a wake-up not yet served by a round
        self._is_urgent = False    # ... of which one must not wait
        self._is_stopped = False
        self.rounds = 0            # rounds run (for tests)

    def wake(self, *, slot_freed: bool = False) -> None:
        """Ask for a claim round: at once, or (``slot_freed``) after the coalescing wait."""
        with self._cond:
            self._is_pending = True
            if not slot_freed:
                self._is_urgent = True
            self._cond.notify()

    def stop(self) -> None:
        """End the thread after the round in flight, if any."""
        with self._cond:
            self._is_stopped = True
            self._cond.notify()

    def run(self) -> None:
        """Wait for wake-ups and run the rounds (the thread's body)."""
        while True:
            with self._cond:
                while not self._is_pending and not self._is_stopped:
                    self._cond.wait()
                if self._is_stopped:
                    return
                if not self._is_urgent and self.coalesce_seconds > 0:
                    until = time.monotonic() + self.coalesce_seconds
                    while (not self._is_urgent and not self._is_stopped
                           and self._free_slots() < self.batch_slots):
                        left = until - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if self._is_stopped:
                        return
                self._is_pending = self._is_urgent = False
            self.rounds += 1
            try:
                self._fill()
            except DatabaseUnavailable as exc:  # the poll's guard reports the outage
                log.debug("claim on wake-up failed: %s; the poll tries again", exc)
            except Forbidden as exc:
                log.warning("claim on wake-up refused: %s", exc)
            except Exception:
                log.exception("claim on wake-up failed")
