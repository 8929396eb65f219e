"""Time in a real browser: the queue's "waiting since" in the viewer's own time zone, as
"YYYY-MM-DD HH:MM:SS zone" whatever the browser's locale (static/app.js rewrites every
<time data-local>, also after an htmx poll swaps the table), UTC in the tooltip; the overview's history charts load as SVG images under the console's CSP."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from pgdispatch.sql import transitions

from tests.webapp.support import ensure_account

from .conftest import SCREENSHOTS, sign_in

PASSWORD = "alice-password"


def _sign_in(page, base: str, path: str) -> None:
    sign_in(page, base, "alice", PASSWORD, path)


def test_waiting_since_reads_in_the_viewers_time_zone_with_utc_in_the_tooltip(live_server, browser, world):
    world.setup()
    job = world.job()
    # 11:00:00 UTC is 16:30 in Kolkata (UTC+5:30, no daylight saving): unmistakable
    world.conn.execute("UPDATE jobs SET ready_at = '2025-03-04 11:00:00+00' WHERE id = %s", (job["id"],))
    ensure_account(world.conn, "alice", PASSWORD, "operator")
    # en-US would say "03/04/2025, 04:30:00 PM GMT+5:30": the console says it as the charts,
    # the reasons and the CLI do, 24-hour and ISO-like, with the zone's short name
    ctx = browser.new_context(timezone_id="Asia/Kolkata", locale="en-US")
    try:
        page = ctx.new_page()
        _sign_in(page, live_server, "/queue/?sort=oldest")
        stamp = page.locator(f"#queue-job-{job['id']} .waiting-since time[data-local]")
        expect(stamp).to_have_attribute("title", "2025-03-04 11:00:00 UTC")
        expect(stamp).to_have_text(re.compile(r"^2025-03-04 16:30:00 (GMT\+5:30|IST)$"))

        # a poll swaps the table in anew (UTC from the server): localized again
        with page.expect_response(lambda r: "/queue/" in r.url and r.request.headers.get("hx-request") == "true"):
            pass
        page.wait_for_function(
            "id => { const t = document.querySelector(`#queue-job-${id} .waiting-since time[data-local]`);"
            " return t && t.dataset.localized && t.textContent.includes('16:30:00'); }",
            arg=job["id"])
        expect(stamp).to_have_attribute("title", "2025-03-04 11:00:00 UTC")
    finally:
        ctx.close()


def test_the_overview_charts_load_as_images(live_server, context, world):
    world.setup(pools=("linux", "macos"))
    runner = world.runner(pools=("linux", "macos"), slots=4, name="build-1")
    for _ in range(4):
        world.job()
    world.job(pool="macos", requires_approval=True)
    rows = transitions.beat_runner(world.conn, runner_id=runner, beat_seconds=1.0, duty_lease_seconds=20.0)
    term = {r["duty"]: r for r in rows}["summaries"]["term"]
    world.claim(runner), world.claim(runner)
    assert transitions.run_summaries(world.conn, runner_id=runner, term=term)
    ensure_account(world.conn, "alice", PASSWORD, "operator")

    page = context.new_page()
    _sign_in(page, live_server, "/")
    images = page.locator("#overview-charts img")
    expect(images).to_have_count(4)
    for i in range(4):
        images.nth(i).scroll_into_view_if_needed()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=images.nth(i).element_handle())
    assert "ready" in images.nth(0).get_attribute("alt")
    page.click("text=last day")
    page.wait_for_url(re.compile(r"span=day"))
    expect(page.locator("#overview-charts strong[aria-current]")).to_have_text("last day")
    assert context.console_errors == []
    page.locator("#overview-charts").screenshot(path=str(SCREENSHOTS / "overview-charts.png"))
