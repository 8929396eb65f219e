"""The elected duties: what one scheduler suffices for, done by the one that holds it.

Three duties, one row each in ``duty_leases`` (sql/schema.sql): ``summaries`` (the queue
summary and its per-minute history), ``expiry`` (the lapsed leases of every runner) and
``cleanup`` (silent runners marked lost, old history pruned). The election rides on the
runner keep-alive: every beat (pgd_beat_runner, sql/functions/runners.sql) renews the duties
this runner holds and takes over each one whose lease lapsed, by the database's clock, and
returns every duty row. ``Duties`` keeps what the last beat said and times the next one:

* a holder beats every ``duty_lease_seconds / 3``, so that two lost beats still renew;
* a non-holder beats every ``runner_beat_seconds``, and also right when the lease it last
  saw ends (plus up to 1 s of jitter, so that waiting schedulers do not all beat at once):
  a dead or stalled holder is replaced within one lease;
* a holder counts its lease from when it sent the renewing beat (a local monotonic clock,
  never compared with the database's), so a holder that could not renew for a whole lease
  stops doing duties before another can take them over;
* every duty run carries the term it was taken in, and the database refuses a stamp of an
  old term (pgd_stamp_duty): a paused holder that wakes after a takeover writes nothing.

Safety never depends on the election: when the expiry duty has not been done for longer
than a lease, or a beat finds a lease of its pools lapsed for longer than that whatever the
holder says (``expiry_is_overdue``), every scheduler expires its own pools' lapsed leases
itself (scheduler/expiry.py). A host whose login is revoked holds no duty.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from pgdispatch.sql import Settings

from . import runner_row

log = logging.getLogger(__name__)

DUTIES = ("cleanup", "expiry", "summaries")
MAX_JITTER_SECONDS = 1.0
MIN_BEAT_DELAY_SECONDS = 0.05
# How often the holder of the cleanup duty runs one batch of it (seconds).
CLEANUP_INTERVAL_SECONDS = 60.0


class Duties:
    """This scheduler's view of the election, updated by each ``beat``.

    Args:
        pool: the scheduler's connection pool (sql.scheduling.make_scheduler_pool).
        settings: runner_beat_seconds, duty_lease_seconds (seconds).
        runner_id: this runner.
        is_draining: called at each beat; True makes the beat release every duty held.
        reschedule(delay_seconds): asks for the next beat that many seconds from now
            (main.py moves the APScheduler job); None in tests that beat by hand.
        on_answer(rows): called with every beat's answer (the duty rows, which carry the
            operator's drain of this runner: main.py learns a drain and a resume there).
    """

    def __init__(self, pool, settings: Settings, *, runner_id: int,
                 is_draining: Callable[[], bool] = lambda: False,
                 reschedule: Callable[[float], None] | None = None,
                 on_answer: Callable[[list[dict[str, Any]]], None] | None = None):
        self.pool = pool
        self.on_answer = on_answer
        self.settings = settings
        self.runner_id = runner_id
        self.is_draining = is_draining
        self.reschedule = reschedule
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, float]] = {}  # duty -> (term, monotonic deadline)
        self._rows: dict[str, dict[str, Any]] = {}
        self._seen_at = 0.0  # monotonic time of the beat that returned _rows
        # monotonic time by which the first running lease lapses, by the last beat (None: no
        # lease running then); the expiry holder passes only once it is reached
        self._next_lapse: float | None = 0.0

    # -- the beat ----------------------------------------------------------------------------

    def beat(self) -> list[dict[str, Any]]:
        """One keep-alive: mark the runner alive, renew or take over duties (release them
        when draining), remember the answer, and schedule the next beat.

        Returns the duty rows (see sql.transitions.beat_runner).
        Raises:
            DatabaseUnavailable: nothing learnt; the next beat comes at the holder's
                interval (if it holds a duty) or the non-holder's.
        """
        s = self.settings
        draining = self.is_draining()
        self._schedule(s.duty_lease_seconds / 3 if self._held else s.runner_beat_seconds)
        sent = time.monotonic()
        rows = runner_row.beat(self.pool, runner_id=self.runner_id, is_draining=draining,
                               beat_seconds=s.runner_beat_seconds,
                               duty_lease_seconds=s.duty_lease_seconds)
        self._learn(rows, sent)
        self._schedule(self.next_beat_delay())
        if self.on_answer is not None:
            self.on_answer(rows)
        return rows

    def _learn(self, rows: list[dict[str, Any]], sent: float) -> None:
        with self._lock:
            before = dict(self._held)
            self._rows = {r["duty"]: r for r in rows}
            self._seen_at = sent
            nxt = rows[0].get("next_lease_expiry") if rows else None
            self._next_lapse = None if nxt is None else \
                sent + (nxt - rows[0]["db_now"]).total_seconds()
            for r in rows:
                duty = r["duty"]
                if r["is_mine"]:
                    left = (r["expires_at"] - r["db_now"]).total_seconds()
                    self._held[duty] = (r["term"], sent + left)
                    if before.get(duty, (None,))[0] != r["term"]:
                        log.info("took over duty %s (term %d)", duty, r["term"])
                elif duty in self._held:
                    del self._held[duty]
                    log.info("gave up duty %s (now %s)", duty,
                             f"held by runner {r['runner_name']}" if r["runner_id"] and
                             r["runner_id"] != self.runner_id else "released")

    def next_beat_delay(self) -> float:
        """Seconds until the next beat: a third of the lease while holding a duty; else the
        runner beat, or sooner when a lease seen held by another ends first (with up to
        MAX_JITTER_SECONDS of jitter)."""
        s = self.settings
        if self.is_draining():
            return s.runner_beat_seconds
        with self._lock:
            if self._held:
                return max(MIN_BEAT_DELAY_SECONDS, s.duty_lease_seconds / 3)
            delay = s.runner_beat_seconds
            for r in self._rows.values():
                left = (r["expires_at"] - r["db_now"]).total_seconds() \
                    - (time.monotonic() - self._seen_at)
                if left < delay:
                    delay = left + random.uniform(0, min(MAX_JITTER_SECONDS,
                                                         s.runner_beat_seconds))
            return max(MIN_BEAT_DELAY_SECONDS, delay)

    def _schedule(self, delay: float) -> None:
        if self.reschedule is not None:
            self.reschedule(delay)

    # -- what the duty jobs ask --------------------------------------------------------------

    def term(self, duty: str) -> int | None:
        """The term this runner holds ``duty`` in, or None: not held, or held but not
        renewed for a whole lease (counted from the renewing beat's sending)."""
        with self._lock:
            held = self._held.get(duty)
            if held is None or time.monotonic() >= held[1]:
                return None
            return held[0]

    def lost(self, duty: str, term: int) -> None:
        """A duty run was refused in ``term`` (taken over meanwhile): stop doing the duty
        until a beat says it is held again."""
        with self._lock:
            if self._held.get(duty, (None,))[0] == term:
                del self._held[duty]
                log.info("duty %s (term %d) was taken over; no longer doing it", duty, term)

    def lease_may_have_lapsed(self) -> bool:
        """Whether a running lease may have lapsed since the last beat: the first lease the
        beat saw running ends by now (or no beat answered yet). A lease claimed after that
        beat is seen by the next one (a holder beats every duty lease / 3), so the expiry
        holder skips its pass, sending nothing, while this is False."""
        with self._lock:
            return self._next_lapse is not None and time.monotonic() >= self._next_lapse

    def expiry_is_overdue(self) -> bool:
        """Whether this scheduler expires its own pools' lapsed leases itself: nothing is
        known yet; or the last beat found a lease of its pools lapsed for more than a duty
        lease (``leases_overdue``, read from the attempts: true even when a holder stamps
        its duty without doing it); or the expiry duty, held by another (or nobody), was
        last done (or, never done, taken) more than a duty lease ago."""
        with self._lock:
            row = self._rows.get("expiry")
            if row is None:
                return True
            if row.get("leases_overdue"):
                return True
            if row["is_mine"] and "expiry" in self._held:
                return False
            done = row["last_done_at"] or row["held_since"]
            if done is None:
                return True
            age = (row["db_now"] - done).total_seconds() + (time.monotonic() - self._seen_at)
            return age > self.settings.duty_lease_seconds

    def rows(self) -> list[dict[str, Any]]:
        """The duty rows of the last beat (sql.transitions.beat_runner), by duty name."""
        with self._lock:
            return [self._rows[d] for d in sorted(self._rows)]

