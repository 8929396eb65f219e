"""A job whose stored times Python cannot hold (past year 9999 or before year 1: left by a
release before the backoff clamp, or set by hand) is shown by the job page, the queue, the
overview and the API like any other (issue 16: ``jobs show`` failed with "timestamp too
large"; sql/timestamps.py). The sql-level test without the clamp is in
tests/sql/test_time_bounds.py."""

from __future__ import annotations

import pytest

from pgdispatch.sql import transitions
from pgdispatch.sql.accounts import create_api_token

from .support import ensure_account


@pytest.fixture
def far_jobs(world):
    """A queued job ready 'infinity' and one ready at '-infinity'; the summary refreshed."""
    world.setup()
    late, early = world.job(), world.job()
    world.conn.execute("UPDATE jobs SET ready_at = 'infinity' WHERE id = %s", (late["id"],))
    world.conn.execute("UPDATE jobs SET ready_at = '-infinity' WHERE id = %s", (early["id"],))
    world.conn.execute("UPDATE jobs SET created_at = '294276-12-31' WHERE id = %s", (early["id"],))
    transitions.summarize_queue(world.conn)
    return late, early


def test_the_pages_show_them(operator, far_jobs):
    late, early = far_jobs
    for path in (f"/jobs/{late['id']}", f"/jobs/{early['id']}", "/queue/", "/", "/jobs/"):
        response = operator.get(path)
        assert response.status_code == 200, (path, response.get_data(as_text=True)[:300])
    assert "9999-12-30" in operator.get(f"/jobs/{late['id']}").get_data(as_text=True)


def test_the_api_shows_and_explains_them(app, conn, far_jobs):
    late, early = far_jobs
    ensure_account(conn, "alice", "alice-password", "operator")
    auth = {"Authorization": f"Bearer {create_api_token(conn, username='alice', name='ci')}"}
    client = app.test_client()
    shown = client.get(f"/api/v1/jobs/{late['id']}", headers=auth)
    assert shown.status_code == 200 and shown.get_json()["ready_at"] == "9999-12-30T00:00:00+00:00"
    explained = client.get(f"/api/v1/jobs/{late['id']}/explain", headers=auth)
    assert explained.status_code == 200
    assert explained.get_json()["reasons"][0]["code"] == "retry_delayed"
    shown = client.get(f"/api/v1/jobs/{early['id']}", headers=auth).get_json()
    assert shown["ready_at"] == "0001-01-02T00:00:00+00:00"
    assert shown["created_at"] == "9999-12-30T00:00:00+00:00"
