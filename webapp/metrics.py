"""``/metrics`` (Prometheus text) and ``/healthz``; both public, both read-only.

The web process exports what the database knows, read at scrape time from one overview
read (the small tables and the queue summary: its cost does not grow with the queue), and
the few things it measures itself: its transaction retries and statement deadlines
(sql/db.py) and the process's own ``process_*``/``python_*``. Claims, lease expiries and wait
times are measured by the schedulers, on their own endpoints (scheduler/metrics.py); this
one never exports them.

=============================================  ===============================================
``pgdispatch_queue_depth{reason}``             waiting jobs under every reason that holds for
                                               them (a job with two reasons counts in both)
``pgdispatch_queue_primary_depth{reason}``     under their first (primary) reason only
``pgdispatch_queue_waiting``                   waiting jobs (the sum of the primary depths)
``pgdispatch_oldest_waiting_seconds``          age of the oldest waiting job of the pool whose
``{pool,reason}``                              primary reason is that one (only pairs with a
                                               waiting job; delayed retries are not waiting)
``pgdispatch_pool_waiting{pool}``              blocked and queued jobs of the pool
``pgdispatch_pool_live_runners{pool}``         live, non-draining runners granted the pool
``pgdispatch_pool_running{pool}``              jobs holding a slot of the pool
``pgdispatch_pool_slots{pool}``                the pool's slots (pool slots, not runner slots)
``pgdispatch_pool_runner_slots{pool}``         slots of the pool's live runners
``pgdispatch_pool_free_runner_slots{pool}``    those of them not running a job now
``pgdispatch_organization_running``            jobs running per organization, and its limit
``/_max_running{organization}``
``pgdispatch_uncertain_targets``               targets whose deployment outcome is unknown
``pgdispatch_jobs{state}``                     jobs by state (finished ones: the last hour)
``pgdispatch_runners_live``                    runners with a recent heartbeat
``pgdispatch_queue_summary_age_seconds``       age of the oldest queue summary row
``pgdispatch_db_dead_tuples{table}``           dead tuples of each hot table (sql/health.py),
``pgdispatch_db_live_tuples{table}``           and live ones (pg_stat_user_tables)
``pgdispatch_db_total_bytes{table}``           a hot table's total size, indexes and TOAST in
``pgdispatch_db_index_bytes{table}``           it; its indexes alone
``pgdispatch_db_horizon_age_seconds{kind}``    how long the oldest session / prepared
                                               transaction has held the xmin horizon (0: none)
``pgdispatch_db_horizon_xmin_age{kind}``       the oldest xmin held, in transactions, per kind
                                               (session, prepared, slot; 0: none)
``pgdispatch_db_reads_all_stats``              1 when other roles' sessions are visible
``pgdispatch_db_claim_calls_total``            the claim's calls and time in the database
``pgdispatch_db_claim_seconds_total``          (pg_stat_user_functions; with track_functions)
``pgdispatch_transaction_retries_total``       this process's retried transactions
``{name,sqlstate}``
``pgdispatch_statement_deadlines_total``       this process's statements past the deadline
=============================================  ===============================================

A runner serving several pools counts its free slots for each. No ``*_created`` series
(sql/metrics.py).

Several workers (``pgdispatch web``, gunicorn): each worker is a process with its own
counters, and a scrape is answered by whichever worker takes it. With
``PROMETHEUS_MULTIPROC_DIR`` set (``pgdispatch web`` sets it to a fresh private directory
before anything imports prometheus_client; webapp/serve.py marks each exited worker dead), the
counters are prometheus_client's multiprocess ones: every scrape sums the counters of every
worker, the exited ones included, so they never go back. ``process_*``/``python_*`` are not
exported then (they describe one worker, a different one at each scrape). Without it (one
process: the test client, ``gunicorn webapp.wsgi:app`` with one worker) this process's own
registry is exported, ``process_*`` included.
"""

from __future__ import annotations

import os

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

import pgdispatch.sql.metrics as shared
from pgdispatch.sql import DatabaseUnavailable, health, reads
from pgdispatch.sql.db import ping_database

from .db import get_conn

bp = Blueprint("metrics", __name__)

# What this process measures: one registry, not the process-wide default (which holds every
# shared sql counter, the claim histogram too, whether or not this process ever claims).
# (In multiprocess mode the files also hold the shared sql metrics this process never
# measures — the claim histogram, expiry failures: their values exist once sql.metrics is
# imported — so only these are read from them.)
_OWN_COUNTERS = (shared.TRANSACTION_RETRIES, shared.STATEMENT_DEADLINES)
_OWN = CollectorRegistry(auto_describe=True)
for _metric in _OWN_COUNTERS:
    _OWN.register(_metric)
ProcessCollector(registry=_OWN)
PlatformCollector(registry=_OWN)
GCCollector(registry=_OWN)


class _WorkersCollector:
    """The web's own counters summed over every worker that ever ran (prometheus_client's
    multiprocess files in ``path``), each family declared even before its first sample."""

    def __init__(self, path: str):
        self.collector = MultiProcessCollector(None, path=path)

    def collect(self):
        own = {m.describe()[0].name: m.describe()[0] for m in _OWN_COUNTERS}
        seen = set()
        for family in self.collector.collect():
            if family.name in own:
                seen.add(family.name)
                family.documentation = own[family.name].documentation
                yield family
        for name in own.keys() - seen:
            yield CounterMetricFamily(name, own[name].documentation)


def multiprocess_dir() -> str | None:
    """The directory of prometheus_client's multiprocess files when this process runs in
    that mode (``PROMETHEUS_MULTIPROC_DIR``, read when prometheus_client was imported), else
    None."""
    from prometheus_client import values
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return path if path and values.ValueClass is not values.MutexValue else None


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class _StateCollector:
    """Gauges computed at scrape time from one overview read (small tables + queue summary)."""

    def __init__(self, data: dict):
        self.data = data

    def collect(self):
        d = self.data
        depth = _gauge("pgdispatch_queue_depth",
                       "Waiting jobs under every reason that holds for them (from the queue "
                       "summary); a job with several reasons counts under each.", ["reason"])
        for code, n in d["reason_counts"].items():
            depth.add_metric([code], n)
        yield depth
        primary = _gauge("pgdispatch_queue_primary_depth",
                         "Waiting jobs by their first (primary) reason; these sum to "
                         "pgdispatch_queue_waiting.", ["reason"])
        for code, n in d["primary_counts"].items():
            primary.add_metric([code], n)
        yield primary
        waiting = _gauge("pgdispatch_queue_waiting", "Waiting jobs (blocked, queued, uncertain).")
        waiting.add_metric([], d["waiting"])
        yield waiting
        oldest = _gauge("pgdispatch_oldest_waiting_seconds",
                        "Age in seconds of the oldest waiting job of the pool whose primary "
                        "reason is this one (waiting since ready_at, or created_at when "
                        "blocked).", ["pool", "reason"])
        for o in d["oldest_waiting"]:
            oldest.add_metric([o["pool"], o["reason"]], o["seconds"])
        yield oldest
        age = _gauge("pgdispatch_queue_summary_age_seconds",
                     "Age of the oldest queue summary row, in seconds.")
        if d["summary_age_seconds"] is not None:
            age.add_metric([], d["summary_age_seconds"])
        yield age
        org_running = _gauge("pgdispatch_organization_running", "Jobs running per organization.",
                             ["organization"])
        org_limit = _gauge("pgdispatch_organization_max_running",
                           "Concurrency limit per organization.", ["organization"])
        for o in d["organizations"]:
            org_running.add_metric([o["name"]], o["running"])
            org_limit.add_metric([o["name"]], o["max_running"])
        yield org_running
        yield org_limit
        per_pool = {
            "pgdispatch_pool_waiting": ("Blocked and queued jobs per pool.", "waiting"),
            "pgdispatch_pool_live_runners": ("Live, non-draining runners granted the pool.",
                                             "live_runners"),
            "pgdispatch_pool_running": ("Jobs running per pool (holding a pool slot).", "running"),
            "pgdispatch_pool_slots": ("Pool slots: how many jobs the pool admits at once.", "slots"),
            "pgdispatch_pool_runner_slots": ("Runner slots: what the pool's live runners run at "
                                             "once, jobs of any of their pools.", "runner_slots"),
            "pgdispatch_pool_free_runner_slots": ("Runner slots of the pool's live runners not "
                                                  "running a job now (a runner serving several "
                                                  "pools counts its free slots for each).",
                                                  "free_runner_slots"),
        }
        for name, (doc, key) in per_pool.items():
            family = _gauge(name, doc, ["pool"])
            for p in d["pools"]:
                family.add_metric([p["name"]], p[key])
            yield family
        uncertain = _gauge("pgdispatch_uncertain_targets",
                           "Targets whose deployment outcome is unknown.")
        uncertain.add_metric([], sum(1 for t in d["targets"] if t["state"] == "uncertain"))
        yield uncertain
        jobs = _gauge("pgdispatch_jobs", "Jobs by state; succeeded, failed, cancelled and superseded: "
                      "finished in the last hour.", ["state"])
        for state, n in sorted(d["jobs_by_state"].items()):
            jobs.add_metric([state], n)
        yield jobs
        live = _gauge("pgdispatch_runners_live", "Runners with a recent heartbeat.")
        live.add_metric([], sum(1 for r in d["runners"] if r["is_live"]))
        yield live


class _HealthCollector:
    """Gauges of the database's health computed at scrape time (sql/health.py)."""

    def __init__(self, data: dict):
        self.data = data

    def collect(self):
        d = self.data
        per_table = {
            "pgdispatch_db_dead_tuples": ("Dead tuples of the hot table (pg_stat_user_tables; "
                                          "vacuum removes those no snapshot may see).",
                                          "dead_tuples"),
            "pgdispatch_db_live_tuples": ("Live tuples of the hot table (pg_stat_user_tables).",
                                          "live_tuples"),
            "pgdispatch_db_total_bytes": ("Total size of the hot table in bytes, its indexes "
                                          "and TOAST included.", "total_bytes"),
            "pgdispatch_db_index_bytes": ("Size of the hot table's indexes in bytes.",
                                          "index_bytes"),
        }
        for name, (doc, key) in per_table.items():
            family = _gauge(name, doc, ["table"])
            for t in d["tables"]:
                family.add_metric([t["table_name"]], t[key])
            yield family
        age = _gauge("pgdispatch_db_horizon_age_seconds",
                     "How long the oldest session or prepared transaction of this kind has held "
                     "the xmin horizon, in seconds (0: none holds it; no sample when the "
                     "ages cannot be seen: pgdispatch_db_reads_all_stats 0).", ["kind"])
        xmin = _gauge("pgdispatch_db_horizon_xmin_age",
                      "Age in transactions of the oldest xmin held by a holder of this kind "
                      "(0: none holds it).", ["kind"])
        for kind in health.HOLDER_KINDS:
            mine = [h for h in d["holders"] if h["kind"] == kind]
            # without pg_read_all_stats another role's session shows no age: 0 would read
            # as "none holds it", so no sample then
            if kind != "slot" and (d["reads_all_stats"] or kind != "session"):
                age.add_metric([kind], max((h["xact_age_seconds"] or 0.0 for h in mine),
                                           default=0.0))
            xmin.add_metric([kind], max((h["xmin_age"] or 0 for h in mine), default=0))
        yield age
        yield xmin
        visible = _gauge("pgdispatch_db_reads_all_stats",
                         "1 when the horizon read sees other roles' sessions (the owner has "
                         "pg_read_all_stats), else 0.")
        visible.add_metric([], 1 if d["reads_all_stats"] else 0)
        yield visible
        claim = d["claim"]
        calls = CounterMetricFamily("pgdispatch_db_claim_calls",
                                    "Calls of pgd_claim and pgd_claim_batch counted by the server "
                                    "(pg_stat_user_functions, track_functions pl or all).")
        spent = CounterMetricFamily("pgdispatch_db_claim_seconds",
                                    "Time spent inside pgd_claim and pgd_claim_batch, in seconds, "
                                    "as the server counts it.")
        if claim["is_available"]:
            calls.add_metric([], claim["calls"])
            spent.add_metric([], claim["total_seconds"])
        yield calls
        yield spent


@bp.get("/metrics")
def metrics():
    """This process's own counters plus gauges read from the database now."""
    data = reads.overview(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(_StateCollector(data))
    scrape.register(_HealthCollector(health.read_database_health(get_conn())))
    path = multiprocess_dir()
    if path:
        workers = CollectorRegistry(auto_describe=False)
        workers.register(_WorkersCollector(path))
        own = generate_latest(workers)
    else:
        own = generate_latest(_OWN)
    return Response(own + generate_latest(scrape),
                    mimetype=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"Content-Type": CONTENT_TYPE_LATEST})


@bp.get("/healthz")
def healthz():
    """200 when the database answers, 503 otherwise."""
    try:
        ping_database(get_conn())
    except DatabaseUnavailable as exc:
        response = jsonify(status="unavailable", error=str(exc))
        response.status_code = 503
        return response
    return jsonify(status="ok")
