"""/metrics, /healthz, the runners page and the audit log."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions

from tests.conftest import with_database

from .support import make_uncertain_target


def test_metrics_has_counters_and_scrape_time_gauges(app, world):
    """The web's /metrics: what the database knows (every reason counts, the primary ones
    beside, the oldest waiting per pool and primary reason, per pool runners and slots) and
    what this process measures (its retries and deadlines) — never the claim, expiry or wait
    series, which only a scheduler measures (scheduler/metrics.py)."""
    make_uncertain_target(world)
    build = world.job()                                              # no runner serves linux
    world.job(depends_on=[build["id"]], requires_approval=True)      # and a dependency, an approval
    world.job(pool="deploy")
    assert world.claim(world.runner(pools=("deploy",)), pools=("deploy",))  # a claim here
    transitions.summarize_queue(world.conn)
    response = app.test_client().get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = response.get_data(as_text=True)
    for name in ("pgdispatch_transaction_retries_total", "pgdispatch_statement_deadlines_total",
                 "pgdispatch_queue_depth", "pgdispatch_queue_primary_depth",
                 "pgdispatch_queue_waiting", "pgdispatch_oldest_waiting_seconds",
                 "pgdispatch_pool_waiting", "pgdispatch_pool_live_runners",
                 "pgdispatch_organization_running", "pgdispatch_organization_max_running",
                 "pgdispatch_pool_running", "pgdispatch_pool_slots", "pgdispatch_uncertain_targets",
                 "pgdispatch_jobs", "pgdispatch_queue_summary_age_seconds"):
        assert f"# TYPE {name}" in text, name
    for name in ("pgdispatch_claim_seconds", "pgdispatch_lease_expirations_total",
                 "pgdispatch_lease_expiry_failures_total", "pgdispatch_wait_seconds",
                 "pgdispatch_claims_total"):
        assert name not in text, name

    def sample(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert match, name
        return float(match.group(1))

    assert sample("pgdispatch_uncertain_targets") == 1
    assert sample('pgdispatch_pool_slots{pool="deploy"}') == 100
    assert sample('pgdispatch_queue_depth{reason="no_authorized_runner"}') == 2
    assert sample('pgdispatch_queue_primary_depth{reason="no_authorized_runner"}') == 1
    assert sample('pgdispatch_queue_depth{reason="approval_required"}') == 1
    assert sample('pgdispatch_queue_primary_depth{reason="approval_required"}') == 0
    assert sample('pgdispatch_queue_primary_depth{reason="dependency_pending"}') == 1
    assert sample("pgdispatch_queue_waiting") == 3  # the two, and the lost deployment
    assert sample('pgdispatch_jobs{state="uncertain"}') == 1
    assert sample('pgdispatch_pool_waiting{pool="linux"}') == 2
    assert sample('pgdispatch_pool_live_runners{pool="deploy"}') == 2
    assert sample('pgdispatch_pool_live_runners{pool="linux"}') == 0
    # runner slots, and how many are free: the claim above holds one slot of one runner
    slots = sample('pgdispatch_pool_runner_slots{pool="deploy"}')
    assert slots >= 2 and sample('pgdispatch_pool_free_runner_slots{pool="deploy"}') == slots - 1
    assert sample('pgdispatch_pool_free_runner_slots{pool="linux"}') == 0
    # no undocumented *_created series beside the counters (sql/metrics.py)
    assert not re.search(r"^\w+_created[ {]", text, re.M), "a *_created series"
    for reason in ("no_authorized_runner", "dependency_pending"):
        assert sample(f'pgdispatch_oldest_waiting_seconds{{pool="linux",reason="{reason}"}}') >= 0
    assert len(re.findall(r"^pgdispatch_oldest_waiting_seconds\{", text, re.M)) == 2


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
