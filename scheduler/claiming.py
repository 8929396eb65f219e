"""The claim job: fill this scheduler's free slots with claimed jobs.

Runs every ``claim_interval_seconds`` and, through ``wake()``, at once whenever a slot frees,
so throughput is not bounded by the interval. Each claim is one short transaction
(sql.transitions.claim) with a fresh claim token; the claimed job goes to the executor.

A claim whose connection broke may still have committed. Its token (and the server session
it ran in) is kept, and the next run asks the database before claiming anything new
(transitions.recover_claim: first make sure that session has ended, so the answer is final,
then look the token up): a claim that did commit is renewed with a heartbeat and run; one
that did not is forgotten.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sql import DatabaseUnavailable, FencedOut, Settings, transitions
from sql.scheduling import backend_pid, connection
from sql.transitions import Claim

log = logging.getLogger(__name__)


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
    """

    def __init__(self, pool, settings: Settings, *, runner_id: int, pool_ids: list[int],
                 free_slots: Callable[[], int], launch: Callable[[Claim, float], None],
                 is_draining: Callable[[], bool]):
        self.pool = pool
        self.settings = settings
        self.runner_id = runner_id
        self.pool_ids = list(pool_ids)
        self.free_slots = free_slots
        self.launch = launch
        self.is_draining = is_draining
        self._lock = threading.Lock()
        self._again = False
        # claim token -> server session (pid) of the claim whose answer was lost
        self._pending: dict[str, int | None] = {}

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
        launched = self._recover_pending()
        while not self.is_draining() and self.free_slots() > 0:
            token = transitions.new_claim_token()
            answered, claim = False, None
            try:
                with connection(self.pool) as conn:
                    sent = time.monotonic()
                    self._pending[token] = backend_pid(conn)
                    claim = transitions.claim(conn, runner_id=self.runner_id,
                                              pools=self.pool_ids, claim_token=token,
                                              lease_seconds=self.settings.lease_seconds)
                    del self._pending[token]
                    answered = True
            except DatabaseUnavailable:
                if not answered:
                    raise  # the token stays pending: the next run asks whether it committed
                # answered, then the connection failed on its way back to the pool: still ours
            if claim is None:
                break
            log.info("claimed job %d attempt %d (generation %d)%s: %s", claim.job_id,
                     claim.attempt_no, claim.generation,
                     f" for target {claim.target_id}" if claim.is_deployment else "",
                     " ".join(claim.command)[:200])
            self.launch(claim, sent)
            launched += 1
        return launched

    def _recover_pending(self) -> int:
        """Ask whether claims whose answer was lost committed; run those that did."""
        launched = 0
        for token, session in list(self._pending.items()):
            with connection(self.pool) as conn:
                found = transitions.recover_claim(conn, claim_token=token, backend_pid=session)
                if found is None:
                    log.info("claim %s did not commit", token)
                    del self._pending[token]
                    continue
                claim, state = found
                if state != "running" or self.is_draining():
                    # Already ended (expired), or we are stopping: the expiry pass re-queues it.
                    log.info("claim %s committed as job %d attempt %d, now %s; not running it",
                             token, claim.job_id, claim.attempt_no, state)
                    del self._pending[token]
                    continue
                # Its lease may be nearly gone: renew it before running, so the self-fencing
                # clock starts from this request.
                sent = time.monotonic()
                try:
                    transitions.heartbeat(conn, attempt_id=claim.attempt_id,
                                          generation=claim.generation,
                                          lease_seconds=self.settings.lease_seconds)
                except FencedOut:
                    log.info("claim %s committed but was fenced out since", token)
                    del self._pending[token]
                    continue
                del self._pending[token]
            log.info("claimed job %d attempt %d (generation %d), recovered after a lost "
                     "connection", claim.job_id, claim.attempt_no, claim.generation)
            self.launch(claim, sent)
            launched += 1
        return launched

