"""Idempotency keys (sql/functions/submit.sql): a repeated key returns its job only when the
request is the same; a different request with the key is refused and writes nothing. An
unknown dependency is named by its id."""

from __future__ import annotations

import threading
import time

import pytest

from pgdispatch.sql import db, transitions
from pgdispatch.sql.errors import Conflict, NotFound

from .catalog import function_source

KEY = "build-7"
FIRST = {"pool": "linux", "command": ["make", "build"], "priority": 5, "max_attempts": 3,
         "timeout_seconds": 600, "requires_approval": False}


def counts(conn) -> tuple[int, int]:
    row = conn.execute("SELECT (SELECT count(*) FROM jobs) AS jobs, "
                       "(SELECT count(*) FROM job_dependencies) AS deps").fetchone()
    return row["jobs"], row["deps"]


def test_the_same_request_returns_the_first_job(world):
    world.setup(pools=("linux", "arm"), targets=("staging",))
    dep_a, dep_b = world.job(), world.job()
    first = world.job(idempotency_key=KEY, depends_on=[dep_a["id"], dep_b["id"]], **FIRST)
    before = counts(world.conn)
    # dependencies are a set: order and repeats do not make another request; nor does the delay
    again = world.job(idempotency_key=KEY, depends_on=[dep_b["id"], dep_a["id"], dep_a["id"]],
                      delay_seconds=30, **FIRST)
    assert first["is_new"] and not again["is_new"] and again["id"] == first["id"]
    assert counts(world.conn) == before
    # the key is the project's: another project may use it for its own job
    world.project("api", org="acme", pools=("linux",))
    other = world.job(project="api", idempotency_key=KEY, command=["other"])
    assert other["is_new"] and other["id"] != first["id"]


@pytest.mark.parametrize("change, named", [
    ({"pool": "arm"}, "pool"),
    ({"target": "staging"}, "target"),
    ({"command": ["make", "deploy"]}, "command"),
    ({"command": ["make", "build", ""]}, "command"),
    ({"priority": 6}, "priority"),
    ({"max_attempts": 1}, "max attempts"),
    ({"timeout_seconds": 601}, "timeout"),
    ({"requires_approval": True}, "approval"),
    ({"depends_on": "one"}, "dependencies"),
    ({"depends_on": "none"}, "dependencies"),
    ({"command": ["x"], "priority": 0}, "command, priority"),
])
def test_a_different_request_with_the_key_is_refused_and_writes_nothing(world, change, named):
    world.setup(pools=("linux", "arm"), targets=("staging",))
    dep_a, dep_b = world.job(), world.job()
    deps = {"one": [dep_a["id"]], "none": []}
    first = world.job(idempotency_key=KEY, depends_on=[dep_a["id"], dep_b["id"]], **FIRST)
    before = counts(world.conn)
    request = {**FIRST, "depends_on": [dep_a["id"], dep_b["id"]], **change}
    if isinstance(request["depends_on"], str):
        request["depends_on"] = deps[request["depends_on"]]
    with pytest.raises(Conflict) as caught, world.conn.transaction():
        world.job(idempotency_key=KEY, **request)
    assert str(caught.value) == (f"idempotency key already used for job {first['id']} "
                                 f"by a request that differs in {named}")
    assert counts(world.conn) == before


def test_a_racing_submit_with_a_different_request_is_refused_after_the_first_commits(world, db_url):
    """The second submit of the key waits for the uncommitted first (the unique index), then
    compares its request with the first's job: refused, and one job carries the key."""
    world.setup()
    got: dict = {}

    def second() -> None:
        with db.connect(db_url, application_name="racer-submit") as conn:
            try:
                transitions.submit(conn, project="web", pool="linux", command=["other"],
                                   idempotency_key=KEY)
            except Conflict as exc:
                got["refused"] = str(exc)
            got["done"] = time.monotonic()

    with db.connect(db_url, application_name="racer-first") as first:
        with first.transaction():
            got["first"] = transitions.submit(first, project="web", pool="linux", command=["true"],
                                              idempotency_key=KEY)
            racer = threading.Thread(target=second)
            racer.start()
            # the second submit is waiting for this one's key (its row lock), not just started
            deadline = time.monotonic() + 30
            while "done" not in got and time.monotonic() < deadline and not world.conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = 'racer-submit'"
                    " AND wait_event_type = 'Lock'").fetchone():
                time.sleep(0.01)
            assert "done" not in got, "the second submit did not wait for the first"
            got["committed"] = time.monotonic()
        racer.join(timeout=30)
    assert not racer.is_alive()
    assert got["done"] >= got["committed"]
    assert got["refused"] == (f"idempotency key already used for job {got['first']['id']} "
                              "by a request that differs in command")
    assert world.conn.execute("SELECT count(*) AS n FROM jobs WHERE idempotency_key = %s",
                              (KEY,)).fetchone()["n"] == 1


def test_the_check_fails_with_a_submit_that_does_not_compare(world):
    """The same differing repeat against a pgd_submit that returns the keyed job without
    comparing requests gets the first job as if it were the one asked for: the tests above
    would see it."""
    broken = function_source("pgd_submit").replace(
        "RETURN QUERY SELECT pgd_submit_repeat(v_id, v_request), false;",
        "RETURN QUERY SELECT v_id, false;")
    assert broken.count("RETURN QUERY SELECT v_id, false;") == 2, "update this test with pgd_submit"
    world.conn.execute(broken)
    world.setup()
    first = world.job(idempotency_key=KEY, command=["true"])
    again = world.job(idempotency_key=KEY, command=["rm", "-rf", "build"])
    assert again["id"] == first["id"] and again["command"] == ["true"]


def test_after_an_operator_retry_the_same_request_still_finds_its_job(world):
    """A retry raises the job's max_attempts (to failures + 1): the comparison is with
    what the first request asked for, so the identical request is not refused, and one that
    asks for the raised value is."""
    world.setup()
    runner = world.runner()
    first = world.job(idempotency_key=KEY, command=["false"])
    claim = world.claim(runner)
    world.complete(claim, outcome="failed", exit_code=1)
    transitions.retry_job(world.conn, job_id=first["id"], actor="alice", reason="flaky")
    assert world.row("jobs", first["id"])["max_attempts"] == 2
    again = world.job(idempotency_key=KEY, command=["false"])
    assert again["id"] == first["id"] and not again["is_new"]
    with pytest.raises(Conflict, match="differs in max attempts$"):
        world.job(idempotency_key=KEY, command=["false"], max_attempts=2)


def test_only_keyed_submits_keep_their_request(world):
    world.setup()
    dep = world.job()["id"]
    keyed = world.job(idempotency_key=KEY, depends_on=[dep, dep])
    rows = world.conn.execute("SELECT job_id, request FROM idempotent_requests").fetchall()
    assert rows == [{"job_id": keyed["id"], "request": {
        "pool": keyed["pool_id"], "target": None, "command": ["true"], "priority": 0,
        "max attempts": 1, "timeout": 3600, "approval": False, "dependencies": [dep]}}]


def test_an_unknown_dependency_is_named_by_its_id(world):
    world.setup()
    known = world.job()
    with pytest.raises(NotFound, match=r"^unknown dependency 999999$"), world.conn.transaction():
        world.job(depends_on=[known["id"], 999999])
    with (pytest.raises(NotFound, match=r"^unknown dependencies 999998, 999999$"),
          world.conn.transaction()):
        world.job(depends_on=[999999, known["id"], 999998, 999999])
    with (pytest.raises(NotFound, match=r"^unknown dependencies 900001, 900002, 900003, 900004, "
                                        r"900005 … \(7 in all\)$"),
          world.conn.transaction()):
        world.job(depends_on=list(range(900007, 900000, -1)))
    assert counts(world.conn) == (1, 0)
