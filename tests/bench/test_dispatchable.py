"""bench/e2e.py's dispatchable moment of a load sample: the end-to-end latency under load is
judged from it (docs/benchmarks.md, "End to end"), so what it leaves out is checked here."""

from bench.e2e import dispatchable_at

SLOTS = 2


def attempt(claimed, finished, ready_at):
    return {"claimed": claimed, "finished": finished, "ready_at": ready_at}


def test_a_runner_full_at_the_ready_moment_is_waited_for_until_a_slot_frees():
    sample = {"ready": 10.0, "claimed": 16.0}
    others = [attempt(9.0, 15.0, 8.0), attempt(9.5, 30.0, 8.0)]
    assert dispatchable_at(sample, others, SLOTS) == (2, 15.0)


def test_a_free_slot_taken_by_a_job_queued_ahead_of_it_is_waited_for():
    sample = {"ready": 10.0, "claimed": 14.5}
    others = [attempt(9.0, 30.0, 8.0), attempt(11.0, 14.0, 9.5)]
    assert dispatchable_at(sample, others, SLOTS) == (1, 14.0)


def test_a_slot_given_to_a_job_that_was_ready_later_is_the_samples_own_wait():
    sample = {"ready": 10.0, "claimed": 14.5}
    others = [attempt(9.0, 30.0, 8.0), attempt(11.0, 14.0, 10.5)]
    assert dispatchable_at(sample, others, SLOTS) == (1, 10.0)


def test_a_runner_never_full_leaves_the_ready_moment():
    sample = {"ready": 10.0, "claimed": 11.0}
    others = [attempt(9.0, 10.5, 8.0), attempt(10.6, None, 9.0)]
    assert dispatchable_at(sample, others, SLOTS) == (1, 10.0)


def test_the_last_time_the_runner_had_room_again_counts():
    # full at the ready moment, a slot frees at 12, a job queued ahead refills it at 12.5,
    # another frees at 15: the runner last had room again at 15
    sample = {"ready": 10.0, "claimed": 15.5}
    others = [attempt(9.0, 12.0, 8.0), attempt(9.5, 15.0, 8.0), attempt(12.5, None, 9.0)]
    assert dispatchable_at(sample, others, SLOTS) == (2, 15.0)
