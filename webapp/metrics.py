"""``/metrics`` (Prometheus text) and ``/healthz``; both public, both read-only."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

import pgdispatch.sql.metrics  # noqa: F401  (registers the shared counters in the default registry)
from pgdispatch.sql import DatabaseUnavailable, reads
from pgdispatch.sql.db import ping_database

from .db import get_conn

bp = Blueprint("metrics", __name__)


class _StateCollector:
    """Gauges computed at scrape time from one overview read (small tables + queue summary)."""

    def __init__(self, data: dict):
        self.data = data

    def collect(self):
        d = self.data
        depth = GaugeMetricFamily("pgdispatch_queue_depth",
                                  "Waiting jobs by their first reason (from the queue summary).",
                                  labels=["reason"])
        for code, n in d["reason_counts"].items():
            depth.add_metric([code], n)
        yield depth
        age = GaugeMetricFamily("pgdispatch_queue_summary_age_seconds",
                                "Age of the oldest queue summary row, in seconds.")
        if d["summary_age_seconds"] is not None:
            age.add_metric([], d["summary_age_seconds"])
        yield age
        org_running = GaugeMetricFamily("pgdispatch_organization_running",
                                        "Jobs running per organization.", labels=["organization"])
        org_limit = GaugeMetricFamily("pgdispatch_organization_max_running",
                                      "Concurrency limit per organization.", labels=["organization"])
        for o in d["organizations"]:
            org_running.add_metric([o["name"]], o["running"])
            org_limit.add_metric([o["name"]], o["max_running"])
        yield org_running
        yield org_limit
        pool_running = GaugeMetricFamily("pgdispatch_pool_running", "Jobs running per pool.",
                                         labels=["pool"])
        pool_slots = GaugeMetricFamily("pgdispatch_pool_slots", "Slots per pool.", labels=["pool"])
        for p in d["pools"]:
            pool_running.add_metric([p["name"]], p["running"])
            pool_slots.add_metric([p["name"]], p["slots"])
        yield pool_running
        yield pool_slots
        uncertain = GaugeMetricFamily("pgdispatch_uncertain_targets",
                                      "Targets whose deployment outcome is unknown.")
        uncertain.add_metric([], sum(1 for t in d["targets"] if t["state"] == "uncertain"))
        yield uncertain
        jobs = GaugeMetricFamily("pgdispatch_jobs", "Jobs by state; succeeded, failed and cancelled: finished in the last hour.", labels=["state"])
        for state, n in sorted(d["jobs_by_state"].items()):
            jobs.add_metric([state], n)
        yield jobs
        live = GaugeMetricFamily("pgdispatch_runners_live", "Runners with a recent heartbeat.")
        live.add_metric([], sum(1 for r in d["runners"] if r["is_live"]))
        yield live


@bp.get("/metrics")
def metrics():
    """This process's counters (sql.metrics) plus gauges read from the database now."""
    data = reads.overview(get_conn(), live_seconds=current_app.config["RUNNER_LIVE_SECONDS"])
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(_StateCollector(data))
    return Response(generate_latest(REGISTRY) + generate_latest(scrape),
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
