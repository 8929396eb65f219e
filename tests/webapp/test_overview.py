"""The overview: capacity bars, waiting jobs by reason from the summary, uncertain first."""

from __future__ import annotations

import re

from sql import transitions


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
    assert re.search(r"refreshed \d+ s ago", page)
    assert "Uncertain targets" not in page


def test_overview_fragment_polls(operator, world):
    world.setup()
    response = operator.get("/", headers={"HX-Request": "true"})
    body = response.get_data(as_text=True)
    assert body.lstrip().startswith('<div id="overview"')
    assert 'hx-trigger="every 2s"' in body and 'hx-get="/"' in body
    assert "<html" not in body
