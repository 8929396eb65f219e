"""The Database page, the overview's banner for a pinned xmin horizon and its gauges on
/metrics: a foreign session that holds a snapshot open is named (pid, application, age) by
the console's own non-superuser login, and never its query text."""

from __future__ import annotations

import re
import time

import pytest

from pgdispatch.sql import db

from ..factories import snapshot_holder

MARKER = "page-secret-marker-51c2"


@pytest.fixture
def foreign(db_url):
    """A foreign session of this database holding a snapshot, its last query MARKER."""
    with snapshot_holder(db_url, application_name="nightly-report", marker=MARKER) as c:
        yield c


def test_the_page_names_the_holder_first_and_the_hot_tables(viewer, foreign):
    page = viewer.get("/database/").get_data(as_text=True)
    assert '<a href="/database/" aria-current="page">Database</a>' in page
    row = re.search(rf'<tr id="holder-session-{foreign.pid}"[^>]*>(.*?)</tr>', page, re.S)
    assert row, "the foreign session is not listed"
    cells = row.group(1)
    assert "nightly-report" in cells and "idle in transaction" in cells
    assert re.search(r"<td>\d+ s</td>", cells)  # its age
    assert page.index('id="horizon-holders"') < page.index('id="hot-tables"')
    for table in ("jobs", "attempts", "delivery_receipts", "capacity_stripes", "job_dependencies",
                  "audit_events"):
        assert f'id="table-{table}"' in page, table
    assert "needs-read-all-stats" not in page
    assert MARKER not in page


def test_the_fragment_polls(viewer):
    response = viewer.get("/database/", headers={"HX-Request": "true"})
    body = response.get_data(as_text=True)
    assert body.lstrip().startswith('<section id="database-health"')
    assert 'hx-trigger="every 2s"' in body and "<html" not in body
    assert "HX-Request" in response.headers["Vary"]


def test_the_banner_names_the_holder_past_the_threshold(make_app, signed_in, foreign):
    time.sleep(0.05)
    client = signed_in("victor", on=make_app(HORIZON_ALERT_SECONDS=0.0))
    page = client.get("/").get_data(as_text=True)
    banner = re.search(r'<section id="pinned-horizon".*?</section>', page, re.S)
    assert banner, "no banner"
    text = banner.group(0)
    assert f"<strong>{foreign.pid}</strong> (nightly-report)" in text
    assert re.search(r"held the xmin horizon for \d+ s", text)
    assert 'href="/database/"' in text
    assert MARKER not in page


def test_no_banner_below_the_threshold(viewer, foreign):
    page = viewer.get("/").get_data(as_text=True)  # the default: 300 s
    assert 'id="pinned-horizon"' not in page


def test_metrics_show_the_horizon_age_at_least_the_holders(app, foreign, db_url):
    time.sleep(0.2)
    with db.connect(db_url) as c:  # a superuser: the holder's age as the server sees it
        held = c.execute("SELECT extract(epoch FROM statement_timestamp() - xact_start)::float8"
                         " AS s FROM pg_stat_activity WHERE pid = %s", (foreign.pid,)).fetchone()
    text = app.test_client().get("/metrics").get_data(as_text=True)

    def sample(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert match, name
        return float(match.group(1))

    assert held["s"] >= 0.2
    assert sample('pgdispatch_db_horizon_age_seconds{kind="session"}') >= held["s"]
    assert sample('pgdispatch_db_horizon_age_seconds{kind="prepared"}') == 0
    assert sample('pgdispatch_db_horizon_xmin_age{kind="session"}') >= 0
    assert sample('pgdispatch_db_dead_tuples{table="jobs"}') >= 0
    assert sample('pgdispatch_db_total_bytes{table="jobs"}') > 0
    assert sample("pgdispatch_db_reads_all_stats") == 1
    assert "# TYPE pgdispatch_db_claim_calls_total counter" in text
