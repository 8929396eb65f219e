"""What the job commands themselves saw: the fault tests' commands append one line when they
start and one when they end to a runs file,

    <job id> <attempt no> start
    <job id> <attempt no> done <exit code>

(from PGDISPATCH_JOB_ID and PGDISPATCH_ATTEMPT), and ``runs_violations`` holds that record
against the attempts the database kept. It is the evidence, outside the database, that no
claim was run twice and that a success the database records really happened.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any


def run_command(runs: Path, seconds: float, exit_code: int = 0) -> list[str]:
    """A job command that records itself in ``runs``, sleeps ``seconds`` and exits."""
    return ["sh", "-c",
            f'echo "$PGDISPATCH_JOB_ID $PGDISPATCH_ATTEMPT start" >> {runs}; '
            f'sleep {seconds}; '
            f'echo "$PGDISPATCH_JOB_ID $PGDISPATCH_ATTEMPT done {exit_code}" >> {runs}; '
            f'exit {exit_code}']


def read_runs(path: Path) -> list[tuple[int, int, str, int | None]]:
    """(job id, attempt no, "start" | "done", exit code or None) per line of ``path``."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        out.append((int(parts[0]), int(parts[1]), parts[2],
                    int(parts[3]) if len(parts) > 3 else None))
    return out


def runs_violations(runs: list[tuple[int, int, str, int | None]],
                    attempts: list[dict[str, Any]]) -> list[str]:
    """Where the runs file and the attempts (``job_id``, ``attempt_no``, ``state`` rows)
    disagree, as ``"runs: …"`` lines:

    * an attempt's command started more than once (a claim is run by one runner, once);
    * a command ran for an attempt the database never recorded;
    * an attempt recorded succeeded whose command never finished with exit code 0.
    """
    started = collections.Counter((j, a) for j, a, what, _ in runs if what == "start")
    finished_ok = {(j, a) for j, a, what, code in runs if what == "done" and code == 0}
    known = {(r["job_id"], r["attempt_no"]): r["state"] for r in attempts}
    out = [f"runs: job {j} attempt {a} was started {n} times"
           for (j, a), n in sorted(started.items()) if n > 1]
    ran = {(j, a) for j, a, _, _ in runs}
    out += [f"runs: job {j} attempt {a} ran, but the database has no such attempt"
            for (j, a) in sorted(ran) if (j, a) not in known]
    out += [f"runs: job {j} attempt {a} is recorded succeeded, but its command never finished "
            f"with exit code 0" for (j, a), state in sorted(known.items())
            if state == "succeeded" and (j, a) not in finished_ok]
    return out


def reruns(runs: list[tuple[int, int, str, int | None]]) -> int:
    """How many jobs had their command finish (any exit code) in more than one attempt."""
    done = collections.Counter(j for j, _, what, _ in runs if what == "done")
    return sum(1 for n in done.values() if n > 1)
