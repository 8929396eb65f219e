"""Factories: build the small tables and jobs through the real transitions."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from typing import Any

from pgdispatch.sql import config, db, transitions
from pgdispatch.sql.queries import Q

_seq = itertools.count(1)


@contextlib.contextmanager
def snapshot_holder(url: str, *, application_name: str, marker: str) -> Iterator[Any]:
    """A session of the database at ``url`` idle in a repeatable-read transaction that holds
    a snapshot (the xmin horizon), its last statement carrying ``marker`` (its query text,
    which no reader of the database's health may see); the connection, with its server
    ``pid``. Rolled back at the end."""
    with db.connect(url, application_name=application_name) as c:
        c.pid = c.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        c.execute(f"SELECT '{marker}' AS marker")
        yield c
        c.execute("ROLLBACK")


class World:
    """Builds test fixtures on one connection; every name is unique per call."""

    def __init__(self, conn):
        self.conn = conn

    def apply(self, doc: dict[str, Any], env: dict[str, str] | None = None) -> None:
        """Apply a config given as a dict shaped like the TOML file."""
        lines = []
        for section, entries in doc.items():
            for entry in entries:
                lines.append(f"[[{section}]]")
                for k, v in entry.items():
                    lines.append(f"{k} = {json.dumps(v)}")
        config.apply_config(self.conn, "\n".join(lines), actor="test", env=env or {})

    def setup(self, *, org_limit: int = 100, pool_slots: int = 100, project_limit: int | None = None,
              weight: int = 1, pools: tuple[str, ...] = ("linux",), targets: tuple[str, ...] = (),
              org: str = "acme", project: str = "web") -> dict[str, Any]:
        """One organization, its pools, one project granted them, and targets."""
        proj: dict[str, Any] = {"name": project, "organization": org, "pools": list(pools), "weight": weight}
        if project_limit is not None:
            proj["max_running"] = project_limit
        self.apply({
            "organizations": [{"name": org, "max_running": org_limit}],
            "pools": [{"name": p, "slots": pool_slots} for p in pools],
            "projects": [proj],
            "targets": [{"name": t} for t in targets],
        })
        return {"org": org, "project": project, "pools": pools}

    def project(self, name: str, *, org: str, pools: tuple[str, ...], weight: int = 1,
                max_running: int | None = None) -> None:
        proj: dict[str, Any] = {"name": name, "organization": org, "pools": list(pools), "weight": weight}
        if max_running is not None:
            proj["max_running"] = max_running
        self.apply({"projects": [proj]})

    def runner(self, pools: tuple[str, ...] = ("linux",), slots: int = 4, name: str | None = None) -> int:
        return transitions.register_runner(self.conn, name=name or f"runner-{next(_seq)}",
                                           pools=list(pools), slots=slots, hostname="test")

    def pool_ids(self, names: tuple[str, ...]) -> list[int]:
        return [r["id"] for r in Q.list_pools(self.conn) if r["name"] in names]

    def job(self, project: str = "web", pool: str = "linux", command=("true",), **kw) -> dict[str, Any]:
        return transitions.submit(self.conn, project=project, pool=pool, command=list(command), **kw)

    def claim(self, runner_id: int, pools: tuple[str, ...] = ("linux",), lease_seconds: float = 30.0,
              conn=None):
        return transitions.claim(conn or self.conn, runner_id=runner_id, pools=self.pool_ids(pools),
                                 claim_token=transitions.new_claim_token(), lease_seconds=lease_seconds)

    def complete(self, c, outcome: str = "succeeded", conn=None, **kw):
        return transitions.complete(conn or self.conn, attempt_id=c.attempt_id, generation=c.generation,
                                    outcome=outcome, receipt_key=kw.pop("receipt_key", c.receipt_key),
                                    **kw)

    def row(self, table: str, id_: int) -> dict[str, Any]:
        assert table in {"jobs", "targets", "attempts", "projects", "organizations", "pools", "runners"}
        return self.conn.execute(f"SELECT * FROM {table} WHERE id = %s", (id_,)).fetchone()

    def counters(self) -> dict[str, int]:
        """Running jobs summed over organizations and pools (their held slots) and projects
        (their running jobs), and the running attempts that back them."""
        c = self.conn
        return {
            "org": c.execute("SELECT coalesce(sum(pgd_organization_running(id)),0) AS n "
                             "FROM organizations").fetchone()["n"],
            "project": c.execute("SELECT coalesce(sum(pgd_project_running(id)),0) AS n "
                                 "FROM projects").fetchone()["n"],
            "pool": c.execute("SELECT coalesce(sum(pgd_pool_running(id)),0) AS n FROM pools").fetchone()["n"],
            "attempts": c.execute("SELECT count(*) AS n FROM attempts WHERE state='running'").fetchone()["n"],
        }

    def expire_now(self, attempt_id: int) -> None:
        """Make a lease lapse now (test-only: moves the lease into the past)."""
        self.conn.execute("UPDATE attempts SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
                          (attempt_id,))
