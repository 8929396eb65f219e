"""The Jobs page in a real browser: a holder link lists who holds a capacity, and the list
follows by itself (htmx polling) when another job starts holding it."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from .conftest import SCREENSHOTS
from .test_console import _populate, _sign_in


def test_holders_of_an_organization_follow_live(live_server, context, world):
    _populate(world)
    runner = world.runner(pools=("linux",), slots=4, name="build-2")
    page = context.new_page()
    _sign_in(page, live_server, "alice")
    page.goto(live_server + "/jobs/?state=running&organization=acme")
    rows = page.locator("#jobs-table tbody tr[id^=jobs-row-]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("build-1")
    expect(rows.first.locator(".running-for")).to_have_text(re.compile(r"\d+ (s|min)"))
    # another job of acme starts: the page shows it without a reload
    started = world.claim(runner)
    assert started is not None
    expect(page.locator(f"#jobs-row-{started.job_id}")).to_contain_text("build-2", timeout=10000)
    expect(rows).to_have_count(2)
    # the runner cell is itself a holder link: the jobs that runner runs
    page.locator(f"#jobs-row-{started.job_id} a", has_text="build-2").click()
    page.wait_for_url(f"**/jobs/?state=running&runner={runner}")
    expect(rows).to_have_count(1)
    page.goto(live_server + "/jobs/")
    page.set_viewport_size({"width": 1280, "height": 700})
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "jobs.png"), full_page=True)
    assert not context.console_errors, context.console_errors
