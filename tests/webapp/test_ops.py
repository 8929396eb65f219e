"""/metrics, /healthz, the runners page and the audit log."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions

from tests.conftest import with_database

from .support import make_uncertain_target


def test_metrics_has_counters_and_scrape_time_gauges(app, world):
    make_uncertain_target(world)
    world.job()
    transitions.summarize_queue(world.conn)
    response = app.test_client().get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = response.get_data(as_text=True)
    for name in ("pgdispatch_transaction_retries_total", "pgdispatch_claim_seconds",
                 "pgdispatch_lease_expirations_total", "pgdispatch_queue_depth",
                 "pgdispatch_organization_running", "pgdispatch_pool_running", "pgdispatch_pool_slots"):
        assert f"# TYPE {name}" in text, name
    assert re.search(r'^pgdispatch_uncertain_targets 1\.0$', text, re.M)
    assert re.search(r'^pgdispatch_pool_slots\{pool="deploy"\} 100\.0$', text, re.M)
    assert re.search(r'^pgdispatch_queue_depth\{reason="no_authorized_runner"\} 1\.0$', text, re.M)
    assert re.search(r'^pgdispatch_jobs\{state="uncertain"\} 1\.0$', text, re.M)


def test_healthz_answers_200_when_the_database_does(app):
    response = app.test_client().get("/healthz")
    assert response.status_code == 200 and response.get_json() == {"status": "ok"}


def test_healthz_answers_503_when_the_database_does_not(make_app, server_url):
    app = make_app(DB_POOL_TIMEOUT_SECONDS=0.5)
    app.config["DATABASE_URL"] = with_database(server_url, "pgd_test_no_such_database")
    response = app.test_client().get("/healthz")
    assert response.status_code == 503
    assert response.get_json()["status"] == "unavailable"
    api = app.test_client().get("/api/v1/jobs/1", headers={"Authorization": "Bearer pgd_xxxxxxxxxx"})
    assert api.status_code == 503 and "error" in api.get_json()


def test_runners_page(operator, world):
    world.setup(pools=("linux", "deploy"))
    world.runner(pools=("linux", "deploy"), slots=3, name="build-host-1")
    page = operator.get("/runners/").get_data(as_text=True)
    assert "build-host-1" in page and "deploy, linux" in page
    assert "runner-live" in page and "0 of 3" in page
    assert "every pool (unbound login)" in page  # the tests' superuser


def test_runners_page_shows_each_hosts_login_its_grant_and_what_it_asks_for_without_one(operator, world, db_url):
    from pgdispatch.sql import db, transitions as t

    from ..logins import Logins

    world.setup(pools=("linux", "macos"))
    logins = Logins(db_url)
    try:
        login, url = logins.make("mac_host", groups=("pgdispatch_scheduler",))
        world.apply({"runners": [{"login": login, "pools": ["macos"]}]})
        with db.connect(url) as host:
            t.register_runner(host, name="mac-1", pools=["macos"], slots=2, hostname="mac")
        world.apply({"runners": [{"login": login, "pools": ["linux"]}]})  # macos revoked
        page = operator.get("/runners/").get_data(as_text=True)
    finally:
        logins.drop()
    row = page[page.index("mac-1"):]
    row = row[:row.index("</tr>")]
    assert f"<code>{login}</code>" in row
    assert "not granted</span> asks for macos" in row
    assert "<td>macos</td>" in row and "linux" in row  # asked for macos; granted linux


def test_audit_log_filters(operator, world):
    world.setup()
    world.project("api", org="acme", pools=("linux",))
    transitions.pause_project(world.conn, project="web", reason="freeze web", actor="alice")
    transitions.pause_project(world.conn, project="api", reason="freeze api", actor="bob")
    page = operator.get("/audit/").get_data(as_text=True)
    assert "freeze web" in page and "freeze api" in page
    by_bob = operator.get("/audit/?actor=bob").get_data(as_text=True)
    assert "freeze api" in by_bob and "freeze web" not in by_bob
    by_subject = operator.get("/audit/?subject=project:we").get_data(as_text=True)
    assert "freeze web" in by_subject and "freeze api" not in by_subject
    wildcard = operator.get("/audit/?subject=project:%25").get_data(as_text=True)
    assert "freeze" not in wildcard  # a prefix, not a LIKE pattern
    ids = [int(i) for i in re.findall(r'id="audit-(\d+)"', page)]
    older = operator.get(f"/audit/?before_id={ids[0]}").get_data(as_text=True)
    assert f'id="audit-{ids[0]}"' not in older and f'id="audit-{ids[1]}"' in older
    assert operator.get("/audit/?before_id=x").status_code == 422
