"""``python -m scheduler --pool Q [--pool Q2] --slots N [--name NAME] [--grace-seconds S]
[--max-batch N] [--no-listen] [--run-as USER]``:
the same flags as ``pgdispatch scheduler``, settings from the environment (Settings.from_env)."""

from __future__ import annotations

import argparse
import logging
import sys

from pgdispatch.sql import PgDispatchError, Settings
from pgdispatch.sql.embedded import database_url

from .claiming import DEFAULT_MAX_BATCH
from .main import run
from .sandbox import from_settings


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the scheduler until SIGTERM/SIGINT; returns the exit code (2 and
    one line on stderr for bad input)."""
    parser = argparse.ArgumentParser(prog="python -m scheduler")
    parser.add_argument("--pool", action="append", required=True, dest="pools")
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--name")
    parser.add_argument("--grace-seconds", type=float, default=30.0)
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    parser.add_argument("--listen", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--run-as", dest="run_as")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env().with_overrides(run_as=args.run_as)
        sandbox = from_settings(settings, slots=args.slots)  # refused before the database is touched
        return run(settings, database_url=database_url(settings), pools=args.pools, sandbox=sandbox,
                   slots=args.slots, name=args.name, grace_seconds=args.grace_seconds,
                   max_batch=args.max_batch, listen=args.listen)
    except PgDispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
