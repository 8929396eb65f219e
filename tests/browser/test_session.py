"""A session that ends while the console is open (signed out elsewhere): the page never shows
the sign-in form inside a polled fragment; it goes to the sign-in page, which says the session
ended and returns to the page — also when a proxy drops htmx's HX-Redirect (static/app.js)."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.webapp.support import ensure_account

from .conftest import sign_in

USER = ("alice", "alice-password")


def _sign_in(page, base: str, path: str) -> None:
    sign_in(page, base, USER[0], USER[1], path)


def _end_sessions(world) -> None:
    world.conn.execute("UPDATE users SET session_generation = session_generation + 1 "
                       "WHERE username = %s", (USER[0],))


def _signed_out_to_the_sign_in_page(page, back_to: str) -> None:
    page.wait_for_url(re.compile(r"/login\?"), timeout=10_000)
    expect(page.locator("#session-ended")).to_contain_text("Your session has ended")
    page.fill("input[name=username]", USER[0])
    page.fill("input[name=password]", USER[1])
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(re.escape(back_to) + "$"))


def test_a_poll_after_the_session_ended_goes_to_sign_in_and_back(live_server, context, world):
    world.setup()
    world.job()
    ensure_account(world.conn, *USER, "operator")
    page = context.new_page()
    _sign_in(page, live_server, "/queue/?project=web")
    expect(page.locator("#queue-table")).to_be_visible()
    _end_sessions(world)
    # the next poll (every 2 s) gets 401 + HX-Redirect: off to sign in, and back to the queue
    _signed_out_to_the_sign_in_page(page, "/queue/?project=web")
    expect(page.locator("#queue-table")).to_be_visible()

    # a proxy that drops HX-Redirect: app.js reads the 401 itself, nothing is swapped in
    def drop_redirect(route):
        response = route.fetch()
        headers = {k: v for k, v in response.headers.items() if k.lower() != "hx-redirect"}
        route.fulfill(response=response, headers=headers)

    page.route(re.compile(r".*/queue/.*"), drop_redirect)
    _end_sessions(world)
    _signed_out_to_the_sign_in_page(page, "/queue/?project=web")
    page.unroute(re.compile(r".*/queue/.*"))
    assert [e for e in context.console_errors if "401" not in e] == []
