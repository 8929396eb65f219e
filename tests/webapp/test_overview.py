"""The overview: capacity bars, waiting jobs by reason from the summary, uncertain first."""

from __future__ import annotations

import re

from pgdispatch.sql import reads, transitions
from pgdispatch.sql.explain import REASON_CODES

from .support import make_uncertain_target


def test_capacity_and_reason_counts(operator, world):
    world.setup(org_limit=5, pool_slots=2, targets=("staging",))
    runner = world.runner(slots=4)
    for _ in range(3):
        world.job()
    world.claim(runner)
    world.claim(runner)
    before = operator.get("/").get_data(as_text=True)
    assert "No queue summary yet" in before
    transitions.summarize_queue(world.conn)
    page = operator.get("/").get_data(as_text=True)
    assert re.search(r'<meter min="0" max="5" value="2"[^>]*>2 of 5</meter>', page)  # organization
    assert re.search(r'<meter min="0" max="2" value="2"[^>]*>2 of 2</meter>', page)  # pool, full
    assert "capacity is-full" in page
    assert re.search(r'reason-capacity_pool">capacity_pool</span>\s*</td>\s*<td class="num">\s*'
                     r'<a href="/queue/\?reason=capacity_pool">1</a>', page)
    assert re.search(r'refreshed <span id="summary-age" data-seconds="[0-9.]+">\d+ s ago</span>', page)
    assert "Uncertain targets" not in page


def test_overview_fragment_polls(operator, world):
    world.setup()
    response = operator.get("/", headers={"HX-Request": "true"})
    body = response.get_data(as_text=True)
    assert body.lstrip().startswith('<div id="overview"')
    assert 'hx-trigger="every 2s"' in body and 'hx-get="/"' in body
    assert "<html" not in body


def _console_counts(page: str) -> tuple[dict[str, int], dict[str, int]]:
    """(every reason, primary) counts as the overview shows them."""
    every, primary = {}, {}
    for code in REASON_CODES:
        match = re.search(rf'reason-{code}">{code}</span>\s*</td>\s*<td class="num">\s*'
                          r'(?:<a href="[^"]*">)?(\d+)(?:</a>)?\s*</td>\s*'
                          r'<td class="num primary-count">(\d+)</td>', page)
        assert match, code
        every[code], primary[code] = int(match.group(1)), int(match.group(2))
    return every, primary


def test_every_reason_counted_and_the_same_as_each_jobs_explanation(operator, world):
    """One waiting job (at least) for every reason code as its primary one, and jobs with
    several; the overview's counts under every reason and under the primary one (from the
    queue summary) equal sql.reads.overview's, and both equal the waiting jobs' own reasons
    explained one by one (the queue's reason filter lists as many)."""
    make_uncertain_target(world)                          # uncertain job on production
    world.apply({
        "organizations": [{"name": "tiny", "max_running": 0}],
        "pools": [{"name": "gpu", "slots": 4}, {"name": "full", "slots": 0}, {"name": "arm", "slots": 4},
                  {"name": "held", "slots": 4}],
        "projects": [{"name": "small", "organization": "tiny", "pools": ["linux"]},
                     {"name": "bounded", "organization": "acme", "pools": ["linux"], "max_running": 0},
                     {"name": "frozen", "organization": "acme", "pools": ["linux"]},
                     {"name": "ml", "organization": "acme", "pools": ["gpu", "full", "arm", "held"]}],
        "targets": [{"name": "staging"}],
    })
    runner = world.runner(pools=("linux", "deploy", "full"), slots=10)
    holder = world.job(pool="deploy", target="staging", command=["deploy", "staging"])
    assert world.claim(runner, pools=("deploy",)).job_id == holder["id"]   # staging held
    arm = world.runner(pools=("arm",), slots=1)
    world.job(project="ml", pool="arm", command=["busy"])
    assert world.claim(arm, pools=("arm",)) is not None                    # its one runner slot
    world.job(project="ml", pool="arm", command=["next"])                   # runners_busy
    upstream = world.job(command=["build"])                                 # ready
    world.job(command=["test"], depends_on=[upstream["id"]])                # dependency_pending
    world.job(command=["gate"], depends_on=[upstream["id"]], requires_approval=True)  # + approval
    world.job(command=["release"], requires_approval=True)                  # approval_required
    world.job(project="frozen", command=["x"])                              # project_paused
    world.job(project="frozen", command=["y"], delay_seconds=600)           # project_paused + delay
    world.job(project="frozen", command=["z"], requires_approval=True)      # approval + paused
    transitions.pause_project(world.conn, project="frozen", reason="freeze", actor="alice")
    world.job(project="ml", pool="held", command=["p"])                     # pool_paused
    world.job(project="ml", pool="held", command=["p2"], requires_approval=True)  # approval + pool
    transitions.pause_pool(world.conn, pool="held", reason="driver update", actor="alice")
    world.job(command=["later"], delay_seconds=3600)                        # retry_delayed
    world.job(project="ml", pool="gpu", command=["train"])                  # no_authorized_runner
    world.job(project="small", command=["s"])                               # capacity_organization
    world.job(project="small", command=["s2"], requires_approval=True)      # approval + capacity
    world.job(project="bounded", command=["b"])                             # capacity_project
    world.job(project="ml", pool="full", command=["f"])                     # capacity_pool
    world.job(pool="deploy", target="staging", command=["deploy", "2"])     # target_held
    world.job(pool="deploy", target="staging", command=["deploy", "5"])     # target_order + held
    world.job(pool="deploy", target="staging", command=["deploy", "4"],
              depends_on=[upstream["id"]])                                  # dependency + target_held
    world.job(pool="deploy", target="production", command=["deploy", "3"])  # target_uncertain
    transitions.summarize_queue(world.conn)

    primary = {code: 0 for code in REASON_CODES}
    every = {code: 0 for code in REASON_CODES}
    for job in reads.list_waiting(world.conn, limit=500)["jobs"]:
        primary[job["reasons"][0]["code"]] += 1
        for r in job["reasons"]:
            every[r["code"]] += 1
    assert all(primary.values()), primary  # the world really has every reason
    assert every != primary                # and jobs with more than one
    data = reads.overview(world.conn)
    page = operator.get("/").get_data(as_text=True)
    assert _console_counts(page) == (data["reason_counts"], data["primary_counts"]) == (every, primary)
    assert f'<span class="count">{sum(primary.values())}</span>' in page
    for code, n in every.items():  # the filter behind each count lists as many jobs
        assert len(reads.list_waiting(world.conn, reason=code, limit=500)["jobs"]) == n, code
    assert "Stale" not in page


def test_the_summary_age_is_shown_and_flagged_when_stale(operator, world):
    world.setup()
    world.job()
    transitions.summarize_queue(world.conn)
    world.conn.execute("UPDATE queue_summaries SET refreshed_at = now() - interval '10 minutes'")
    page = operator.get("/").get_data(as_text=True)
    age = re.search(r'<span id="summary-age" data-seconds="([0-9.]+)">10 min ago</span>', page)
    assert age and 600 <= float(age.group(1)) < 660
    assert "Stale: no scheduler has refreshed it lately" in page
