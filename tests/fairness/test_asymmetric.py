"""Test 1 and 5: a project with 10,000 queued jobs does not make one with 10 wait behind it
(DESIGN.md, "Fairness"), and a plain global FIFO claim fails the same check."""

from __future__ import annotations

import pytest


from .checks import ASYMMETRIC_CAP, SMALL_BOUND, SMALL_JOBS, check_small_project_starts_within, run_asymmetric
from .workload import install_global_order


def test_ten_jobs_submitted_after_ten_thousand_all_start_within_the_bound(conn):
    """4 slots, equal durations: the small project's 10 jobs all start within
    2×10 + 4 = 24 claims (measured: 20; its first starts at claim 2), not after 10,000."""
    trace = run_asymmetric(conn)
    took = check_small_project_starts_within(trace)
    numbers = trace.claim_numbers("small")
    assert numbers[0] <= 2, numbers
    assert took <= SMALL_BOUND
    # the two projects alternate: the big one still gets every other claim
    big = trace.claim_numbers("big")
    assert len(big) >= 9 and all(b - a == 2 for a, b in zip(big, big[1:9])), big
    # and nothing ran over the pool meanwhile
    assert all(sum(s.running.values()) <= 4 for s in trace.steps)


def test_a_global_fifo_claim_fails_the_bound(conn):
    """The check can fail: pgd_claim's candidates ordered by the head job's (priority, id)
    across projects — a plain global FIFO — keeps the small project waiting behind all
    10,000 (none of its jobs starts in 100 claims)."""
    install_global_order(conn)
    trace = run_asymmetric(conn)
    assert len(trace.steps) == ASYMMETRIC_CAP
    assert trace.claim_numbers("small") == []
    with pytest.raises(AssertionError, match=f"did not all start within {SMALL_BOUND} claims"):
        check_small_project_starts_within(trace)


def test_the_global_fifo_does_start_the_small_project_after_the_big_one(conn):
    """…and it is the order, not a broken claim, that makes it wait: with 100 big jobs ahead,
    the small project's jobs start at claims 101-110."""
    install_global_order(conn)
    trace = run_asymmetric(conn, big_jobs=100, cap=150)
    assert trace.claim_numbers("small") == list(range(101, 101 + SMALL_JOBS))
