"""The overview's charts (webapp/charts.py): server-side SVG images of the rolled-up history,
for the last hour or day, that need no JavaScript; a span or chart that does not exist is a
clear 4xx."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from pgdispatch.sql import transitions

SVG = "{http://www.w3.org/2000/svg}"


def duty_pass(world, runner: int | None = None) -> int:
    """One run of the summaries duty by ``runner`` (else a fresh one: it takes every duty)."""
    runner = runner or world.runner(slots=8)
    rows = transitions.beat_runner(world.conn, runner_id=runner, beat_seconds=1.0,
                                   duty_lease_seconds=20.0)
    term = {r["duty"]: r for r in rows}["summaries"]["term"]
    assert transitions.run_summaries(world.conn, runner_id=runner, term=term)
    return runner


def test_the_overview_shows_four_charts_that_are_svg_images(operator, world):
    world.setup(pools=("linux", "macos"))
    for _ in range(3):
        world.job()
    world.job(pool="macos")
    runner = duty_pass(world)
    world.claim(runner)
    duty_pass(world, runner)

    page = operator.get("/").get_data(as_text=True)
    images = re.findall(r'<img src="(/charts/(\w+)\.svg\?[^"]*)"[^>]*alt="([^"]*)"', page)
    assert [name for _, name, _ in images] == ["depth", "running", "wait", "oldest"]
    alts = {name: alt for _, name, alt in images}
    assert "latest: no_authorized_runner 1, ready 3." in alts["depth"]
    assert "linux 1" in alts["running"]
    assert 'hx-trigger="every 60s"' in page

    for src, name, _ in images:
        response = operator.get(src.replace("&amp;", "&"))
        assert response.status_code == 200
        assert response.mimetype == "image/svg+xml"
        assert "script-src" not in response.headers["Content-Security-Policy"]
        root = ET.fromstring(response.get_data())
        assert root.tag == SVG + "svg"
        assert not list(root.iter(SVG + "script")), "a chart must not carry a script"
    depth = operator.get("/charts/depth.svg").get_data(as_text=True)
    assert "ready" in depth and "no_authorized_runner" in depth  # macos has no runner
    assert "Waiting jobs by primary reason, last hour" in depth


def test_the_day_span_is_a_link_and_an_unknown_span_or_chart_is_refused(operator, world):
    world.setup()
    duty_pass(world)
    page = operator.get("/").get_data(as_text=True)
    assert '<a href="/?span=day">last day</a>' in page
    day = operator.get("/?span=day").get_data(as_text=True)
    assert "/charts/wait.svg?span=day" in day
    assert "Running jobs by pool, last day" in operator.get("/charts/running.svg?span=day").get_data(as_text=True)

    fragment = operator.get("/charts/?span=day", headers={"HX-Request": "true"})
    body = fragment.get_data(as_text=True)
    assert body.lstrip().startswith('<section id="overview-charts"') and "<html" not in body
    assert operator.get("/charts/?span=day").status_code == 302  # without htmx: the page

    for url in ("/?span=week", "/charts/depth.svg?span=week", "/charts/?span=x"):
        response = operator.get(url)
        assert response.status_code == 422, url  # InvalidInput, as every bad filter
        assert "unknown span" in response.get_data(as_text=True)
    assert operator.get("/charts/nosuch.svg").status_code == 404


def test_a_viewer_sees_the_charts_and_a_stranger_does_not(app, viewer, world):
    world.setup()
    assert app.test_client().get("/charts/depth.svg").status_code in (302, 401)
    assert viewer.get("/charts/depth.svg").status_code == 200


def y_labels(svg: bytes) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text for g in root.iter(SVG + "g") if "axis y" in (g.get("class") or "")
            for t in g.iter(SVG + "text")]


def test_a_huge_value_gets_a_few_ticks_not_thousands(operator, world):
    """A count of 2^31 - 1 and a wait of two thousand years: the axes keep a handful of
    labels (the old table of steps ended at 100,000: 21,475 labels, a 7 MB image)."""
    world.setup()
    pool = world.pool_ids(("linux",))[0]
    world.conn.execute("INSERT INTO queue_reason_history (at, reason, waiting) "
                       "VALUES (date_trunc('minute', now()), 'ready', 2147483647)")
    world.conn.execute("INSERT INTO queue_history (at, pool_id, waiting, running, "
                       "oldest_wait_seconds) VALUES (date_trunc('minute', now()), %s, 0, "
                       "2147483647, 6.4e10)", (pool,))
    for name in ("depth", "running", "oldest"):
        body = operator.get(f"/charts/{name}.svg").get_data()
        labels = y_labels(body)
        assert 2 <= len(labels) <= 7, (name, len(labels))
        assert len(body) < 100_000, name
    assert y_labels(operator.get("/charts/depth.svg").get_data())[:2] == ["0", "500000000"]
    assert "latest: linux 740741 d." in operator.get("/").get_data(as_text=True)


def test_the_oldest_chart_says_what_it_plots(operator, world):
    """The oldest wait is of the queued jobs past their ready time, whatever holds them: a
    job blocked on its dependency for an hour is not in it; its alt text says so."""
    world.setup()
    upstream = world.job()
    world.job(depends_on=[upstream["id"]])
    world.conn.execute("UPDATE jobs SET created_at = now() - interval '1 hour', "
                       "ready_at = now() - interval '5 minutes'")
    duty_pass(world)
    page = operator.get("/").get_data(as_text=True)
    alt = re.search(r'<img src="/charts/oldest\.svg[^"]*"[^>]*alt="([^"]*)"', page).group(1)
    assert "oldest queued job" in alt and "blocked jobs and delayed retries left out" in alt
    assert alt.endswith("latest: linux 5 min.")  # the queued one's, not the blocked one's hour
