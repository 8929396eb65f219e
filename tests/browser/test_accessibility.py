"""axe-core (axe-playwright-python) on every console page: no serious or critical violation,
at a desktop width and on a phone, where the queue still says why each job waits (its cards'
values labelled) and no page is wider than the phone's screen."""

from __future__ import annotations


from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import expect

from pgdispatch.sql import transitions

from tests.webapp.support import ensure_account

from .conftest import SCREENSHOTS, sign_in
from .test_console import _populate

ADMIN = ("ada", "ada-admin-password")
PHONE = {"width": 390, "height": 844}


def _violations(axe: Axe, page) -> list[str]:
    """The serious and critical axe violations of the page, one line each."""
    found = axe.run(page).response["violations"]
    return [f"{page.url}: {v['id']} ({v['impact']}): {v['help']} — "
            + "; ".join(" ".join(n["target"]) for n in v["nodes"][:5])
            for v in found if v["impact"] in ("serious", "critical")]


def _sign_in(page, base: str) -> None:
    sign_in(page, base, ADMIN[0], ADMIN[1])


def _pages(made: dict) -> list[str]:
    """Every console page (after sign-in), with a failed and a waiting job's detail and a
    missing job's 404 page."""
    return ["/", "/queue/", "/projects/", "/targets/", "/jobs/", f"/jobs/{made['failed']['id']}",
            f"/jobs/{made['waiting']['id']}", "/runners/", "/audit/", "/admin/", "/admin/limits",
            "/jobs/999999999"]


def _overflowing(page, width: int) -> list[str]:
    """What sticks out past the right edge of a ``width`` px viewport (outside any box that
    scrolls by itself): the page then scrolls sideways. Empty when it does not."""
    if page.evaluate("document.documentElement.scrollWidth") <= width:
        return []
    return page.evaluate("""width => {
        const inScroller = el => { for (let p = el.parentElement; p; p = p.parentElement) {
            const s = getComputedStyle(p); if (/(auto|scroll|hidden)/.test(s.overflowX)) return true; }
            return false; };
        const out = el => el.getBoundingClientRect().right > width + 0.5;
        // the outermost boxes that stick out (their parent does not)
        const name = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
            + (typeof el.className === "string" && el.className.trim()
               ? "." + el.className.trim().split(/ +/).join(".") : "");
        return [...document.querySelectorAll("body *")]
            .filter(el => out(el) && !out(el.parentElement) && !inScroller(el)).slice(0, 8)
            .map(el => `${location.pathname}: ${name(el)} ends at ${Math.round(el.getBoundingClientRect().right)} px`);
    }""", width) or [f"{page.url}: {page.evaluate('document.documentElement.scrollWidth')} px wide"]


def test_every_console_page_has_no_serious_accessibility_violation(live_server, context, world):
    made = _populate(world)
    ensure_account(world.conn, *ADMIN, "admin")
    # the grey badges too: a stopped runner, a cancelled job
    transitions.stop_runner(world.conn, runner_id=world.runner(name="retired-1"))
    transitions.cancel_job(world.conn, job_id=world.job(command=["make", "docs"])["id"], actor="ada")
    axe = Axe()
    page = context.new_page()
    page.goto(live_server + "/login")
    problems = _violations(axe, page)
    _sign_in(page, live_server)
    for path in _pages(made):
        page.goto(live_server + path)
        expect(page.locator("main h1").first).to_be_visible()
        problems += _violations(axe, page)
    assert problems == []


def test_skip_link_and_the_queue_on_a_phone(live_server, browser, world):
    made = _populate(world)
    ensure_account(world.conn, *ADMIN, "admin")
    ctx = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    try:
        page = ctx.new_page()
        _sign_in(page, live_server)
        page.goto(live_server + "/queue/")
        # the first Tab reaches the skip link, shown on focus; following it lands in <main>
        page.keyboard.press("Tab")
        skip = page.get_by_role("link", name="Skip to content")
        expect(skip).to_be_focused()
        expect(skip).to_be_in_viewport()
        page.keyboard.press("Enter")
        expect(page.locator("main")).to_be_focused()
        # on a 390 px phone every waiting job says why it waits, on screen, nothing scrolls sideways
        row = page.locator(f"#queue-job-{made['waiting']['id']}")
        expect(row.locator(".reason").first).to_have_text("ready")
        width = PHONE["width"]
        for cell in (row.locator(".reason").first, row.locator(".reason-message").first):
            box = cell.bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, box
        # each card's values say what they are (the column headers are hidden on a phone)
        labels = row.locator("td[data-label]").evaluate_all(
            "cells => cells.filter(c => c.offsetParent).map(c =>"
            " getComputedStyle(c, '::before').content)")
        assert labels[:3] == ['"State"', '"Project"', '"Pool"'], labels
        assert '"Waiting since"' in labels and '"Age"' in labels, labels
        assert _overflowing(page, width) == []
        assert _violations(Axe(), page) == []
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "queue-phone.png"), full_page=True)
        # no page scrolls sideways: wide tables scroll in their own box, the nav wraps
        wide = []
        for path in _pages(made):
            page.goto(live_server + path)
            expect(page.locator("main h1").first).to_be_visible()
            wide += _overflowing(page, width)
            if path == "/runners/":  # runner slots are busy (overview, CLI), pool slots taken
                expect(page.locator("#runners tr", has_text="build-1")).to_contain_text("1 of 4 busy")
        page.get_by_role("button", name="Sign out").click()
        expect(page.locator("#signed-out")).to_be_visible()
        wide += _overflowing(page, width)
        assert wide == [], "\n".join(wide)
    finally:
        ctx.close()
