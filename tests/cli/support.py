"""What the CLI tests share (tests/cli, tests/pooling/test_cli.py): a small config for
``pgdispatch apply`` and running ``pgdispatch`` as an operator does, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ALICE_PASSWORD = "correct horse battery"

CONFIG = """
[[organizations]]
name = "acme"
max_running = 5

[[pools]]
name = "linux"
slots = 8

[[pools]]
name = "deploy"
slots = 2

[[projects]]
name = "web"
organization = "acme"
pools = ["linux", "deploy"]
weight = 1
max_running = 3

[[targets]]
name = "production"

[[users]]
username = "alice"
role = "operator"
password_env = "ALICE_PASSWORD"
"""


def run_pgdispatch(url: str, cwd: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    """``pgdispatch ARGS`` with DATABASE_URL ``url`` in folder ``cwd``, no PGDISPATCH_*
    setting but ``env_extra``; waits for it (60 s at most). Its actions are audited as the
    URL's database login (the CLI names no actor of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=url, ALICE_PASSWORD=ALICE_PASSWORD, **env_extra)
    return subprocess.run([sys.executable, "-m", "pgdispatch", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)
