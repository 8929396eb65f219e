"""The console's bulk actions (webapp/jobs.py bulk_preview, bulk_apply) and a job's priority:
the preview says "this will cancel N jobs" with the list and changes nothing; the confirm
applies exactly the ids its form carries, reporting done and skipped with why; viewers may
not; bad input is 4xx."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions

from .support import count


def form_of(page: str) -> dict:
    """The confirm form's fields, as the browser would send them."""
    form = page[page.index('class="bulk-confirm"'):]
    form = form[:form.index("</form>")]
    return {m.group(1): m.group(2) for m in re.finditer(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form)}


def test_preview_then_confirm_applies_exactly_the_previewed_ids(operator, world):
    world.setup(pools=("linux", "arm"))
    ids = [world.job(command=["make", f"t{i}"])["id"] for i in range(3)]
    arm = world.job(pool="arm")["id"]
    jobs_page = operator.get("/jobs/?pool=linux").get_data(as_text=True)
    assert 'action="/jobs/bulk"' in jobs_page and '<input type="hidden" name="pool" value="linux">' in jobs_page
    before = count(world.conn, "audit_events")
    response = operator.get("/jobs/bulk?action=cancel&pool=linux")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert "This will cancel 3 jobs" in page and "make t0" in page and f"bulk-row-{arm}" not in page
    assert count(world.conn, "audit_events") == before
    fields = form_of(page)
    assert fields["action"] == "cancel" and fields["pool"] == "linux"
    assert fields["jobs"] == " ".join(f"{i}:0" for i in ids)
    # a job submitted after the preview is not taken; one cancelled meanwhile is skipped
    late = world.job()["id"]
    transitions.cancel_job(world.conn, job_id=ids[1], actor="bob")
    done = operator.post("/jobs/bulk", data={**fields, "bulk_reason": "bad build",
                                             "csrf_token": operator.csrf})
    assert done.status_code == 200
    report = done.get_data(as_text=True)
    assert "Cancelled 2 of 3 jobs; skipped 1" in report and f"bulk-skipped-{ids[1]}" in report
    assert "cancelled by bob" in report
    assert [world.row("jobs", i)["state"] for i in (*ids, late, arm)] == [
        "cancelled", "cancelled", "cancelled", "queued", "queued"]
    event = world.conn.execute("SELECT * FROM audit_events WHERE action = 'bulk_cancel'").fetchone()
    assert (event["actor"], event["reason"]) == ("alice", "bad build")
    assert event["details"]["filter"] == {"pool": "linux"} and event["details"]["requested"] == 3


def test_reprioritize_preview_and_nothing_to_do(operator, world):
    world.setup()
    job = world.job()["id"]
    page = operator.get("/jobs/bulk?action=reprioritize&priority=-5").get_data(as_text=True)
    assert "This will reprioritize 1 job to priority -5" in page
    done = operator.post("/jobs/bulk", data={**form_of(page), "csrf_token": operator.csrf})
    assert "Reprioritized 1 of 1 job to priority -5; skipped 0" in done.get_data(as_text=True)
    assert world.row("jobs", job)["priority"] == -5
    again = operator.get("/jobs/bulk?action=reprioritize&priority=-5").get_data(as_text=True)
    assert "No jobs to reprioritize" in again and "bulk-confirm" not in again


def test_a_viewer_may_not_and_bad_input_is_4xx(operator, viewer, world):
    world.setup()
    job = world.job()["id"]
    assert viewer.get("/jobs/bulk?action=cancel").status_code == 403
    assert viewer.post("/jobs/bulk", data={"action": "cancel", "jobs": f"{job}:0",
                                           "csrf_token": viewer.csrf}).status_code == 403
    assert 'action="/jobs/bulk"' not in viewer.get("/jobs/").get_data(as_text=True)
    for query in ("action=delete", "action=reprioritize", "action=reprioritize&priority=5000",
                  "action=cancel&state=sleeping", "action=cancel&project=nope",
                  "action=cancel&runner=x", "action=cancel&older_than=-1"):
        assert operator.get(f"/jobs/bulk?{query}").status_code in (404, 422), query
    for jobs in ("", "x", f"{job}", f"{job}:0:1", " ".join(["1:0"] * 10001)):
        r = operator.post("/jobs/bulk", data={"action": "cancel", "jobs": jobs, "csrf_token": operator.csrf})
        assert r.status_code == 422, jobs[:20]
    assert world.row("jobs", job)["state"] == "queued"
    assert count(world.conn, "audit_events", "action LIKE %s", ("bulk%",)) == 0


def test_set_priority_on_the_job_page(operator, world):
    world.setup()
    job = world.job()["id"]
    page = operator.get(f"/jobs/{job}").get_data(as_text=True)
    assert f"/jobs/{job}/priority" in page
    r = operator.post(f"/jobs/{job}/priority", data={"priority": "40", "reason": "hotfix",
                                                     "csrf_token": operator.csrf},
                      headers={"HX-Request": "true"})
    assert r.status_code == 200 and "priority 0 -&gt; 40" in r.get_data(as_text=True)
    assert world.row("jobs", job)["priority"] == 40
    for bad in ("", "x", "1001", "٣"):
        r = operator.post(f"/jobs/{job}/priority", data={"priority": bad, "csrf_token": operator.csrf})
        assert r.status_code == 422, bad
    again = operator.post(f"/jobs/{job}/priority", data={"priority": "40", "csrf_token": operator.csrf})
    assert again.status_code == 409
