"""The console and the JSON API behind PgBouncer in transaction pooling (issue 16: 111 of 840
console requests and 11 /healthz answered 500 behind the pooler).

Two apps, as two gunicorn workers would be, take turns over the same requests through a
PgBouncer with one server connection, so that their statements share it: every page of the
console and its htmx fragments, /healthz, /metrics, the API's reads, a submit, operator
actions from the console and the API (pause, resume, cancel, resolve). None answers 500,
and each action did what it says. The same with psycopg preparing statements on the server
(PGDISPATCH_PREPARE_THRESHOLD=1) is shown failing.
"""

from __future__ import annotations

import dataclasses

from pgdispatch.sql import Settings
from pgdispatch.sql.accounts import create_api_token
from pgdispatch.webapp import create_app, shutdown

from ..webapp.conftest import PASSWORDS, TEST_SETTINGS, csrf_from, login
from ..webapp.support import ensure_account, make_uncertain_target

ROUNDS = 4
PAGES = ("/", "/queue/", "/projects/", "/targets/", "/jobs/", "/jobs/?state=failed",
         "/runners/", "/audit/", "/admin/", "/admin/limits", "/healthz", "/metrics",
         "/api/v1/openapi.json",
         # the looks of issue 19: charts, the queue's sort and any-reason filter, holders,
         # folded runners, a job's trail
         "/?span=day", "/charts/depth.svg", "/charts/wait.svg", "/queue/?sort=oldest",
         "/queue/?reason=approval_required", "/jobs/?state=running&organization=acme",
         "/runners/?show=stopped", "/audit/?job=1",
         # issue 21's age order (find_job_list_bounds before list_jobs, one transaction) and
         # issue 22's Database page (the definer functions of sql/functions/health.sql)
         "/jobs/?older_than=0", "/jobs/?older_than=0&before_id=3",
         "/jobs/?older_than=0&after_id=1", "/database/")
API_LISTS = ("/api/v1/jobs", "/api/v1/jobs?state=running&pool=linux", "/api/v1/overview",
             "/api/v1/projects", "/api/v1/pools", "/api/v1/targets", "/api/v1/runners",
             "/api/v1/audit", "/api/v1/jobs?older_than=0&state=failed")
FRAGMENTS = ("/", "/queue/", "/targets/", "/runners/")


def exercise(world, pooled_url: str, settings: Settings) -> tuple[list[str], dict]:
    """The requests above, ROUNDS times, alternating between two apps on ``pooled_url``.
    Returns (every request answered 500 or otherwise not as expected, the database's state
    after the actions)."""
    uncertain = make_uncertain_target(world)  # web on linux and deploy, target production
    ensure_account(world.conn, "ada", PASSWORDS["ada"], "admin")
    token = create_api_token(world.conn, username="ada", name="ci")
    api_headers = {"Authorization": f"Bearer {token}"}
    apps = [create_app(settings, database_url=pooled_url, TESTING=True) for _ in range(2)]
    bad: list[str] = []
    try:
        clients = []
        for app in apps:
            client = app.test_client()
            signed_in = login(client, "ada")
            if signed_in.status_code != 303:
                bad.append(f"sign-in: {signed_in.status_code}")
                return bad, {}
            client.csrf = csrf_from(client.get("/").get_data(as_text=True))
            clients.append(client)

        def call(i: int, method: str, path: str, expect: tuple[int, ...] = (200,), **kwargs):
            response = clients[i % 2].open(path, method=method, **kwargs)
            if response.status_code not in expect:
                bad.append(f"{method} {path}: {response.status_code} "
                           f"{response.get_data(as_text=True)[:200]!r}")
            return response

        submitted = []
        for i in range(ROUNDS):
            for page in PAGES:
                call(i, "GET", page)
            for page in FRAGMENTS:
                call(i + 1, "GET", page, headers={"HX-Request": "true"})
            for page in API_LISTS:
                call(i, "GET", page, headers=api_headers)
            job = call(i, "POST", "/api/v1/jobs", (201,), headers=api_headers,
                       json={"project": "web", "pool": "linux", "command": ["make", "build"]})
            if job.status_code == 201:
                job_id = job.get_json()["id"]
                submitted.append(job_id)
                call(i + 1, "GET", f"/api/v1/jobs/{job_id}", headers=api_headers)
                call(i, "GET", f"/api/v1/jobs/{job_id}/explain", headers=api_headers)
                call(i + 1, "GET", f"/jobs/{job_id}")
                call(i, "POST", f"/api/v1/jobs/{job_id}/cancel", headers=api_headers,
                     json={"reason": "through the pooler"})
            call(i + 1, "POST", "/projects/web/pause", (200, 303),
                 data={"reason": "pooled pause", "csrf_token": clients[(i + 1) % 2].csrf})
            call(i, "POST", "/api/v1/projects/web/resume", headers=api_headers, json={})
        call(0, "POST", "/api/v1/targets/production/resolve", headers=api_headers,
             json={"outcome": "failed", "note": "checked: v1 is not live"})
        state = {
            "submitted": world.conn.execute(
                "SELECT state, count(*) AS n FROM jobs WHERE id = ANY(%s) GROUP BY 1",
                (submitted,)).fetchall(),
            "pauses": world.conn.execute(
                "SELECT count(*) AS n FROM audit_events WHERE action = 'pause_project'"
            ).fetchone()["n"],
            "paused": world.conn.execute("SELECT paused_at IS NOT NULL AS p FROM projects "
                                         "WHERE name = 'web'").fetchone()["p"],
            "target": world.conn.execute("SELECT state FROM targets WHERE name = 'production'"
                                         ).fetchone()["state"],
            "lost": world.conn.execute("SELECT state FROM jobs WHERE id = %s",
                                       (uncertain["job"]["id"],)).fetchone()["state"],
        }
        return bad, state
    finally:
        for app in apps:
            shutdown(app)


def test_console_and_api_through_a_shared_server_connection_never_answer_500(
        world, db_url, pgbouncer_url):
    bad, state = exercise(world, pgbouncer_url(db_url), TEST_SETTINGS)
    assert bad == []
    assert state == {"submitted": [{"state": "cancelled", "n": ROUNDS}], "pauses": ROUNDS,
                     "paused": False, "target": "free", "lost": "failed"}


def test_the_console_check_fails_with_server_side_prepared_statements(world, db_url,
                                                                       pgbouncer_url):
    """Broken variant: statements prepared from their second run (psycopg's default is the
    sixth; 0, every statement, already fails each connection's set-up statement)."""
    bad, _ = exercise(world, pgbouncer_url(db_url),
                      dataclasses.replace(TEST_SETTINGS, prepare_threshold=1))
    # 503 since sql/errors.py names a prepared-statement mix-up as the pooler's fault (26000,
    # 42P05); a 500 before that
    assert any(": 500 " in line or ": 503 " in line for line in bad), bad
