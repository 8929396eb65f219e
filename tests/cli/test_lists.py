"""Looking from the CLI: `jobs list` (header, age, filters, keyset), `jobs show`/`explain`
human by default, and list/show for projects, pools, targets, runners and the audit log —
a table by default, JSON with --json, one line on stderr and exit 2 for an unknown filter."""

from __future__ import annotations

import json

from pgdispatch.sql import transitions

from . import test_cli

pgd = test_cli.pgd  # the fixture: the config applied, the CLI run against this test's database


def test_jobs_list_filters_holders_and_reasons(pgd, world):
    runner = world.runner(pools=("linux",), slots=2, name="r-cli")
    running = world.job(command=["make", "build"])
    assert world.claim(runner).job_id == running["id"]
    gated = world.job(pool="deploy", target="production", requires_approval=True)
    queued = world.job()
    out = pgd("jobs", "list", "--state", "running", "--organization", "acme").stdout.splitlines()
    assert out[0].split()[:6] == ["ID", "STATE", "PROJECT", "POOL", "TARGET", "RUNNER"]
    assert len(out) == 2 and out[1].split()[:6] == [str(running["id"]), "running", "acme/web",
                                                    "linux", "-", "r-cli"]
    held = json.loads(pgd("jobs", "list", "--runner", str(runner), "--state", "running", "--json").stdout)["jobs"]
    assert [(j["id"], j["runner"]) for j in held] == [(running["id"], "r-cli")]
    assert held[0]["running_seconds"] >= 0 and held[0]["age_seconds"] >= 0
    why = pgd("jobs", "list", "--reason", "approval_required").stdout.splitlines()
    assert why[0].split()[-1] == "WHY" and why[1].split()[0] == str(gated["id"])
    assert "approval_required" in why[1]
    newer = json.loads(pgd("jobs", "list", "--after", str(running["id"]), "--json").stdout)["jobs"]
    assert [j["id"] for j in newer] == [gated["id"], queued["id"]]
    none = pgd("jobs", "list", "--project", "web", "--older-than", "86400")
    assert none.stdout == "no jobs match\n"
    for args, message in ((("--organization", "nope"), "error: unknown organization 'nope'"),
                          (("--reason", "busy"), "error: unknown reason 'busy'"),
                          (("--runner", "424242"), "error: unknown runner 424242"),
                          (("--older-than", "nan"), "is not a finite number")):
        bad = pgd("jobs", "list", *args, check=False)
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert message in bad.stderr and bad.stdout == ""


def test_show_and_explain_read_as_text_and_as_json(pgd, world):
    job = world.job(pool="deploy", target="production", requires_approval=True,
                    command=["deploy.sh", "production"])
    shown = pgd("jobs", "show", str(job["id"])).stdout
    assert f"job:          {job['id']}" in shown and "state:        blocked" in shown
    assert "command:      deploy.sh production" in shown
    explained = pgd("jobs", "explain", str(job["id"])).stdout.splitlines()
    assert explained[0] == f"job {job['id']} (blocked) waits for {len(explained) - 1} reasons:"
    assert explained[1].startswith("  approval_required (primary): ")
    assert json.loads(pgd("jobs", "explain", str(job["id"]), "--json").stdout)["reason"] == "approval_required"


def test_projects_pools_targets_runners_and_audit(pgd, world, conn):
    runner = world.runner(pools=("linux",), slots=3, name="r-look")
    running = world.job()
    world.claim(runner)
    transitions.pause_project(conn, project="web", reason="release freeze", actor="alice")
    projects = pgd("projects", "list").stdout.splitlines()
    assert projects[0].split()[:3] == ["PROJECT", "ORGANIZATION", "RUNNING"]
    assert projects[1].split()[:4] == ["web", "acme", "1", "of"] and "release freeze" in projects[1]
    web = pgd("projects", "show", "web").stdout
    assert "paused:" in web and "by alice: release freeze" in web and "pause_project" in web
    assert f"\n{running['id']} " in web  # the holder, in the running jobs
    assert json.loads(pgd("projects", "show", "web", "--json").stdout)["running_jobs"][0]["id"] == running["id"]
    pools = pgd("pools", "list").stdout
    assert "1 of 8 held" in pools and "1 of 3 busy" in pools and "no live runner" in pools
    linux = json.loads(pgd("pools", "show", "linux", "--json").stdout)
    assert (linux["slots"], linux["running"], linux["runner_slots"], linux["free_runner_slots"]) == (8, 1, 3, 2)
    assert [r["name"] for r in linux["runners"]] == ["r-look"]
    targets = pgd("targets", "list").stdout.splitlines()
    assert targets[1].split()[:2] == ["production", "free"]
    assert json.loads(pgd("targets", "show", "production", "--json").stdout)["state"] == "free"
    listed = pgd("runners", "list").stdout
    assert "r-look" in listed and "1 of 3 busy" in listed and "live" in listed
    shown = pgd("runners", "show", str(runner)).stdout
    assert "runner slots:  1 of 3 busy" in shown and f"\n{running['id']} " in shown
    events = pgd("audit", "list", "--actor", "alice").stdout.splitlines()
    assert events[0].split() == ["ID", "AT", "ACTOR", "ACTION", "SUBJECT", "WHY"]
    assert "pause_project" in events[1] and "project:web" in events[1]
    page = pgd("audit", "list", "--limit", "1", "--json")
    assert len(json.loads(page.stdout)["events"]) == 1 and page.stderr.startswith("more: --before ")
    for args, code, message in ((("projects", "show", "nope"), 3, "unknown project 'nope'"),
                                (("pools", "show", "nope"), 3, "unknown pool 'nope'"),
                                (("targets", "show", "nope"), 3, "unknown target 'nope'"),
                                (("runners", "show", "424242"), 3, "unknown runner 424242")):
        bad = pgd(*args, check=False)
        assert (bad.returncode, len(bad.stderr.splitlines())) == (code, 1) and message in bad.stderr
