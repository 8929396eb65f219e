"""The console's Jobs page: filters (the holder links of contract 2), the columns, paging,
live polling, and bad input as a clear 4xx page."""

from __future__ import annotations

import html as html_lib
import re

import pytest


@pytest.fixture
def holders(world):
    """globex holds its capacity with two running jobs on runner r-globex; acme one, on r-acme."""
    world.setup(pools=("linux",))
    world.apply({"organizations": [{"name": "globex", "max_running": 2}]})
    world.project("api", org="globex", pools=("linux",))
    acme_runner = world.runner(name="r-acme", slots=1)
    web = world.job(command=["make", "web"])
    world.claim(acme_runner)
    globex_runner = world.runner(name="r-globex", slots=4)
    api = [world.job(project="api", command=["make", f"api{i}"]) for i in range(2)]
    for _ in api:
        world.claim(globex_runner)
    waiting = world.job(project="api")
    return {"web": web["id"], "api": [j["id"] for j in api], "waiting": waiting["id"],
            "globex_runner": globex_runner, "acme_runner": acme_runner}


def rows(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'id="jobs-row-(\d+)"', html)]


def test_holder_links_list_the_jobs_holding_a_capacity(operator, holders):
    html = operator.get("/jobs/?state=running&organization=globex").get_data(as_text=True)
    assert rows(html) == holders["api"][::-1]
    assert ">r-globex</a>" in html and "globex" in html
    # the runner cell links to that runner's running jobs (a holder link itself)
    assert f'/jobs/?state=running&amp;runner={holders["globex_runner"]}' in html
    assert rows(operator.get(f"/jobs/?state=running&runner={holders['acme_runner']}").get_data(
        as_text=True)) == [holders["web"]]
    assert rows(operator.get("/jobs/?state=running&project=web").get_data(as_text=True)) == [holders["web"]]
    assert rows(operator.get("/jobs/?state=running&pool=linux").get_data(as_text=True)) == sorted(
        [holders["web"], *holders["api"]], reverse=True)
    assert rows(operator.get("/jobs/?organization=globex").get_data(as_text=True)) == [
        holders["waiting"], *holders["api"][::-1]]
    # running for: a duration, not a timestamp
    assert re.search(r'<span class="running-for">\d+ s</span>', html)


def test_the_table_polls_itself_with_its_filters(operator, holders):
    page = operator.get("/jobs/?state=running&organization=globex")
    assert "HX-Request" in page.headers["Vary"]
    fragment = operator.get("/jobs/?state=running&organization=globex", headers={"HX-Request": "true"})
    html = fragment.get_data(as_text=True)
    assert html.lstrip().startswith('<section id="jobs-table"')
    assert 'hx-trigger="every 2s"' in html and "<html" not in html
    poll = re.search(r'hx-get="([^"]+)"', html).group(1)
    assert "state=running" in poll and "organization=globex" in poll


def test_reason_and_age_filters(operator, world, holders):
    html = operator.get("/jobs/?reason=capacity_organization").get_data(as_text=True)
    assert rows(html) == [holders["waiting"]] and "reason-capacity_organization" in html
    world.conn.execute("UPDATE jobs SET created_at = now() - interval '2 hours' WHERE id = %s",
                       (holders["web"],))
    assert rows(operator.get("/jobs/?older_than=3600").get_data(as_text=True)) == [holders["web"]]
    assert holders["web"] not in rows(operator.get("/jobs/?younger_than=3600").get_data(as_text=True))


def test_pages_older_and_newer(operator, world, holders):
    ids = sorted([holders["web"], *holders["api"], holders["waiting"]], reverse=True)
    first = operator.get("/jobs/?limit=2").get_data(as_text=True)
    assert rows(first) == ids[:2] and f"before_id={ids[1]}" in first
    older = operator.get(f"/jobs/?limit=2&before_id={ids[1]}").get_data(as_text=True)
    assert rows(older) == ids[2:4]
    newer = operator.get(f"/jobs/?limit=2&after_id={ids[3]}").get_data(as_text=True)
    assert rows(newer) == [ids[2], ids[1]] and "oldest first" in newer


def test_an_age_filtered_list_pages_through_each_job_once_either_way(operator, world, holders):
    """With older_than the list is in creation order: following its links (Older jobs from
    the first page, Newer jobs from after_id=0) shows every matching job once, in that order."""
    for i in range(7):
        world.job(project="api" if i % 2 else "web")
    ids = [r["id"] for r in world.conn.execute("SELECT id FROM jobs ORDER BY id")]
    assert len(ids) == 11
    for n, job_id in enumerate(ids):  # created out of id order, one within the hour
        world.conn.execute("UPDATE jobs SET created_at = now() - %s * interval '1 hour' WHERE id = %s",
                           ((n * 5) % 11 + 0.5, job_id))
    want = [r["id"] for r in world.conn.execute(
        "SELECT id FROM jobs WHERE created_at <= now() - interval '1 hour' "
        "ORDER BY created_at DESC, id DESC")]
    assert len(want) == 10 and want != sorted(want, reverse=True)

    def follow(url: str, label: str) -> list[int]:
        seen: list[int] = []
        while url:
            html = operator.get(url).get_data(as_text=True)
            seen += rows(html)
            link = re.search(rf'<a rel="next" href="([^"]+)">{label}', html)
            url = html_lib.unescape(link.group(1)) if link else None
        return seen

    assert follow("/jobs/?older_than=3600&limit=3", "Older jobs") == want
    assert follow("/jobs/?older_than=3600&limit=3&after_id=0", "Newer jobs") == want[::-1]


@pytest.mark.parametrize("query, message", [
    ("organization=nope", "unknown organization &#39;nope&#39;"),
    ("target=nope", "unknown target &#39;nope&#39;"),
    ("runner=424242", "unknown runner 424242"),
    ("runner=abc", "runner must be a whole number"),
    ("state=paused", "unknown state &#39;paused&#39;"),
    ("reason=busy", "unknown reason &#39;busy&#39;"),
    ("older_than=nan", "older_than must be a number of seconds between"),
    ("younger_than=soon", "younger_than must be a number of seconds"),
    ("before_id=-1", "before_id must be a whole number"),
])
def test_bad_filters_are_a_clear_4xx_page(operator, world, query, message):
    world.setup()
    response = operator.get(f"/jobs/?{query}")
    assert response.status_code == 422
    assert message in response.get_data(as_text=True)


def test_last_error_only_where_it_says_something_now(operator, world):
    """A failed attempt's error shows while the job waits for its retry and once it failed
    for good, never beside the retry that runs now (or that succeeded)."""
    world.setup(pools=("linux",))
    runner = world.runner(slots=2)
    job = world.job(max_attempts=3)["id"]

    def cell():
        html = operator.get("/jobs/").get_data(as_text=True)
        return html.split(f'id="jobs-row-{job}"', 1)[1].split("</tr>", 1)[0]

    first = world.claim(runner)
    world.complete(first, outcome="failed", error="disk full on build-7", backoff_base_seconds=0,
                   backoff_cap_seconds=0)
    assert "before the retry:" in cell() and "disk full on build-7" in cell()
    second = world.claim(runner)
    assert second is not None and second.job_id == job
    assert "disk full" not in cell()
    world.complete(second, outcome="failed", error="disk full again", backoff_base_seconds=0,
                   backoff_cap_seconds=0)
    world.complete(world.claim(runner), outcome="failed", error="third time",
                   backoff_base_seconds=0, backoff_cap_seconds=0)
    assert world.row("jobs", job)["state"] == "failed"
    assert "third time" in cell() and "before the retry" not in cell()


def test_numbers_in_the_url_are_ascii_digits(operator, world):
    world.setup()
    for query in ("older_than=1_000", "older_than=%D9%A1%D9%A0", "runner=%D9%A1", "limit=1_0",
                  "before_id=" + "9" * 5000, "older_than=" + "1" * 5000):
        response = operator.get(f"/jobs/?{query}")
        assert response.status_code == 422, query
        assert "1" * 100 not in response.get_data(as_text=True), query
