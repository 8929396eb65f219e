"""A hostile job (tests/security/test_job_sandbox.py): it tries every way it knows to reach its
scheduler's credentials and prints, as one JSON line, what it got.

Run by the scheduler as ``python3 hostile_job.py DATA_DIR SCHEDULER_DIR SOCKET_PATH PORT``
(none of them a secret). Standard library only: it runs as another user, outside the venv.
"""

import glob
import json
import os
import socket
import struct
import sys

data_dir, scheduler_dir, socket_path, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
me = os.getuid()
got = {}


def read(path, limit=4000):
    """The first ``limit`` bytes of ``path`` as text, None when it cannot be read (the report
    must fit in the scheduler's 64 KiB output tail)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace").replace("\0", " ")
    except OSError:
        return None


# the scheduler's environment, and every other user's process environment
ppid = os.getppid()
got["scheduler_environ"] = read(f"/proc/{ppid}/environ")
others = {}
for proc in glob.glob("/proc/[0-9]*"):
    try:
        if os.stat(proc).st_uid == me:
            continue
    except OSError:
        continue
    text = read(f"{proc}/environ", 200)
    if text:
        others[proc] = text
got["other_environs"] = others
# readable by everyone: it must hold no password (the test looks for it in this output)
got["scheduler_cmdline"] = read(f"/proc/{ppid}/cmdline") or ""
try:
    got["scheduler_cwd"] = os.readlink(f"/proc/{ppid}/cwd")
except OSError:
    got["scheduler_cwd"] = None

# the data directory: its listing and every file in it
files = {}
try:
    got["data_dir_listing"] = os.listdir(data_dir)
except OSError:
    got["data_dir_listing"] = None
for name in ("pgpass", "secret_key", "pgdata/pg_hba.conf", "pgdata/postgresql.auto.conf",
             "pgdata/PG_VERSION", "pgdata/global/pg_control"):
    text = read(os.path.join(data_dir, name), 300)
    if text is not None:
        files[name] = text
for root, dirs, names in os.walk(data_dir):
    for name in names:
        path = os.path.join(root, name)
        name = os.path.relpath(path, data_dir)
        if name not in files and len(files) < 40 and read(path, 1) is not None:
            files[name] = "(readable)"
got["data_dir_files"] = files

# its own environment
got["credential_env"] = {k: v for k, v in os.environ.items()
                         if k in ("DATABASE_URL", "PGPASSWORD", "PGPASSFILE", "PGSERVICEFILE")
                         or (k.startswith("PGDISPATCH_") and not k.startswith("PGDISPATCH_JOB_")
                             and k not in ("PGDISPATCH_ATTEMPT", "PGDISPATCH_ATTEMPT_ID",
                                           "PGDISPATCH_GENERATION"))}
got["env_names"] = sorted(os.environ)

# descriptors inherited from the scheduler (its database sockets)
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
got["inherited_fds"] = {fd: target for fd, target in fds.items()
                        if fd not in ("0", "1", "2") and os.path.exists(f"/proc/self/fd/{fd}")}


def startup(sock):
    """Send a startup message as postgres; say what the server answers."""
    body = struct.pack("!i", 196608) + b"user\0postgres\0database\0postgres\0\0"
    sock.sendall(struct.pack("!i", len(body) + 4) + body)
    kind = sock.recv(1)
    if kind == b"R":
        _, code = struct.unpack("!ii", sock.recv(8))
        return "authenticated without a password" if code == 0 else f"asked for a password ({code})"
    return f"refused ({kind!r})"


# the database, as its superuser, without a password: every socket it can find, and loopback
connections = {}
sockets = {socket_path, *glob.glob("/tmp/**/.s.PGSQL.*", recursive=True),
           *glob.glob("/run/**/.s.PGSQL.*", recursive=True),
           *glob.glob("/var/run/postgresql/.s.PGSQL.*")}
for path in sorted(p for p in sockets if not p.endswith(".lock")):
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(3)
            s.connect(path)
            connections[path] = startup(s)
    except OSError as exc:
        connections[path] = f"cannot connect: {exc.strerror or exc}"
for host in ("127.0.0.1", "::1"):
    for p in sorted({port, 5432}):
        try:
            with socket.create_connection((host, p), timeout=3) as s:
                connections[f"{host}:{p}"] = startup(s)
        except OSError as exc:
            connections[f"{host}:{p}"] = f"cannot connect: {exc.strerror or exc}"
got["connections"] = connections

# writing into the scheduler's directories
written = []
for folder in (scheduler_dir, data_dir, os.path.join(data_dir, "pgdata")):
    path = os.path.join(folder, "written-by-a-job")
    try:
        with open(path, "w") as f:
            f.write("x")
        written.append(path)
    except OSError:
        pass
got["written"] = written

got["uid"], got["gid"], got["groups"] = os.getuid(), os.getgid(), sorted(os.getgroups())
got["cwd"], got["home"] = os.getcwd(), os.environ.get("HOME")
print("REPORT " + json.dumps(got))
