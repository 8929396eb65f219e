"""The runners page shows who holds each elected duty and when it was last done, and keeps
stopped runners from piling up (webapp/runners.py)."""

from __future__ import annotations

from pgdispatch.sql import transitions


def test_the_runners_page_names_each_duty_holder_and_shows_only_the_last_stopped(operator, world):
    world.setup()
    holder = world.runner(name="duty-host")
    rows = transitions.beat_runner(world.conn, runner_id=holder, beat_seconds=1.0,
                                   duty_lease_seconds=20.0)
    term = {r["duty"]: r["term"] for r in rows}["summaries"]
    assert transitions.run_summaries(world.conn, runner_id=holder, term=term)
    for i in range(13):
        transitions.stop_runner(world.conn, runner_id=world.runner(name=f"gone-{i:02d}"))
    page = operator.get("/runners/").get_data(as_text=True)

    row = page[page.index('id="duty-summaries"'):]
    row = row[:row.index("</tr>")]
    assert "duty-host" in row and f"term {term}" in row and "held" in row
    assert "never" not in row  # last done: a time ago
    cleanup = page[page.index('id="duty-cleanup"'):]
    assert "never" in cleanup[:cleanup.index("</tr>")]  # held, not done yet
    # the beat itself stamps expiry while no lease has lapsed (pgd_beat_runner)
    expiry = page[page.index('id="duty-expiry"'):]
    assert "never" not in expiry[:expiry.index("</tr>")]
    # the newest ten stopped runners, and how many are folded away
    assert "gone-12" in page and "gone-03" in page and "gone-02" not in page
    assert "3 stopped runners are folded away" in page
