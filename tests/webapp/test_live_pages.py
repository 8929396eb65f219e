"""Runners, projects and audit refresh like the overview: the fragment root polls itself,
with the page's filters; history pages do not poll; a pause reason being typed has a stable
id and hx-preserve, so a refresh keeps it (the browser proves it: tests/browser/test_records.py)."""

from __future__ import annotations

import re

from pgdispatch.sql import transitions


def _root(html: str, root_id: str) -> str:
    match = re.search(rf'<section id="{root_id}"[^>]*>', html)
    assert match, root_id
    return match.group(0)


def test_projects_and_audit_poll_their_fragment(operator, world):
    world.setup()
    transitions.pause_project(world.conn, project="web", reason="freeze", actor="alice")
    world.project("api", org="acme", pools=("linux",))
    projects = operator.get("/projects/").get_data(as_text=True)
    root = _root(projects, "projects-table")
    assert 'hx-get="/projects/"' in root and re.search(r'hx-trigger="every \d+s"', root)
    fragment = operator.get("/projects/", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert fragment.lstrip().startswith('<section id="projects-table"')  # the polled root
    api_id = world.conn.execute("SELECT id FROM projects WHERE name = 'api'").fetchone()["id"]
    assert re.search(rf'id="project-{api_id}-pause-reason" hx-preserve="true"', fragment)

    audit = operator.get("/audit/?actor=alice").get_data(as_text=True)
    root = _root(audit, "audit-table")
    assert 'hx-get="/audit/?actor=alice"' in root and re.search(r'hx-trigger="every \d+s"', root)
    events = world.conn.execute("SELECT max(id) AS id FROM audit_events").fetchone()["id"]
    older = operator.get(f"/audit/?before_id={events}").get_data(as_text=True)
    assert "hx-trigger" not in _root(older, "audit-table")
