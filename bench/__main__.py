"""``python -m bench [NAME [ARGS...]]``: run one benchmark by name, or every one in turn."""

from __future__ import annotations

import importlib
import sys

# sub-command name -> module with main(argv) -> int, or "module:function" with that signature
BENCHMARKS = {
    "fairness": "bench.fairness",
    "notify": "bench.notify",
    "pooled": "bench.pooled",
    "fleet": "bench.fleet",
    # throughput (claim + peers + ceiling, alternated on one server), latency, then the report
    "all": "bench.report:main_all",
    # the parts of "all", one at a time, and the re-print of a saved report
    "claim": "bench.report:main_claim",
    "peers": "bench.report:main_peers",
    "ceiling": "bench.report:main_ceiling",
    "latency": "bench.report:main_latency",
    # what each guarantee costs: the batched cycle with one guarantee taken out at a time
    "ledger": "bench.report:main_ledger",
    "report": "bench.report",
    "costs": "bench.costs",
    "running": "bench.running",
    "claim-wal": "bench.claim_wal",
    # the job search at a large history, its index size, its WAL per submit
    "search": "bench.search",
    # every console page, each filter, job detail, explain and the search at 1M queued and
    # 10M finished jobs (issue 21, item 5)
    "console": "bench.console",
    # dispatch latency, throughput of real commands and CPU per long job, through the real
    # scheduler process
    "e2e": "bench.e2e",
    # every benchmark above once, at sizes that take seconds (make bench-smoke, make test)
    "smoke": "bench.smoke",
    # make bench: every table of docs/benchmarks.md in turn, at the settings it quotes, timed
    "plan": "bench.plan",
}
# what `python -m bench` with no name runs
DEFAULT = ("plan",)


def _entry(name: str):
    module, _, function = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), function or "main")


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m bench [{'|'.join(BENCHMARKS)}] [ARGS...]  "
              f"(no name: {' + '.join(DEFAULT)})")
        return 0
    if not argv:
        status = 0
        for name in DEFAULT:
            print(f"== {name}")
            status |= _entry(name)([])
        return status
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    return _entry(name)(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
