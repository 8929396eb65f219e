"""The queue's time columns: each waiting job's "waiting since" (a blocked job since it was
created, a queued one since its ready_at) and age, sortable longest waiting first, with
keyset pages that follow that order (ties broken by id) without skipping or repeating."""

from __future__ import annotations

import re

import pytest


def _ids(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'id="queue-job-(\d+)"', page)]


def _next(page: str) -> str | None:
    match = re.search(r'rel="next" href="([^"]+)"', page)
    return match.group(1).replace("&amp;", "&") if match else None


@pytest.fixture
def aged(world):
    """Five waiting jobs whose waits are, by id: 10 s, 1 h, 30 min, 1 h (a tie), 2 h (blocked
    on an approval, created 2 h ago: it waits since then, whatever its ready_at says)."""
    world.setup()
    ids = [world.job()["id"] for _ in range(4)]
    ids.append(world.job(requires_approval=True)["id"])
    c = world.conn
    for job_id, seconds in zip(ids, [10, 3600, 1800, 3600]):
        c.execute("UPDATE jobs SET ready_at = now() - make_interval(secs => %s), "
                  "created_at = now() - make_interval(secs => %s) WHERE id = %s",
                  (seconds, seconds + 60, job_id))
    c.execute("UPDATE jobs SET created_at = now() - interval '2 hours', ready_at = now() WHERE id = %s",
              (ids[4],))
    # the tie: the same instant for both
    c.execute("UPDATE jobs SET ready_at = (SELECT ready_at FROM jobs WHERE id = %s) WHERE id = %s",
              (ids[1], ids[3]))
    return ids


def test_longest_waiting_first_pages_in_that_order(operator, aged):
    one, two, three, four, five = aged
    page = operator.get("/queue/?sort=oldest").get_data(as_text=True)
    assert _ids(page) == [five, two, four, three, one]
    assert 'aria-sort="ascending">Waiting since ▲' in page
    assert 'option value="oldest" selected' in page
    row = re.search(rf'id="queue-job-{five}".*?</tr>', page, re.S).group(0)
    assert re.search(r'class="waiting-since"[^>]*><time datetime="[^"]+" title="[^"]+ UTC">2 h ago</time>', row)
    assert "<time datetime=" in row and "data-local" in row  # the absolute time, localized by app.js
    assert 'class="age" data-label="Age" title="since it was submitted">2 h</td>' in row

    seen, url = [], "/queue/?sort=oldest&limit=2"
    while url:
        page = operator.get(url).get_data(as_text=True)
        seen += _ids(page)
        url = _next(page)
        assert url is None or ("sort=oldest" in url and "after_since=" in url)
    assert seen == [five, two, four, three, one]  # the tie split across pages: none lost

    # the poll of a later page keeps its cursor and the order
    later = operator.get("/queue/?sort=oldest&limit=2").get_data(as_text=True)
    second = operator.get(_next(later), headers={"HX-Request": "true"}).get_data(as_text=True)
    poll = re.search(r'hx-get="([^"]+)"', second).group(1).replace("&amp;", "&")
    assert "after_since=" in poll and "sort=oldest" in poll
    assert _ids(operator.get(poll).get_data(as_text=True)) == [four, three]


def test_by_id_is_still_the_default_and_shows_the_same_columns(operator, aged):
    page = operator.get("/queue/").get_data(as_text=True)
    assert _ids(page) == aged
    assert 'aria-sort="ascending">Job ▲' in page
    assert '<a href="/queue/?sort=oldest" title="Longest waiting first">Waiting since</a>' in page
    assert page.count('class="waiting-since"') == 5


@pytest.mark.parametrize("query", ["sort=newest", "sort=oldest&after_since=yesterday",
                                   "sort=oldest&after_since=2025-01-01T00:00:00",
                                   "sort=oldest&after_since=2025-01-01T00:00:00%2B00:00&after_id=x"])
def test_a_bad_sort_or_cursor_is_a_4xx(operator, world, query):
    world.setup()
    response = operator.get("/queue/?" + query)
    assert response.status_code in (400, 422), query
    assert "Traceback" not in response.get_data(as_text=True)
