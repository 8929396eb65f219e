"""``python -m bench all``: every throughput series alternated on one server, the latency
figures, then the report (table, JSON, chart). ``python -m bench report`` re-prints a saved one.

Run it from the repository root (``make bench`` installs ``bench/requirements.txt`` first)::

    python -m bench all [--quick] [--clients 1,4,8,16] [--repeats 3] [--jobs 10000]
                        [--series pgdispatch,pgqueuer-batch50,...] [--history 1000000] [--no-latency]
    python -m bench report [RESULTS.json] [--chart docs/benchmarks.png]

One PostgreSQL serves the whole invocation: the embedded one (started in a temporary
directory, stopped at the end) or ``DATABASE_URL``'s, on which every database is created and
dropped by the benchmark. For each repeat, for each client count N, every series runs once,
one after the other, the first series rotating with the repeat, so that drift of the machine
(other work, caches, checkpoints) falls on every series alike. Series:

* ``pgdispatch``, ``pgdispatch-bound`` — ``bench/claim.py`` (limits free / binding);
* ``pgqueuer-batch10`` … ``-batch200``, ``procrastinate-c1`` … ``-c16`` — ``bench/peers.py`` (each
  peer swept over its setting; ``pgdispatch-batch10`` … ``-batch200`` the same batch sizes);
* ``raw-claim``, ``tpcb`` — ``bench/ceiling.py`` (pgbench).

Then ``bench/latency.py`` (claim latency, console and explain at size). The report gives, per
series and N, the median jobs/s of the repeats (min–max beside it), the ratios of every
pgdispatch series' median to every peer's and ceiling's, and the latency table; it is
printed (Markdown tables), saved as ``bench/results/<UTC timestamp>.json`` (gitignored) and
drawn as ``docs/benchmarks.png`` (matplotlib).

Every option can also come from the environment: ``BENCH_QUICK=1`` (N = 1, 4; one repeat;
1,000 jobs; 3 s of tpcb; queued sizes 1,000 and 10,000; 10,000 history rows; 200 claims),
``BENCH_CLIENTS``, ``BENCH_REPEATS``, ``BENCH_JOBS``, ``BENCH_SERIES``, ``BENCH_HISTORY``,
``BENCH_QUEUED_SIZES``, ``BENCH_LATENCY_CLAIMS``, ``BENCH_TPCB_SECONDS``; a flag wins.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import ceiling, claim, latency, ledger, peers
from .common import (RESULTS_DIR, ROOT, Bench, bench_server, git_commit, machine, make_template,
                     pgbench_version, server_settings, version)

CHART = ROOT / "docs" / "benchmarks.png"
# "prototype" (bench/prototypes.py, retired when the product took slot rows): only in saved
# results, which `python -m bench report` can still print and draw (here and in chart's styles)
KIND_ORDER = {"pgdispatch": 0, "ledger": 1, "prototype": 1, "peer": 2, "ceiling": 3}

FULL = {"clients": "1,4,8,16", "repeats": 3, "jobs": 10_000, "tpcb_seconds": 10.0,
        "history": 1_000_000, "queued_sizes": "10000,100000,1000000", "latency_claims": 1000}
QUICK = {"clients": "1,4", "repeats": 1, "jobs": 1000, "tpcb_seconds": 3.0,
         "history": 10_000, "queued_sizes": "1000,10000", "latency_claims": 200}


def all_series() -> dict[str, Any]:
    """Every throughput series by name, pgdispatch's first, then the peers, the ceilings."""
    return {**claim.SERIES, **peers.SERIES, **ceiling.SERIES, **ledger.SERIES}


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


def parse(argv: Sequence[str], *, prog: str, only: Sequence[str] | None,
          latency: bool) -> argparse.Namespace:
    """Options from flags, then ``BENCH_*`` variables, then the quick or full defaults."""
    env = os.environ
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", default=_truthy(env.get("BENCH_QUICK")),
                   help="smoke run: small sizes, one repeat (BENCH_QUICK=1)")
    p.add_argument("--clients", help="client counts N, comma-separated (BENCH_CLIENTS)")
    p.add_argument("--repeats", type=int, help="runs per series and N; the median is reported")
    p.add_argument("--jobs", type=int, help="no-op jobs per throughput run")
    p.add_argument("--series", help="series to run, comma-separated (BENCH_SERIES); "
                                    f"known: {', '.join(all_series())}")
    p.add_argument("--procrastinate-jobs", type=int,
                   help="no-op jobs per Procrastinate run (default: --jobs)")
    p.add_argument("--projects", type=int, default=4, help="pgdispatch projects the jobs spread over")
    p.add_argument("--idle-seconds", type=float, default=0.001,
                   help="pause of a pgdispatch loop whose claim found nothing (seconds)")
    p.add_argument("--warmup", type=int, default=2000,
                   help="jobs each pgdispatch run completes, then ANALYZE, before its clock starts")
    p.add_argument("--tpcb-seconds", type=float, help="duration of each tpcb-like run (seconds)")
    p.add_argument("--tpcb-scale", type=int, help="pgbench -i scale (default: the largest N)")
    p.add_argument("--timeout-seconds", type=float, default=900.0, help="limit of one run (seconds)")
    p.add_argument("--history", type=int, help="finished jobs in the latency history database")
    p.add_argument("--queued-sizes", help="queued jobs at which latency is measured")
    p.add_argument("--latency-claims", type=int, help="claims timed at each size")
    p.add_argument("--no-latency", action="store_true", help="skip the latency figures")
    p.add_argument("--out", type=Path, help="results JSON (default bench/results/<timestamp>.json)")
    p.add_argument("--chart", type=Path, default=CHART if only is None else None,
                   help="PNG chart to write (default for `all`: docs/benchmarks.png)")
    opts = p.parse_args(list(argv))
    base = QUICK if opts.quick else FULL
    env_names = {"clients": "BENCH_CLIENTS", "repeats": "BENCH_REPEATS", "jobs": "BENCH_JOBS",
                 "tpcb_seconds": "BENCH_TPCB_SECONDS", "history": "BENCH_HISTORY",
                 "queued_sizes": "BENCH_QUEUED_SIZES", "latency_claims": "BENCH_LATENCY_CLAIMS"}
    for key, default in base.items():
        if getattr(opts, key) is None:
            raw = env.get(env_names[key])
            setattr(opts, key, type(default)(raw) if raw else default)
    opts.clients = _ints(opts.clients)
    opts.queued_sizes = _ints(opts.queued_sizes)
    known = all_series()
    wanted = opts.series or env.get("BENCH_SERIES")
    # by default every series but the ledger's (bench/ledger.py: run when named)
    default = [s for s in known if known[s].kind != "ledger"]
    opts.series = [s for s in (wanted.split(",") if wanted else (only if only is not None else default))
                   if s]
    unknown = [s for s in opts.series if s not in known]
    if unknown:
        p.error(f"unknown series {unknown}; known: {', '.join(known)}")
    if only is not None:
        opts.series = [s for s in opts.series if s in only]
    opts.latency = latency and not opts.no_latency
    if opts.tpcb_scale is None:
        opts.tpcb_scale = max(4 if opts.quick else 1, max(opts.clients))
    if min(opts.clients) < 1 or opts.repeats < 1 or opts.jobs < 1:
        p.error("clients, repeats and jobs must be at least 1")
    return opts


# --- environment --------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    """pgdispatch (git commit), the peers, the drivers, pgbench and the plotting library."""
    out = {"pgdispatch": git_commit(), **peers.versions(), "psycopg": version("psycopg"),
           "matplotlib": version("matplotlib")}
    try:
        out["pgbench"] = pgbench_version()
    except (OSError, subprocess.CalledProcessError) as exc:
        out["pgbench"] = f"unavailable: {exc}"
    return out


# --- running ------------------------------------------------------------------------------------


def run_cli(argv: Sequence[str], *, prog: str, only: Sequence[str] | None, latency: bool) -> int:
    """Parse options, run the chosen series (and latency), report. Returns the exit status:
    0, or 1 when a run failed (the others still ran and are reported)."""
    opts = parse(argv, prog=prog, only=only, latency=latency)
    result = run(opts, command=[prog, *argv])
    emit(result, out=opts.out, chart_path=opts.chart)
    return 1 if result["errors"] else 0


def run(opts: argparse.Namespace, *, command: Sequence[str]) -> dict[str, Any]:
    """Run everything ``opts`` asks for on one server; returns the results document."""
    known = all_series()
    vers = versions()
    series, unavailable = [], {}
    for name in opts.series:
        reason = known[name].unavailable()
        if reason:
            unavailable[name] = reason
            print(f"!! {name} cannot run: {reason}", flush=True)
        else:
            series.append(known[name])
    label_values = {k: v or "?" for k, v in vers.items()}
    started_at = dt.datetime.now(dt.timezone.utc)
    doc: dict[str, Any] = {
        "created_at": started_at.isoformat(timespec="seconds"),
        "command": list(command), "quick": opts.quick, "machine": machine(), "versions": vers,
        "params": {k: getattr(opts, k) for k in (
            "clients", "repeats", "jobs", "warmup", "projects", "idle_seconds",
            "tpcb_seconds", "tpcb_scale", "history", "queued_sizes", "latency_claims",
            "procrastinate_jobs")},
        "series": {s.name: {"label": s.label.format(**label_values), "kind": s.kind,
                            "system": s.system, "batch": s.batch} for s in series},
        "unavailable": unavailable, "runs": [], "errors": [], "latency": [],
    }
    print(f"versions: {json.dumps(vers)}", flush=True)
    with bench_server() as (url, kind):
        doc["server"] = {"kind": kind, "settings": server_settings(url)}
        print(f"server: {kind} {json.dumps(doc['server']['settings'])}", flush=True)
        bench = Bench(server_url=url, server_kind=kind, template=make_template(url), jobs=opts.jobs,
                      projects=opts.projects, idle_seconds=opts.idle_seconds,
                      timeout_seconds=opts.timeout_seconds, tpcb_seconds=opts.tpcb_seconds,
                      tpcb_scale=opts.tpcb_scale, warmup=opts.warmup,
                      procrastinate_jobs=opts.procrastinate_jobs)
        try:
            for repeat in range(opts.repeats):
                for n in opts.clients:
                    k = repeat % len(series) if series else 0
                    for s in series[k:] + series[:k]:
                        _one(doc, bench, s, n, repeat, opts.repeats)
            if "tpcb_init_seconds" in bench.state:
                doc["tpcb_init_seconds"] = bench.state["tpcb_init_seconds"]
            if opts.latency:
                started = time.monotonic()
                try:
                    doc["latency"] = latency.run(bench, history=opts.history,
                                                 queued_sizes=opts.queued_sizes,
                                                 claims=opts.latency_claims,
                                                 progress=lambda m: print(f"   latency: {m}", flush=True))
                except Exception as exc:  # noqa: BLE001 - reported, the throughput figures stand
                    doc["errors"].append({"series": "latency", "error": f"{type(exc).__name__}: {exc}"})
                    print(f"!! latency failed: {exc}", flush=True)
                doc["latency_seconds"] = time.monotonic() - started
        finally:
            bench.close()
    doc["elapsed_seconds"] = (dt.datetime.now(dt.timezone.utc) - started_at).total_seconds()
    doc["summary"] = summarize(doc["runs"])
    doc["ratios"] = ratios(doc)
    doc["comparisons"] = comparisons(doc)
    doc["costs"] = costs(doc)
    return doc


def _one(doc: dict[str, Any], bench, s, n: int, repeat: int, repeats: int) -> None:
    tag = f"[{repeat + 1}/{repeats}] N={n:<2} {s.name:<17}"
    try:
        r = s.run(bench, n)
    except Exception as exc:  # noqa: BLE001 - reported, the other series go on
        doc["errors"].append({"series": s.name, "clients": n, "repeat": repeat,
                              "error": f"{type(exc).__name__}: {exc}"})
        print(f"{tag} FAILED: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        return
    r["repeat"] = repeat
    doc["runs"].append(r)
    extra = f", {r['empty_claims']} empty claims" if r.get("empty_claims") else ""
    print(f"{tag} {r['jobs_per_s']:>9,.0f} /s  ({r['seconds']:.2f} s{extra})", flush=True)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{series: {N: {"median", "min", "max", "runs"}}} of jobs/s (N as a string, for JSON)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in runs:
        out.setdefault(r["series"], {}).setdefault(str(r["clients"]), []).append(r["jobs_per_s"])
    return {s: {n: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": len(v)}
                for n, v in by_n.items()} for s, by_n in out.items()}


def ratios(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{"<pgdispatch series>/<other>": {N: median ratio}} for every pgdispatch series against
    every peer and ceiling that ran at that N."""
    summary, kinds = doc["summary"], {k: v["kind"] for k, v in doc["series"].items()}
    out: dict[str, dict[str, float]] = {}
    for p in (s for s in summary if kinds.get(s) == "pgdispatch"):
        for other in (s for s in summary if kinds.get(s) in ("peer", "ceiling")):
            cells = {n: summary[p][n]["median"] / summary[other][n]["median"]
                     for n in summary[p] if n in summary[other] and summary[other][n]["median"]}
            if cells:
                out[f"{p}/{other}"] = cells
    return out


COST_FIELDS = ("wal_bytes_per_job", "wal_records_per_job", "wal_fpi_per_job",
               "index_entries_per_job", "server_cpu_seconds_per_job")


def costs(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{series: {"clients": its best N, field: median over its runs at that N}} for the
    per-job cost fields (COST_FIELDS, bench/common.py run_costs) where the runs have them."""
    out: dict[str, dict[str, Any]] = {}
    for s, by_n in doc["summary"].items():
        n = max(by_n, key=lambda k: by_n[k]["median"])
        runs = [r for r in doc["runs"] if r["series"] == s and str(r["clients"]) == n]
        cell: dict[str, Any] = {"clients": int(n)}
        for f in COST_FIELDS:
            values = [r[f] for r in runs if r.get(f) is not None]
            cell[f] = statistics.median(values) if values else None
        by_relation = [r["wal_by_relation"] for r in runs if r.get("wal_by_relation")]
        if by_relation:
            names = {k for b in by_relation for k in b}
            cell["wal_by_relation"] = dict(sorted(
                ((k, statistics.mean(b.get(k, 0.0) for b in by_relation)) for k in names),
                key=lambda kv: -kv[1]))
        if any(cell[f] is not None for f in COST_FIELDS):
            out[s] = cell
    return out


def comparisons(doc: dict[str, Any]) -> dict[str, Any]:
    """The two comparisons the targets are judged by (docs/benchmarks.md), from the medians:

    * "equal_batch": for each batch size B that pgdispatch (limits free) and a peer both ran
      — the series of system "pgdispatch" and of the peer's system with ``batch`` B —
      {"batch", "ours", "peer" (series names), "ratios": {N: ours / peer}, "raw" (the raw
      SQL cycle at B, bench/ceiling.py, or None), "of_raw": {N: (ours / raw, peer / raw)}};
    * "best": for each system, its best median over every series of that system and every
      N: {"series", "clients", "median"}; "best_ratios": {peer system: pgdispatch's best /
      that peer's best}, each pair named in the table; "best_of_raw": {system: its best / the
      raw cycle's best}: how close each comes to what PostgreSQL itself does here.

    A saved result from before the sweep (no "system" in its series) gives none."""
    summary, info = doc["summary"], doc["series"]
    system = lambda s: info.get(s, {}).get("system")  # noqa: E731
    best: dict[str, dict[str, Any]] = {}
    for s, by_n in summary.items():
        if not system(s):
            continue
        for n, cell in by_n.items():
            if system(s) not in best or cell["median"] > best[system(s)]["median"]:
                best[system(s)] = {"series": s, "clients": int(n), "median": cell["median"]}
    equal = []
    ours = {info[s]["batch"]: s for s in summary if system(s) == "pgdispatch"}
    raws = {info[s]["batch"]: s for s in summary if system(s) == "raw"}
    for s in summary:
        if info.get(s, {}).get("kind") != "peer" or info[s].get("batch") not in ours:
            continue
        mine = ours[info[s]["batch"]]
        cells = {n: summary[mine][n]["median"] / summary[s][n]["median"]
                 for n in summary[mine] if n in summary[s] and summary[s][n]["median"]}
        if cells:
            raw = raws.get(info[s]["batch"])
            of_raw = {n: (summary[mine][n]["median"] / summary[raw][n]["median"],
                          summary[s][n]["median"] / summary[raw][n]["median"])
                      for n in cells if raw and n in summary[raw] and summary[raw][n]["median"]}
            equal.append({"batch": info[s]["batch"], "ours": mine, "peer": s, "ratios": cells,
                          "raw": raw, "of_raw": of_raw})
    equal.sort(key=lambda e: (e["peer"].split("-")[0], e["batch"]))
    peers_best = {k: v for k, v in best.items()
                  if any(info[s].get("kind") == "peer" and info[s].get("system") == k for s in info)}
    best_ratios = ({k: best["pgdispatch"]["median"] / v["median"] for k, v in peers_best.items()}
                   if "pgdispatch" in best else {})
    of_raw = ({k: v["median"] / best["raw"]["median"] for k, v in best.items() if k != "raw"}
              if "raw" in best else {})
    return {"equal_batch": equal, "best": best, "best_ratios": best_ratios, "best_of_raw": of_raw}


# --- output -------------------------------------------------------------------------------------


def _md(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def _ledger_rows(doc: dict[str, Any], clients: list[str]) -> list[list[str]]:
    """The ledger table's rows: each ledger series beside pgdispatch-batch<B> of the run."""
    rows = []
    costs = doc.get("costs") or {}
    for s, meta in doc["series"].items():
        if meta["kind"] != "ledger":
            continue
        full = f"pgdispatch-batch{meta['batch']}"
        ours, theirs = doc["summary"].get(s, {}), doc["summary"].get(full, {})
        if not theirs:
            continue
        cells = [f"{ours[n]['median'] / theirs[n]['median']:.2f}" if n in ours and n in theirs
                 else "—" for n in clients]

        def delta(key: str, scale: float, spec: str) -> str:
            a, b = (costs.get(s) or {}).get(key), (costs.get(full) or {}).get(key)
            return "—" if a is None or b is None else format((a - b) * scale, spec)

        rows.append([meta["label"], str(meta["batch"]), *cells,
                     delta("server_cpu_seconds_per_job", 1e6, "+,.0f"),
                     delta("wal_bytes_per_job", 1, "+,.0f")])
    return rows


def tables(doc: dict[str, Any]) -> str:
    """The report as Markdown tables (printed, and pasted into docs/benchmarks.md)."""
    series = sorted(doc["series"], key=lambda s: KIND_ORDER[doc["series"][s]["kind"]])
    clients = [str(n) for n in doc["params"]["clients"]]
    label = lambda s: doc["series"][s]["label"]  # noqa: E731
    when = doc["created_at"][:16].replace("T", " ")
    mode = "QUICK SMOKE RUN (noisy, not final figures)" if doc["quick"] else "Run"
    fewer = doc["params"].get("procrastinate_jobs")
    sizes = (f", {doc['params']['jobs']:,} jobs per run"
             + (f" (Procrastinate {fewer:,})" if fewer else "")
             + f", median of {doc['params']['repeats']} run(s)" if doc["runs"] else "")
    parts = [f"{mode}: {when} UTC, `{' '.join(doc['command'])}`, server {doc['server']['kind']} "
             f"(fsync {doc['server']['settings'].get('fsync')}, synchronous_commit "
             f"{doc['server']['settings'].get('synchronous_commit')}){sizes}", ""]
    rows = []
    for s in series:
        cells = []
        for n in clients:
            c = doc["summary"].get(s, {}).get(n)
            if c is None:
                cells.append("failed" if any(e.get("series") == s for e in doc["errors"]) else "—")
            elif c["runs"] > 1:
                cells.append(f"{c['median']:,.0f} ({c['min']:,.0f}–{c['max']:,.0f})")
            else:
                cells.append(f"{c['median']:,.0f}")
        rows.append([label(s), *cells])
    if rows:
        parts += ["Throughput, jobs/s (tpcb-like: transactions/s; raw claim: cycles/s)", "",
                  _md(["series", *[f"N={n}" for n in clients]], rows), ""]
    if doc["ratios"]:
        rows = [[f"{label(k.split('/')[0])} / {label(k.split('/')[1])}",
                 *[f"{v[n]:.2f}" if n in v else "—" for n in clients]] for k, v in doc["ratios"].items()]
        parts += ["Ratios of medians, pgdispatch / peer and pgdispatch / ceiling", "",
                  _md(["ratio", *[f"N={n}" for n in clients]], rows), ""]
    comp = doc.get("comparisons") or {}
    if comp.get("equal_batch"):
        def cell(e: dict[str, Any], n: str) -> str:
            if n not in e["ratios"]:
                return "—"
            raw = e["of_raw"].get(n)
            return f"{e['ratios'][n]:.2f}" + (f" ({raw[0]:.2f} / {raw[1]:.2f} of raw)" if raw else "")

        rows = [[str(e["batch"]), f"{label(e['ours'])} / {label(e['peer'])}",
                 *[cell(e, n) for n in clients]] for e in comp["equal_batch"]]
        parts += ["At equal batch: pgdispatch (limits free) / the peer at the same jobs per "
                  "claiming transaction, ratio of medians at each N (in brackets each one's "
                  "fraction of the raw SQL cycle at that batch, when it ran)", "",
                  _md(["batch", "pair", *[f"N={n}" for n in clients]], rows), ""]
    if comp.get("best_ratios"):
        ours = comp["best"]["pgdispatch"]
        rows = [[f"{label(ours['series'])}, N={ours['clients']}: {ours['median']:,.0f}",
                 f"{label(b['series'])}, N={b['clients']}: {b['median']:,.0f}",
                 f"{comp['best_ratios'][k]:.2f}"] for k, b in comp["best"].items()
                if k in comp["best_ratios"]]
        parts += ["Best against best: each system's best median over the settings and N it ran "
                  "(jobs/s)", "", _md(["pgdispatch at its best", "peer at its best", "ratio"], rows), ""]
    if comp.get("best_of_raw"):
        raw = comp["best"]["raw"]
        parts += [f"Of the ceiling (the raw SQL cycle at its best: {label(raw['series'])}, "
                  f"N={raw['clients']}: {raw['median']:,.0f}/s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in comp["best_of_raw"].items()), ""]
    ledger_rows = _ledger_rows(doc, clients)
    if ledger_rows:
        parts += ["What each guarantee costs (bench/ledger.py): pgdispatch with one guarantee "
                  "taken out (never product code) / pgdispatch at the same batch, ratio of "
                  "medians at each N; per-job server CPU and WAL of the variant minus the "
                  "full cycle's, each at its best N", "",
                  _md(["taken out", "batch", *[f"N={n}" for n in clients], "Δ server CPU µs/job",
                       "Δ WAL bytes/job"], ledger_rows), ""]
    if doc.get("costs"):
        fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
        rows = [[label(s), str(c["clients"]), fmt(c["wal_bytes_per_job"], ",.0f"),
                 fmt(c["wal_records_per_job"], ".1f"), fmt(c["wal_fpi_per_job"], ".2f"),
                 fmt(c["index_entries_per_job"], ".1f"),
                 fmt(None if c["server_cpu_seconds_per_job"] is None
                     else c["server_cpu_seconds_per_job"] * 1e6, ",.0f")]
                for s, c in sorted(doc["costs"].items(),
                                   key=lambda kv: KIND_ORDER[doc["series"][kv[0]]["kind"]])]
        parts += ["Per-job cost at each series' best N (median of its runs there): the whole "
                  "server's WAL, index entries and CPU during the timed part (bench/common.py, "
                  "run_costs)", "",
                  _md(["series", "N", "WAL bytes", "WAL records", "full-page images",
                       "index entries", "server CPU µs"], rows), ""]
        where = [(s, c["wal_by_relation"]) for s, c in doc["costs"].items() if c.get("wal_by_relation")]
        if where:
            parts += ["Where the WAL goes: block references per job by relation (a record that "
                      "changes two pages counts twice; pg_get_wal_block_info, bench/common.py "
                      "_wal_by_relation), at each series' best N", ""]
            for s, rel in sorted(where, key=lambda kv: KIND_ORDER[doc["series"][kv[0]]["kind"]]):
                total = sum(rel.values())
                parts.append(f"* {doc['series'][s]['label']} ({total:.1f}): "
                             + ", ".join(f"{k} {v:.1f}" for k, v in rel.items() if v >= 0.05))
            parts.append("")
    if doc["latency"]:
        rows = [[f"{r['queued']:,}", f"{r['history']:,}", f"{r['claim_ms']['p50']:.2f}",
                 f"{r['claim_ms']['p95']:.2f}", f"{r['claim_ms']['p99']:.2f}",
                 f"{r['summarize_ms']:.1f}", f"{r['overview_ms']:.1f}", f"{r['queue_page_ms']:.1f}",
                 f"{r['explain_ms']:.1f}"] for r in doc["latency"]]
        parts += [f"Latency at size, milliseconds (claim: {doc['params']['latency_claims']} claims, "
                  "one connection; pages and explain: median of 5)", "",
                  _md(["queued", "finished history", "claim p50", "claim p95", "claim p99",
                       "summarize_queue", "overview page", "queue page", "jobs explain"], rows), ""]
        builds = {r["history"]: r["history_build_seconds"] for r in doc["latency"]}
        parts.append("History build: " + ", ".join(f"{h:,} rows in {s:.0f} s" for h, s in builds.items()))
        parts.append("")
    if doc["unavailable"]:
        parts += [f"Not run: {s}: {why}" for s, why in doc["unavailable"].items()] + [""]
    if doc["errors"]:
        parts += [f"FAILED: {e['series']} N={e.get('clients', '—')} repeat {e.get('repeat', '—')}: "
                  f"{e['error'][:500]}" for e in doc["errors"]] + [""]
    vers = ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)
    load = doc["machine"]["loadavg_at_start"]
    load = " / ".join(f"{x:.1f}" for x in load) if load else "unknown"
    parts.append(f"Versions: {vers}. Machine: {doc['machine']['cpus']} CPUs, load average at start {load}.")
    return "\n".join(parts)


def chart(doc: dict[str, Any], path: Path) -> Path:
    """Draw throughput by N per series (and claim latency by queued size) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_latency = bool(doc["latency"])
    fig, axes = plt.subplots(1, 2 if has_latency else 1, figsize=(16 if has_latency else 11, 5.6),
                             squeeze=False)
    ax = axes[0][0]
    # one colour per system, one line style and marker per batch size (a sweep's series
    # of one system read as one family)
    shown = [(s, meta) for s, meta in sorted(doc["series"].items(),
                                             key=lambda kv: KIND_ORDER[kv[1]["kind"]])
             if doc["summary"].get(s)]
    systems = list(dict.fromkeys(meta.get("system") or meta["kind"] for _, meta in shown))
    batches = sorted({meta.get("batch") or 1 for _, meta in shown})
    lines = ["-", "--", "-.", ":", (0, (1, 1))]
    markers = ["o", "s", "^", "D", "v"]
    for s, meta in shown:
        cells = doc["summary"][s]
        ns = sorted(int(n) for n in cells)
        k = batches.index(meta.get("batch") or 1)
        ax.plot(ns, [cells[str(n)]["median"] for n in ns], linestyle=lines[k % len(lines)],
                marker=markers[k % len(markers)],
                color=f"C{systems.index(meta.get('system') or meta['kind']) % 10}",
                label=meta["label"])
    ax.set_xlabel("concurrent workers / clients (N)")
    ax.set_ylabel("jobs per second (median)")
    ax.set_xticks(doc["params"]["clients"])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Throughput: no-op jobs, claim -> complete")
    if has_latency:
        ax = axes[0][1]
        for i, h in enumerate(dict.fromkeys(r["history"] for r in doc["latency"])):
            rows = [r for r in doc["latency"] if r["history"] == h]
            for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                ax.plot([r["queued"] for r in rows], [r["claim_ms"][q] for r in rows], style, marker="o",
                        color=f"C{i}", label=f"{q}, {h:,} finished jobs")
        ax.set_xscale("log")
        ax.set_xlabel("queued jobs")
        ax.set_ylabel("claim latency, ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Claim latency at size (one connection)")
    when = doc["created_at"][:10]
    title = f"pgdispatch benchmarks, {when}, {doc['machine']['cpus']} CPUs, {doc['server']['kind']} PostgreSQL"
    if doc["quick"]:
        title = "SMOKE RUN (BENCH_QUICK=1): noisy, not the final figures\n" + title
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def emit(doc: dict[str, Any], *, out: Path | None, chart_path: Path | None) -> Path:
    """Print the tables, save the JSON (and the chart when a path is given); returns the JSON path."""
    out = out or RESULTS_DIR / (dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print()
    print(tables(doc))
    print(f"\nresults: {out}")
    if chart_path is not None:
        try:
            print(f"chart: {chart(doc, chart_path)}")
        except ImportError as exc:
            print(f"!! no chart: {exc} (pip install -r bench/requirements.txt)")
    return out


def latest() -> Path | None:
    """The newest results file of ``python -m bench all`` (or of one of its parts)."""
    files = sorted(RESULTS_DIR.glob("[0-9]*T*Z.json"))
    return files[-1] if files else None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench report [FILE] [--chart PNG]``: print a saved run and draw its chart."""
    p = argparse.ArgumentParser(prog="python -m bench report", description=main.__doc__)
    p.add_argument("file", nargs="?", type=Path, help="results JSON (default: the newest)")
    p.add_argument("--chart", type=Path, default=CHART, help="PNG to write (default docs/benchmarks.png)")
    opts = p.parse_args(list(argv or []))
    path = opts.file or latest()
    if path is None:
        print(f"no results in {RESULTS_DIR}; run `python -m bench all` first", file=sys.stderr)
        return 2
    doc = json.loads(path.read_text())
    print(tables(doc))
    try:
        print(f"chart: {chart(doc, opts.chart)}")
    except ImportError as exc:
        print(f"!! no chart: {exc} (pip install -r bench/requirements.txt)")
    return 0


def main_all(argv: Sequence[str] | None = None) -> int:
    """``python -m bench all``: every series, alternated, then latency and the report."""
    return run_cli(list(argv or []), prog="python -m bench all", only=None, latency=True)


def main_claim(argv: Sequence[str] | None = None) -> int:
    """``python -m bench claim``: the pgdispatch series alone (bench/claim.py)."""
    return run_cli(list(argv or []), prog="python -m bench claim", only=list(claim.SERIES),
                   latency=False)


def main_peers(argv: Sequence[str] | None = None) -> int:
    """``python -m bench peers``: the peers alone (bench/peers.py)."""
    return run_cli(list(argv or []), prog="python -m bench peers", only=list(peers.SERIES),
                   latency=False)


def main_ceiling(argv: Sequence[str] | None = None) -> int:
    """``python -m bench ceiling``: the ceilings alone (bench/ceiling.py)."""
    return run_cli(list(argv or []), prog="python -m bench ceiling", only=list(ceiling.SERIES),
                   latency=False)


LEDGER_DEFAULT = ("pgdispatch-batch100", *(f"ledger-{v}-batch100" for v in ledger.VARIANTS),
                  "raw-claim-batch100")


def main_ledger(argv: Sequence[str] | None = None) -> int:
    """``python -m bench ledger``: what each guarantee costs (bench/ledger.py), by default at
    batch 100 beside pgdispatch and the raw cycle at the same batch, alternated."""
    argv = list(argv or [])
    if not any(a == "--series" or a.startswith("--series=") for a in argv):
        argv += ["--series", ",".join(LEDGER_DEFAULT)]
    return run_cli(argv, prog="python -m bench ledger",
                   only=[*claim.SERIES, *ledger.SERIES, *ceiling.SERIES], latency=False)


def main_latency(argv: Sequence[str] | None = None) -> int:
    """``python -m bench latency``: the latency figures alone (bench/latency.py)."""
    return run_cli(list(argv or []), prog="python -m bench latency", only=[], latency=True)


if __name__ == "__main__":
    sys.exit(main_all(sys.argv[1:]))
