"""The benchmark's slot-rows prototype (bench/prototypes.py) does the work it is measured for:
a claim takes one organization and one pool slot row, the limit those rows stand for holds,
and the completion frees them. Without this, a faster prototype could be one that skips it."""

from bench import claim as bench_claim
from bench import prototypes
from sql import transitions


def _claim(conn, runner_id, pool_ids):
    return transitions.claim(conn, runner_id=runner_id, pools=pool_ids,
                             claim_token=transitions.new_claim_token(), lease_seconds=60)


def _held(conn) -> int:
    return conn.execute(prototypes.SLOTS_HELD).fetchone()["held"]


def test_the_slot_rows_prototype_reserves_holds_the_limit_and_releases(conn, db_url):
    conn.execute(prototypes.slot_rows_sql(recheck=True))
    pool_ids = bench_claim.prepare(db_url, jobs=3, projects=2,
                                   limit={"organization": 1, "pool": 2, "project": 5})
    runner_id = transitions.register_runner(conn, name="proto", pools=[bench_claim.POOL], slots=3)

    first = _claim(conn, runner_id, pool_ids)
    assert first is not None
    assert _held(conn) == 2  # one organization slot, one pool slot
    assert _claim(conn, runner_id, pool_ids) is None  # the organization's one slot is taken

    transitions.complete(conn, attempt_id=first.attempt_id, generation=first.generation,
                         outcome="succeeded", exit_code=0, receipt_key=first.receipt_key)
    assert _held(conn) == 0
    assert _claim(conn, runner_id, pool_ids) is not None


def test_the_prototype_is_built_from_the_migrated_functions():
    """Both variants replace the counter statements of pgd_claim and pgd_complete_attempt;
    only the no-recheck variant switches the fairness re-check off."""
    with_recheck = prototypes.slot_rows_sql(recheck=True)
    without = prototypes.slot_rows_sql(recheck=False)
    for text in (with_recheck, without):
        assert "UPDATE organizations o SET running" not in text
        assert "UPDATE pools SET running = running - 1" not in text
        assert text.count("proto_organization_slots s SET job_id") == 1
    assert "SELECT false" in without and "SELECT false" not in with_recheck
