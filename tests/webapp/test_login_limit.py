"""The login limit is the database's (pgd_sign_in, sql/functions/accounts.sql): at most 10
failed sign-ins per username and per client address in 60 seconds, whichever web worker or
host takes the attempt; every failure and every refusal is audited; behind trusted proxies
(PGDISPATCH_TRUSTED_PROXIES) the address counted is the client's."""

from __future__ import annotations

import concurrent.futures
import http.cookiejar
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from ..variants import variant_sql
from .conftest import csrf_from, login
from .support import count, ensure_account

LIMIT = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "pgdispatch web did not answer in 60 s"
            time.sleep(0.2)


def _post_login(url: str, cookie: str, token: str, password: str) -> int:
    body = urllib.parse.urlencode({"username": "alice", "password": password,
                                   "csrf_token": token}).encode()
    request = urllib.request.Request(url + "/login", data=body, headers={"Cookie": cookie})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("variant", ["real", "broken: no limit in the database"])
def test_sixty_bad_passwords_across_four_workers_get_at_most_the_limit_checked(
        db_url, world, tmp_path, variant):
    ensure_account(world.conn, "alice", "alice-password", "operator")
    if variant != "real":
        world.conn.execute(variant_sql(world.conn, "pgd_sign_in_limit_reached", [
            ("SELECT (SELECT count(*)", "SELECT false AND (SELECT count(*)"),
            ("OR (p_address IS NOT NULL", "OR false AND (p_address IS NOT NULL")]))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_SECRET_KEY="login-limit-test-key-0123456789")
    proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", "web", "--workers", "4",
                             "--bind", f"127.0.0.1:{port}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, proc)
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with opener.open(url + "/login", timeout=10) as r:
            token = csrf_from(r.read().decode())
        cookie = "; ".join(f"{c.name}={c.value}" for c in jar)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda i: _post_login(url, cookie, token, f"guess-{i}"),
                                     range(60)))
        right = _post_login(url, cookie, token, "alice-password")
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
    workers = set(re.findall(r"Booting worker with pid: (\d+)", output))
    assert len(workers) == 4, output
    checked = count(world.conn, "audit_events", "action = 'sign_in_failed'")
    refused = count(world.conn, "audit_events", "action = 'sign_in_refused'")
    if variant != "real":
        assert checked > LIMIT  # without the database's limit, every guess is checked
        return
    assert checked == statuses.count(401) == LIMIT, statuses
    assert statuses.count(429) == 60 - LIMIT
    assert right == 429  # even the right password waits for the window to pass
    assert refused == 60 - LIMIT + 1
    assert count(world.conn, "audit_events", "action = 'sign_in'") == 0


def test_failures_and_refusals_are_audited_with_the_name_tried_and_the_address(app, world):
    ensure_account(world.conn, "alice", "alice-password", "operator")
    client = app.test_client()
    for _ in range(LIMIT):
        assert login(client, "alice", "wrong password").status_code == 401
    assert login(client, "alice").status_code == 429
    assert login(client, "nobody-such", "whatever").status_code == 429  # same address, new name
    rows = world.conn.execute("SELECT actor, action, subject, details FROM audit_events "
                              "ORDER BY id").fetchall()
    assert [r["action"] for r in rows] == ["sign_in_failed"] * LIMIT + ["sign_in_refused"] * 2
    assert {r["actor"] for r in rows} == {"alice", "nobody-such"}
    assert all(r["details"] == {"address": "127.0.0.1"} for r in rows)


def test_the_limit_is_per_username_too(app, world):
    """Ten failures for one name from many addresses: the eleventh, from anywhere, waits."""
    ensure_account(world.conn, "alice", "alice-password", "operator")
    for i in range(LIMIT):
        client = app.test_client()
        response = client.post("/login", environ_base={"REMOTE_ADDR": f"198.51.100.{i}"},
                               data={"username": "alice", "password": "nope",
                                     "csrf_token": csrf_from(client.get("/login").get_data(as_text=True))})
        assert response.status_code == 401
    assert login(app.test_client(), "alice").status_code == 429


def test_parameters_do_not_say_whether_a_user_exists(world):
    """An unknown name gets the same shape of answer as a known one, the same each time."""
    from pgdispatch.sql.queries import Q

    ensure_account(world.conn, "alice", "alice-password", "operator")
    known = Q.sign_in_parameters(world.conn, username="alice", address=None)
    unknown = Q.sign_in_parameters(world.conn, username="mallory", address=None)
    assert unknown == Q.sign_in_parameters(world.conn, username="mallory", address=None)
    assert unknown["salt"] != known["salt"] != Q.sign_in_parameters(
        world.conn, username="mallet", address=None)["salt"]
    assert {k: v for k, v in known.items() if k != "salt"} == \
        {k: v for k, v in unknown.items() if k != "salt"}
    assert len(known["salt"]) == len(unknown["salt"])


@pytest.mark.parametrize("hops, forwarded, counted", [
    (0, "203.0.113.7", "127.0.0.1"),                 # no proxy trusted: the header is ignored
    (1, "203.0.113.7", "203.0.113.7"),
    (1, "198.51.100.1, 203.0.113.7", "203.0.113.7"),  # a client-sent value before the proxy's
])
def test_behind_trusted_proxies_the_clients_address_is_counted(make_app, world, hops,
                                                               forwarded, counted):
    app = make_app(TRUSTED_PROXIES=hops)
    client = app.test_client()
    token = csrf_from(client.get("/login").get_data(as_text=True))
    response = client.post("/login", headers={"X-Forwarded-For": forwarded},
                           data={"username": "alice", "password": "nope", "csrf_token": token})
    assert response.status_code == 401
    [row] = world.conn.execute("SELECT address FROM sign_in_failures").fetchall()
    assert row["address"] == counted


def test_a_bad_trusted_proxies_setting_is_refused(monkeypatch):
    from pgdispatch.webapp import _trusted_proxies

    assert _trusted_proxies("2") == 2
    for bad in ("-1", "two", "11"):
        with pytest.raises(ValueError, match="PGDISPATCH_TRUSTED_PROXIES"):
            _trusted_proxies(bad)
