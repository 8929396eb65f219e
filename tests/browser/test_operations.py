"""Operations in a real browser against real processes: an operator resolves an uncertain
target and a real scheduler process runs the next deployment; an admin edits limits and the
overview's capacity bars follow."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.e2e.test_scheduler_e2e import Schedulers, wait_until
from tests.webapp.support import ensure_account, make_uncertain_target

from .conftest import SCREENSHOTS, sign_in

PASSWORDS = {"alice": "alice-password", "ada": "ada-admin-password"}
ROLES = {"alice": "operator", "ada": "admin"}


def _sign_in(page, base: str, username: str, path: str = "/") -> None:
    sign_in(page, base, username, PASSWORDS[username], path)


def _accounts(world, *names: str) -> None:
    for name in names:
        ensure_account(world.conn, name, PASSWORDS[name], ROLES[name])


def test_resolving_an_uncertain_target_lets_a_real_scheduler_run_the_next_deployment(
        live_server, context, world, db_url, tmp_path):
    lost = make_uncertain_target(world)["job"]
    nxt = world.job(pool="deploy", target="production",
                    command=["sh", "-c", "sleep 1; echo deployed v2 to production"])
    _accounts(world, "alice")
    schedulers = Schedulers(db_url, tmp_path)
    try:
        # `python -m pgdispatch scheduler --pool deploy --slots 1`, short intervals
        schedulers.start("deployer", pools=("deploy",), slots=1, via_cli=True)
        page = context.new_page()
        _sign_in(page, live_server, "alice", "/targets/")
        card = page.locator("article.target", has_text="production")
        expect(card).to_have_class(re.compile(r"\btarget-uncertain\b"))
        expect(card).to_contain_text(f"held by job {lost['id']}")

        # the next deployment waits on the uncertain target, however long the scheduler runs
        job_page = context.new_page()
        job_page.goto(f"{live_server}/jobs/{nxt['id']}")
        expect(job_page.locator(f"#job-{nxt['id']}-explain")).to_contain_text("target_uncertain")
        assert world.row("jobs", nxt["id"])["state"] == "queued"

        form = card.locator("form.resolve-form")
        form.get_by_label("No: it failed").check()
        form.locator("textarea[name=note]").fill("host still on v1; nothing was deployed")
        form.get_by_role("button", name=re.compile("Resolve")).click()
        expect(page.locator("#flash")).to_contain_text(
            f"target production resolved as failed; job {lost['id']} failed")
        expect(page.locator(".target-uncertain")).to_have_count(0)

        # the real scheduler claims the next deployment; the job page (polling) follows it
        badge = job_page.locator(f"#job-{nxt['id']} h1 .badge")
        expect(badge).to_have_text(re.compile(r"^(running|succeeded)$"), timeout=30000)
        expect(badge).to_have_text("succeeded", timeout=30000)
        expect(job_page.locator(f"#job-{nxt['id']}")).to_contain_text("deployed v2 to production")
        expect(job_page.locator(f"#job-{nxt['id']}")).to_contain_text("on deployer")
        # and the targets page, polling too, shows the target free again
        expect(card.locator(".badge").first).to_have_text("free", timeout=10000)
    finally:
        schedulers.close()
    wait_until(lambda: world.row("jobs", nxt["id"])["state"] == "succeeded", what="the job row")
    event = world.conn.execute("SELECT actor, reason FROM audit_events "
                               "WHERE action = 'resolve_target'").fetchone()
    assert event == {"actor": "alice", "reason": "host still on v1; nothing was deployed"}
    assert context.console_errors == []


def test_admin_edits_a_limit_and_the_capacity_bar_follows(live_server, context, world):
    world.setup(org_limit=6, pool_slots=4, pools=("linux", "deploy"), targets=("production",))
    runner = world.runner(pools=("linux",), slots=4, name="build-1")
    for command in (["make", "build"], ["make", "test"], ["make", "lint"]):
        world.job(command=command)
    world.claim(runner)
    world.claim(runner)
    _accounts(world, "alice", "ada")

    overview = context.new_page()
    _sign_in(overview, live_server, "ada", "/")
    pool_bar = overview.locator("#capacity-pools .capacity", has_text="linux")
    expect(pool_bar.locator(".capacity-numbers")).to_have_text("2 of 4 pool slots")

    admin = context.new_page()
    admin.goto(live_server + "/admin/limits")
    expect(admin.locator("nav.tabs a[aria-current=page]")).to_have_text("Limits")
    slots = admin.get_by_label("Slots of linux")
    slots.fill("2")
    slots.locator("xpath=ancestor::form").get_by_role("button", name="Save").click()
    expect(admin.locator("#flash")).to_contain_text("pool linux: 2 slots (2 running)")
    assert admin.url.endswith("/admin/limits")  # swapped in place by htmx
    # the overview was not reloaded: its poll shows the new limit, now full
    expect(pool_bar.locator(".capacity-numbers")).to_have_text("2 of 2 pool slots", timeout=10000)
    expect(pool_bar).to_have_class(re.compile(r"\bis-full\b"))
    assert pool_bar.locator("meter").get_attribute("max") == "2"

    org = admin.get_by_label("Limit of acme")
    org.fill("10")
    org.locator("xpath=ancestor::form").get_by_role("button", name="Save").click()
    expect(admin.locator("#flash")).to_contain_text("organization acme: limit 10")
    expect(overview.locator("#capacity-organizations .capacity-numbers")).to_have_text(
        "2 of 10 running", timeout=10000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin.screenshot(path=str(SCREENSHOTS / "admin-limits.png"), full_page=True)

    # accounts: create a token for alice; it is shown once
    admin.goto(live_server + "/admin/")
    form = admin.locator("#admin-new-token form")
    form.locator("select[name=username]").select_option("alice")
    form.locator("input[name=name]").fill("deploy-bot")
    form.get_by_role("button", name="Create token").click()
    expect(admin.locator("#new-token-value")).to_have_text(re.compile(r"^pgd_"))
    admin.screenshot(path=str(SCREENSHOTS / "admin.png"), full_page=True)

    # an operator is refused the admin area
    operator = context.browser.new_context()
    try:
        page = operator.new_page()
        _sign_in(page, live_server, "alice", "/")
        expect(page.locator("nav a", has_text="Admin")).to_have_count(0)
        assert page.goto(live_server + "/admin/limits").status == 403
    finally:
        operator.close()
    assert world.conn.execute("SELECT slots FROM pools WHERE name = 'linux'").fetchone()["slots"] == 2
    actions = [r["action"] for r in world.conn.execute(
        "SELECT action FROM audit_events WHERE actor = 'ada' AND action <> 'sign_in' ORDER BY id")]
    assert actions == ["set_pool_slots", "set_organization_limit", "create_api_token"]
    assert context.console_errors == []
