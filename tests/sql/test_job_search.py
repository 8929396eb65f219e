"""reads.search_jobs: find a job by its command text (trigram index), project, submitter,
state and id — what matches, in what order, paging, the index it uses, and refusals."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput, reads
from pgdispatch.sql.errors import UnknownFilter


@pytest.fixture
def found(world):
    """acme/web and globex/api; jobs with commands that share words, by two submitters."""
    world.setup()
    world.apply({"organizations": [{"name": "globex", "max_running": 3}]})
    world.project("api", org="globex", pools=("linux",))
    jobs = {
        "web_build": world.job(command=["make", "build", "TARGET=web"], submitted_by="alice"),
        "api_build": world.job(project="api", command=["make", "build", "TARGET=api"],
                               submitted_by="bob"),
        "release": world.job(command=["./release.sh", "--version", "4711"], submitted_by="alice"),
        "percent": world.job(command=["echo", "100%_done"], submitted_by="bob"),
        "deploy": world.job(command=["Deploy-Staging", "now"], submitted_by="alice"),
    }
    return {k: v["id"] for k, v in jobs.items()}


def ids(page):
    return [j["id"] for j in page["jobs"]]


def test_text_matches_the_command_as_one_text_case_insensitively_newest_first(conn, found):
    assert ids(reads.search_jobs(conn, q="make build")) == [found["api_build"], found["web_build"]]
    # words joined by one space, any case, inside a word
    assert ids(reads.search_jobs(conn, q="BUILD TARGET=w")) == [found["web_build"]]
    assert ids(reads.search_jobs(conn, q="staging")) == [found["deploy"]]
    assert ids(reads.search_jobs(conn, q="nothing like it")) == []
    page = reads.search_jobs(conn, q="  make  ")
    assert page["query"] == "make" and page["job_id"] is None and page["next"] is None
    assert {j["match"] for j in page["jobs"]} == {"command"}
    row = page["jobs"][0]
    assert row["project"] == "api" and row["command"] == ["make", "build", "TARGET=api"]
    assert row["submitted_by"] == "bob" and row["state"] == "queued"


def test_percent_underscore_and_backslash_are_taken_literally(conn, found):
    assert ids(reads.search_jobs(conn, q="100%_")) == [found["percent"]]
    assert ids(reads.search_jobs(conn, q="0%_d")) == [found["percent"]]
    # as a pattern, "%" and "_" would match every command
    assert ids(reads.search_jobs(conn, q="e%_")) == []
    assert ids(reads.search_jobs(conn, q="a\\_b")) == []


def test_filters_project_submitter_state(conn, world, found):
    assert ids(reads.search_jobs(conn, q="make", project="web")) == [found["web_build"]]
    assert ids(reads.search_jobs(conn, q="make", submitter="bob")) == [found["api_build"]]
    assert ids(reads.search_jobs(conn, q="make", submitter="carol")) == []
    assert ids(reads.search_jobs(conn, q="make", state="running")) == []
    runner = world.runner()
    assert world.claim(runner).job_id == found["web_build"]
    assert ids(reads.search_jobs(conn, q="make", state="running")) == [found["web_build"]]
    with pytest.raises(UnknownFilter, match="unknown project 'nope'"):
        reads.search_jobs(conn, q="make", project="nope")


def test_an_id_goes_straight_to_the_job(conn, found):
    page = reads.search_jobs(conn, q=f"#{found['release']}")
    assert ids(page) == [found["release"]] and page["jobs"][0]["match"] == "id"
    assert page["job_id"] == found["release"]
    # short digits: the id only; an unknown id: nothing
    assert ids(reads.search_jobs(conn, q=str(found["web_build"]))) == [found["web_build"]]
    assert ids(reads.search_jobs(conn, q="#999999999")) == []
    # an id's filters apply too
    assert ids(reads.search_jobs(conn, q=f"#{found['release']}", project="api")) == []


def test_digits_are_the_job_with_that_id_first_then_the_commands_containing_them(conn, world, found):
    page = reads.search_jobs(conn, q="4711")
    assert page["job_id"] == 4711 and ids(page) == [found["release"]]
    assert page["jobs"][0]["match"] == "command"
    # a job whose id is the digits and whose command holds them: listed once, as the id
    job = world.job(command=["echo", str(found["release"] + 1) * 3])
    digits = str(job["id"]) * 3
    if len(digits) <= 19:
        world.job(command=["echo", "again", digits])
    page = reads.search_jobs(conn, q=str(job["id"]))
    assert page["jobs"][0] == {**page["jobs"][0], "id": job["id"], "match": "id"}
    assert ids(page).count(job["id"]) == 1


def test_keyset_pages_newest_first_then_none(conn, world, found):
    more = [world.job(command=["make", "test", str(i)])["id"] for i in range(5)]
    every = ids(reads.search_jobs(conn, q="make", limit=500))
    assert every == sorted(more + [found["web_build"], found["api_build"]], reverse=True)
    first = reads.search_jobs(conn, q="make", limit=3)
    assert ids(first) == every[:3] and first["next"] == {"before_id": every[2]}
    second = reads.search_jobs(conn, q="make", limit=3, **first["next"])
    assert ids(second) == every[3:6]
    last = reads.search_jobs(conn, q="make", limit=3, **second["next"])
    assert ids(last) == every[6:] and last["next"] is None
    # the id match is on the first page only
    assert ids(reads.search_jobs(conn, q=str(every[0]), before_id=every[0])) == []


@pytest.mark.parametrize("q, message", [
    ("", "empty"), ("   ", "empty"), ("ab", "too short"), ("#a", "too short"),
    ("x" * 201, "longer than 200"), ("make\x00", "control"), ("a\nbc", "control"),
    ("#0", "job id must be between"), ("#" + "9" * 20, "job id must be between"),
    (17, "must be text"), (None, "must be text"), ("caf\udce9", "UTF-8"),
])
def test_refused_texts(conn, found, q, message):
    with pytest.raises(InvalidInput, match=message):
        reads.search_jobs(conn, q=q)


@pytest.mark.parametrize("kw, message", [
    ({"state": "done"}, "unknown state"), ({"limit": 0}, "limit"), ({"limit": 501}, "limit"),
    ({"before_id": -1}, "before_id"), ({"before_id": True}, "before_id"),
    ({"submitter": ""}, "submitter"), ({"submitter": "a\x00"}, "submitter"),
    ({"submitter": "x" * 201}, "submitter"), ({"submitter": "caf\udce9"}, "UTF-8"),
    ({"project": "caf\udce9"}, "project must be valid UTF-8"), ({"project": ""}, "project"),
])
def test_refused_filters(conn, found, kw, message):
    with pytest.raises(InvalidInput, match=message):
        reads.search_jobs(conn, q="make", **kw)


def test_a_rare_word_is_found_through_the_trigram_index(conn, world):
    """With the planner's view of many commands without the word, the search reads
    jobs_command_trgm_idx (a bitmap of the trigram entries), not every job."""
    world.setup()
    conn.execute("""INSERT INTO jobs (project_id, pool_id, state, command)
                    SELECT p.id, q.id, 'queued', ARRAY['make', 'step-' || g]
                      FROM projects p, pools q, generate_series(1, 5000) g
                     WHERE p.name = 'web' AND q.name = 'linux'""")
    needle = world.job(command=["run", "zqxjvw-once"])["id"]
    conn.execute("ANALYZE jobs")
    pattern = reads._contains("zqxjvw")
    conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute(
        "EXPLAIN SELECT id FROM jobs WHERE pgd_command_text(command) ILIKE %s "
        "ORDER BY id DESC LIMIT 50", (pattern,)))
    assert "jobs_command_trgm_idx" in plan, plan
    assert ids(reads.search_jobs(conn, q="zqxjvw")) == [needle]


@pytest.mark.parametrize("kw", [
    {"q": "make check 3"}, {"q": "make build TARGET=we"}, {"q": "Release.sh --version"},
    {"q": "make"}, {"q": "make", "project": "web"}, {"q": "make", "submitter": "alice"},
    {"q": "e%_"}, {"q": "4711"}, {"q": "make", "state": "queued", "limit": 2},
    {"q": "build", "before_id": 10**6},
])
def test_the_trigram_step_finds_what_the_probe_of_the_newest_jobs_finds(conn, world, found, monkeypatch, kw):
    """With a probe too small to hold a page, the second step (the trigram index, bitmap
    scans only) answers, the same as the probe alone; and it leaves the planner's settings
    of the caller's transaction as they were."""
    for i in range(6):
        world.job(command=["make", "check", str(i)], submitted_by="alice" if i % 2 else "bob")
    expected = reads.search_jobs(conn, **kw)
    monkeypatch.setattr(reads, "SEARCH_PROBE_ROWS", 2)
    assert reads.search_jobs(conn, **kw) == {**expected, "now": reads.search_jobs(conn, **kw)["now"]}
    settings = conn.execute("SELECT current_setting('enable_indexscan') AS i, "
                            "current_setting('enable_seqscan') AS s").fetchone()
    assert settings == {"i": "on", "s": "on"}


def test_a_found_job_is_the_row_list_jobs_gives_and_its_match(conn, world, found):
    """search_jobs and list_jobs (sql/jobs.sql) each spell out the job row, as aiosql has
    no shared fragments: the two must agree, column for column, for a finished job, a
    running one (its attempt and runner) and waiting ones."""
    runner = world.runner(name="runner-search")
    finished = world.claim(runner)
    world.complete(finished)
    running = world.claim(runner)
    assert running is not None and running.job_id != finished.job_id
    with conn.transaction():  # one now(): the ages agree too
        listed = {j["id"]: j for j in reads.list_jobs(conn, limit=100)["jobs"]}
        searched = [j for q in ("make build", str(finished.job_id), str(running.job_id))
                    for j in reads.search_jobs(conn, q=q)["jobs"]]
    assert {finished.job_id, running.job_id, found["web_build"]} <= {j["id"] for j in searched}
    for job in searched:
        row = dict(job)
        assert row.pop("match") in ("id", "command")
        assert row == listed[job["id"]]
    assert listed[finished.job_id]["duration_seconds"] is not None
    assert listed[running.job_id]["runner"] == "runner-search"


def test_the_index_is_asked_for_the_texts_rarest_word_among_the_newest_commands(conn, world):
    """A text whose first word most commands share ("feature" of "feature-1234"): the trigram
    step asks the index for the word the probe found in the fewest commands, and checks the
    whole text on what it finds; the answer is what the whole text gives."""
    world.setup()
    conn.execute("""INSERT INTO jobs (project_id, pool_id, state, command)
                    SELECT p.id, q.id, 'queued', ARRAY['make', '--branch=feature-' || (g % 300)]
                      FROM projects p, pools q, generate_series(1, 1200) g
                     WHERE p.name = 'web' AND q.name = 'linux'""")
    other = world.job(command=["echo", "1234", "feature"])["id"]   # both words, not the text
    needle = world.job(command=["make", "--branch=feature-1234"])["id"]
    conn.execute("ANALYZE jobs")
    words = reads._search_words("feature-1234")
    assert words == ["feature", "-1234"]
    probe = reads.Q.probe_recent_jobs(conn, pattern=reads._contains("feature-1234"), probe=1000,
                                      words=[f"%{w}%" for w in words], before_id=None, job_id=None,
                                      project_id=None, submitter=None, state=None)
    assert probe["examined"] == 1000 and probe["word_hits"][0] > probe["word_hits"][1]
    assert reads._narrow_pattern("%feature-1234%", words, probe["word_hits"]) == "%-1234%"
    assert ids(reads.search_jobs(conn, q="feature-1234")) == [needle]
    assert other not in ids(reads.search_jobs(conn, q="feature-1234"))
    expected = [r["id"] for r in conn.execute(
        "SELECT id FROM jobs WHERE pgd_command_text(command) ILIKE '%feature-12%' "
        "ORDER BY id DESC LIMIT 50")]
    assert ids(reads.search_jobs(conn, q="feature-12")) == expected


@pytest.mark.parametrize("words, hits, expected", [
    (["feature", "1234"], [1000, 3], "%1234%"),
    (["make", "build"], [40, 40], "%make build%"),     # no word rarer than another: the text
    (["zebra"], [0], "%make build%"),                 # one word: the text
    (["abc", "abcd"], [5, 5], "%make build%"),
    (["abc", "abcd", "xyz"], [5, 5, 9], "%abcd%"),      # a tie: the longer word
])
def test_narrow_pattern(words, hits, expected):
    assert reads._narrow_pattern("%make build%", words, hits) == expected


def insert_commands(conn, *blocks: tuple[int, str]) -> list[int]:
    """Jobs of acme/web in blocks, oldest first: (count, SQL of the command's second word
    from g, the row's number in its block, 1-based); their ids, oldest first."""
    out: list[int] = []
    for count, word in blocks:
        out += [r["id"] for r in conn.execute(f"""
            INSERT INTO jobs (project_id, pool_id, state, command)
            SELECT p.id, q.id, 'queued', ARRAY['make', {word}]
              FROM projects p, pools q, generate_series(1, {count}) g
             WHERE p.name = 'web' AND q.name = 'linux' ORDER BY g RETURNING jobs.id""")]
    return sorted(out)


def index_steps(monkeypatch) -> list[dict]:
    """The calls search_jobs makes of the trigram step (Q.search_jobs with a pattern), each
    with its floor_id and before_id; the real statement runs."""
    calls: list[dict] = []
    real = reads.Q.search_jobs

    def spy(conn, **kw):
        if kw["pattern"] is not None:
            calls.append({"floor_id": kw["floor_id"], "before_id": kw["before_id"],
                          "limit": kw["limit"]})
        return real(conn, **kw)
    monkeypatch.setattr(reads.Q, "search_jobs", spy)
    return calls


def newest_matching(conn, word: str, limit: int = 50) -> list[int]:
    return [r["id"] for r in conn.execute(
        "SELECT id FROM jobs WHERE pgd_command_text(command) ILIKE %s ORDER BY id DESC LIMIT %s",
        (f"%{word}%", limit))]


def test_sparse_matches_among_the_newest_widen_the_probe_before_the_index(conn, world, monkeypatch):
    """A word in one command of 40: the probe of the newest 1,000 holds 25, less than a page,
    so the search reads as many more of the newest as a page takes at that density, and a
    half (3,000; bounded by SEARCH_PROBE_ROWS_MAX), and answers from them, without the
    trigram step."""
    world.setup()
    insert_commands(conn, (4000, "CASE WHEN g % 40 = 0 THEN 'needle-' || g ELSE 'hay' END"))
    expected = newest_matching(conn, "needle")
    assert len(expected) == 50
    calls = index_steps(monkeypatch)
    assert ids(reads.search_jobs(conn, q="needle")) == expected
    assert calls == []
    monkeypatch.setattr(reads, "SEARCH_PROBE_ROWS_MAX", 2000)   # too sparse for that bound
    assert ids(reads.search_jobs(conn, q="needle")) == expected
    assert len(calls) == 1


def test_sparse_matches_among_the_newest_are_read_from_a_window_of_the_newest_ids(conn, world, monkeypatch):
    """A word in one command of 40, with a bound the widened probe would pass: the probe of
    the newest 1,000 holds 25, so the trigram step reads the ids from a floor that leaves
    SEARCH_WINDOW_PAGES pages of matches at that density (4,000 ids), one statement, and
    answers what SQL alone does."""
    world.setup()
    made = insert_commands(conn, (8000, "CASE WHEN g % 40 = 0 THEN 'needle-' || g ELSE 'hay' END"))
    monkeypatch.setattr(reads, "SEARCH_PROBE_ROWS_MAX", 2000)
    calls = index_steps(monkeypatch)
    expected = newest_matching(conn, "needle")
    assert len(expected) == 50
    assert ids(reads.search_jobs(conn, q="needle")) == expected
    window = 1000 * 50 * reads.SEARCH_WINDOW_PAGES // 25
    assert calls == [{"floor_id": made[-1] - window + 1, "before_id": None, "limit": 50}]


def test_a_window_short_of_a_page_is_followed_by_the_rest_below_it(conn, world, monkeypatch):
    """The newest 1,000 hold 25 matches, the 3,000 before them none, and older ones many
    (and a bound the widened probe would pass): the window (4,000 ids) holds the 25, so a second statement reads the other 25 below its
    floor; the page is what SQL alone gives, and the next page follows on from it."""
    world.setup()
    made = insert_commands(conn, (2000, "'needle-' || g"), (3000, "'hay'"),
                           (1000, "CASE WHEN g % 40 = 0 THEN 'needle-' || g ELSE 'hay' END"))
    monkeypatch.setattr(reads, "SEARCH_PROBE_ROWS_MAX", 2000)
    calls = index_steps(monkeypatch)
    expected = newest_matching(conn, "needle", 100)
    page = reads.search_jobs(conn, q="needle")
    assert ids(page) == expected[:50]
    floor_id = made[-1] - 1000 * 50 * reads.SEARCH_WINDOW_PAGES // 25 + 1
    assert calls == [{"floor_id": floor_id, "before_id": None, "limit": 50},
                     {"floor_id": None, "before_id": floor_id, "limit": 25}]
    assert ids(reads.search_jobs(conn, q="needle", **page["next"])) == expected[50:]


def test_no_match_among_the_newest_reads_a_window_as_if_one_were_there(conn, world, monkeypatch):
    """None of the newest 1,000 matches: the window is the one a single match would give
    (100,000 ids), and the rare word is found below the probe."""
    world.setup()
    made = insert_commands(conn, (3, "'zqxjvw-' || g"), (1500, "'hay'"))
    calls = index_steps(monkeypatch)
    assert ids(reads.search_jobs(conn, q="zqxjvw")) == made[2::-1]
    floor_id = made[-1] - 1000 * 50 * reads.SEARCH_WINDOW_PAGES + 1
    # below the window only when there are ids below it (the shared database's ids grow)
    assert calls == [{"floor_id": floor_id, "before_id": None, "limit": 50}] + (
        [{"floor_id": None, "before_id": floor_id, "limit": 47}] if floor_id > 1 else [])


def test_the_floor_keeps_older_matches_out(conn, world):
    """search_jobs (sql/jobs.sql) with :floor_id answers only ids from the floor up."""
    world.setup()
    made = insert_commands(conn, (10, "'needle-' || g"))
    rows = reads.Q.search_jobs(conn, pattern="%needle%", narrow="%needle%", ids=None,
                               floor_id=made[6], limit=50, job_id=None, project_id=None,
                               submitter=None, state=None, before_id=None)
    assert [r["id"] for r in rows] == made[:5:-1]
