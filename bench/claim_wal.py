"""WAL written per claim: bytes of WAL (``pg_current_wal_insert_lsn`` before and after) over a
run of single claims and a run of batch claims, each a one-statement transaction as the
scheduler sends it.

Run it from the repository root::

    python -m bench claim-wal [--claims 1000] [--batch 10] [--repeats 3] [--out FILE]

Method. One server (the embedded one in a temporary directory, or ``DATABASE_URL``'s); for
every repeat a new database copied from a migrated template, one organization, pool and
project (limits never binding), ``--claims`` queued no-op jobs for the single claims and as
many for the batches, ``VACUUM ANALYZE``, then ``CHECKPOINT`` (so that both runs start with
no page already logged since a checkpoint, and their full-page images are alike). The WAL
position is read just before and just after each run from the same connection; nothing else
uses that database, but the figure is server-wide, so background work (autovacuum, a
checkpoint) would show: the median of the repeats is reported. The claim's WAL is its job and
target updates, its two stripe updates, the attempt insert and its index entries, and the
commit record; reads (of ``claim_tombstones``, for instance) and advisory locks write none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pgdispatch.sql import db, transitions

from .common import bench_server, limits, prepare, scratch_database, template_database


def wal_of(conn, fn) -> int:
    """Bytes of WAL inserted while ``fn()`` ran."""
    before = conn.execute("SELECT pg_current_wal_insert_lsn() AS l").fetchone()["l"]
    fn()
    return conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s) AS d",
                        (before,)).fetchone()["d"]


def one_run(url: str, *, claims: int, batch: int) -> dict[str, float]:
    """Bytes of WAL per claimed job: ``claims`` single claims, then ``claims`` jobs in
    batches of ``batch``."""
    [pool_id] = prepare(url, jobs=2 * claims, projects=1, limit=limits(1, binding=False))
    with db.connect(url, application_name="bench-claim-wal") as conn:
        runner = transitions.register_runner(conn, name="bench-wal", pools=["bench"], slots=claims,
                                             hostname="bench", pid=0)
        conn.execute("CHECKPOINT")

        def singles() -> None:
            for _ in range(claims):
                c = transitions.claim(conn, runner_id=runner, pools=[pool_id],
                                      claim_token=transitions.new_claim_token(), lease_seconds=600)
                assert c is not None, "ran out of jobs"

        def batches() -> None:
            for _ in range(claims // batch):
                got = transitions.claim_batch(
                    conn, runner_id=runner, pools=[pool_id], lease_seconds=600,
                    claim_tokens=[transitions.new_claim_token() for _ in range(batch)])
                assert len(got) == batch, "a batch came back short"

        single = wal_of(conn, singles)
        conn.execute("CHECKPOINT")
        batched = wal_of(conn, batches)
    return {"single_bytes_per_claim": float(single) / claims,
            "batch_bytes_per_job": float(batched) / (claims // batch * batch)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench claim-wal")
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args(argv)
    runs = []
    with bench_server() as (server_url, kind), template_database(server_url) as template:
        for _ in range(args.repeats):
            with scratch_database(server_url, "pgd_bench_wal", template=template) as url:
                runs.append(one_run(url, claims=args.claims, batch=args.batch))
    result = {"server": kind, "claims": args.claims, "batch": args.batch, "runs": runs,
              **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
