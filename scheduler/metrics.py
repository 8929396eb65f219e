"""Each scheduler process's own Prometheus endpoint (``pgdispatch scheduler --metrics-port``).

The web console's ``/metrics`` shows what the database knows (queue depth by reason, running
per organization and pool, uncertain targets). What happens inside a scheduler process —
how long its claims take, how many leases its expiry passes ended, how often a transaction
was retried, what it is running now — is only known there, so each scheduler serves it:

==========================================  ==========================================
``pgdispatch_claims_total{kind}``           jobs this scheduler claimed and launched
                                            (kind: build, deployment)
``pgdispatch_claim_seconds``                histogram of claim transactions, in seconds,
                                            empty claims included (sql.metrics)
``pgdispatch_wait_seconds{pool}``           histogram of how long each job this scheduler
                                            claimed had waited: its ready_at to its
                                            attempt's claimed_at, in seconds (the claim's
                                            answer; a claim recovered after a lost answer
                                            is not observed)
``pgdispatch_lease_expirations_total{kind}`` leases this process's expiry passes ended
``pgdispatch_transaction_retries_total``    transactions retried after 40P01/40001,
                                            by transaction name and SQLSTATE
``pgdispatch_statement_deadlines_total``    statements cancelled at the statement deadline
``pgdispatch_scheduler_completions_total``  executions ended, by reported outcome
                                            (``unreported``: fenced out, or the report
                                            could not be delivered)
``pgdispatch_scheduler_running_jobs``       jobs running in this process now
``pgdispatch_scheduler_slots``              its slots
``pgdispatch_scheduler_info{runner,pools}`` 1, labelled with the runner name and pools
``process_*``, ``python_*``                 the process itself (CPU seconds, memory, fds, GC)
==========================================  ==========================================

One registry per exporter (not the process-wide default), so the endpoint serves exactly
these; the shared sql counters are registered in it as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, start_http_server)
from prometheus_client.core import GaugeMetricFamily, Metric

import pgdispatch.sql.metrics
from pgdispatch import sql
from pgdispatch.sql import InvalidInput

log = logging.getLogger(__name__)

OUTCOMES = ("succeeded", "failed", "cancelled", "handed_back", "lost", "unreported")
# Waits from a moment (a free runner took it at once) to an hour and more (a queue behind a
# long freeze), in seconds.
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                1800.0, 3600.0, 7200.0)


class _SchedulerCollector:
    """Gauges read from the scheduler at scrape time."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        s = self.scheduler
        running = GaugeMetricFamily("pgdispatch_scheduler_running_jobs",
                                    "Jobs running in this scheduler process now.")
        running.add_metric([], len(s.running()))
        yield running
        slots = GaugeMetricFamily("pgdispatch_scheduler_slots",
                                  "Jobs this scheduler runs at once at most.")
        slots.add_metric([], s.slots)
        yield slots
        info = GaugeMetricFamily("pgdispatch_scheduler_info", "This scheduler's runner name and pools.",
                                 labels=["runner", "pools"])
        info.add_metric([s.name, ",".join(s.pools)], 1)
        yield info


class Exporter:
    """An HTTP endpoint serving one scheduler's metrics; start it before the scheduler
    registers (a port already in use then changes nothing), then ``watch`` the scheduler.

    Args:
        port: TCP port; 0 picks a free one (``self.port`` tells which).
        addr: address to listen on (default loopback; ``0.0.0.0`` for a remote Prometheus).
    Raises:
        InvalidInput: the address or port cannot be listened on.
    """

    def __init__(self, *, port: int, addr: str = "127.0.0.1"):
        self.registry = CollectorRegistry(auto_describe=True)
        for shared in (sql.metrics.CLAIM_SECONDS, sql.metrics.LEASE_EXPIRATIONS,
                       sql.metrics.EXPIRY_FAILURES, sql.metrics.TRANSACTION_RETRIES,
                       sql.metrics.STATEMENT_DEADLINES):
            self.registry.register(shared)
        for kind in ("build", "deployment"):
            sql.metrics.LEASE_EXPIRATIONS.labels(kind=kind)  # exported as 0 until one happens
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.claims = Counter("pgdispatch_claims_total",
                              "Jobs this scheduler claimed and launched.", ["kind"],
                              registry=self.registry)
        self.completions = Counter("pgdispatch_scheduler_completions_total",
                                   "Executions ended in this scheduler, by reported outcome.",
                                   ["outcome"], registry=self.registry)
        self.wait = Histogram("pgdispatch_wait_seconds",
                              "How long each job this scheduler claimed had waited, from its "
                              "ready_at to its claim, in seconds.", ["pool"],
                              buckets=WAIT_BUCKETS, registry=self.registry)
        for kind in ("build", "deployment"):
            self.claims.labels(kind=kind)
        for outcome in OUTCOMES:
            self.completions.labels(outcome=outcome)
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InvalidInput(f"cannot serve metrics on {addr}:{port}: {reason}") from None
        self.addr = addr
        self.port = self._server.server_port
        log.info("serving metrics on http://%s:%d/metrics", addr, self.port)

    def watch(self, scheduler) -> None:
        """Count ``scheduler``'s claims (and observe each claimed job's wait) and
        completions (chained before any callbacks it already has) and export its running
        jobs and slots. Call before it starts."""
        self.registry.register(_SchedulerCollector(scheduler))
        for pool in scheduler.pools:
            self.wait.labels(pool=pool)  # exported (empty) before the first claim
        on_claimed, on_completed = scheduler.on_claimed, scheduler.on_completed

        def claimed(claim) -> None:
            self.claims.labels(kind="deployment" if claim.is_deployment else "build").inc()
            if claim.wait_seconds is not None and claim.pool is not None:
                # a clock step can make ready_at look later than the claim: no negative wait
                self.wait.labels(pool=claim.pool).observe(max(claim.wait_seconds, 0.0))
            if on_claimed is not None:
                on_claimed(claim)

        def completed(result) -> None:
            self.completions.labels(outcome=result.outcome if result.is_reported and result.outcome
                                    else "unreported").inc()
            if on_completed is not None:
                on_completed(result)

        scheduler.on_claimed, scheduler.on_completed = claimed, completed

    def close(self) -> None:
        """Stop serving (the process exit does it too: the server thread is a daemon)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
