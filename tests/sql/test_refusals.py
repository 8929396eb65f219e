"""A refused operator action says why the job or project is where it is (the refusal texts of
sql/functions/operator.sql).

The refusals used to name the subject's last audit event, which for a job that the system
moved by itself (a cascaded cancellation, a runner's report) was its submission.
"""

from __future__ import annotations

import re

import pytest

from pgdispatch.sql import transitions
from pgdispatch.sql.errors import AlreadyResolved

UTC_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def refusal(fn, **kw) -> str:
    """The message ``fn(**kw)`` is refused with (in a savepoint, so that the test's
    transaction goes on)."""
    with pytest.raises(AlreadyResolved) as caught, kw["conn"].transaction():
        fn(**kw)
    return str(caught.value)


def test_a_job_cancelled_by_its_dependency_says_so_when_cancelled_again(world):
    world.setup()
    upstream = world.job()
    downstream = world.job(depends_on=[upstream["id"]])
    transitions.cancel_job(world.conn, job_id=upstream["id"], actor="alice")
    said = refusal(transitions.cancel_job, conn=world.conn, job_id=downstream["id"], actor="bob")
    assert re.fullmatch(rf"job {downstream['id']} is cancelled and cannot be cancelled "
                        rf"\(dependency {upstream['id']} cancelled, at {UTC_TIME}\)", said), said
    assert "cli" not in said  # not the submitter's audit event


def test_a_succeeded_job_says_when_it_succeeded_when_retried(world):
    world.setup()
    world.job()
    c = world.claim(world.runner())
    world.complete(c)
    said = refusal(transitions.retry_job, conn=world.conn, job_id=c.job_id, actor="alice")
    assert re.fullmatch(rf"job {c.job_id} is succeeded and cannot be retried \(succeeded at {UTC_TIME}\)",
                        said), said


def test_a_second_cancel_of_a_running_job_names_who_asked_first(world):
    world.setup()
    world.job()
    c = world.claim(world.runner())
    transitions.cancel_job(world.conn, job_id=c.job_id, actor="alice")
    said = refusal(transitions.cancel_job, conn=world.conn, job_id=c.job_id, actor="bob")
    assert re.fullmatch(rf"job {c.job_id} is running and cannot be cancelled "
                        rf"\(cancel already requested by alice at {UTC_TIME}\)", said), said


def test_a_waiting_job_is_not_retried_and_points_to_explain(world):
    world.setup()
    job = world.job()
    said = refusal(transitions.retry_job, conn=world.conn, job_id=job["id"], actor="alice")
    assert said == (f"job {job['id']} is queued and cannot be retried "
                    "(it is waiting to run; jobs explain says on what)")


def test_resuming_a_project_that_is_not_paused_says_so_and_who_resumed_it(world):
    world.setup()
    said = refusal(transitions.resume_project, conn=world.conn, project="web", actor="bob")
    assert said == "project web is not paused"
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    transitions.resume_project(world.conn, project="web", actor="carol")
    said = refusal(transitions.resume_project, conn=world.conn, project="web", actor="bob")
    assert re.fullmatch(rf"project web is not paused \(resumed by carol at {UTC_TIME}\)", said), said
