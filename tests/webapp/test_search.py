"""Finding a job in the API (GET /api/v1/jobs/search) and the console (the search box in
the nav, /jobs/search): what matches, paging, an id straight to the job, refusals as 4xx."""

from __future__ import annotations

import pytest

from pgdispatch.sql.accounts import create_api_token

from .support import ensure_account


@pytest.fixture
def api(app, conn):
    """``api(path, user="victor")`` -> response, with a viewer's token (reading is enough)."""
    ensure_account(conn, "victor", "victor-password", "viewer")
    token = create_api_token(conn, username="victor", name="dashboard")
    client = app.test_client()
    return lambda path: client.get(path, headers={"Authorization": f"Bearer {token}"})


@pytest.fixture
def found(world):
    world.setup(pools=("linux", "deploy"), targets=("production",))
    jobs = [world.job(command=["make", "build", f"--sha=feed{i}"], submitted_by="alice")["id"]
            for i in range(3)]
    jobs.append(world.job(pool="deploy", target="production", command=["./deploy.sh", "feed9"],
                          submitted_by="bob")["id"])
    return jobs


def test_api_search_pages_filters_and_ids(api, found):
    page = api("/api/v1/jobs/search?q=FEED&limit=2")
    assert page.status_code == 200, page.json
    body = page.json
    assert [j["id"] for j in body["jobs"]] == [found[3], found[2]]
    assert body["query"] == "FEED" and body["job_id"] is None and body["order"] == "newest_first"
    assert body["jobs"][0]["submitted_by"] == "bob" and body["jobs"][0]["match"] == "command"
    assert body["next"] == {"before_id": found[2]}
    rest = api(body["next_url"]).json
    # a full page says where the next starts (more may match); the last one says none
    assert [j["id"] for j in rest["jobs"]] == [found[1], found[0]]
    last = api(rest["next_url"]).json
    assert last["jobs"] == [] and last["next"] is None and last["next_url"] is None
    assert [j["id"] for j in api("/api/v1/jobs/search?q=feed&submitter=bob").json["jobs"]] == [found[3]]
    assert [j["id"] for j in api("/api/v1/jobs/search?q=feed&state=running").json["jobs"]] == []
    by_id = api(f"/api/v1/jobs/search?q=%23{found[1]}").json
    assert by_id["job_id"] == found[1] and [(j["id"], j["match"]) for j in by_id["jobs"]] == [(found[1], "id")]


@pytest.mark.parametrize("query, status, message", [
    ("", 422, "query parameter q is required"),
    ("q=ab", 422, "q must be a job id (#N), digits, or 3 to 200 characters of a command"),
    ("q=%20%20make", 422, "q must be a job id"),
    ("q=%23abc", 422, "q must be a job id"),
    ("q=" + "x" * 201, 422, "q"),
    ("q=make&state=done", 422, "state"),
    ("q=make&limit=0", 422, "limit"),
    ("q=make&project=nope", 404, "unknown project 'nope'"),
    ("q=make&submitter=", 422, "submitter"),
    ("q=make&q=build", 422, "more than once"),
    ("q=make&sort=id", 422, "unknown query parameter"),
])
def test_api_search_refuses_with_4xx(api, found, query, status, message):
    response = api(f"/api/v1/jobs/search?{query}")
    assert response.status_code == status, response.json
    assert message in response.json["error"], response.json
    assert len(response.json["error"]) < 500 and "anyOf" not in response.json["error"]


def test_console_search_box_results_and_pages(viewer, found):
    assert 'action="/jobs/search"' in viewer.get("/").get_data(as_text=True)  # the nav's box
    empty = viewer.get("/jobs/search")
    assert empty.status_code == 200 and "Search for a job by its command" in empty.get_data(as_text=True)
    html = viewer.get("/jobs/search?q=feed&submitter=alice").get_data(as_text=True)
    rows = [f'id="search-row-{i}"' in html for i in found]
    assert rows == [True, True, True, False], html
    assert "3 jobs for “feed” matching the filters, newest first." in html
    assert html.index(f"search-row-{found[2]}") < html.index(f"search-row-{found[0]}")
    assert viewer.get("/jobs/search?q=feed&project=web&state=running").get_data(as_text=True).count(
        "No job matches “feed” with these filters.") == 1


def test_console_search_pages_keep_the_filters(viewer, world, found, monkeypatch):
    from pgdispatch.webapp import jobs

    monkeypatch.setattr(jobs, "SEARCH_LIMIT", 2)
    html = viewer.get("/jobs/search?q=feed&submitter=alice").get_data(as_text=True)
    assert f"search-row-{found[2]}" in html and f"search-row-{found[1]}" in html
    assert f'href="/jobs/search?q=feed&amp;before_id={found[1]}&amp;submitter=alice"' in html
    older = viewer.get(f"/jobs/search?q=feed&before_id={found[1]}&submitter=alice").get_data(as_text=True)
    assert f"search-row-{found[0]}" in older and f"search-row-{found[2]}" not in older


def test_console_an_id_opens_the_job(viewer, world, found):
    for q in (f"%23{found[1]}", str(found[1]), f"+%23{found[1]}+"):
        response = viewer.get(f"/jobs/search?q={q}")
        assert response.status_code == 302, q
        assert response.headers["Location"].endswith(f"/jobs/{found[1]}")
    # digits that commands contain too: the results, the job by id first
    digits = world.job(command=["echo", f"build-{found[1]}{found[1]}{found[1]}"])["id"]
    q = f"{found[1]}" * 3
    if len(q) >= 3:
        html = viewer.get(f"/jobs/search?q={q}").get_data(as_text=True)
        assert f"search-row-{digits}" in html
    # an unknown id: no redirect, nothing found
    missing = viewer.get("/jobs/search?q=%23999999")
    assert missing.status_code == 200 and "No job matches “#999999”" in missing.get_data(as_text=True)


@pytest.mark.parametrize("query, message", [
    ("q=ab", "too short"), ("q=%23abc%00", "control"), ("q=make&state=done", "unknown state"),
    ("q=make&project=nope", "unknown project"), ("q=make&before_id=x", "before_id"),
    ("q=" + "x" * 201, "longer than 200"),
])
def test_console_search_refuses_with_4xx(viewer, found, query, message):
    response = viewer.get(f"/jobs/search?{query}")
    assert 400 <= response.status_code < 500, response.status_code
    assert message in response.get_data(as_text=True)


def test_htmx_gets_only_the_results_fragment(viewer, found):
    response = viewer.get("/jobs/search?q=feed", headers={"HX-Request": "true"})
    html = response.get_data(as_text=True)
    assert "<html" not in html and html.lstrip().startswith('<section id="search-results"')
    assert "HX-Request" in response.headers["Vary"]
