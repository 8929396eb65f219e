"""A real server thread and the system Chromium, driven by Playwright (no browser download)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from pgdispatch.sql import Settings
from pgdispatch.webapp import create_app, shutdown

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"


@pytest.fixture(scope="session")
def browser():
    """One headless system Chromium for the session."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def live_server(console_url):
    """The console served by werkzeug on 127.0.0.1 (an ephemeral port) in a thread, logged in
    as the console's own login (pgdispatch_web)."""
    app = create_app(Settings(secret_key="browser-test-secret-key-0123456789"), database_url=console_url)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="console", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(timeout=10)
    server.server_close()
    shutdown(app)


@pytest.fixture
def context(browser):
    """A fresh browser context (cookies) per test; console errors are collected."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    ctx.console_errors = []

    def on_page(page):
        page.on("console", lambda m: m.type == "error" and ctx.console_errors.append(m.text))
        page.on("pageerror", lambda e: ctx.console_errors.append(str(e)))

    ctx.on("page", on_page)
    yield ctx
    ctx.close()


def sign_in(page, base: str, username: str, password: str, path: str = "/") -> None:
    """Open ``path`` (the console sends the browser to its sign-in form first), sign in as
    ``username`` and wait until the browser is back on ``path`` (any query string)."""
    page.goto(base + path)
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(re.escape(path.split("?")[0]) + r"(\?.*)?$"))
