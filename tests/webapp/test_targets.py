"""Resolving an uncertain target through the console's HTTP endpoint."""

from __future__ import annotations

import threading

from .support import count, make_uncertain_target


def _target(conn, name="production"):
    return conn.execute("SELECT * FROM targets WHERE name = %s", (name,)).fetchone()


def test_uncertain_target_shows_its_evidence_and_the_form(operator, world):
    made = make_uncertain_target(world)
    page = operator.get("/targets/").get_data(as_text=True)
    assert "target-uncertain" in page
    assert "runner-lost" in page  # the runner that held it
    assert "Last heartbeat" in page and "Output tail" in page
    assert 'name="note"' in page and 'value="retry"' in page
    assert f'/jobs/{made["job"]["id"]}' in page
    overview = operator.get("/").get_data(as_text=True)
    assert "Uncertain targets" in overview and "production" in overview


def test_operator_resolves_through_the_form(operator, world):
    made = make_uncertain_target(world)
    response = operator.post("/targets/production/resolve", data={
        "outcome": "succeeded", "note": "checked the dashboard", "csrf_token": operator.csrf})
    assert response.status_code == 303 and response.headers["Location"] == "/targets/"
    target = _target(world.conn)
    assert target["state"] == "free" and target["holder_job_id"] is None
    job = world.row("jobs", made["job"]["id"])
    assert job["state"] == "succeeded"
    event = world.conn.execute("SELECT * FROM audit_events WHERE action = 'resolve_target'").fetchone()
    assert event["actor"] == "alice" and event["subject"] == "target:production"
    assert event["reason"] == "checked the dashboard"
    assert event["details"]["outcome"] == "succeeded"
    assert "target production resolved as succeeded" in operator.get("/targets/").get_data(as_text=True)


def test_resolve_refuses_bad_input_and_changes_nothing(operator, viewer, world):
    make_uncertain_target(world)
    no_note = operator.post("/targets/production/resolve", data={
        "outcome": "failed", "note": "", "csrf_token": operator.csrf})
    assert no_note.status_code == 422 and b"note is required" in no_note.data
    bad_outcome = operator.post("/targets/production/resolve", data={
        "outcome": "maybe", "note": "hmm", "csrf_token": operator.csrf})
    assert bad_outcome.status_code == 422
    unknown = operator.post("/targets/nowhere/resolve", data={
        "outcome": "failed", "note": "x", "csrf_token": operator.csrf})
    assert unknown.status_code == 404
    as_viewer = viewer.post("/targets/production/resolve", data={
        "outcome": "failed", "note": "x", "csrf_token": viewer.csrf})
    assert as_viewer.status_code == 403
    assert "Resolve production" not in viewer.get("/targets/").get_data(as_text=True)
    assert _target(world.conn)["state"] == "uncertain"
    assert count(world.conn, "audit_events", "action = 'resolve_target'") == 0


def test_two_operators_resolve_at_once_one_wins_one_hears_who(signed_in, world):
    make_uncertain_target(world)
    clients = {"alice": signed_in("alice"), "bob": signed_in("bob")}
    barrier = threading.Barrier(2)
    results: dict[str, tuple[int, str]] = {}

    def resolve(name: str, outcome: str) -> None:
        client = clients[name]
        barrier.wait()
        response = client.post("/targets/production/resolve",
                               data={"outcome": outcome, "note": f"{name} checked",
                                     "csrf_token": client.csrf},
                               headers={"HX-Request": "true"})
        results[name] = (response.status_code, response.get_data(as_text=True))

    threads = [threading.Thread(target=resolve, args=("alice", "succeeded")),
               threading.Thread(target=resolve, args=("bob", "retry"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(status for status, _ in results.values()) == [200, 409]
    (winner,) = [n for n, (status, _) in results.items() if status == 200]
    (loser,) = [n for n, (status, _) in results.items() if status == 409]
    loser_body = results[loser][1]
    assert f"already resolved by {winner} at" in loser_body
    assert 'hx-swap-oob="true"' in loser_body and "target-free" in loser_body
    events = world.conn.execute("SELECT actor FROM audit_events WHERE action = 'resolve_target'").fetchall()
    assert [e["actor"] for e in events] == [winner]
    assert _target(world.conn)["state"] == "free"
    # asked again later, the loser is told exactly who it was
    client = clients[loser]
    again = client.post("/targets/production/resolve", data={
        "outcome": "failed", "note": "late", "csrf_token": client.csrf})
    assert again.status_code == 409
    assert f"already resolved by {winner} at".encode() in again.data


def _superseding_target(world) -> dict:
    """staging supersedes and deploys newest ready first; two superseded, two waiting."""
    world.setup(targets=())
    world.apply({"targets": [{"name": "staging", "supersede": True, "deploy_order": "newest_ready_first"}]})
    jobs = [world.job(target="staging", command=("deploy",)) for _ in range(3)]
    world.apply({"targets": [{"name": "staging", "supersede": False, "deploy_order": "newest_ready_first"}]})
    jobs.append(world.job(target="staging", command=("deploy",)))
    world.runner()  # a live runner: the reasons are the target's, not "no runner"
    return {"jobs": [j["id"] for j in jobs]}


def test_the_target_page_shows_its_order_what_runs_next_and_what_was_superseded(viewer, world):
    a, b, c, d = _superseding_target(world)["jobs"]
    response = viewer.get("/targets/staging")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert "Deploys <strong>newest ready first</strong>" in page
    # what runs next, in order: the newest ready first, the other with its reason
    assert page.index(f'id="next-{d}"') < page.index(f'id="next-{c}"')
    assert f"target staging deploys newest ready first: job {d} is next" in page
    assert "reason-target_order" in page and 'class="is-head"' in page
    # superseded: how many and by what, with links
    assert "2 deployments superseded (2 in the last hour)" in page
    assert f'id="superseded-{b}"' in page and f'id="superseded-{a}"' in page
    assert f'href="/jobs/{c}">job {c}</a>' in page and f'href="/jobs/{b}">job {b}</a>' in page
    # the list links each target's page, and says its order
    listed = viewer.get("/targets/").get_data(as_text=True)
    assert 'href="/targets/staging"' in listed and "deploys newest ready first" in listed


def test_the_target_page_polls_its_fragment_and_refuses_an_unknown_target(viewer, world):
    _superseding_target(world)
    fragment = viewer.get("/targets/staging", headers={"HX-Request": "true"})
    body = fragment.get_data(as_text=True)
    assert "<html" not in body
    assert 'id="target-page-' in body and 'hx-trigger="every 2s"' in body
    assert "HX-Request" in fragment.headers["Vary"]
    assert viewer.get("/targets/nowhere").status_code == 404
