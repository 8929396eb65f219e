"""Looking from the CLI: `jobs list` (header, age, filters, keyset), `jobs show`/`explain`
human by default, and list/show for projects, pools, targets, runners and the audit log —
a table by default, JSON with --json, one line on stderr and exit 2 for an unknown filter."""

from __future__ import annotations

import json
import re

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
    assert "1 of 8 taken" in pools and "1 of 3 busy" in pools and "no live runner" in pools
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


def test_a_resolved_deployment_its_trail_and_the_overview(pgd, world):
    """jobs show says how a lost deployment was resolved (not "last error: -") and lists the
    job's own audit trail; audit list --job gives the trail; overview says how long the
    oldest job waited; runners list says lost vs stopped; the --json of a list is the API's
    object."""
    runner = world.runner(pools=("deploy",), name="r-lost")
    job = world.job(pool="deploy", target="production", command=["deploy.sh"])
    claim = world.claim(runner, pools=("deploy",))
    world.expire_now(claim.attempt_id)
    transitions.expire_leases(world.conn)
    transitions.resolve_target(world.conn, target="production", outcome="failed",
                               note="checked: not deployed", actor="alice")
    world.conn.execute("UPDATE runners SET stopped_at = now(), stop_reason = 'lost' WHERE id = %s",
                       (runner,))  # test-only: as the cleanup duty marks a silent runner
    transitions.stop_runner(world.conn, runner_id=world.runner(name="r-done"))
    gated = world.job(requires_approval=True)
    transitions.summarize_queue(world.conn)

    shown = pgd("jobs", "show", str(job["id"])).stdout
    assert "resolved:     failed by alice at " in shown and ": checked: not deployed" in shown
    assert "last error" not in shown
    trail = shown.split("audit trail (oldest first):\n", 1)[1].splitlines()
    assert trail[0].split() == ["ID", "AT", "ACTOR", "ACTION", "SUBJECT", "WHY"]
    assert "submit_job" in trail[1] and "resolve_target" in trail[-1]
    as_json = json.loads(pgd("jobs", "show", str(job["id"]), "--json").stdout)
    assert as_json["resolution"]["note"] == "checked: not deployed"
    assert [e["action"] for e in as_json["audit"]][-1] == "resolve_target"
    events = json.loads(pgd("audit", "list", "--job", str(job["id"]), "--json").stdout)
    assert set(events) == {"events", "next"} and events["events"][0]["action"] == "resolve_target"
    assert {e["id"] for e in events["events"]} == {e["id"] for e in as_json["audit"]}

    runners = pgd("runners", "list").stdout.splitlines()
    assert "lost" in next(line for line in runners if "r-lost" in line)
    assert "stopped" in next(line for line in runners if "r-done" in line)
    listed = json.loads(pgd("runners", "list", "--json").stdout)["runners"]
    assert {r["name"]: r["stop_reason"] for r in listed} == {"r-lost": "lost", "r-done": "stopped"}
    for command, key in (("projects", "projects"), ("pools", "pools"), ("targets", "targets")):
        assert list(json.loads(pgd(command, "list", "--json").stdout)) == [key]

    overview = pgd("overview").stdout
    assert overview.startswith("waiting: 1 job(s)") and "approval_required" in overview
    oldest = overview.split("oldest waiting (per pool and primary reason):\n", 1)[1].splitlines()
    assert oldest[0].split() == ["POOL", "REASON", "WAITING", "SINCE"]
    assert oldest[1].split()[:2] == ["linux", "approval_required"]
    assert "uncertain targets: none" in overview and "paused projects: none" in overview
    o = json.loads(pgd("overview", "--json").stdout)
    assert o["waiting"] == 1 and o["primary_counts"]["approval_required"] == 1
    assert o["oldest_waiting"][0]["reason"] == "approval_required" and o["oldest_waiting"][0]["seconds"] >= 0
    why = pgd("jobs", "list", "--reason", "approval_required").stdout.splitlines()
    assert why[0].split()[-3:] == ["WAITING", "SINCE", "WHY"] and why[1].split()[0] == str(gated["id"])
    # how long it has waited, and since when
    assert re.search(r" \d+ s +\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ +approval_required", why[1]), why[1]

def test_the_next_page_line_keeps_the_filters_in_creation_order(pgd, world):
    """`more:` says the whole next page: run as it stands, an age-filtered list goes on in
    creation order, not from the newest job by id."""
    ids = [world.job()["id"] for _ in range(5)]
    # created in the reverse of id order: ids[0] an hour ago, ids[4] five hours ago
    for hours, job_id in enumerate(ids, 1):
        world.conn.execute("UPDATE jobs SET created_at = now() - make_interval(hours => %s) "
                           "WHERE id = %s", (hours, job_id))
    first = pgd("jobs", "list", "--older-than", "60", "--limit", "2", "--json")
    order = [j["id"] for j in json.loads(first.stdout)["jobs"]]
    assert order == [ids[0], ids[1]]
    assert first.stderr == f"more: --older-than 60 --limit 2 --before {ids[1]}\n"
    following = pgd("jobs", "list", *first.stderr.split()[1:], "--json")
    assert [j["id"] for j in json.loads(following.stdout)["jobs"]] == [ids[2], ids[3]]


def test_a_window_keeps_its_upper_bound_and_bad_numbers_exit_2(pgd, world):
    ids = [world.job()["id"] for _ in range(6)]
    page = pgd("jobs", "list", "--after", str(ids[0]), "--before", str(ids[5]), "--limit", "2", "--json")
    assert [j["id"] for j in json.loads(page.stdout)["jobs"]] == ids[1:3]
    assert page.stderr == f"more: --limit 2 --after {ids[2]} --before {ids[5]}\n"
    for args in (("jobs", "list", "--limit", "1_0"), ("jobs", "list", "--limit", "١٠"),
                 ("jobs", "list", "--older-than", "1_000"), ("jobs", "show", "١"),
                 ("audit", "list", "--job", "424242"), ("jobs", "list", "--organization", "x" * 5000)):
        bad = pgd(*args, check=False)
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, (args, bad.stderr)
        assert len(bad.stderr) < 200 and bad.stdout == "", (args, bad.stderr)


def test_targets_show_lists_what_runs_next_in_order_and_what_was_superseded(pgd, world):
    world.apply({"targets": [{"name": "production", "supersede": True}]})
    old = world.job(pool="deploy", target="production", command=["deploy"])["id"]
    world.apply({"targets": [{"name": "production", "deploy_order": "newest_ready_first", "supersede": True}]})
    mid = world.job(pool="deploy", target="production", command=["deploy"])["id"]
    world.apply({"targets": [{"name": "production", "deploy_order": "newest_ready_first"}]})
    new = world.job(pool="deploy", target="production", command=["deploy"])["id"]
    world.runner(pools=("deploy",), name="r-deploy")
    out = pgd("targets", "show", "production").stdout
    assert "deploy order:   newest ready first" in out
    assert "superseded:     1 (1 in the last hour)" in out
    lines = out.splitlines()
    at = lines.index("next, newest ready first (2 waiting):")
    assert lines[at + 1].split()[:3] == ["#", "JOB", "PROJECT"]
    assert lines[at + 2].split()[:4] == ["1", str(new), "(next)", "web"] and "ready" in lines[at + 2]
    assert lines[at + 3].split()[:2] == ["2", str(mid)]
    assert f"target production deploys newest ready first: job {new} is next" in lines[at + 3]
    sup = lines.index("superseded (latest):")
    assert lines[sup + 2].split()[:3] == [str(old), "web", str(mid)]
    shown = json.loads(pgd("targets", "show", "production", "--json").stdout)
    assert [j["job_id"] for j in shown["next"]["jobs"]] == [new, mid]
    assert shown["superseded"]["latest"][0]["superseded_by"] == mid
