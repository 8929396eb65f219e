"""Claim rounds under a steady stream of short jobs (scheduler/claiming.py): a round fills
the slots free when it starts and ends, and the slots that free meanwhile are claimed
together by the next round (ClaimWaker), so claims form batches instead of one claim
transaction per freed slot."""

from __future__ import annotations

import threading
import time

from pgdispatch.scheduler.claiming import Claimer, ClaimWaker
from pgdispatch.sql.scheduling import make_scheduler_pool

from .conftest import FAST, wait_until


def test_a_round_claims_only_the_slots_free_when_it_started(world, db_url):
    """Jobs that end at once free their slot while the round still runs: the round stops at
    the four slots it started with instead of claiming the whole queue one by one."""
    world.setup()
    for _ in range(30):
        world.job(command=["true"])
    runner = world.runner(slots=4)
    pool_ids = world.pool_ids(("linux",))
    pool = make_scheduler_pool(db_url, slots=1)
    launched = []
    try:
        claimer = Claimer(pool, FAST, runner_id=runner, pool_ids=pool_ids,
                          free_slots=lambda: 4,  # every job ends as soon as it is launched
                          launch=lambda c, sent_at: launched.append(c),
                          is_draining=lambda: False)
        assert claimer.fill() == 4
        # one ordinary claim opens the round, one batch takes the other three
        assert (claimer.claims_sent, claimer.batches_sent) == (1, 1)
        assert claimer.is_work_waiting()  # 26 left: the next completion claims at once
        assert claimer.fill() == 4
    finally:
        pool.close()
    assert len({c.job_id for c in launched}) == 8


class _Slots:
    def __init__(self, free: int):
        self.free = free
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            return self.free


def test_freed_slots_wait_briefly_to_be_claimed_together():
    slots = _Slots(0)
    rounds: list[int] = []
    waker = ClaimWaker(lambda: rounds.append(slots()) or 0, free_slots=slots, batch_slots=8,
                       coalesce_seconds=0.5)
    waker.start()
    try:
        for _ in range(3):  # three jobs end close together, each waking the claimer
            with slots.lock:
                slots.free += 1
            waker.wake(slot_freed=True)
            time.sleep(0.02)
        wait_until(lambda: rounds, timeout=5, what="the coalesced round")
        assert rounds == [3]  # one round for the three freed slots
    finally:
        waker.stop()
        waker.join(5)


def test_a_wakeup_or_a_full_batch_of_free_slots_does_not_wait():
    slots = _Slots(1)
    rounds: list[float] = []
    waker = ClaimWaker(lambda: rounds.append(time.monotonic()) or 0, free_slots=slots,
                       batch_slots=4, coalesce_seconds=30.0)
    waker.start()
    try:
        waker.wake(slot_freed=True)
        time.sleep(0.05)
        assert rounds == []  # waiting for more slots to free
        sent = time.monotonic()
        waker.wake()  # a NOTIFY: at once
        wait_until(lambda: rounds, timeout=5, what="the round a wake-up asks for")
        assert rounds[0] - sent < 5
        with slots.lock:
            slots.free = 4
        waker.wake(slot_freed=True)  # batch_slots free: nothing more to wait for
        wait_until(lambda: len(rounds) == 2, timeout=5, what="the round of a full batch")
    finally:
        waker.stop()
        waker.join(5)
