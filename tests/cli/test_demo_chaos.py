"""The demo's chaos scheduler (pgdispatch/demo.py) never takes the deployment an operator's
resolution frees: it holds off while a target is uncertain and for a while after a resolution."""

from __future__ import annotations

import pytest

from pgdispatch import demo
from pgdispatch.sql import Settings, transitions

from tests.webapp.support import make_uncertain_target


def test_the_chaos_round_holds_off_around_an_operator_resolution(world):
    world.setup(pools=("linux", "deploy"), targets=("staging",))
    assert demo.chaos_hold_off(world.conn) is None  # nothing to protect: it may start
    make_uncertain_target(world, "staging")
    held = demo.chaos_hold_off(world.conn)
    assert held is not None and "staging is uncertain" in held
    transitions.resolve_target(world.conn, target="staging", outcome="retry",
                               note="checked the host; run it again", actor="alice")
    # the re-run is queued now: a chaos scheduler started now would take it and lose it again
    held = demo.chaos_hold_off(world.conn)
    assert held is not None and "target:staging was resolved by alice" in held
    # past the quiet time (here: none) it may start again
    assert demo.chaos_hold_off(world.conn, quiet_seconds=0) is None


@pytest.mark.own_database
def test_a_held_off_round_starts_no_scheduler(world, db_url, tmp_path):
    make_uncertain_target(world, "staging")
    transitions.resolve_target(world.conn, target="staging", outcome="succeeded",
                               note="the deploy log says it finished", actor="alice")
    run = demo.Demo(Settings(data_dir=tmp_path), bind="127.0.0.1:0")
    run.workload_url = db_url
    assert run.lose_a_runner() is False
    assert run.children == []


def test_a_hold_off_is_said_once_when_it_starts_and_once_when_it_ends(world, tmp_path, caplog):
    """Checked every 15 s while a target stays uncertain: one line, not one a check."""
    world.setup(pools=("linux", "deploy"), targets=("staging",))
    run = demo.Demo(Settings(data_dir=tmp_path), bind="127.0.0.1:0")
    caplog.set_level("INFO", logger="pgdispatch.demo")

    def said() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name == "pgdispatch.demo"]
        caplog.clear()
        return lines

    assert run.hold_off(world.conn) is None and said() == []  # no episode: nothing to say
    make_uncertain_target(world, "staging")
    for _ in range(4):
        assert run.hold_off(world.conn)
    assert said() == ["demo chaos: holding off: target staging is uncertain, waiting for an operator"]
    transitions.resolve_target(world.conn, target="staging", outcome="succeeded",
                               note="the deploy log says it finished", actor="alice")
    for _ in range(3):  # the quiet time after the resolution: its reason, once (its age grows)
        assert run.hold_off(world.conn)
    [line] = said()
    assert line.startswith("demo chaos: holding off: target:staging was resolved by alice ")
    run.quiet_seconds = 0  # the quiet time is over
    for _ in range(3):
        assert run.hold_off(world.conn) is None
    assert said() == ["demo chaos: no longer holding off (no target uncertain, none resolved "
                      "in the last 0 s)"]


def test_the_demo_schedulers_metrics_ports_are_fixed_unless_taken():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        other = demo.metrics_port(taken)
        assert other != taken
        with socket.socket() as s:  # the one it gives can be listened on
            s.bind(("127.0.0.1", other))
    assert demo.metrics_port(other) == other  # a free one is kept
    assert sorted(demo.DEMO_METRICS_PORTS.values()) == [9464, 9465]
