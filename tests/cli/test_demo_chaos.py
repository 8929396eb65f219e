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
