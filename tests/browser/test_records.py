"""Records in a real browser: the projects, runners and audit pages refresh by themselves (a
pause reason being typed survives the refresh), and a deployment resolved by an operator
reads as the operator's outcome, with the job's own audit trail."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from pgdispatch.sql import transitions

from tests.webapp.support import ensure_account, make_uncertain_target

from .conftest import SCREENSHOTS, sign_in

PASSWORD = "alice-password"


def _sign_in(page, base: str, path: str) -> None:
    sign_in(page, base, "alice", PASSWORD, path)


def test_pages_refresh_by_themselves_and_keep_a_typed_reason(live_server, context, world):
    world.setup(pools=("linux",))
    world.project("api", org="acme", pools=("linux",))
    ensure_account(world.conn, "alice", PASSWORD, "operator")
    page = context.new_page()
    _sign_in(page, live_server, "/projects/")
    web = page.locator("tr", has_text="web").first
    web.locator("input[name=reason]").fill("release freeze for INC-7")

    # another operator pauses api meanwhile: the page shows it without a reload...
    transitions.pause_project(world.conn, project="api", reason="disk full", actor="bob")
    api = page.locator("tr", has_text="api").first
    expect(api).to_contain_text("paused", timeout=6000)
    expect(api).to_contain_text("by bob")
    # ...and what alice was typing is still there, and still submits
    expect(web.locator("input[name=reason]")).to_have_value("release freeze for INC-7")
    web.get_by_role("button", name="Pause").click()
    expect(page.locator("#flash")).to_contain_text("project web paused")
    assert world.conn.execute("SELECT pause_reason FROM projects WHERE name = 'web'"
                              ).fetchone()["pause_reason"] == "release freeze for INC-7"

    page.goto(live_server + "/runners/")
    expect(page.locator("#runners")).to_contain_text("No runner has registered")
    world.runner(name="fresh-host")
    expect(page.locator("#runners")).to_contain_text("fresh-host", timeout=6000)

    page.goto(live_server + "/audit/")
    expect(page.locator("#audit-table")).not_to_contain_text("resume_project")
    transitions.resume_project(world.conn, project="api", actor="bob", reason="disk cleaned")
    expect(page.locator("#audit-table")).to_contain_text("disk cleaned", timeout=6000)
    assert context.console_errors == []


def test_a_resolved_deployment_reads_right_and_has_its_own_trail(live_server, context, world):
    made = make_uncertain_target(world, "staging")
    job_id = made["job"]["id"]
    ensure_account(world.conn, "alice", PASSWORD, "operator")
    page = context.new_page()
    _sign_in(page, live_server, "/targets/")
    form = page.locator("form.resolve-form")
    form.get_by_label("Yes: it succeeded").check()
    form.locator("textarea[name=note]").fill("v4.2 answers on every staging host")
    form.get_by_role("button", name=re.compile("Resolve")).click()
    expect(page.locator("#flash")).to_contain_text(
        f"target staging resolved as succeeded; job {job_id} succeeded")

    page.goto(f"{live_server}/jobs/{job_id}")
    job = page.locator(f"#job-{job_id}")
    expect(job.locator("h1 .badge")).to_have_text("succeeded")
    expect(page.locator(f"#job-{job_id}-resolution")).to_contain_text(
        re.compile(r"it succeeded,\s+by alice at .*v4\.2 answers on every staging host"))
    expect(job).not_to_contain_text("Last error")
    expect(job).to_contain_text("0 failed, 1 lost with its runner")
    trail = page.locator(f"#job-{job_id}-audit tbody tr")
    expect(trail).to_have_count(2)
    expect(trail.nth(0)).to_contain_text("submit_job")
    expect(trail.nth(1)).to_contain_text("resolve_target")
    expect(trail.nth(1)).to_contain_text("alice")
    expect(trail.nth(1)).to_contain_text("v4.2 answers on every staging host")
    page.screenshot(path=str(SCREENSHOTS / "job-resolved.png"), full_page=True)

    page.get_by_role("link", name="This job in the audit log").click()
    expect(page.locator("#audit-table")).to_contain_text("resolve_target")
    expect(page.locator("input[name=job]")).to_have_value(str(job_id))
    assert context.console_errors == []
