"""Bad input to /api/v1, by hand: bodies that cannot be read, or that the OpenAPI document
refuses, path parameters and headers past their bounds. Each is a 4xx ``{"error": ...}``
whose status the document lists for that operation, and nothing changes.

tests/webapp/test_fuzz.py generates inputs from the document; these are the ones a
generator does not make (a body nested 100 000 deep, a key twice, bytes that are not UTF-8,
a number in quotes), and the walk at the end checks the document's list of statuses.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pgdispatch.sql.accounts import create_api_token
from pgdispatch.webapp.openapi import SPEC

from .support import ensure_account, make_uncertain_target

SUBMIT = {"project": "web", "pool": "linux", "command": ["make"]}


@pytest.fixture
def stage(world):
    """An uncertain target (production), a project (web), a waiting job; tokens for alice
    (operator) and victor (viewer)."""
    made = make_uncertain_target(world)
    job = world.job(requires_approval=True)
    ensure_account(world.conn, "alice", "alice-password", "operator")
    ensure_account(world.conn, "victor", "victor-password", "viewer")
    return {"job": job["id"], "lost": made["job"]["id"],
            "tokens": {"alice": create_api_token(world.conn, username="alice", name="ci"),
                       "victor": create_api_token(world.conn, username="victor", name="ro")}}


@pytest.fixture
def call(app, stage):
    client = app.test_client()

    def send(method, path, *, user="alice", headers=None, **kwargs):
        headers = dict(headers or {})
        if user:
            headers.setdefault("Authorization", f"Bearer {stage['tokens'][user]}")
        return client.open(path, method=method, headers=headers, **kwargs)

    return send


def state(conn) -> tuple:
    """Everything an API call could change (test-only reads)."""
    return (
        conn.execute("SELECT count(*) AS n FROM audit_events").fetchone()["n"],
        [tuple(r.values()) for r in conn.execute(
            "SELECT id, state, priority, max_attempts, requires_approval, approved_at, ready_at "
            "FROM jobs ORDER BY id")],
        [tuple(r.values()) for r in conn.execute("SELECT name, paused_at FROM projects ORDER BY id")],
        [tuple(r.values()) for r in conn.execute("SELECT name, state FROM targets ORDER BY id")],
        [tuple(r.values()) for r in conn.execute("SELECT name, paused_at FROM pools ORDER BY id")],
        [tuple(r.values()) for r in conn.execute(
            "SELECT id, drain_requested_at, drain_deadline FROM runners ORDER BY id")],
    )


def operation_of(method: str, path: str) -> dict:
    """The document's operation for a concrete path."""
    parts = path.removeprefix("/api/v1").split("?")[0].split("/")
    # a literal segment wins over a parameter (/jobs/search, not /jobs/{job_id}), as in Flask
    for template, ops in sorted(SPEC["paths"].items(), key=lambda item: item[0].count("{")):
        names = template.split("/")
        if len(names) == len(parts) and all(n.startswith("{") or n == p for n, p in zip(names, parts)):
            if method.lower() in ops:
                return ops[method.lower()]
    raise AssertionError(f"{method} {path} is not in the document")


def assert_refused(response, method: str, path: str, statuses: tuple[int, ...]) -> str:
    """A 4xx JSON error, one of ``statuses``, documented for the operation; its message."""
    assert response.status_code in statuses, (method, path, response.status_code,
                                              response.get_data(as_text=True)[:300])
    assert response.mimetype == "application/json", response.get_data(as_text=True)[:300]
    message = response.get_json()["error"]
    assert isinstance(message, str) and message and "\n" not in message
    documented = operation_of(method, path)["responses"]
    assert str(response.status_code) in documented, (method, path, response.status_code)
    return message


NESTED = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"reason": ' + '{"a": ' * 40 + '1' + '}' * 40 + '}'

# (raw body, content type, statuses, a fragment of the message): any operation with a body
UNREADABLE = [
    pytest.param(NESTED, "application/json", (400,), "nested deeper", id="nested-list"),
    pytest.param('{"reason": ' + NESTED + '}', "application/json", (400,), "nested deeper",
                 id="nested-in-field"),
    pytest.param(DEEP_OBJECT, "application/json", (400,), "nested deeper than 32", id="nested-40"),
    pytest.param('{"reason": "a", "reason": "b"}', "application/json", (400,), "appears twice",
                 id="duplicate-key"),
    pytest.param('{"reason": NaN}', "application/json", (400,), "NaN", id="nan"),
    pytest.param('{"reason": -Infinity}', "application/json", (400,), "Infinity", id="infinity"),
    pytest.param('{"reason": 1e400}', "application/json", (400,), "too large", id="1e400"),
    pytest.param('{"reason": ' + "9" * 5000 + '}', "application/json", (400,), "not valid JSON",
                 id="5000-digits"),
    pytest.param(b'{"reason": "caf\xe9"}', "application/json", (400,), "UTF-8", id="latin-1"),
    pytest.param(b'\xff\xfe{\x00}\x00', "application/json", (400,), "", id="utf-16-bom"),
    pytest.param('{"reason": "\\ud800"}', "application/json", (400,), "surrogate",
                 id="lone-surrogate"),
    pytest.param('{"reason": "x"', "application/json", (400,), "not valid JSON", id="truncated"),
    pytest.param("reason=freeze", "application/x-www-form-urlencoded", (415,), "Content-Type",
                 id="form"),
    pytest.param('{"reason": "freeze"}', "text/plain", (415,), "Content-Type", id="text-plain"),
    pytest.param('{"reason": "freeze"}', None, (415,), "Content-Type", id="no-content-type"),
    pytest.param('{"reason": "freeze"}', "multipart/form-data; boundary=x", (415,), "Content-Type",
                 id="multipart"),
    pytest.param("x" * (2 * 1024 * 1024), "application/json", (413,), "", id="2-MiB"),
]


def action_paths(stage) -> list[str]:
    return ["/api/v1/jobs", f"/api/v1/jobs/{stage['job']}/cancel",
            f"/api/v1/jobs/{stage['job']}/approve", f"/api/v1/jobs/{stage['lost']}/retry",
            "/api/v1/projects/web/pause", "/api/v1/projects/web/resume",
            "/api/v1/targets/production/resolve", f"/api/v1/jobs/{stage['job']}/priority",
            "/api/v1/jobs/bulk",
            "/api/v1/pools/deploy/pause", "/api/v1/pools/deploy/resume",
            "/api/v1/runners/1/drain", "/api/v1/runners/1/resume"]


@pytest.mark.parametrize("raw, content_type, statuses, fragment", UNREADABLE)
def test_a_body_that_cannot_be_read_is_refused_everywhere(call, stage, world, raw, content_type,
                                                          statuses, fragment):
    before = state(world.conn)
    for path in action_paths(stage):
        headers = {"Content-Type": content_type} if content_type else {}
        response = call("POST", path, data=raw, headers=headers)
        message = assert_refused(response, "POST", path, statuses)
        assert fragment in message, (path, message)
    assert state(world.conn) == before


# (operation path key, body, fragment): JSON the document refuses, field by field
SUBMIT_TYPES = [
    ("delay_seconds", "5", "delay_seconds must be a number, got \"5\""),
    ("delay_seconds", True, "delay_seconds must be a number, got true"),
    ("delay_seconds", None, "delay_seconds must be a number, got null"),
    ("delay_seconds", [5], "delay_seconds must be a number, got a list"),
    ("delay_seconds", -1, "delay_seconds must be between 0 and 2592000, got -1"),
    ("priority", "5", "priority must be a whole number"),
    ("priority", 5.5, "priority must be a whole number, got 5.5"),
    ("priority", True, "priority must be a whole number, got true"),
    ("priority", 10**30, "priority must be between -1000 and 1000"),
    ("priority", -10**18, "priority must be between -1000 and 1000"),
    ("max_attempts", 0, "max_attempts must be between 1 and 100, got 0"),
    ("max_attempts", "3", "max_attempts must be a whole number"),
    ("timeout_seconds", 1.5, "timeout_seconds must be a whole number"),
    ("timeout_seconds", {"s": 1}, "timeout_seconds must be a whole number, got an object"),
    ("requires_approval", 1, "requires_approval must be true or false, got 1"),
    ("requires_approval", 0, "requires_approval must be true or false, got 0"),
    ("requires_approval", "true", "requires_approval must be true or false, got \"true\""),
    ("depends_on", ["1"], "depends_on[0] must be a whole number"),
    ("depends_on", [1.5], "depends_on[0] must be a whole number"),
    ("depends_on", [True], "depends_on[0] must be a whole number"),
    ("depends_on", [0], "depends_on[0] must be between 1 and"),
    ("depends_on", [2**63], "depends_on[0] must be between 1 and"),
    ("depends_on", list(range(1, 1002)), "depends_on has more than 1000 items"),
    ("depends_on", 7, "depends_on must be a list"),
    ("project", 7, "project must be text, got 7"),
    ("project", "x" * 100_000, "is not a name"),
    ("project", "we\x00b", "project must not contain NUL bytes"),
    ("project", "", "is not a name"),
    ("pool", ["linux"], "pool must be text, got a list"),
    ("target", 5, "target must be a name"),
    ("target", "pro duction", "target must be a name"),
    ("command", "make", "command must be a list"),
    ("command", [], "command must not be empty"),
    ("command", [7], "command[0] must be text, got 7"),
    ("command", ["make", None], "command[1] must be text, got null"),
    ("command", ["a\x00b"], "command[0] must not contain NUL bytes"),
    ("command", ["   "], "command[0] must not be blank"),
    ("command", ["x" * 16385], "command[0] is longer than 16384 characters"),
    ("command", ["x"] * 257, "command has more than 256 items"),
    ("command", ["x" * 16000] * 5, "command is longer than 65536 characters"),
    ("idempotency_key", "", "idempotency_key must not be empty"),
    ("idempotency_key", "k" * 201, "idempotency_key is longer than 200 characters"),
    ("idempotency_key", 12, "idempotency_key must be text or null, got 12"),
    ("idempotency_key", "k\x00", "idempotency_key must not contain NUL bytes"),
    ("colour", "red", "unknown field 'colour'"),
]


@pytest.mark.parametrize("field, value, fragment", SUBMIT_TYPES,
                         ids=[f"{f}={json.dumps(v)[:20]}" for f, v, _ in SUBMIT_TYPES])
def test_a_submission_is_checked_against_the_document(call, world, stage, field, value, fragment):
    before = state(world.conn)
    response = call("POST", "/api/v1/jobs", json={**SUBMIT, field: value})
    message = assert_refused(response, "POST", "/api/v1/jobs", (422,))
    assert fragment in message, message
    assert state(world.conn) == before


ACTION_BODIES = [
    ("/api/v1/projects/web/pause", {}, "missing field 'reason'"),
    ("/api/v1/projects/web/pause", None, "the request body must be an object, got null"),
    ("/api/v1/projects/web/pause", {"reason": None}, "reason must be text, got null"),
    ("/api/v1/projects/web/pause", {"reason": 5}, "reason must be text, got 5"),
    ("/api/v1/projects/web/pause", {"reason": ["freeze"]}, "reason must be text, got a list"),
    ("/api/v1/projects/web/pause", {"reason": " \t"}, "reason must not be blank"),
    ("/api/v1/projects/web/pause", {"reason": "x\x00"}, "reason must not contain NUL bytes"),
    ("/api/v1/projects/web/pause", {"reason": "x" * 1001}, "reason is longer than 1000"),
    ("/api/v1/projects/web/pause", {"reason": "x", "by": "me"}, "unknown field 'by'"),
    ("/api/v1/projects/web/pause", [{"reason": "x"}], "the request body must be an object"),
    ("/api/v1/projects/web/pause", "freeze", "the request body must be an object"),
    ("/api/v1/projects/web/resume", {"reason": 0}, "reason must be text or null, got 0"),
    ("/api/v1/projects/web/resume", {"reason": "x" * 1_000_000}, "longer than 1000"),
    ("/api/v1/targets/production/resolve", {"outcome": "retry"}, "missing field 'note'"),
    ("/api/v1/targets/production/resolve", {"outcome": "RETRY", "note": "x"},
     "outcome must be one of succeeded, failed, retry"),
    ("/api/v1/targets/production/resolve", {"outcome": True, "note": "x"}, "outcome must be one of"),
    ("/api/v1/targets/production/resolve", {"outcome": "retry", "note": {"a": 1}},
     "note must be text, got an object"),
    ("/api/v1/pools/deploy/pause", {}, "missing field 'reason'"),
    ("/api/v1/pools/deploy/pause", {"reason": " "}, "reason must not be blank"),
    ("/api/v1/pools/deploy/resume", {"reason": 7}, "reason must be text or null, got 7"),
    ("/api/v1/runners/1/drain", {"deadline_seconds": 5}, "missing field 'reason'"),
    ("/api/v1/runners/1/drain", {"reason": "x", "deadline_seconds": -1}, "deadline_seconds"),
    ("/api/v1/runners/1/drain", {"reason": "x", "deadline_seconds": 2.5}, "deadline_seconds"),
    ("/api/v1/runners/1/drain", {"reason": "x", "deadline_seconds": "9"}, "deadline_seconds"),
    ("/api/v1/runners/1/drain", {"reason": "x", "deadline_seconds": 10**9}, "deadline_seconds"),
    ("/api/v1/runners/1/resume", {"why": "x"}, "unknown field 'why'"),
    ("/jobs/{job}/approve", {"reason": False}, "reason must be text or null, got false"),
    ("/jobs/{job}/cancel", {"reason": 1.5}, "reason must be text or null, got 1.5"),
    ("/jobs/{lost}/retry", {"why": "x"}, "unknown field 'why'"),
]


@pytest.mark.parametrize("path, body, fragment", ACTION_BODIES,
                         ids=[f"{p.rsplit('/', 1)[-1]}:{json.dumps(b)[:24]}" for p, b, _ in ACTION_BODIES])
def test_an_action_body_is_checked_against_the_document(call, world, stage, path, body, fragment):
    if path.startswith("/jobs/"):
        path = "/api/v1" + path.format(**stage)
    before = state(world.conn)
    response = call("POST", path, data=json.dumps(body), content_type="application/json")
    message = assert_refused(response, "POST", path, (422,))
    assert fragment in message, message
    assert state(world.conn) == before


def test_the_document_says_number_where_the_checks_took_text(call, world, stage):
    """The reproduction of the issue: ``"delay_seconds": "5"`` was accepted, as was
    ``"priority": "5"`` and ``"requires_approval": 1``; well-typed, they still are."""
    for body in ({"delay_seconds": "5"}, {"priority": "5"}, {"max_attempts": "2"}):
        assert call("POST", "/api/v1/jobs", json={**SUBMIT, **body}).status_code == 422, body
    ok = call("POST", "/api/v1/jobs", json={**SUBMIT, "delay_seconds": 5, "priority": 5.0,
                                            "requires_approval": False, "target": None})
    assert ok.status_code == 201, ok.get_json()
    assert ok.get_json()["priority"] == 5


def test_an_empty_body_is_an_empty_object(call, world, stage):
    """No body at all, whatever its Content-Type says, is ``{}``: fine where nothing is
    required, a missing field where something is."""
    assert call("POST", "/api/v1/projects/web/resume", data=b"",
                content_type="text/plain").status_code == 409  # not paused: the action ran
    missing = call("POST", "/api/v1/projects/web/pause")
    assert missing.status_code == 422 and "missing field 'reason'" in missing.get_json()["error"]


PATHS = [
    ("GET", "/api/v1/jobs/0"), ("GET", "/api/v1/jobs/-1"), ("GET", "/api/v1/jobs/99999999"),
    ("GET", f"/api/v1/jobs/{2**63}"), ("GET", f"/api/v1/jobs/{'9' * 5000}"),
    ("GET", f"/api/v1/jobs/{2**64}/explain"), ("POST", f"/api/v1/jobs/{2**63}/cancel"),
    ("POST", "/api/v1/projects/%00/pause"), ("POST", "/api/v1/projects/nope/pause"),
    ("POST", "/api/v1/projects/" + "p" * 5000 + "/resume"),
    ("POST", "/api/v1/projects/%ff%fe/resume"), ("POST", "/api/v1/targets/%C3%A9/resolve"),
    ("GET", "/api/v1/jobs?organization=nope"), ("GET", "/api/v1/jobs?limit=0&state=x"),
    ("GET", "/api/v1/jobs?runner=" + "9" * 5000), ("GET", "/api/v1/jobs?older_than=1e400"),
    ("GET", "/api/v1/projects/%00"), ("GET", f"/api/v1/runners/{2**64}"),
    ("GET", "/api/v1/audit?actor=%00"), ("GET", "/api/v1/audit?before_id=0"),
    ("GET", "/api/v1/audit?job=424242"), ("GET", "/api/v1/overview?colour=red"),
    ("GET", "/api/v1/projects?colour=red"), ("GET", "/api/v1/jobs/1?verbose=1"),
    ("GET", "/api/v1/jobs/search"), ("GET", "/api/v1/jobs/search?q=ab"),
    ("GET", "/api/v1/jobs/search?q=%00make"), ("GET", "/api/v1/jobs/search?q=make&project=nope"),
    ("GET", "/api/v1/jobs/search?q=make&before_id=0"),
    ("POST", f"/api/v1/jobs/{2**63}/priority"), ("POST", "/api/v1/jobs/bulk?dry_run=1"),
    ("POST", f"/api/v1/runners/{2**64}/drain"), ("POST", "/api/v1/runners/0/resume"),
    ("POST", "/api/v1/pools/%00/pause"), ("POST", "/api/v1/pools/nope/resume"),
]


def test_the_walk_meets_only_documented_statuses(call, world, stage):
    """Every operation, sent what a careless or hostile client sends: no token, a bad
    token, a viewer's, path parameters out of range or not text, every unreadable body.
    Each answer is a 4xx JSON error listed for that operation in the document."""
    job = stage["job"]
    operations = [("GET", "/api/v1/openapi.json"), ("POST", "/api/v1/jobs"),
                  ("GET", f"/api/v1/jobs/{job}"), ("GET", f"/api/v1/jobs/{job}/explain"),
                  *[("POST", p) for p in action_paths(stage)[1:]],
                  # the lists and shows (tests/webapp/test_api_lists.py)
                  ("GET", "/api/v1/jobs?state=running"), ("GET", "/api/v1/projects"),
                  ("GET", "/api/v1/projects/web"), ("GET", "/api/v1/pools"),
                  ("GET", "/api/v1/pools/deploy"), ("GET", "/api/v1/targets"),
                  ("GET", "/api/v1/targets/production"), ("GET", "/api/v1/runners"),
                  ("GET", "/api/v1/runners/1"), ("GET", "/api/v1/audit"),
                  ("GET", "/api/v1/overview"), ("GET", "/api/v1/jobs/search?q=make")]
    assert {operation_of(m, p)["operationId"] for m, p in operations} == {
        op["operationId"] for ops in SPEC["paths"].values() for op in ops.values()}
    before = state(world.conn)
    seen: dict[str, set[int]] = {}

    def check(response, method, path):
        if response.status_code < 400:
            return
        assert_refused(response, method, path, tuple(range(400, 500)))
        seen.setdefault(operation_of(method, path)["operationId"], set()).add(response.status_code)

    for method, path in operations:
        for headers in ({"Authorization": "Bearer nope"}, {"Authorization": "Basic YTpi"},
                        {"Authorization": "Bearer " + "t" * 8000}, {"Authorization": "Bearer \x00"}):
            check(call(method, path, headers=headers), method, path)
        check(call(method, path, user=None), method, path)
        if method == "POST":
            check(call(method, path, user="victor", json={"reason": "x"}), method, path)
            for param in UNREADABLE:
                raw, content_type, _, _ = param.values
                check(call(method, path, data=raw,
                           headers={"Content-Type": content_type} if content_type else {}),
                      method, path)
    for method, path in PATHS:
        check(call(method, path, json={"reason": "x"} if method == "POST" else None), method, path)
    assert state(world.conn) == before
    assert {401, 403, 400, 413, 415} <= set().union(*seen.values()), seen
    assert 404 in seen["getJob"] and 404 in seen["pauseProject"], seen
    assert 404 in seen["listJobs"] and 422 in seen["listJobs"] and 422 in seen["listAuditEvents"], seen
    assert 404 in seen["listAuditEvents"] and 422 in seen["getOverview"] and 422 in seen["getJob"], seen


# --- a real `pgdispatch web`: gunicorn reads the request head before Flask ----------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def web(db_url, tmp_path):
    """``pgdispatch web`` on a free port (its own process, one worker); yields its URL."""
    import os

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env["DATABASE_URL"] = db_url
    proc = subprocess.Popen([sys.executable, "-m", "pgdispatch", "web", "--bind",
                             f"127.0.0.1:{port}", "--workers", "1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "pgdispatch web did not answer in 30 s"
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _raw(url: str, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send a hand-written request head; the status, headers and body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, body = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("what, head, status", [
    ("a URL of 9000 bytes", b"GET /api/v1/jobs/" + b"1" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    ("a header of 9000 bytes", b"GET /api/v1/jobs/1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
     + b"t" * 9000 + b"\r\n\r\n", 431),
    ("200 headers", b"GET /api/v1/jobs/1 HTTP/1.1\r\nHost: x\r\n"
     + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", 431),
    ("a console URL of 9000 bytes", b"GET /jobs/?q=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
])
def test_gunicorn_refuses_an_oversized_head_in_json(web, what, head, status):
    code, headers, body = _raw(web, head)
    assert code == status, (what, body[:200])
    assert headers["Content-Type"] == "application/json", (what, headers)
    message = json.loads(body)["error"]
    assert ("too" in message or "longer" in message) and "<" not in message, message


def test_a_long_url_below_gunicorns_limit_reaches_the_application(web):
    """Longer than gunicorn's default limit (4094 bytes), within the one it is given: the
    application sees the request and answers (JSON)."""
    code, headers, body = _raw(web, b"GET /api/v1/jobs/" + b"1" * 4000 + b" HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
    assert code == 401 and headers["Content-Type"] == "application/json", body[:200]


@pytest.mark.parametrize("size, status", [(2 * 1024 * 1024, 413), (1000, 201)])
def test_a_chunked_body_over_the_limit_is_too_large_not_cut(web, stage, size, status):
    """Without a Content-Length (Transfer-Encoding: chunked) the body is read up to the limit
    (1 MiB): one that reaches it is refused as too large (413), never parsed cut (a 400
    'Unterminated string' that would hide what happened); one below it goes through."""
    payload = json.dumps({"project": "web", "pool": "linux",
                          "command": ["echo", "x" * max(0, size - 100)]}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 65536]), payload[i:i + 65536])
                      for i in range(0, len(payload), 65536)) + b"0\r\n\r\n"
    head = (b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer " + stage["tokens"]["alice"].encode() + b"\r\n\r\n")
    code, headers, body = _raw(web, head + chunks)
    assert code == status and headers["Content-Type"] == "application/json", body[:300]
