"""Times read from the database are always times Python can hold.

PostgreSQL's timestamptz runs from 4713 BC to 294276 AD and holds ``±infinity``; Python's
datetime runs from year 1 to 9999. psycopg raises DataError ("timestamp too large (after
year 10K)") for a value outside Python's range, so one such value in a row made every read
of that row fail: ``jobs show``, the job page, the queue, the API (issue 16). Every time the
database computes now is near (``now()`` plus at most 30 days of backoff or delay, or a day
of lease: sql/functions/complete.sql, submit.sql, claim.sql, sql/attempts.sql); such a
value can still be stored by hand or by a release before those bounds. It is loaded as the
nearer of EARLIEST and LATEST instead: a job ready at 'infinity' is shown ready on
9999-12-30, which is what it means to an operator, and every other time is loaded as it is.

Registered on each connection pgdispatch opens (sql/db.py, ``connect`` and ``make_pool``),
not on psycopg's global adapters: other users of psycopg in the same process (a benchmark's
peer) keep psycopg's own loaders.
"""

from __future__ import annotations

import datetime as dt
import functools

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import Format

# A day inside Python's limits, so that converting either to any time zone (at most ±26 h
# from UTC) still gives a datetime; the console converts every time to UTC to show it.
LATEST = dt.datetime(9999, 12, 30, tzinfo=dt.timezone.utc)
EARLIEST = dt.datetime(1, 1, 2, tzinfo=dt.timezone.utc)


def _is_before(data: bytes | memoryview, fmt: Format) -> bool:
    """Whether a timestamp psycopg could not load lies before year 1 (else after 9999)."""
    raw = bytes(data)
    if fmt == Format.BINARY:
        # microseconds since 2000-01-01, big-endian int64 (-infinity is its minimum)
        return int.from_bytes(raw, "big", signed=True) < 0
    # ISO DateStyle, the one psycopg reads: "-infinity", "4713-01-01 00:00:00+00 BC"
    return raw.startswith(b"-") or raw.rstrip().endswith(b"BC")


@functools.cache
def _clamping(base: type[Loader]) -> type[Loader]:
    """A loader that loads as ``base`` does, and an out-of-range time as EARLIEST or LATEST."""

    class Clamped(Loader):
        format = base.format

        def __init__(self, oid: int, context=None):
            super().__init__(oid, context)
            self._load = base(oid, context).load

        def load(self, data):
            try:
                return self._load(data)
            except psycopg.DataError:
                return EARLIEST if _is_before(data, self.format) else LATEST

    Clamped.__name__ = Clamped.__qualname__ = f"Clamped{base.__name__}"
    return Clamped


def register(adapters) -> None:
    """Make ``adapters`` (a connection's) load timestamptz values, text and binary, through
    ``_clamping``. Idempotent. pgdispatch's schema has no other time type."""
    oid = adapters.types["timestamptz"].oid
    for fmt in (Format.TEXT, Format.BINARY):
        base = adapters.get_loader(oid, fmt)
        if base is None or base.__name__.startswith("Clamped"):
            continue
        adapters.register_loader(oid, _clamping(base))
