"""The runners page refreshes by itself, folds stopped runners away after FOLD_SECONDS and
keeps them, listed with ``?show=stopped`` (webapp/runners.py)."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions
from pgdispatch.webapp.runners import FOLD_SECONDS


def _stopped_ago(world, runner_id: int, seconds: float) -> None:
    """Test-only: the runner stopped ``seconds`` ago."""
    world.conn.execute("UPDATE runners SET stopped_at = now() - make_interval(secs => %s), "
                       "stop_reason = 'stopped', draining = true WHERE id = %s", (seconds, runner_id))


def test_stopped_runners_fold_away_and_stay_listed(operator, world):
    world.setup()
    world.runner(name="busy-host")
    recent = world.runner(name="just-stopped")
    transitions.stop_runner(world.conn, runner_id=recent)
    old = [world.runner(name=f"old-{i}") for i in range(3)]
    for runner_id in old:
        _stopped_ago(world, runner_id, FOLD_SECONDS + 60)
    lost = world.runner(name="old-lost")
    world.conn.execute("UPDATE runners SET stopped_at = now() - interval '2 days', "
                       "stop_reason = 'lost' WHERE id = %s", (lost,))

    page = operator.get("/runners/").get_data(as_text=True)
    # polled like the overview
    assert re.search(r'<section id="runners-table"[^>]*hx-trigger="every \d+s"', page)
    assert "busy-host" in page and "just-stopped" in page
    assert "old-0" not in page and "old-lost" not in page
    assert "4 stopped runners are folded away (stopped over 10 min ago" in page
    assert 'href="/runners/?show=stopped"' in page

    stopped = operator.get("/runners/?show=stopped").get_data(as_text=True)
    assert "busy-host" not in stopped
    for name in ("just-stopped", "old-0", "old-1", "old-2", "old-lost"):
        assert name in stopped
    assert "5 stopped or lost runners on record" in stopped
    assert stopped.index("old-lost") < stopped.index("old-0")  # newest first

    first = operator.get("/runners/?show=stopped&limit=2").get_data(as_text=True)
    assert "old-lost" in first and "old-2" in first and "old-1" not in first
    assert f"before_id={old[2]}" in first  # the keyset of the next page
    second = operator.get(f"/runners/?show=stopped&limit=2&before_id={old[2]}").get_data(as_text=True)
    assert "old-1" in second and "old-0" in second and "old-2" not in second
    assert 'hx-trigger' not in second.split('id="runners-table"')[1].split(">")[0]  # history: not polled


def test_runners_page_refuses_bad_input(operator, world):
    world.setup()
    for query in ("show=everything", "show=stopped&before_id=abc", "show=stopped&limit=0"):
        response = operator.get(f"/runners/?{query}")
        assert response.status_code == 422, query


# --- an operator's drain from the runners page ----------------------------------------------

def test_operator_drains_and_resumes_a_runner_from_the_page(operator, viewer, world):
    world.setup()
    runner = world.runner()
    assert "Drain" not in viewer.get("/runners/").get_data(as_text=True)
    assert viewer.post(f"/runners/{runner}/drain", data={"reason": "x", "csrf_token": viewer.csrf}
                       ).status_code == 403
    page = operator.get("/runners/").get_data(as_text=True)
    assert f'action="/runners/{runner}/drain"' in page and 'name="deadline_seconds"' in page
    bad = operator.post(f"/runners/{runner}/drain",
                        data={"reason": "x", "deadline_seconds": "1.5", "csrf_token": operator.csrf})
    assert bad.status_code == 422 and b"deadline seconds" in bad.data
    assert operator.post(f"/runners/{runner}/drain", data={"reason": "", "csrf_token": operator.csrf}
                         ).status_code == 422
    assert world.row("runners", runner)["drain_requested_at"] is None
    htmx = operator.post(f"/runners/{runner}/drain",
                         data={"reason": "host reboot", "deadline_seconds": "120",
                               "csrf_token": operator.csrf}, headers={"HX-Request": "true"})
    body = htmx.get_data(as_text=True)
    assert htmx.status_code == 200 and body.lstrip().startswith(f'<tr id="runner-{runner}"')
    assert "badge runner-drained" in body and "host reboot" in body and "builds handed back at" in body
    assert "handed back after 120 s" in body  # the flash, out of band
    twice = operator.post(f"/runners/{runner}/drain", data={"reason": "x", "csrf_token": operator.csrf})
    assert twice.status_code == 409 and b"already draining (drain asked by alice at" in twice.data
    resumed = operator.post(f"/runners/{runner}/resume", data={"csrf_token": operator.csrf},
                            headers={"HX-Request": "true"})
    assert resumed.status_code == 200 and "badge runner-live" in resumed.get_data(as_text=True)
    assert [e["action"] for e in world.conn.execute(
        "SELECT action FROM audit_events WHERE subject = %s ORDER BY id", (f"runner:{runner}",))] == [
        "drain_runner", "resume_runner"]
