"""The randomized fault schedule (issue 3, scenario C), driven by one seeded ``random.Random``.

Real scheduler processes (one of them talking to PostgreSQL through a commit-dropping
proxy, chaos_proxy.ChaosProxy) run builds and deployments to three targets (one superseding
every project's older waiting deployments and deploying newest ready first, one superseding
only ops' own, one neither) while the schedule, step by step:

* submits builds (some failing, some retried, some depending on earlier jobs, some needing
  approval) and deployments;
* acts as operators on its own connection through ``pgdispatch.sql.transitions``: pause and resume
  projects and pools, drain and resume runners, cancel jobs, retry failed ones, approve, resolve uncertain targets;
* injects faults: SIGKILL or SIGTERM of a scheduler (a replacement is started at once),
  ``pg_terminate_backend`` of a random pgdispatch backend (application_name
  ``pgdispatch…``; never the operator's or the checker's), and arming the proxy so that the
  next COMMIT of the proxied scheduler commits but never gets its answer.

Every couple of seconds, and at the end, the invariant checker runs on a snapshot; at the
end the job commands' own record is checked too (chaos_runs). The seed fixes the schedule
(which action, which victim, which outcome), not the processes' timing: a replay repeats the
same decisions against a similar, not identical, interleaving.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import signal
import time
from pathlib import Path
from typing import Any

from pgdispatch.sql import PgDispatchError, db, transitions

from ..concurrency.harness import UNCONDITIONAL_SLOTS_SQL
from ..factories import World
from .chaos_procs import Fleet, Proc, wait_until
from .chaos_runs import read_runs, run_command, runs_violations
from .invariants import check_invariants

PROJECTS = ("web", "api", "ops")
DEPLOYERS = ("web", "ops")
TARGETS = ("production", "staging", "canary")

CONFIG = {
    "organizations": [{"name": "acme", "max_running": 4}, {"name": "globex", "max_running": 3}],
    "pools": [{"name": "linux", "slots": 6}, {"name": "deploy", "slots": 2}],
    "projects": [
        {"name": "web", "organization": "acme", "pools": ["linux", "deploy"], "max_running": 3},
        {"name": "api", "organization": "acme", "pools": ["linux"]},
        {"name": "ops", "organization": "globex", "pools": ["linux", "deploy"], "weight": 2,
         "supersede_targets": ["staging"]},
    ],
    # canary supersedes (every project's older waiting deployments) and deploys newest ready
    # first; staging supersedes ops' own (a project-and-target pair); production neither
    "targets": [{"name": "production"}, {"name": "staging"},
                {"name": "canary", "supersede": True, "deploy_order": "newest_ready_first"}],
}

# What one step of the schedule may do, with its weight.
ACTIONS = {
    "nothing": 4.0,
    "sigkill": 1.0,
    "sigterm": 1.0,
    "terminate_backend": 2.0,
    "commit_drop": 2.0,
    "pause": 0.8,
    "resume": 1.0,
    "cancel": 1.5,
    "resolve": 1.5,
    "retry": 0.7,
    "approve": 1.0,
    # steering the fleet (issue 20): a pool paused and resumed, a runner drained (with or
    # without a deadline) and resumed; the checker's "steering" check watches them
    "pause_pool": 0.3,
    "resume_pool": 0.8,
    "drain_runner": 0.3,
    "resume_runner": 0.8,
}
FAULTS = ("sigkill", "sigterm", "terminate_backend", "commit_drop")


@dataclasses.dataclass
class Summary:
    """What a run did and found."""

    seed: int
    seconds: float
    drain_seconds: float
    jobs: int
    attempts: int
    attempt_states: dict[str, int]
    job_states: dict[str, int]
    faults: dict[str, int]
    operator: dict[str, int]
    violations: list[str]
    commits_dropped: int

    def line(self) -> str:
        return (f"chaos: seed={self.seed} duration={self.seconds:.1f}s "
                f"drain={self.drain_seconds:.1f}s jobs={self.jobs} {self.job_states} "
                f"attempts={self.attempts} {self.attempt_states} faults={self.faults} "
                f"(commits dropped {self.commits_dropped}) operator={self.operator} "
                f"violations={len(self.violations)}")


# A deliberately broken pgd_claim (same signature and result): check-then-act capacity. It
# judges organization, project and pool capacity on a plain read (the held slots of the
# organization and of the pool under their limits, the project's running jobs under its
# bound), widens the window with a pg_sleep, then reserves all three unconditionally: the
# project's count without its bound, and a slot of the organization and one of the pool
# whether or not one is free within the limit (a stripe with room if one is unlocked, else
# any unlocked stripe, its cap raised to make room past the limit), so that the held slots
# still count every claim and go over the limit as the counters did before the slot rows.
# Each attempt records the stripes it holds its slots in, so that completions and expiries
# give them back. It takes them in the lock order of sql/functions/capacity.sql (job, target,
# project, organization stripe, pool stripe), so that it does not deadlock against the real
# completions and starve itself of claims; the only stripe it ever waits for is stripe 1, when
# another transaction holds every stripe of the owner. The job is still taken with FOR UPDATE
# SKIP LOCKED and a deployment's target still only when free, so that the one thing wrong is
# over-admission. Self-contained on purpose: it does not depend on the text of the real
# pgd_claim. The reservation is the harness's (tests/concurrency/harness.py).
BROKEN_CLAIM_SQL = """
CREATE OR REPLACE FUNCTION pgd_claim(p_runner_id bigint, p_pool_ids bigint[],
                                     p_claim_token uuid, p_lease_seconds double precision)
RETURNS TABLE (job_id bigint, attempt_id bigint, attempt_no integer, generation bigint,
               lease_expires_at timestamptz, project_id bigint, pool_id bigint,
               target_id bigint, command text[], timeout_seconds integer,
               more_waiting boolean, pool text, wait_seconds double precision)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_runner  runners%ROWTYPE;
    v_job     jobs%ROWTYPE;
    v_org     bigint;
    v_attempt bigint;
    v_lease   timestamptz;
    v_org_stripe  smallint;
    v_pool_stripe smallint;
    v_proj_stripe smallint;
BEGIN
    SELECT * INTO v_runner FROM runners r WHERE r.id = p_runner_id;
    IF NOT FOUND OR v_runner.draining OR v_runner.stopped_at IS NOT NULL THEN
        RETURN;
    END IF;
    SELECT j.* INTO v_job
      FROM jobs j
      JOIN projects p ON p.id = j.project_id
      JOIN organizations o ON o.id = p.organization_id
      JOIN pools q ON q.id = j.pool_id
      LEFT JOIN targets t ON t.id = j.target_id
     WHERE j.pool_id = ANY (p_pool_ids) AND j.pool_id = ANY (v_runner.pool_ids)
       AND j.state = 'queued' AND j.ready_at <= now()
       AND p.paused_at IS NULL
       AND pgd_organization_running(o.id) < o.max_running
       AND (p.max_running IS NULL OR pgd_project_running(p.id) < p.max_running)
       AND pgd_pool_running(q.id) < q.slots
       AND (j.target_id IS NULL OR t.state = 'free')
     ORDER BY pgd_project_running(p.id)::float8 / p.weight, j.priority DESC, j.id
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT p.organization_id INTO v_org FROM projects p WHERE p.id = v_job.project_id;
    BEGIN
        SELECT j.* INTO v_job
          FROM jobs j
         WHERE j.project_id = v_job.project_id AND j.pool_id = v_job.pool_id
           AND j.state = 'queued' AND j.ready_at <= now()
           AND (j.target_id IS NULL
                OR EXISTS (SELECT 1 FROM targets t WHERE t.id = j.target_id AND t.state = 'free'))
         ORDER BY j.priority DESC, j.id
         LIMIT 1
           FOR UPDATE OF j SKIP LOCKED;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'PDSKP';
        END IF;
        IF v_job.target_id IS NOT NULL THEN
            UPDATE targets t SET state = 'held', holder_job_id = v_job.id, held_since = now()
             WHERE t.id = v_job.target_id AND t.state = 'free';
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'PDSKP';
            END IF;
        END IF;
        PERFORM pg_sleep(0.05);
        -- the bug: no project claim lock (its bound is not held), and slots taken whatever the
        -- limit: from a stripe with room, else from a full one with its cap raised past it
        UPDATE projects p SET last_claimed_at = now() WHERE p.id = v_job.project_id;
{slots}        UPDATE jobs j
           SET state = 'running', generation = j.generation + 1,
               attempts_made = j.attempts_made + 1, started_at = coalesce(j.started_at, now())
         WHERE j.id = v_job.id
        RETURNING * INTO v_job;
        v_lease := clock_timestamp() + make_interval(secs => p_lease_seconds);
        INSERT INTO attempts (job_id, attempt_no, generation, runner_id, claim_token, state,
                              claimed_at, lease_expires_at, last_heartbeat_at,
                              organization_stripe, pool_stripe, project_stripe)
        VALUES (v_job.id, v_job.attempts_made, v_job.generation, p_runner_id, p_claim_token,
                'running', clock_timestamp(), v_lease, now(), v_org_stripe, v_pool_stripe,
                v_proj_stripe)
        RETURNING id INTO v_attempt;
        RETURN QUERY SELECT v_job.id, v_attempt, v_job.attempts_made, v_job.generation, v_lease,
                            v_job.project_id, v_job.pool_id, v_job.target_id, v_job.command,
                            v_job.timeout_seconds, false, NULL::text, NULL::float8;
    EXCEPTION WHEN SQLSTATE 'PDSKP' THEN
        RETURN;
    END;
END;
$$;
""".replace("{slots}", UNCONDITIONAL_SLOTS_SQL)


class ChaosRun:
    """One seeded schedule against the database at ``db_url``.

    Args:
        db_url: this test's database (already migrated), on the shared server.
        proxy: a ChaosProxy in front of it (``proxy.db_url``).
        fleet: starts and kills the scheduler processes.
        tmp_path: the job commands append to ``tmp_path/runs.txt``.
        seed: the schedule's seed.
        seconds: how long faults are injected.
        schedulers / slots: how many scheduler processes run at once, with how many slots.
        actions: weights of the schedule's actions (default ACTIONS).
        backlog: how many jobs the schedule keeps waiting.
    """

    def __init__(self, db_url: str, proxy, fleet: Fleet, tmp_path: Path, *, seed: int,
                 seconds: float, schedulers: int = 3, slots: int = 3,
                 actions: dict[str, float] | None = None, backlog: int = 20):
        self.db_url = db_url
        self.proxy = proxy
        self.fleet = fleet
        self.runs = tmp_path / "runs.txt"
        self.runs.touch()
        self.seed = seed
        self.rng = random.Random(seed)
        self.seconds = seconds
        self.n_schedulers = schedulers
        self.slots = slots
        self.actions = dict(ACTIONS if actions is None else actions)
        self.backlog = backlog
        self.faults: collections.Counter = collections.Counter({k: 0 for k in FAULTS})
        self.operator: collections.Counter = collections.Counter()
        self.violations: list[str] = []
        self.live: list[Proc] = []
        self.stopping: list[Proc] = []  # SIGTERMed: must exit 0 by themselves
        self.submitted: list[int] = []
        self._n = 0
        self.ops = db.connect(db_url, application_name="chaos-operator")
        self.checker = db.connect(db_url, application_name="chaos-checker")

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        World(self.ops).apply(CONFIG)
        for i in range(self.n_schedulers):
            self._start_scheduler(is_proxied=(i == 0))

    def _start_scheduler(self, *, is_proxied: bool) -> Proc:
        self._n += 1
        name = f"s{self._n}{'-proxied' if is_proxied else ''}"
        url = self.proxy.db_url if is_proxied else self.db_url
        proc = self.fleet.start_scheduler(name, url, pools=("linux", "deploy"), slots=self.slots)
        self.live.append(proc)
        return proc

    # -- the schedule ----------------------------------------------------------------------

    def run(self) -> None:
        """Inject the schedule for ``seconds``; check the invariants every ~2 s meanwhile."""
        deadline = time.monotonic() + self.seconds
        next_check = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self._reap_stopping()
            self._top_up()
            action = self.rng.choices(list(self.actions), weights=list(self.actions.values()))[0]
            getattr(self, f"_do_{action}")()
            if time.monotonic() >= next_check:
                self._check()
                next_check = time.monotonic() + 2.0
            time.sleep(self.rng.uniform(0.1, 0.4))
        self.proxy.drop_after_commit.clear()

    def _check(self) -> None:
        for v in check_invariants(self.checker):
            if v not in self.violations:
                self.violations.append(v)

    def _rows(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        return self.ops.execute(sql, params or None).fetchall()

    def _top_up(self) -> None:
        """Keep about ``backlog`` jobs waiting, so that the limits, not the submitter, bound
        what runs."""
        waiting = self._rows("SELECT count(*) AS n FROM jobs "
                             "WHERE state IN ('queued', 'blocked')")[0]["n"]
        for _ in range(min(max(0, self.backlog - waiting), self.rng.randint(1, 6))):
            self._submit_one()

    def _command(self) -> list[str]:
        seconds = self.rng.choice((0.05, 0.1, 0.2, 0.4, 0.7, 1.0))
        return run_command(self.runs, seconds, 1 if self.rng.random() < 0.15 else 0)

    def _submit_one(self) -> None:
        kind = self.rng.choices(("build", "deploy", "dependent", "approval"), (60, 25, 10, 5))[0]
        kw: dict[str, Any] = {"command": self._command(), "timeout_seconds": 30,
                              "max_attempts": self.rng.randint(1, 3), "submitted_by": "chaos"}
        if kind == "deploy":
            kw.update(project=self.rng.choice(DEPLOYERS), pool="deploy",
                      target=self.rng.choice(TARGETS), max_attempts=self.rng.randint(1, 2))
        else:
            kw.update(project=self.rng.choice(PROJECTS), pool="linux")
        if kind == "dependent" and self.submitted:
            kw["depends_on"] = [self.rng.choice(self.submitted[-10:])]
        if kind == "approval":
            kw["requires_approval"] = True
        try:
            job = transitions.submit(self.ops, **kw)
        except PgDispatchError:  # a dependency that already failed: refused, nothing written
            self.operator["submit_refused"] += 1
            return
        self.submitted.append(job["id"])
        self.operator["submit"] += 1

    def _pick(self, rows: list[dict[str, Any]], key: str = "id") -> Any:
        values = sorted(r[key] for r in rows)
        return self.rng.choice(values) if values else None

    # faults

    def _do_nothing(self) -> None:
        pass

    def _replace(self, victim: Proc) -> None:
        self.live.remove(victim)
        self._start_scheduler(is_proxied=victim.db_url == self.proxy.db_url)

    def _do_sigkill(self) -> None:
        victim = self.rng.choice(self.live)
        victim.popen.kill()
        victim.popen.wait(timeout=10)
        self.faults["sigkill"] += 1
        self._replace(victim)

    def _do_sigterm(self) -> None:
        victim = self.rng.choice(self.live)
        victim.popen.terminate()
        self.faults["sigterm"] += 1
        self.stopping.append(victim)
        self._replace(victim)

    def _reap_stopping(self, *, timeout_s: float = 0.0) -> None:
        for p in list(self.stopping):
            if timeout_s:
                wait_until(lambda: not p.is_alive, what=f"{p.name} to exit after SIGTERM",
                           timeout_s=timeout_s, logs=p.log_tail)
            code = p.popen.poll()
            if code is None:
                continue
            self.stopping.remove(p)
            if code == -signal.SIGTERM:
                # SIGTERM before the process installed its handlers (still importing): the
                # default action ended it, before it could register or claim anything.
                registered = self._rows("SELECT count(*) AS n FROM runners WHERE name = %s",
                                        (p.name,))[0]["n"]
                assert registered == 0, \
                    f"{p.name} died of SIGTERM after registering\n{p.log_tail()}"
                self.faults["sigterm_during_startup"] += 1
                continue
            assert code == 0, f"{p.name} exited {code} after SIGTERM\n{p.log_tail()}"

    def _do_terminate_backend(self) -> None:
        rows = self._rows("""
            SELECT pid FROM pg_stat_activity
             WHERE datname = current_database() AND application_name LIKE 'pgdispatch%'
               AND pid <> pg_backend_pid()""")
        pid = self._pick(rows, "pid")
        if pid is not None and self._rows("SELECT pg_terminate_backend(%s) AS ok", (pid,))[0]["ok"]:
            self.faults["terminate_backend"] += 1

    def _do_commit_drop(self) -> None:
        if not self.proxy.drop_after_commit.is_set():
            self.proxy.drop_after_commit.set()
            self.faults["commit_drop"] += 1  # armed; proxy.commits_dropped counts the drops

    # operators

    def _act(self, name: str, fn, **kw) -> None:
        try:
            fn(self.ops, actor="chaos-operator", **kw)
            self.operator[name] += 1
        except PgDispatchError:  # someone (a scheduler, the other operator) moved it first
            self.operator[f"{name}_refused"] += 1

    def _do_pause(self) -> None:
        self._act("pause", transitions.pause_project, project=self.rng.choice(PROJECTS),
                  reason="chaos")

    def _do_resume(self) -> None:
        paused = self._rows("SELECT name AS id FROM projects WHERE paused_at IS NOT NULL")
        if paused:
            self._act("resume", transitions.resume_project, project=self._pick(paused))

    def _do_pause_pool(self) -> None:
        self._act("pause_pool", transitions.pause_pool, pool=self.rng.choice(("linux", "deploy")),
                  reason="chaos")

    def _do_resume_pool(self) -> None:
        paused = self._rows("SELECT name AS id FROM pools WHERE paused_at IS NOT NULL")
        if paused:
            self._act("resume_pool", transitions.resume_pool, pool=self._pick(paused))

    def _do_drain_runner(self) -> None:
        runner = self._pick(self._rows("SELECT id FROM runners WHERE stopped_at IS NULL "
                                       "AND drain_requested_at IS NULL"))
        if runner is not None:
            self._act("drain_runner", transitions.drain_runner, runner_id=runner, reason="chaos",
                      deadline_seconds=self.rng.choice((None, 0, 1, 3)))

    def _do_resume_runner(self) -> None:
        drained = self._rows("SELECT id FROM runners WHERE drain_requested_at IS NOT NULL "
                             "AND stopped_at IS NULL")
        if drained:
            self._act("resume_runner", transitions.resume_runner, runner_id=self._pick(drained))

    def _do_cancel(self) -> None:
        job = self._pick(self._rows("SELECT id FROM jobs WHERE state IN "
                                    "('blocked', 'queued', 'running')"))
        if job is not None:
            self._act("cancel", transitions.cancel_job, job_id=job, reason="chaos")

    def _do_resolve(self, outcome: str | None = None) -> None:
        target = self._pick(self._rows("SELECT name AS id FROM targets WHERE state = 'uncertain'"))
        if target is not None:
            self._act("resolve", transitions.resolve_target, target=target,
                      outcome=outcome or self.rng.choice(("succeeded", "failed", "retry")),
                      note="chaos: checked by hand")

    def _do_retry(self) -> None:
        job = self._pick(self._rows("SELECT id FROM jobs WHERE state = 'failed'"))
        if job is not None:
            self._act("retry", transitions.retry_job, job_id=job, reason="chaos")

    def _do_approve(self) -> None:
        job = self._pick(self._rows("SELECT id FROM jobs WHERE state = 'blocked' AND "
                                    "requires_approval AND approved_at IS NULL"))
        if job is not None:
            self._act("approve", transitions.approve_job, job_id=job)

    # -- the end ---------------------------------------------------------------------------

    def drain(self, *, timeout_s: float = 90.0) -> float:
        """Resume every project, resolve every uncertain target and approve every waiting
        job until nothing is left to run; after ``timeout_s`` cancel what still waits.
        Returns the seconds it took. Fails if work is still unfinished after that."""
        started = time.monotonic()
        self.proxy.drop_after_commit.clear()
        for p in self._rows("SELECT name FROM projects WHERE paused_at IS NOT NULL"):
            self._act("resume", transitions.resume_project, project=p["name"])
        for q in self._rows("SELECT name FROM pools WHERE paused_at IS NOT NULL"):
            self._act("resume_pool", transitions.resume_pool, pool=q["name"])
        for r in self._rows("SELECT id FROM runners WHERE drain_requested_at IS NOT NULL "
                            "AND stopped_at IS NULL"):
            self._act("resume_runner", transitions.resume_runner, runner_id=r["id"])
        self._reap_stopping(timeout_s=30)

        def settled() -> bool:
            for _ in self._rows("SELECT id FROM targets WHERE state = 'uncertain'"):
                self._do_resolve(outcome=self.rng.choice(("succeeded", "failed")))
            for j in self._rows("SELECT id FROM jobs WHERE state = 'blocked' AND "
                                "requires_approval AND approved_at IS NULL ORDER BY id"):
                self._act("approve", transitions.approve_job, job_id=j["id"])
            left = self._rows("SELECT count(*) AS n FROM jobs WHERE state NOT IN "
                              "('succeeded', 'failed', 'cancelled', 'superseded')")[0]["n"]
            return left == 0

        try:
            wait_until(settled, what="the drain", timeout_s=timeout_s, interval_s=0.3)
        except AssertionError:
            stuck = self._rows("SELECT id, state, ready_at, last_error FROM jobs WHERE state "
                               "NOT IN ('succeeded', 'failed', 'cancelled', 'superseded') ORDER BY id")
            self.violations.append(f"liveness: {len(stuck)} jobs unfinished after "
                                   f"{timeout_s:g} s of draining: {stuck[:10]}")
            for j in stuck:
                if j["state"] in ("queued", "blocked", "running"):
                    self._act("cancel", transitions.cancel_job, job_id=j["id"], reason="drain")
            wait_until(settled, what="the drain after cancelling", timeout_s=60,
                       interval_s=0.3, logs=self.fleet.logs)
        return time.monotonic() - started

    def finish(self, *, drain_seconds: float) -> Summary:
        """Stop every scheduler (SIGTERM, exit 0), run the final check, and sum up."""
        self._reap_stopping(timeout_s=30)
        for p in list(self.live):
            try:
                code = self.fleet.stop(p)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nsessions now:\n{self._sessions()}") from None
            assert code == 0, f"{p.name} exited {code}\n{p.log_tail()}"
            self.live.remove(p)
        self._check()
        self._check_runs()
        jobs = {r["state"]: r["n"] for r in self._rows(
            "SELECT state, count(*) AS n FROM jobs GROUP BY state ORDER BY state")}
        attempts = {r["state"]: r["n"] for r in self._rows(
            "SELECT state, count(*) AS n FROM attempts GROUP BY state ORDER BY state")}
        self.close()
        return Summary(seed=self.seed, seconds=self.seconds, drain_seconds=drain_seconds,
                       jobs=sum(jobs.values()), attempts=sum(attempts.values()),
                       attempt_states=attempts, job_states=jobs, faults=dict(self.faults),
                       operator=dict(sorted(self.operator.items())),
                       violations=list(self.violations),
                       commits_dropped=self.proxy.commits_dropped)

    def _sessions(self) -> str:
        """This database's sessions, with what they wait for (for a failure message)."""
        rows = self._rows("""
            SELECT pid, application_name, state, wait_event_type, wait_event,
                   pg_blocking_pids(pid) AS blocked_by, left(query, 120) AS query,
                   now() - xact_start AS xact_age
              FROM pg_stat_activity WHERE datname = current_database() ORDER BY pid""")
        return "\n".join(str(r) for r in rows)

    def close(self) -> None:
        """Close the operator's and the checker's connections (safe to call twice)."""
        self.ops.close()
        self.checker.close()

    def _check_runs(self) -> None:
        """No claim ran twice; every recorded success ran (chaos_runs.runs_violations)."""
        attempts = self._rows("SELECT job_id, attempt_no, state FROM attempts")
        self.violations += runs_violations(read_runs(self.runs), attempts)


def fault_seed(env: dict[str, str]) -> int:
    """PGDISPATCH_FAULT_SEED, else a fresh random seed (printed by the caller to replay)."""
    raw = env.get("PGDISPATCH_FAULT_SEED")
    if raw:
        return int(raw)
    return random.SystemRandom().randrange(2**32)


def fault_seconds(env: dict[str, str], default: float = 25.0) -> float:
    """PGDISPATCH_FAULT_SECONDS (seconds), else ``default``."""
    raw = env.get("PGDISPATCH_FAULT_SECONDS")
    return float(raw) if raw else default
