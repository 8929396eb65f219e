"""The console in a real browser: sign in, pause a project, watch the queue follow."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from pgdispatch.sql import transitions

from tests.webapp.support import ensure_account

from .conftest import SCREENSHOTS, sign_in

PASSWORDS = {"alice": "alice-password", "victor": "victor-password"}


def _populate(world) -> dict:
    """A small live-looking world: capacity in use, a waiting job, a failed job with output,
    an uncertain target, audit events."""
    world.setup(org_limit=6, pool_slots=4, pools=("linux", "deploy"), targets=("production", "staging"))
    world.project("api", org="acme", pools=("linux",), max_running=2)
    runner = world.runner(pools=("linux",), slots=4, name="build-1")
    deployer = world.runner(pools=("deploy",), slots=1, name="deploy-1")
    failed = world.job(command=["make", "test"], project="api")
    world.complete(world.claim(runner), "failed", exit_code=2,
                   output_tail="collected 212 items\n...\nFAILED tests/test_api.py::test_login\n1 failed, 211 passed\n")
    world.job(command=["make", "build"])
    world.claim(runner)
    deploy = world.job(pool="deploy", target="production", command=["deploy.sh", "production"])
    lost = world.claim(deployer, pools=("deploy",))
    world.expire_now(lost.attempt_id)
    transitions.expire_leases(world.conn)
    waiting = world.job(command=["make", "lint"])
    world.job(project="api", requires_approval=True, command=["make", "release"])
    # staging: two deployments superseded by a third, then one more waiting behind it
    world.apply({"targets": [{"name": "staging", "supersede": True, "deploy_order": "newest_ready_first"}]})
    for n in range(3):
        world.job(pool="deploy", target="staging", command=["deploy.sh", "staging", f"v{n + 1}"])
    world.apply({"targets": [{"name": "staging", "deploy_order": "newest_ready_first"}]})
    world.job(pool="deploy", target="staging", command=["deploy.sh", "staging", "v4"])
    transitions.summarize_queue(world.conn)
    for name, password in PASSWORDS.items():
        ensure_account(world.conn, name, password, "operator" if name == "alice" else "viewer")
    return {"waiting": waiting, "failed": failed, "deploy": deploy}


def _sign_in(page, base: str, username: str) -> None:
    page.goto(base + "/queue/")
    assert "/login" in page.url  # sent to sign in first
    sign_in(page, base, username, PASSWORDS[username], "/queue/")


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_operator_pauses_a_project_and_the_queue_follows(live_server, context, world):
    made = _populate(world)
    job_id = made["waiting"]["id"]
    queue = context.new_page()
    _sign_in(queue, live_server, "alice")
    reason = queue.locator(f"#queue-job-{job_id} .reason")
    expect(reason).to_have_text("ready")
    _shot(queue, "queue")

    stale = context.new_page()  # a second operator's tab, opened before the pause
    stale.goto(live_server + "/projects/")
    projects = context.new_page()
    projects.goto(live_server + "/projects/")
    row = projects.locator("tr", has_text="web").first
    row.locator("input[name=reason]").fill("release freeze for INC-42")
    row.get_by_role("button", name="Pause").click()
    expect(projects.locator("#flash")).to_contain_text("project web paused")
    expect(row).to_contain_text("paused")
    expect(row).to_contain_text("by alice")
    expect(row.get_by_role("button", name="Resume")).to_be_visible()
    assert projects.url.endswith("/projects/")  # swapped in place by htmx, no navigation
    _shot(projects, "projects")

    # the stale tab still offers Pause; clicking it loses and shows who won, in place
    stale_row = stale.locator("tr", has_text="web").first
    stale_row.locator("input[name=reason]").fill("me too")
    stale_row.get_by_role("button", name="Pause").click()
    expect(stale.locator("#flash .flash-error")).to_contain_text("already paused by alice at")
    expect(stale_row.get_by_role("button", name="Resume")).to_be_visible()

    # the queue page was not reloaded: its poll brings the new reason within one refresh
    expect(reason).to_have_text("project_paused", timeout=5000)
    expect(queue.locator(f"#queue-job-{job_id}")).to_contain_text("paused by alice")

    row_db = world.conn.execute("SELECT paused_at, paused_by FROM projects WHERE name = 'web'").fetchone()
    assert row_db["paused_at"] is not None and row_db["paused_by"] == "alice"
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE action = 'pause_project' "
                              "AND actor = 'alice'").fetchone()["n"] == 1

    for name, path in [("overview", "/"), ("targets", "/targets/"), ("target", "/targets/staging"),
                       ("job-detail", f"/jobs/{made['failed']['id']}"), ("runners", "/runners/"),
                       ("pools", "/pools/"), ("database", "/database/"),
                       ("audit", "/audit/"), ("search", "/jobs/search?q=make"),
                       ("bulk-retry", "/jobs/bulk?action=retry")]:
        projects.goto(live_server + path)
        expect(projects.locator("main h1").first).to_be_visible()
        _shot(projects, name)
    assert "Uncertain targets" in projects.goto(live_server + "/").text()
    # no CSP violation, no script error; Chromium reports the expected 409 as a network line
    expected = "Failed to load resource: the server responded with a status of 409 (CONFLICT)"
    assert [e for e in context.console_errors if e != expected] == []


def test_the_top_bar_finds_a_job_by_command_and_opens_one_by_id(live_server, context, world):
    made = _populate(world)
    page = context.new_page()
    _sign_in(page, live_server, "victor")
    box = page.get_by_role("searchbox", name="Find a job by command or id")
    box.fill("MAKE T")
    box.press("Enter")
    page.wait_for_url(re.compile(r"/jobs/search\?q=MAKE\+T"))
    results = page.locator("#search-results")
    expect(results).to_contain_text("1 job for “MAKE T”")
    expect(results.locator(f"#search-row-{made['failed']['id']}")).to_contain_text("make test")
    page.get_by_role("searchbox", name="Find a job by command or id").fill(f"#{made['deploy']['id']}")
    page.get_by_role("searchbox", name="Find a job by command or id").press("Enter")
    page.wait_for_url(re.compile(rf"/jobs/{made['deploy']['id']}$"))
    expect(page.locator("main h1").first).to_contain_text(str(made["deploy"]["id"]))
    assert context.console_errors == []


def test_viewer_sees_no_action_buttons_and_is_refused(live_server, context, world):
    _populate(world)
    page = context.new_page()
    _sign_in(page, live_server, "victor")
    page.goto(live_server + "/projects/")
    expect(page.locator("#projects-table")).to_contain_text("web")
    expect(page.get_by_role("button", name="Pause")).to_have_count(0)
    page.goto(live_server + "/targets/")
    expect(page.locator(".target-uncertain")).to_have_count(1)
    expect(page.get_by_role("button", name=re.compile("Resolve"))).to_have_count(0)
    token = page.locator("meta[name=csrf-token]").get_attribute("content")
    refused = page.request.post(live_server + "/projects/web/pause",
                                form={"reason": "sneaky", "csrf_token": token}, max_redirects=0)
    assert refused.status == 403
    assert world.conn.execute("SELECT paused_at FROM projects WHERE name = 'web'").fetchone()["paused_at"] is None


def test_without_javascript_pages_read_and_plain_forms_work(live_server, browser, world):
    _populate(world)
    ctx = browser.new_context(java_script_enabled=False)
    try:
        page = ctx.new_page()
        _sign_in(page, live_server, "alice")
        expect(page.locator("#queue-table")).to_contain_text("make lint")
        page.goto(live_server + "/targets/")
        form = page.locator("form.resolve-form")
        form.get_by_label("Unknown: run it again").check()
        form.locator("textarea[name=note]").fill("no trace on the host; rerun")
        form.get_by_role("button", name=re.compile("Resolve")).click()
        page.wait_for_url(re.compile(r"/targets/$"))  # redirect after POST
        expect(page.locator("#flash")).to_contain_text("target production resolved as retry")
        expect(page.locator(".target-uncertain")).to_have_count(0)
    finally:
        ctx.close()
    assert world.conn.execute("SELECT state FROM targets WHERE name = 'production'").fetchone()["state"] == "free"


def test_operator_pauses_a_pool_and_drains_a_runner_in_place(live_server, context, world):
    made = _populate(world)
    job_id = made["waiting"]["id"]
    queue = context.new_page()
    _sign_in(queue, live_server, "alice")
    reason = queue.locator(f"#queue-job-{job_id} .reason")
    expect(reason).to_have_text("ready")

    pools = context.new_page()
    pools.goto(live_server + "/pools/")
    row = pools.locator("tr", has_text="linux").first
    row.locator("input[name=reason]").fill("kernel upgrade")
    row.get_by_role("button", name="Pause").click()
    expect(pools.locator("#flash")).to_contain_text("pool linux paused")
    expect(row).to_contain_text("by alice")
    expect(row.get_by_role("button", name="Resume")).to_be_visible()
    assert pools.url.endswith("/pools/")  # swapped in place by htmx
    expect(reason).to_have_text("pool_paused", timeout=5000)  # the queue's poll follows

    runners = context.new_page()
    runners.goto(live_server + "/runners/")
    row = runners.locator("tr", has_text="build-1").first
    row.locator("input[name=reason]").fill("host reboot")
    row.locator("input[name=deadline_seconds]").fill("300")
    row.get_by_role("button", name="Drain").click()
    expect(runners.locator("#flash")).to_contain_text("drained")
    expect(row).to_contain_text("draining")  # it still runs a build
    expect(row).to_contain_text("host reboot")
    expect(row.get_by_role("button", name="Resume")).to_be_visible()
    assert runners.url.endswith("/runners/")
    _shot(runners, "runners-drain")
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE actor = 'alice' AND "
                              "action IN ('pause_pool', 'drain_runner')").fetchone()["n"] == 2
    assert context.console_errors == []
