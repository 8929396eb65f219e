"""The queue page: every waiting job with its reason; filters; keyset pages; htmx fragment."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions


def _ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'id="queue-job-(\d+)"', html)]


def test_each_waiting_job_shows_its_reason_and_message(operator, world):
    world.setup(pool_slots=1)
    world.project("api", org="acme", pools=("linux",))
    runner = world.runner()
    running = world.job()
    world.claim(runner)
    full = world.job()
    gated = world.job(project="api", requires_approval=True)
    page = operator.get("/queue/").get_data(as_text=True)
    assert _ids(page) == [full["id"], gated["id"]]
    assert running["id"] not in _ids(page)
    assert "reason-capacity_pool" in page and "pool linux: 1 of 1 pool slots taken" in page
    assert "reason-approval_required" in page
    # the capacity reason links to the jobs holding that capacity
    assert '<a class="holders" href="/jobs/?state=running&amp;pool=linux">jobs holding it</a>' in page


def test_the_reason_filter_lists_a_job_under_any_of_its_reasons(operator, world):
    """An approval behind a dependency (the fresh-user run: "No waiting jobs match these
    filters" for approval_required) is listed under both reasons; the row marks its primary
    reason and the one that matched. Organization and target capacity link to the holders,
    and a job waiting on busy runners to the jobs of each runner."""
    world.setup(org_limit=1, pools=("linux", "deploy"), targets=("production",))
    runner = world.runner(pools=("linux", "deploy"), slots=1)
    holder = world.job(pool="deploy", target="production")
    assert world.claim(runner, pools=("deploy",)).job_id == holder["id"]
    build = world.job()
    gated = world.job(pool="deploy", target="production", depends_on=[build["id"]],
                      requires_approval=True)
    page = operator.get("/queue/?reason=approval_required").get_data(as_text=True)
    assert _ids(page) == [gated["id"]]
    row = page[page.index(f'id="queue-job-{gated["id"]}"'):]
    row = row[:row.index("</tr>")]
    assert re.search(r'reason-dependency_pending is-primary">dependency_pending</span> '
                     r'<span class="reason-mark"[^>]*>primary</span>', row)
    assert re.search(r'<li class="is-match"><span class="badge reason reason-approval_required '
                     r'is-match">approval_required</span> <span class="reason-mark is-match"', row)
    assert 'href="/jobs/?state=running&amp;organization=acme">jobs holding it</a>' in row
    assert 'href="/jobs/?state=running&amp;target=production">jobs holding it</a>' in row
    assert _ids(operator.get("/queue/?reason=dependency_pending").get_data(as_text=True)) == [gated["id"]]
    # the organization full, the build waits for it too; once the limit has room, the one
    # runner slot is still taken: runners_busy, with a link to that runner's jobs
    world.apply({"organizations": [{"name": "acme", "max_running": 5}]})
    busy = operator.get("/queue/?reason=runners_busy").get_data(as_text=True)
    assert _ids(busy) == [build["id"]]
    assert f'href="/jobs/?state=running&amp;runner={runner}"' in busy


def test_filters_by_project_and_reason(operator, world):
    world.setup()
    world.project("api", org="acme", pools=("linux",))
    web = world.job()
    api = world.job(project="api")
    transitions.pause_project(world.conn, project="api", reason="freeze", actor="alice")
    assert _ids(operator.get("/queue/?project=web").get_data(as_text=True)) == [web["id"]]
    paused = operator.get("/queue/?reason=project_paused").get_data(as_text=True)
    assert _ids(paused) == [api["id"]]
    assert "paused by alice" in paused
    assert _ids(operator.get("/queue/?organization=nobody").get_data(as_text=True)) == []
    assert 'option value="api" selected' in operator.get("/queue/?project=api").get_data(as_text=True)


def test_keyset_pages_follow_after_id(operator, world):
    world.setup()
    jobs = [world.job()["id"] for _ in range(5)]
    first = operator.get("/queue/?limit=2").get_data(as_text=True)
    assert _ids(first) == jobs[:2]
    link = re.search(r'rel="next" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    assert f"after_id={jobs[1]}" in link
    second = operator.get(link).get_data(as_text=True)
    assert _ids(second) == jobs[2:4]
    last = operator.get(f"/queue/?limit=2&after_id={jobs[3]}").get_data(as_text=True)
    assert _ids(last) == jobs[4:]
    assert 'rel="next"' not in last


def test_htmx_poll_gets_only_the_fragment(operator, world):
    world.setup()
    world.job()
    response = operator.get("/queue/?project=web", headers={"HX-Request": "true"})
    body = response.get_data(as_text=True)
    assert response.status_code == 200
    assert "<html" not in body and "<nav aria-label=\"Console\"" not in body
    assert re.search(r'<section id="queue-table"[^>]*hx-trigger="every 2s"', body)
    assert 'hx-get="/queue/?project=web"' in body
    assert "HX-Request" in response.headers["Vary"]
    full = operator.get("/queue/?project=web")
    assert "<html" in full.get_data(as_text=True) and "HX-Request" in full.headers["Vary"]


def test_bad_filters_are_4xx_not_errors(operator, world):
    world.setup()
    for query in ["reason=bogus", "after_id=abc", "after_id=-1", "limit=0", "limit=100000",
                  "project=a%00b", "after_id=99999999999999999999999"]:
        response = operator.get("/queue/?" + query)
        assert 400 <= response.status_code < 500, query
    for name in ("organization", "project", "pool"):  # fresh-user run: these said "no jobs"
        response = operator.get(f"/queue/?{name}=nope")
        assert response.status_code == 422 and f"unknown {name} &#39;nope&#39;" in \
            response.get_data(as_text=True), name
    htmx = operator.get("/queue/?reason=bogus", headers={"HX-Request": "true"})
    assert htmx.status_code == 422 and htmx.headers["HX-Reswap"] == "none"


def test_the_target_filter_and_the_dependencies_a_row_names(operator, world):
    """A Target filter as on the Jobs page (an unknown name is a 4xx, as the other filters');
    a job behind dependencies names the ones still pending, as `jobs explain` does."""
    world.setup(pools=("linux", "deploy"), targets=("production", "staging"))
    build, lint = world.job(), world.job()
    runner = world.runner()
    assert world.claim(runner).job_id == build["id"]
    prod = world.job(pool="deploy", target="production", depends_on=[build["id"], lint["id"]])
    stage = world.job(pool="deploy", target="staging", depends_on=[lint["id"]])
    world.job(pool="deploy")  # no target: never under a target filter
    page = operator.get("/queue/?target=production").get_data(as_text=True)
    assert _ids(page) == [prod["id"]]
    assert 'option value="production" selected' in page
    assert f"waiting for job {build['id']} (running), job {lint['id']} (queued)" in page
    everything = operator.get("/queue/").get_data(as_text=True)
    assert f"waiting for job {lint['id']} (queued)</span>" in everything  # the staging job's
    assert "to succeed" not in everything
    by_age = operator.get("/queue/?target=staging&sort=oldest").get_data(as_text=True)
    assert _ids(by_age) == [stage["id"]]
    response = operator.get("/queue/?target=nope")
    assert response.status_code == 422 and "unknown target &#39;nope&#39;" in response.get_data(as_text=True)


def test_with_a_reason_filter_every_row_marks_its_primary_reason(operator, world):
    """A job whose only reason matched says both: it is its primary reason, and the match."""
    world.setup()
    world.runner()  # else no_authorized_runner holds too
    gated = world.job(requires_approval=True)
    page = operator.get("/queue/?reason=approval_required").get_data(as_text=True)
    row = page[page.index(f'id="queue-job-{gated["id"]}"'):]
    row = row[:row.index("</tr>")]
    assert re.search(r'reason-approval_required is-primary is-match">approval_required</span> '
                     r'<span class="reason-mark"[^>]*>primary</span> '
                     r'<span class="reason-mark is-match"[^>]*>matched</span>', row), row
    # without a filter, a job with one reason needs no mark
    plain = operator.get("/queue/").get_data(as_text=True)
    assert "reason-mark" not in plain


def test_a_deployment_behind_its_targets_order_shows_target_order_and_links_the_next(operator, world):
    world.setup(targets=("staging",))
    world.runner()
    head = world.job(target="staging", command=["deploy", "1"])
    later = world.job(target="staging", command=["deploy", "2"])
    page = operator.get("/queue/?reason=target_order").get_data(as_text=True)
    assert _ids(page) == [later["id"]]
    assert "reason-target_order" in page
    assert f"target staging deploys oldest first: job {head['id']} is next" in page
    assert f'<a class="holders" href="/jobs/{head["id"]}">job {head["id"]}</a>' in page
    assert '<a class="holders" href="/targets/staging">target staging</a>' in page
