"""A bulk cancel in a real browser: from the Jobs page's filters to the preview ("This will
cancel N jobs" with the list), then the confirmation and its report; no console error or
CSP violation on the way. Takes the screenshots of docs/console.md's bulk section."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.webapp.support import ensure_account

from .conftest import SCREENSHOTS, sign_in


def test_an_operator_previews_and_confirms_a_bulk_cancel(live_server, context, world):
    world.setup(pools=("linux", "deploy"), targets=("staging",))
    staging = [world.job(pool="deploy", target="staging", command=["deploy.sh", "staging", f"v{i}"])["id"]
               for i in range(6)]
    other = world.job(command=["make", "test"])["id"]
    ensure_account(world.conn, "alice", "alice-password", "operator")
    page = context.new_page()
    sign_in(page, live_server, "alice", "alice-password", "/jobs/?target=staging")
    page.select_option("select[name=action]", "cancel")
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#bulk-summary")).to_have_text("This will cancel 6 jobs")
    expect(page.locator("#bulk tbody tr")).to_have_count(6)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "bulk-preview.png"), full_page=True)
    # one of them changes before the operator confirms: it is skipped, with why
    world.conn.execute("SELECT pgd_cancel_job(%s, NULL, 'bob')", (staging[2],))
    page.fill("input[name=bulk_reason]", "superseded by v6")
    page.get_by_role("button", name="Cancel 6 jobs").click()
    expect(page.locator("#bulk-summary")).to_have_text("Cancelled 5 of 6 jobs; skipped 1")
    expect(page.locator(f"#bulk-skipped-{staging[2]}")).to_contain_text("cancelled by bob")
    page.screenshot(path=str(SCREENSHOTS / "bulk-report.png"), full_page=True)
    states = [world.row("jobs", i)["state"] for i in (*staging, other)]
    assert states == ["cancelled"] * 6 + ["queued"]
    assert context.console_errors == []
