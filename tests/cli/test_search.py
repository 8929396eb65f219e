"""`pgdispatch jobs search`: by command text, project, submitter, state and id — a table by
default, the API's page with --json, the next page on stderr, and one line on stderr with
exit 2 for a text trigrams cannot serve or an unknown filter."""

from __future__ import annotations

import json

from . import test_cli

pgd = test_cli.pgd  # the fixture: the config applied, the CLI run against this test's database


def test_jobs_search_table_json_filters_and_pages(pgd, world):
    build = world.job(command=["make", "build", "--sha=c0ffee42"], submitted_by="alice")
    deploy = world.job(pool="deploy", target="production", command=["./deploy.sh", "c0ffee42"],
                       submitted_by="bob")
    world.job(command=["make", "lint"], submitted_by="alice")
    out = pgd("jobs", "search", "C0FFEE").stdout.splitlines()
    assert out[0].split()[:2] == ["ID", "STATE"] and out[0].split()[-2:] == ["SUBMITTED", "BY"]
    assert [line.split()[0] for line in out[1:]] == [str(deploy["id"]), str(build["id"])]
    assert "bob" in out[1] and "./deploy.sh c0ffee42" in out[1]
    page = json.loads(pgd("jobs", "search", "c0ffee", "--submitter", "alice", "--json").stdout)
    assert set(page) == {"query", "job_id", "jobs", "order", "next"}
    assert [j["id"] for j in page["jobs"]] == [build["id"]] and page["next"] is None
    assert page["jobs"][0]["match"] == "command" and page["jobs"][0]["command"][0] == "make"
    assert [j["id"] for j in json.loads(pgd("jobs", "search", "c0ffee", "--project", "web",
                                            "--state", "queued", "--json").stdout)["jobs"]] == [deploy["id"], build["id"]]
    assert json.loads(pgd("jobs", "search", "c0ffee", "--state", "running", "--json").stdout)["jobs"] == []
    first = pgd("jobs", "search", "make", "--limit", "1")
    assert first.stderr == f"more: --before {build['id'] + 2}\n"
    second = pgd("jobs", "search", "make", "--limit", "1", "--before", str(build["id"] + 2))
    assert second.stdout.splitlines()[1].split()[0] == str(build["id"])
    by_id = json.loads(pgd("jobs", "search", f"#{deploy['id']}", "--json").stdout)
    assert [(j["id"], j["match"]) for j in by_id["jobs"]] == [(deploy["id"], "id")]
    assert pgd("jobs", "search", "nothing-like-it").stdout == "no job matches 'nothing-like-it'\n"


def test_jobs_search_refuses_in_one_line(pgd, world):
    world.job(command=["make"])
    for args, message in ((("ab",), "error: search text 'ab' is too short"),
                          (("   ",), "error: search text is empty"),
                          (("x" * 201,), "longer than 200 characters"),
                          (("make", "--project", "nope"), "error: unknown project 'nope'"),
                          (("make", "--state", "done"), "Invalid value for '--state'"),
                          (("make", "--limit", "0"), "Invalid value for '--limit'")):
        bad = pgd("jobs", "search", *args, check=False)
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert message in bad.stderr and bad.stdout == "", bad.stderr
