"""Console and API fixtures: the real app against this test's fresh database."""

from __future__ import annotations

import re

import pytest

from pgdispatch.sql import Settings
from pgdispatch.sql.accounts import create_api_token
from pgdispatch.webapp import create_app, shutdown

from .support import ensure_account

PASSWORDS = {"alice": "alice-password", "bob": "bob-password-2", "victor": "victor-password",
             "ada": "ada-admin-password"}
ROLES = {"alice": "operator", "bob": "operator", "victor": "viewer", "ada": "admin"}
TEST_SETTINGS = Settings(secret_key="test-only-secret-key-0123456789abcdef")


@pytest.fixture
def make_app(console_url):
    """Build apps on this test's database, logged in as the console's own login (group
    pgdispatch_web: tests/conftest.py); their pools are closed at the end."""
    apps = []

    def make(**overrides):
        app = create_app(TEST_SETTINGS, database_url=console_url, TESTING=True, **overrides)
        apps.append(app)
        return app

    yield make
    for app in apps:
        shutdown(app)


@pytest.fixture
def app(make_app):
    return make_app()


@pytest.fixture
def accounts(conn):
    """``accounts("alice", ...)`` creates those accounts (only the ones a test needs):
    alice and bob are operators, victor a viewer, ada an admin."""
    made: set[str] = set()

    def ensure(*names: str) -> None:
        for name in names:
            if name not in made:
                ensure_account(conn, name, PASSWORDS[name], ROLES[name])
                made.add(name)

    return ensure


@pytest.fixture
def signed_in(app, accounts):
    """``signed_in("alice")``: a test client signed in through the real form, with the
    page's CSRF token as ``client.csrf``."""

    def sign_in(name: str, on=None):
        accounts(name)
        client = (on or app).test_client()
        assert login(client, name).status_code == 303
        client.csrf = csrf_from(client.get("/").get_data(as_text=True))
        return client

    return sign_in


def csrf_from(html: str) -> str:
    """The CSRF token a console page carries."""
    match = re.search(r'<meta name="csrf-token" content="([^"]+)"', html)
    assert match, "no csrf token on the page"
    return match.group(1)


def login(client, username: str, password: str | None = None):
    """Sign in through the real form; returns the POST's response."""
    page = client.get("/login")
    token = csrf_from(page.get_data(as_text=True))
    return client.post("/login", data={"username": username,
                                       "password": password or PASSWORDS[username],
                                       "csrf_token": token})


@pytest.fixture
def operator(signed_in):
    """alice, an operator."""
    return signed_in("alice")


@pytest.fixture
def viewer(signed_in):
    """victor, a viewer."""
    return signed_in("victor")


@pytest.fixture
def admin(signed_in):
    """ada, an admin."""
    return signed_in("ada")


@pytest.fixture
def tokens(conn, accounts):
    """Bearer tokens for alice (operator) and victor (viewer), by name."""
    accounts("alice", "victor")
    return {"alice": create_api_token(conn, username="alice", name="ci"),
            "victor": create_api_token(conn, username="victor", name="dashboard")}


@pytest.fixture
def api(app, tokens):
    """``api(method, path, user="alice", **kwargs)`` -> the response of a JSON API call
    with that user's bearer token (``user=None``: none; ``headers`` are kept)."""
    client = app.test_client()

    def call(method, path, *, user="alice", **kwargs):
        headers = kwargs.pop("headers", {})
        if user:
            headers["Authorization"] = f"Bearer {tokens[user]}"
        return client.open(path, method=method, headers=headers, **kwargs)

    return call
