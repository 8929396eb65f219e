"""Job detail (attempts, output tail, explanation) and the approve / cancel / retry actions."""

from __future__ import annotations

from pgdispatch.sql import transitions

from .support import count


def test_detail_shows_attempts_output_and_why(operator, world):
    world.setup()
    runner = world.runner()
    job = world.job(command=["make", "test"], max_attempts=2)
    world.complete(world.claim(runner), "failed", exit_code=2, output_tail="FAILED test_x\n")
    page = operator.get(f"/jobs/{job['id']}").get_data(as_text=True)
    assert "make test" in page
    assert "FAILED test_x" in page and "exit 2" in page
    assert "reason-retry_delayed" in page  # the failed attempt's backoff
    assert f"/jobs/{job['id']}/cancel" in page  # a queued job can be cancelled…
    assert f"/jobs/{job['id']}/retry" not in page  # …but not retried


def test_approve_cancel_retry_through_the_console(operator, world):
    world.setup()
    gated = world.job(requires_approval=True)
    response = operator.post(f"/jobs/{gated['id']}/approve",
                             data={"reason": "looks right", "csrf_token": operator.csrf})
    assert response.status_code == 303 and response.headers["Location"] == f"/jobs/{gated['id']}"
    assert world.row("jobs", gated["id"])["state"] == "queued"
    htmx = operator.post(f"/jobs/{gated['id']}/cancel", data={"csrf_token": operator.csrf},
                         headers={"HX-Request": "true"})
    assert htmx.status_code == 200
    assert htmx.get_data(as_text=True).lstrip().startswith(f'<section id="job-{gated["id"]}"')
    assert world.row("jobs", gated["id"])["state"] == "cancelled"
    again = operator.post(f"/jobs/{gated['id']}/cancel", data={"csrf_token": operator.csrf},
                          headers={"HX-Request": "true"})
    assert again.status_code == 409 and b"cannot be cancelled (cancelled by alice, at 20" in again.data
    retried = operator.post(f"/jobs/{gated['id']}/retry", data={"csrf_token": operator.csrf})
    assert retried.status_code == 303
    assert world.row("jobs", gated["id"])["state"] == "queued"
    actions = [r["action"] for r in world.conn.execute(
        "SELECT action FROM audit_events WHERE actor = 'alice' AND action LIKE '%_job' ORDER BY id").fetchall()]
    assert actions == ["approve_job", "cancel_job", "retry_job"]


def test_viewer_cannot_act_on_jobs(viewer, world):
    world.setup()
    job = world.job()
    page = viewer.get(f"/jobs/{job['id']}").get_data(as_text=True)
    assert "/cancel" not in page
    assert viewer.post(f"/jobs/{job['id']}/cancel", data={"csrf_token": viewer.csrf}).status_code == 403
    assert world.row("jobs", job["id"])["state"] == "queued"
    assert count(world.conn, "audit_events", "action = 'cancel_job'") == 0


def test_unknown_and_impossible_job_ids(operator, world):
    world.setup()
    assert operator.get("/jobs/424242").status_code == 404
    assert operator.get("/jobs/99999999999999999999").status_code == 404
    assert operator.post("/jobs/424242/approve", data={"csrf_token": operator.csrf}).status_code == 404
    assert operator.get("/jobs/?id=abc").status_code == 422
    assert operator.get("/jobs/?state=bogus").status_code == 422
    job = world.job()
    jump = operator.get(f"/jobs/?id={job['id']}")
    assert jump.status_code == 302 and jump.headers["Location"] == f"/jobs/{job['id']}"


def test_jobs_list_filters_by_state(operator, world):
    world.setup()
    a = world.job()
    b = world.job()
    transitions.cancel_job(world.conn, job_id=b["id"], actor="alice")
    page = operator.get("/jobs/?state=cancelled").get_data(as_text=True)
    assert f'id="jobs-row-{b["id"]}"' in page and f'id="jobs-row-{a["id"]}"' not in page


def test_jobs_list_pages_to_older_jobs(world, operator):
    world.setup()
    ids = [world.job()["id"] for _ in range(5)]
    page = operator.get("/jobs/?limit=2")
    html = page.get_data(as_text=True)
    assert page.status_code == 200 and f"before_id={ids[3]}" in html
    older = operator.get(f"/jobs/?limit=2&before_id={ids[3]}").get_data(as_text=True)
    assert f"/jobs/{ids[2]}" in older and f"/jobs/{ids[4]}" not in older


def test_a_resolved_deployment_reads_as_the_operators_outcome_with_its_trail(operator, world):
    from .support import make_uncertain_target

    made = make_uncertain_target(world, "staging")
    job_id = made["job"]["id"]
    transitions.resolve_target(world.conn, target="staging", outcome="succeeded",
                               note="version 4.2 is live on every host", actor="bob")
    page = operator.get(f"/jobs/{job_id}").get_data(as_text=True)
    resolution = page[page.index(f'id="job-{job_id}-resolution"'):]
    resolution = resolution[:resolution.index("</dd>")]
    assert "it succeeded" in resolution and "by bob at" in resolution
    assert "version 4.2 is live on every host" in resolution
    assert "Last error" not in page and "resolved succeeded by" not in page
    assert "0 failed, 1 lost with its runner" in page
    assert "<h2>Outcome</h2>" in page and "as bob resolved it" in page
    trail = page[page.index(f'id="job-{job_id}-audit"'):]
    assert trail.index("submit_job") < trail.index("resolve_target") and "target:staging" in trail
    assert f'href="/audit/?job={job_id}"' in trail
    # the audit page's job filter shows the same trail
    log = operator.get(f"/audit/?job={job_id}").get_data(as_text=True)
    assert "resolve_target" in log and "submit_job" in log
    assert operator.get("/audit/?job=abc").status_code == 422


def test_action_messages_say_what_the_job_does_now(operator, world):
    world.setup()
    runner = world.runner()
    first = world.job()
    second = world.job(requires_approval=True, depends_on=[first["id"]])

    def say(path: str) -> str:
        response = operator.post(path, data={"csrf_token": operator.csrf}, headers={"HX-Request": "true"})
        assert response.status_code in (200, 409), response.status_code
        html = response.get_data(as_text=True)
        return html[html.index('id="flash"'):]

    assert (f"job {second['id']} approved; still waiting for job {first['id']} (dependency_pending)"
            in say(f"/jobs/{second['id']}/approve"))
    claim = world.claim(runner)
    assert claim.job_id == first["id"]
    assert (f"job {first['id']} is running: its runner has been asked to stop it"
            in say(f"/jobs/{first['id']}/cancel"))
    world.complete(claim, "cancelled", exit_code=-15)
    cancelled = say(f"/jobs/{second['id']}/cancel")  # already cancelled with its dependency
    assert f"job {second['id']} is cancelled and cannot be cancelled" in cancelled
    assert "it is cancelled" not in cancelled
    waiting = world.job()
    assert f"job {waiting['id']} cancelled<" in say(f"/jobs/{waiting['id']}/cancel")
    retried = say(f"/jobs/{waiting['id']}/retry")
    assert f"job {waiting['id']} queued again; next in line" in retried and "(ready)" in retried
    gated = world.job(requires_approval=True)
    assert f"job {gated['id']} approved and queued; next in line" in say(f"/jobs/{gated['id']}/approve")


def test_a_running_job_says_for_how_long_and_where(operator, world):
    world.setup()
    runner = world.runner(name="build-7")
    job = world.job()
    claim = world.claim(runner)
    world.conn.execute("UPDATE attempts SET claimed_at = now() - interval '200 seconds' WHERE id = %s",
                       (claim.attempt_id,))
    page = operator.get(f"/jobs/{job['id']}").get_data(as_text=True)
    assert "Why is it" not in page and "It is running" not in page
    assert "<h2>Running</h2>" in page and "For 3 min on build-7 (attempt #1" in page
    assert "running for 3 min" in page  # the attempt's own line
    waiting = world.job()
    page = operator.get(f"/jobs/{waiting['id']}").get_data(as_text=True)
    assert "Why is it waiting?" in page and f'id="job-{waiting["id"]}-waiting"' in page
