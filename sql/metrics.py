"""Prometheus metrics shared by the scheduler and the web processes (prometheus-client)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, disable_created_metrics

# No ``*_created`` series (the time each counter or histogram was made): Prometheus does not
# need them and nothing here documents them. Process-wide, so the web and the scheduler
# processes, which both import this module, export none.
disable_created_metrics()

TRANSACTION_RETRIES = Counter(
    "pgdispatch_transaction_retries_total",
    "Transactions retried after a deadlock (40P01) or serialization failure (40001).",
    ["name", "sqlstate"])
CLAIM_SECONDS = Histogram(
    "pgdispatch_claim_seconds", "Latency of one claim transaction, in seconds.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
EXPIRY_FAILURES = Counter(
    "pgdispatch_lease_expiry_failures_total",
    "Lapsed leases the expiry pass of this process could not end (an error on that row; the "
    "pass went on with the others, and the job's last_error says why).")
LEASE_EXPIRATIONS = Counter(
    "pgdispatch_lease_expirations_total", "Leases ended by the expiry pass in this process.",
    ["kind"])
STATEMENT_DEADLINES = Counter(
    "pgdispatch_statement_deadlines_total",
    "Answers from the database that did not come within the statement deadline (sql/db.py, "
    "Connection): the statement was cancelled and its connection closed.")
