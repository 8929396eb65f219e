"""Every reason counts, and holders one click away, in a real browser (issue 19, items 1-2).

The fresh-user run: production deployments waiting for approval behind a dependency were
counted, filtered and exported as ``dependency_pending`` only, and "globex 3 of 3" was not a
link. Here an operator finds both from the overview."""

from __future__ import annotations

import base64
import re

from playwright.sync_api import expect

from pgdispatch.sql import transitions

from tests.webapp.support import ensure_account

from .conftest import SCREENSHOTS, sign_in

PASSWORD = "alice-password"


def _populate(world) -> dict:
    """acme/web builds and a deployment to production that waits for its build and for an
    approval; globex (limit 1) with its one slot held by a running shop job, and one more
    shop job waiting for it."""
    world.setup(pools=("linux", "deploy"), targets=("production",))
    world.apply({"organizations": [{"name": "globex", "max_running": 1}],
                 "projects": [{"name": "shop", "organization": "globex", "pools": ["linux"]}],
                 "targets": [{"name": "production", "requires_approval": True}]})
    runner = world.runner(pools=("linux", "deploy"), slots=4, name="build-1")
    holder = world.job(project="shop", command=["make", "shop"])
    assert world.claim(runner).job_id == holder["id"]
    waiting = world.job(project="shop", command=["make", "shop-2"])
    build = world.job(command=["make", "build"])
    gated = world.job(pool="deploy", target="production", command=["deploy.sh", "production"],
                      depends_on=[build["id"]])
    transitions.summarize_queue(world.conn)
    ensure_account(world.conn, "alice", PASSWORD, "operator")
    return {"holder": holder, "waiting": waiting, "build": build, "gated": gated}


def _middle_pixel(context, png: bytes) -> tuple[int, int, int]:
    """The RGB of the middle pixel of a PNG, decoded by the browser (a blank page: no CSP)."""
    scratch = context.new_page()
    try:
        return tuple(scratch.evaluate("""async (b64) => {
            const img = new Image();
            img.src = "data:image/png;base64," + b64;
            await img.decode();
            const canvas = document.createElement("canvas");
            canvas.width = img.width; canvas.height = img.height;
            const ctx = canvas.getContext("2d");
            ctx.drawImage(img, 0, 0);
            const d = ctx.getImageData(Math.floor(img.width / 2), Math.floor(img.height / 2), 1, 1).data;
            return [d[0], d[1], d[2]];
        }""", base64.b64encode(png).decode()))
    finally:
        scratch.close()


def _sign_in(page, base: str) -> None:
    sign_in(page, base, "alice", PASSWORD)


def test_an_approval_behind_a_dependency_is_counted_and_filtered(live_server, context, world):
    made = _populate(world)
    page = context.new_page()
    _sign_in(page, live_server)
    row = page.locator("#reason-count-approval_required")
    expect(row.locator("td.num").first).to_have_text("1")        # counted under every reason
    expect(row.locator("td.primary-count")).to_have_text("0")    # its primary is the dependency
    expect(page.locator("#reason-count-dependency_pending td.primary-count")).to_have_text("1")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "overview-reasons.png"), full_page=True)

    row.get_by_role("link", name="1").click()
    page.wait_for_url(re.compile(r"/queue/\?reason=approval_required$"))
    job = page.locator(f"#queue-job-{made['gated']['id']}")
    expect(job).to_be_visible()
    expect(page.locator("#queue-table tbody tr")).to_have_count(1)
    expect(job.locator(".reason.is-primary")).to_have_text("dependency_pending")
    expect(job.locator("li.is-match .reason")).to_have_text("approval_required")
    expect(job.locator("li.is-match")).to_contain_text("target production requires approval")
    page.screenshot(path=str(SCREENSHOTS / "queue-reasons.png"), full_page=True)
    assert context.console_errors == []


def test_a_capacity_bar_links_to_the_jobs_holding_it(live_server, context, world):
    made = _populate(world)
    page = context.new_page()
    _sign_in(page, live_server)
    bar = page.locator(".capacity", has=page.get_by_role("link", name="globex", exact=True))
    expect(bar).to_have_class(re.compile(r"\bis-full\b"))
    expect(bar).to_contain_text("1 of 1")
    # a full limit of one is drawn red, not green (the fresh-user run: a green bar beside red
    # numbers): the colour Chromium paints in the middle of the bar
    red, green, _ = _middle_pixel(context, bar.locator("meter").screenshot())
    assert red > 150 and green < 100, (red, green)
    bar.get_by_role("link", name="globex").click()
    page.wait_for_url(re.compile(r"/jobs/\?state=running&organization=globex$"))
    expect(page.locator(f"#jobs-row-{made['holder']['id']}")).to_contain_text("shop")

    # and the waiting job's reason links to the same holders from the queue
    page.goto(live_server + "/queue/?reason=capacity_organization")
    waiting = page.locator(f"#queue-job-{made['waiting']['id']}")
    expect(waiting).to_contain_text("organization globex: 1 of 1 running")
    waiting.get_by_role("link", name="jobs holding it").click()
    page.wait_for_url(re.compile(r"/jobs/\?state=running&organization=globex$"))
    expect(page.locator(f"#jobs-row-{made['holder']['id']}")).to_be_visible()
    assert context.console_errors == []
