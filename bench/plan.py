"""``make bench`` (``python -m bench plan``): every benchmark of docs/benchmarks.md in turn,
each at the settings its table quotes, timed, in under 30 minutes on the 2-core machine.

Run it from the repository root (``make bench`` installs ``bench/requirements.txt`` first)::

    python -m bench plan [--only NAME,NAME] [--list]

STEPS is the plan: one line per table of docs/benchmarks.md, the sub-command and its flags
(the same command the table names, so any one table is reproduced alone by running its
line). Each step starts its own server (embedded, or ``DATABASE_URL``'s) and saves its own
results under ``bench/results/``; they run one after the other, never side by side, since
two benchmarks on two cores measure each other. At the end a table of the steps, their exit
status and seconds, and ``bench/results/plan-<UTC>.json`` with the same. A step that fails
does not stop the others; the exit status is 1 when one did.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Sequence

from .common import RESULTS_DIR, git_commit

# the swept settings of issue 21, item 1: every system at batch 10, 50, 100, 200 (Procrastinate
# at concurrency 1, 4, 16), and the raw cycle at the same batches; N = 1, 2, 4 (N = 2 is the
# best of every system on 2 cores; 4 shows the fall past the cores)
SWEEP = ",".join([*(f"pgdispatch-batch{b}" for b in (10, 50, 100, 200)),
                  *(f"pgqueuer-batch{b}" for b in (10, 50, 100, 200)),
                  *(f"procrastinate-c{c}" for c in (1, 4, 16)),
                  *(f"raw-claim-batch{b}" for b in (10, 50, 100, 200))])

# (name, sub-command and flags): docs/benchmarks.md quotes each line above its table
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("throughput", ("all", "--series", SWEEP, "--clients", "1,2,4", "--repeats", "3",
                    "--jobs", "4000", "--procrastinate-jobs", "1000", "--no-latency")),
    ("ledger", ("ledger", "--clients", "2", "--repeats", "3", "--jobs", "4000")),
    ("running", ("running", "--running", "0,20000,99999", "--claims", "300")),
    ("fairness", ("fairness",)),
    ("e2e", ("e2e", "--samples", "100", "--throughput-jobs", "1000", "--repeats", "3",
             "--settle-seconds", "5", "--window-seconds", "30")),
    ("console", ("console",)),
)


def run_steps(steps: Sequence[tuple[str, Sequence[str]]],
              entry: Callable[[str], Callable[[list[str]], int]]) -> list[dict]:
    """Run each step through ``entry(sub_command)(flags)``; returns one record per step:
    {"name", "argv", "status", "seconds"} (status 1 for a step that raised)."""
    done = []
    for name, argv in steps:
        print(f"== {name}: python -m bench {' '.join(argv)}", flush=True)
        started = time.monotonic()
        try:
            status = entry(argv[0])(list(argv[1:]))
        except Exception as exc:  # one broken step must not lose the others' results
            print(f"!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            status = 1
        done.append({"name": name, "argv": list(argv), "status": status,
                     "seconds": round(time.monotonic() - started, 1)})
        print(f"== {name}: status {status}, {done[-1]['seconds']:.0f} s", flush=True)
    return done


def main(argv: Sequence[str]) -> int:
    from .__main__ import _entry

    p = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__.split("\n")[0])
    p.add_argument("--only", help="the steps to run, comma-separated (default: all)")
    p.add_argument("--list", action="store_true", help="print the steps and stop")
    opts = p.parse_args(list(argv))
    names = [n for n, _ in STEPS]
    wanted = opts.only.split(",") if opts.only else names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        p.error(f"unknown steps {unknown}; known: {', '.join(names)}")
    steps = [s for s in STEPS if s[0] in wanted]
    if opts.list:
        for name, step_argv in steps:
            print(f"{name}: python -m bench {' '.join(step_argv)}")
        return 0
    started_at = dt.datetime.now(dt.timezone.utc)
    done = run_steps(steps, _entry)
    total = sum(d["seconds"] for d in done)
    print("\n| step | status | seconds |\n|---|---|---|")
    for d in done:
        print(f"| {d['name']} | {d['status']} | {d['seconds']:,.0f} |")
    print(f"| all | {max((d['status'] for d in done), default=0)} | {total:,.0f} |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"plan-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps({"created_at": started_at.isoformat(timespec="seconds"),
                               "commit": git_commit(), "steps": done, "seconds": total}, indent=2))
    print(f"saved {out}")
    return 1 if any(d["status"] for d in done) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
