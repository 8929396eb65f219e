"""The invariant checker: what must hold over the whole database and its attempt history,
whatever faults came before (issue 3).

``check_invariants(conn)`` reads everything in one REPEATABLE READ, READ ONLY snapshot, so it
may run while schedulers and operators are busy: every transition commits its whole change at
once, so every committed snapshot must satisfy all of these. It returns one line per
violation, each starting with the name of the check that found it (``CHECKS``); an empty list
means the database is consistent.

The interval checks use ``attempts.[claimed_at, finished_at)``, stamped with
``clock_timestamp()`` while the job holds its project count (under the project row lock) and
its organization and pool slots (their stripes row-locked from the slot's taking or release to
the commit) by pgd_claim, pgd_complete and pgd_expire_one (see tests/concurrency/harness.py,
``max_overlaps``), so a sweep over them shows how many attempts really held a slot at once.
The limits are the ones configured *now*: an operator who lowers a limit below what once ran
would make the sweep report the past as a violation; the fault tests never lower a limit.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .consistency import steering_violations

JOB_STATES = ("blocked", "queued", "running", "succeeded", "failed", "cancelled", "uncertain",
              "superseded")
TERMINAL = ("succeeded", "failed", "cancelled", "superseded")
ATTEMPT_STATES = ("running", "succeeded", "failed", "expired", "cancelled", "lost")

CHECKS = (
    "job_state",          # every job in one of the valid states
    "job_columns",        # the job's columns agree with its state and its attempts
    "finished_at",        # every terminal job has finished_at (and no other job has one)
    "running_attempt",    # running job <=> exactly one running attempt, at the job's generation
    "attempt_numbering",  # a job's attempts have distinct generations and attempt numbers
    "attempt_overlap",    # a job's attempts never overlap in time
    "succeeded_once",     # at most one succeeded attempt per job, and only for a succeeded job
    "counters",           # project counters and held org/pool slots equal the running
                          # attempts behind them, stripe by stripe; one slot per running job
    "stripes",            # every owner's 8 stripes: 0 <= held <= cap, caps - owed = limit,
                          # all full while anything is owed
    "capacity_overlap",   # the sweep of attempt intervals never exceeds a configured limit
    "target_holder",      # held/uncertain target <=> exactly one running/uncertain holder job
    "target_overlap",     # no two deployment attempts to one target overlapped in time
    "receipts",           # each delivery receipt belongs to a finished attempt
    "dependencies",       # nothing ran before its dependencies succeeded; blocked counts agree
    "steering",           # nothing claimed in a pool while it was paused, nor by a runner
                          # after an operator's drain of it (by the audit log's times)
    "supersede",          # a superseded job: by a newer deployment to its target, audited, never
                          # claimed after; never two survivors on a superseding target
)


def check_invariants(conn) -> list[str]:
    """Every invariant violation in the database ``conn`` points at, as ``"check: detail"``
    lines (check names in ``CHECKS``); empty when all hold.

    ``conn`` is an idle autocommit connection (dict rows, as from ``pgdispatch.sql.db.connect``); the
    checks run in one read-only repeatable-read transaction on it and change nothing.
    """
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        snap = _Snapshot(conn)
        out: list[str] = []
        for check in (_job_state, _job_columns, _finished_at, _running_attempt,
                      _attempt_numbering, _attempt_overlap, _succeeded_once, _counters,
                      _stripes, _capacity_overlap, _target_holder, _target_overlap, _receipts,
                      _dependencies, _steering, _supersede):
            out += check(conn, snap)
    return out


class _Snapshot:
    """The rows every check needs, read once inside the snapshot."""

    def __init__(self, conn):
        self.jobs = {r["id"]: r for r in conn.execute("""
            SELECT j.id, j.state, j.project_id, j.pool_id, j.target_id, j.generation,
                   j.attempts_made, j.pending_dependencies, j.requires_approval, j.approved_at,
                   j.started_at, j.finished_at, p.organization_id AS org_id
              FROM jobs j JOIN projects p ON p.id = j.project_id""").fetchall()}
        self.attempts = conn.execute("""
            SELECT id, job_id, attempt_no, generation, state, claimed_at, finished_at,
                   organization_stripe, pool_stripe
              FROM attempts ORDER BY job_id, claimed_at, id""").fetchall()
        # every organization and pool with its limit, and its stripes and debt
        # (sql/functions/capacity.sql)
        self.owners = {(r["kind"], r["id"]): r for r in conn.execute("""
            SELECT 'organization' AS kind, id, name, max_running AS lim FROM organizations
            UNION ALL
            SELECT 'pool', id, name, slots FROM pools""").fetchall()}
        self.stripes = conn.execute("""
            SELECT kind, owner_id, stripe_no, cap, held FROM capacity_stripes
             ORDER BY kind, owner_id, stripe_no""").fetchall()
        self.debts = {(r["kind"], r["owner_id"]): r["owed"] for r in conn.execute(
            "SELECT kind, owner_id, owed FROM capacity_debts").fetchall()}
        self.stripes_per_owner = conn.execute(
            "SELECT pgd_capacity_stripes() AS n").fetchone()["n"]
        # the system's supersede events (sql/functions/submit.sql, pgd_supersede_older)
        self.supersedes = {r["job_id"]: r for r in conn.execute("""
            SELECT job_id, at, actor, (details ->> 'superseded_by')::bigint AS superseded_by,
                   details ->> 'target' AS target
              FROM audit_events WHERE action = 'supersede'""").fetchall()}
        # a superseding target's scope: every project's deployments (supersede), or the
        # projects of its pairs (project_target_supersede)
        self.supersede_scopes = {r["id"]: r for r in conn.execute("""
            SELECT t.id, t.name, t.supersede,
                   ARRAY(SELECT s.project_id FROM project_target_supersede s
                          WHERE s.target_id = t.id) AS projects
              FROM targets t""").fetchall()}
        self.dependencies = {(r["job_id"], r["depends_on_job_id"]) for r in conn.execute(
            "SELECT job_id, depends_on_job_id FROM job_dependencies").fetchall()}
        self.by_job: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for a in self.attempts:
            self.by_job[a["job_id"]].append(a)


def _job_state(conn, s: _Snapshot) -> list[str]:
    return [f"job_state: job {j['id']} is in state {j['state']!r}, not one of "
            f"{', '.join(JOB_STATES)}" for j in s.jobs.values() if j["state"] not in JOB_STATES]


def _job_columns(conn, s: _Snapshot) -> list[str]:
    out = []
    for j in s.jobs.values():
        atts = s.by_job.get(j["id"], [])
        jid = f"job {j['id']} ({j['state']})"
        awaits_approval = j["requires_approval"] and j["approved_at"] is None
        if j["state"] == "blocked" and not (j["pending_dependencies"] > 0 or awaits_approval):
            out.append(f"job_columns: {jid} is blocked with no dependency pending and no "
                       f"approval due")
        if j["state"] == "uncertain" and j["target_id"] is None:
            out.append(f"job_columns: {jid} is uncertain but has no target")
        top = max((a["generation"] for a in atts), default=0)
        if j["generation"] != top:
            out.append(f"job_columns: {jid} is at generation {j['generation']} but its newest "
                       f"attempt has generation {top}")
        if j["attempts_made"] != len(atts):
            out.append(f"job_columns: {jid} counts {j['attempts_made']} attempts but has "
                       f"{len(atts)}")
        if atts and j["started_at"] is None:
            out.append(f"job_columns: {jid} has attempts but no started_at")
    return out


def _finished_at(conn, s: _Snapshot) -> list[str]:
    out = []
    for j in s.jobs.values():
        if j["state"] in TERMINAL and j["finished_at"] is None:
            out.append(f"finished_at: job {j['id']} is {j['state']} but has no finished_at")
        if j["state"] not in TERMINAL and j["finished_at"] is not None:
            out.append(f"finished_at: job {j['id']} is {j['state']} but has finished_at "
                       f"{j['finished_at']}")
    return out


def _running_attempt(conn, s: _Snapshot) -> list[str]:
    out = []
    for j in s.jobs.values():
        atts = s.by_job.get(j["id"], [])
        running = [a for a in atts if a["state"] == "running"]
        current = [a for a in atts if a["generation"] == j["generation"]]
        jid = f"job {j['id']} ({j['state']}, generation {j['generation']})"
        if j["state"] == "running":
            if len(running) != 1:
                out.append(f"running_attempt: {jid} has {len(running)} running attempts")
            elif running[0]["generation"] != j["generation"]:
                out.append(f"running_attempt: {jid} runs attempt {running[0]['id']} of "
                           f"generation {running[0]['generation']}")
        elif running:
            out.append(f"running_attempt: {jid} is not running but attempt(s) "
                       f"{[a['id'] for a in running]} are")
        if j["state"] == "uncertain" and not (len(current) == 1 and current[0]["state"] == "lost"):
            out.append(f"running_attempt: {jid} is uncertain but its current attempt is "
                       f"{[a['state'] for a in current] or 'missing'}, not lost")
    known = set(s.jobs)
    for a in s.attempts:
        if a["job_id"] not in known:
            out.append(f"running_attempt: attempt {a['id']} belongs to no job ({a['job_id']})")
        if a["state"] not in ATTEMPT_STATES:
            out.append(f"running_attempt: attempt {a['id']} is in state {a['state']!r}")
        if (a["state"] == "running") != (a["finished_at"] is None):
            out.append(f"running_attempt: attempt {a['id']} is {a['state']} with finished_at "
                       f"{a['finished_at']}")
    return out


def _attempt_numbering(conn, s: _Snapshot) -> list[str]:
    out = []
    for job_id, atts in s.by_job.items():
        for key in ("generation", "attempt_no"):
            values = [a[key] for a in atts]
            if len(set(values)) != len(values):
                out.append(f"attempt_numbering: job {job_id} has attempts with repeated "
                           f"{key}s {sorted(values)}")
        ordered = sorted(atts, key=lambda a: (a["claimed_at"], a["id"]))
        if [a["generation"] for a in ordered] != sorted(a["generation"] for a in ordered):
            out.append(f"attempt_numbering: job {job_id} attempts were claimed out of generation "
                       f"order {[a['generation'] for a in ordered]}")
    return out


def _attempt_overlap(conn, s: _Snapshot) -> list[str]:
    out = []
    for job_id, atts in s.by_job.items():
        for a in atts:
            if a["finished_at"] is not None and a["finished_at"] < a["claimed_at"]:
                out.append(f"attempt_overlap: attempt {a['id']} of job {job_id} finished "
                           f"before it was claimed")
        for prev, nxt in zip(atts, atts[1:]):  # ordered by claimed_at
            if prev["finished_at"] is None or prev["finished_at"] > nxt["claimed_at"]:
                out.append(f"attempt_overlap: job {job_id}: attempt {prev['id']} "
                           f"[{prev['claimed_at']}, {prev['finished_at']}) overlaps attempt "
                           f"{nxt['id']} claimed at {nxt['claimed_at']}")
    return out


def _succeeded_once(conn, s: _Snapshot) -> list[str]:
    out = []
    for job_id, atts in s.by_job.items():
        won = [a["id"] for a in atts if a["state"] == "succeeded"]
        if len(won) > 1:
            out.append(f"succeeded_once: job {job_id} succeeded {len(won)} times (attempts {won})")
        job = s.jobs.get(job_id)
        if won and job is not None and job["state"] != "succeeded":
            out.append(f"succeeded_once: job {job_id} is {job['state']} but attempt(s) {won} "
                       f"succeeded")
    return out


# the job column naming an attempt's owner of each kind, and the attempt column naming the
# stripe it holds that owner's slot in
SLOT_OWNERS = (("organization", "org_id", "organization_stripe"),
               ("pool", "pool_id", "pool_stripe"))


def _counters(conn, s: _Snapshot) -> list[str]:
    """Projects count their jobs in state running (``pgd_project_running``); organizations
    and pools hold one slot per running attempt, in stripes (both in sql/functions/capacity.sql):
    the held slots of each (``pgd_organization_running`` / ``pgd_pool_running``) equal its
    running attempts; each running job's running attempt holds exactly one slot of its
    project's organization and one of its pool (it records a stripe of each that exists);
    and each stripe's held count is the number of running attempts recording it, so no slot
    is held without a running attempt behind it."""
    live = [(a, s.jobs[a["job_id"]]) for a in s.attempts
            if a["state"] == "running" and a["job_id"] in s.jobs]
    out = []
    for kind, sql, key in (
            ("organization", "SELECT id, name, pgd_organization_running(id) AS running "
                             "FROM organizations ORDER BY id", "org_id"),
            ("project", "SELECT id, name, pgd_project_running(id) AS running "
                        "FROM projects ORDER BY id", "project_id"),
            ("pool", "SELECT id, name, pgd_pool_running(id) AS running FROM pools ORDER BY id",
             "pool_id")):
        behind: dict[int, int] = defaultdict(int)
        for _, j in live:
            behind[j[key]] += 1
        counts = "counts {} running" if kind == "project" else "holds {} slots"
        for r in conn.execute(sql).fetchall():
            if r["running"] != behind.get(r["id"], 0):
                out.append(f"counters: {kind} {r['name']} {counts.format(r['running'])} but "
                           f"{behind.get(r['id'], 0)} attempts are running")
    stripes = {(r["kind"], r["owner_id"], r["stripe_no"]): r for r in s.stripes}
    for kind, key, column in SLOT_OWNERS:
        on_stripe: dict[tuple[int, int], int] = defaultdict(int)
        holding: dict[int, int] = defaultdict(int)  # running job -> its slots of this kind
        for a, j in live:
            if (kind, j[key], a[column]) in stripes:
                on_stripe[(j[key], a[column])] += 1
                holding[j["id"]] += 1
            else:
                out.append(f"counters: running attempt {a['id']} of job {j['id']} records "
                           f"{kind} stripe {a[column]}, which its {kind} does not have")
        for (k, owner, no), st in stripes.items():
            if k == kind and st["held"] != on_stripe.get((owner, no), 0):
                name = s.owners.get((kind, owner), {}).get("name", f"#{owner}")
                out.append(f"counters: {kind} {name} stripe {no} holds {st['held']} slots but "
                           f"{on_stripe.get((owner, no), 0)} running attempts record it")
        for j in s.jobs.values():
            if j["state"] == "running" and holding.get(j["id"], 0) != 1:
                out.append(f"counters: running job {j['id']} holds {holding.get(j['id'], 0)} "
                           f"slots of its {kind}")
    return out


def _stripes(conn, s: _Snapshot) -> list[str]:
    """The capacity of each organization and pool as stripes (sql/functions/capacity.sql):
    exactly ``pgd_capacity_stripes()`` of them, each holding 0 to its cap; the caps minus what
    is owed equal the limit now configured (a lowering below the held slots is owed, so this
    holds whatever the limits did before); while anything is owed every stripe is full, so that
    no claim finds room; a debt is more than nothing; no stripe or debt of an owner that does
    not exist."""
    out = []
    by_owner: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for st in s.stripes:
        by_owner[(st["kind"], st["owner_id"])].append(st)
    for (kind, owner_id), o in sorted(s.owners.items()):
        mine = by_owner.get((kind, owner_id), [])
        owed = s.debts.get((kind, owner_id), 0)
        name = f"{kind} {o['name']}"
        if len(mine) != s.stripes_per_owner:
            out.append(f"stripes: {name} has {len(mine)} stripes, not {s.stripes_per_owner}")
        for st in mine:
            if not 0 <= st["held"] <= st["cap"]:
                out.append(f"stripes: {name} stripe {st['stripe_no']} holds {st['held']} slots "
                           f"of its cap {st['cap']}")
            if owed and st["held"] < st["cap"]:
                out.append(f"stripes: {name} owes {owed} slots but stripe {st['stripe_no']} "
                           f"has room (held {st['held']} of cap {st['cap']})")
        caps = sum(st["cap"] for st in mine)
        if caps - owed != o["lim"]:
            out.append(f"stripes: {name}: caps {caps} minus {owed} owed, but the limit is "
                       f"{o['lim']}")
        if (kind, owner_id) in s.debts and owed <= 0:
            out.append(f"stripes: {name} has a debt of {owed} slots")
    for kind, owner_id in sorted(set(by_owner) | set(s.debts)):
        if (kind, owner_id) not in s.owners:
            out.append(f"stripes: stripes or a debt of {kind} {owner_id}, which does not exist")
    return out


def max_overlap(intervals: list[tuple[Any, Any]]) -> tuple[int, Any]:
    """The most half-open ``[start, end)`` intervals (end None: still open) holding at once,
    and the first moment that many did."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        if end is not None:
            events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # at a tie an end comes before a start
    n = best = 0
    at = None
    for t, delta in events:
        n += delta
        if n > best:
            best, at = n, t
    return best, at


def _sweep(s: _Snapshot, key) -> dict[Any, list[tuple[Any, Any]]]:
    groups: dict[Any, list[tuple[Any, Any]]] = defaultdict(list)
    for a in s.attempts:
        job = s.jobs.get(a["job_id"])
        if job is not None and key(job) is not None:
            groups[key(job)].append((a["claimed_at"], a["finished_at"]))
    return groups


def _capacity_overlap(conn, s: _Snapshot) -> list[str]:
    out = []
    for kind, sql, key in (
            ("organization", "SELECT id, name, max_running AS lim FROM organizations", "org_id"),
            ("project", "SELECT id, name, max_running AS lim FROM projects "
                        "WHERE max_running IS NOT NULL", "project_id"),
            ("pool", "SELECT id, name, slots AS lim FROM pools", "pool_id")):
        groups = _sweep(s, lambda j: j[key])
        for r in conn.execute(sql).fetchall():
            best, at = max_overlap(groups.get(r["id"], []))
            if best > r["lim"]:
                out.append(f"capacity_overlap: {kind} {r['name']}: {best} attempts held it at "
                           f"once (at {at}), limit {r['lim']}")
    return out


def _target_holder(conn, s: _Snapshot) -> list[str]:
    out = []
    holders: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for j in s.jobs.values():
        if j["target_id"] is not None and j["state"] in ("running", "uncertain"):
            holders[j["target_id"]].append(j)
    expect = {"held": "running", "uncertain": "uncertain"}
    targets = conn.execute("SELECT id, name, state, holder_job_id FROM targets ORDER BY id")
    for t in targets.fetchall():
        hs = holders.pop(t["id"], [])
        name = f"target {t['name']} ({t['state']}, holder {t['holder_job_id']})"
        if t["state"] == "free":
            if hs or t["holder_job_id"] is not None:
                out.append(f"target_holder: {name} is free but job(s) {[j['id'] for j in hs]} "
                           f"hold it")
        elif t["state"] in expect:
            if len(hs) != 1:
                out.append(f"target_holder: {name} has {len(hs)} running/uncertain deployment "
                           f"jobs: {[j['id'] for j in hs]}")
            elif hs[0]["id"] != t["holder_job_id"] or hs[0]["state"] != expect[t["state"]]:
                out.append(f"target_holder: {name} but job {hs[0]['id']} ({hs[0]['state']}) is "
                           f"the one holding it")
        else:
            out.append(f"target_holder: {name} is in an unknown state")
    for target_id, hs in holders.items():
        out.append(f"target_holder: jobs {[j['id'] for j in hs]} hold target {target_id}, "
                   f"which does not exist")
    return out


def _target_overlap(conn, s: _Snapshot) -> list[str]:
    names = {r["id"]: r["name"] for r in conn.execute("SELECT id, name FROM targets").fetchall()}
    out = []
    for target_id, intervals in sorted(_sweep(s, lambda j: j["target_id"]).items()):
        best, at = max_overlap(intervals)
        if best > 1:
            out.append(f"target_overlap: target {names.get(target_id, target_id)}: {best} "
                       f"deployment attempts at once (at {at})")
    return out


def _receipts(conn, s: _Snapshot) -> list[str]:
    out = []
    by_id = {a["id"]: a for a in s.attempts}
    for r in conn.execute("SELECT key, attempt_id, outcome, response FROM delivery_receipts "
                          "ORDER BY created_at, key").fetchall():
        a = by_id.get(r["attempt_id"])
        if a is None:
            out.append(f"receipts: receipt {r['key']} belongs to no attempt ({r['attempt_id']})")
        elif a["state"] == "running" or a["finished_at"] is None:
            out.append(f"receipts: receipt {r['key']} ({r['outcome']}) belongs to attempt "
                       f"{a['id']}, which is still running")
        answered = (r["response"] or {}).get("attempt_id")
        if answered != r["attempt_id"]:
            out.append(f"receipts: receipt {r['key']} is for attempt {r['attempt_id']} but its "
                       f"stored answer names attempt {answered}")
    return out


def _dependencies(conn, s: _Snapshot) -> list[str]:
    deps: dict[int, list[int]] = defaultdict(list)
    for r in conn.execute("SELECT job_id, depends_on_job_id FROM job_dependencies").fetchall():
        deps[r["job_id"]].append(r["depends_on_job_id"])
    out = []
    for job_id, upstream in sorted(deps.items()):
        j = s.jobs.get(job_id)
        if j is None:
            continue
        states = {u: (s.jobs[u]["state"] if u in s.jobs else "missing") for u in upstream}
        unmet = {u: st for u, st in states.items() if st != "succeeded"}
        if s.by_job.get(job_id) and unmet:
            out.append(f"dependencies: job {job_id} ran although dependencies {unmet} had not "
                       f"succeeded")
        if j["state"] in ("blocked", "queued"):
            if j["pending_dependencies"] != len(unmet):
                out.append(f"dependencies: job {job_id} ({j['state']}) counts "
                           f"{j['pending_dependencies']} pending dependencies but {len(unmet)} "
                           f"have not succeeded: {unmet}")
            dead = {u: st for u, st in unmet.items()
                    if st in ("failed", "cancelled", "superseded", "missing")}
            if dead:
                out.append(f"dependencies: job {job_id} ({j['state']}) still waits on "
                           f"dependencies that ended without success: {dead}")
    return out


def _steering(conn, s: _Snapshot) -> list[str]:
    # pause and drain windows from the audit log against the attempts' claimed_at
    # (consistency.steering_violations), read in the same snapshot
    return [f"steering: {v}" for v in steering_violations(conn)]

def _supersede(conn, s: _Snapshot) -> list[str]:
    """A superseded job was superseded by a newer deployment to its own target (its audit
    event, actor system, says which), and no attempt of it was claimed after that or runs
    now. Never two survivors: on a target that supersedes for a job's project, no deployment
    that never ran is still waiting (queued or blocked) beside a newer one in the same scope
    (other than one the newer waits for, directly or through other jobs: pgd_supersede_older
    keeps the new job's upstream chain), since the newer one's submit would have superseded
    it; and none that ran and went back to waiting (a retry, a hand-back, a re-run) beside a
    newer one that is waiting, running, uncertain or succeeded (pgd_supersede_stale)."""
    out = []
    for j in s.jobs.values():
        event = s.supersedes.get(j["id"])
        if j["state"] != "superseded":
            if event is not None:
                out.append(f"supersede: job {j['id']} is {j['state']} but was superseded by job "
                           f"{event['superseded_by']} at {event['at']}")
            continue
        if event is None:
            out.append(f"supersede: job {j['id']} is superseded with no supersede event")
            continue
        by = s.jobs.get(event["superseded_by"])
        if event["actor"] != "system" or by is None or by["id"] <= j["id"] or by["target_id"] != j["target_id"]:
            out.append(f"supersede: job {j['id']} (target {j['target_id']}) superseded by job "
                       f"{event['superseded_by']} (target {by and by['target_id']}), actor "
                       f"{event['actor']}: not a newer deployment to its target")
        for a in s.by_job.get(j["id"], []):
            if a["state"] == "running" or a["claimed_at"] >= event["at"]:
                out.append(f"supersede: job {j['id']} superseded at {event['at']} but attempt "
                           f"{a['id']} ({a['state']}) was claimed at {a['claimed_at']}")
    waiting: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for j in s.jobs.values():
        if j["target_id"] is not None and j["state"] in ("queued", "blocked", "running",
                                                         "uncertain", "succeeded", "failed",
                                                         "cancelled", "superseded"):
            waiting[j["target_id"]].append(j)
    for target_id, jobs in waiting.items():
        scope = s.supersede_scopes.get(target_id)
        if scope is None or not (scope["supersede"] or scope["projects"]):
            continue
        jobs.sort(key=lambda j: j["id"])
        for old in jobs:
            if old["state"] not in ("queued", "blocked"):
                continue
            if not scope["supersede"] and old["project_id"] not in scope["projects"]:
                continue
            downstream = _downstream(s, old["id"])
            for new in jobs:
                if (new["id"] > old["id"]
                        and (old["attempts_made"] == 0
                             or new["state"] in ("queued", "blocked", "running", "uncertain",
                                                 "succeeded"))
                        and (scope["supersede"] or new["project_id"] == old["project_id"])
                        and new["id"] not in downstream):
                    out.append(f"supersede: target {scope['name']}: job {old['id']} ({old['state']}) "
                               f"still waits although job {new['id']} ({new['state']}) is newer")
                    break
    return out


def _downstream(s: _Snapshot, job_id: int) -> set[int]:
    """The jobs that wait for ``job_id``, directly or through other jobs."""
    below: dict[int, set[int]] = defaultdict(set)
    for child, parent in s.dependencies:
        below[parent].add(child)
    seen: set[int] = set()
    frontier = [job_id]
    while frontier:
        for child in below.get(frontier.pop(), ()):
            if child not in seen:
                seen.add(child)
                frontier.append(child)
    return seen
