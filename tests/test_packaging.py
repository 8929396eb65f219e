"""The package owns its import names: installed, pgdispatch is ``pgdispatch.sql``,
``pgdispatch.scheduler`` and ``pgdispatch.webapp`` (pyproject.toml), so PyPI's ``scheduler``
or python-sql's ``sql`` can sit beside it; and no code of ours imports the bare folder names,
which only exist in a source checkout."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import MIGRATIONS

ROOT = Path(__file__).resolve().parent.parent
BARE = {"sql", "scheduler", "webapp"}


# an import in a string of code that a test or a benchmark runs with `python -c`
IN_STRINGS = re.compile(r"(?:from\s+(sql|scheduler|webapp)(?:\.\w+)*\s+import\b"
                        r"|(?<![\w.])import\s+(sql|scheduler|webapp)\b(?!\s+as\b)(?![\w.]*\s+import))")


def bare_imports(source: str) -> list[str]:
    """The absolute imports of ``source`` whose first name is one of the bare folder names,
    in its code or in the strings of code it runs."""
    found = [m.group(1) or m.group(2) for m in IN_STRINGS.finditer(source)
             if not source[:m.start()].endswith("from pgdispatch ")]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in BARE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in BARE:
            found.append(node.module)
    return sorted(set(found))


def test_no_module_imports_the_bare_folder_names():
    # the check itself sees them, in code and in a string of code
    assert bare_imports("import sql.db\nfrom scheduler import main\nfrom . import x\n") == [
        "scheduler", "sql", "sql.db"]
    assert bare_imports('code = "import sys; from webapp.serve import serve"\n') == ["webapp"]
    assert bare_imports("from pgdispatch.sql import db\nimport pgdispatch.webapp.db\n") == []
    offenders = {}
    for folder in ("pgdispatch", "sql", "scheduler", "webapp", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if folder == "pgdispatch" and path.relative_to(ROOT / folder).parts[0] in BARE:
                continue  # the symbolic links to the folders scanned on their own
            if path == Path(__file__).resolve():
                continue  # its examples above
            names = bare_imports(path.read_text())
            if names:
                offenders[str(path.relative_to(ROOT))] = names
    assert offenders == {}


CLAIM = textwrap.dedent("""
    import json, os, scheduler
    from pgdispatch.sql import db, transitions
    import pgdispatch.scheduler.main
    with db.connect(os.environ["DATABASE_URL"]) as conn:
        runner = transitions.register_runner(conn, name="wheel", pools=["linux"], slots=1)
        pools = [r["id"] for r in conn.execute("SELECT id FROM pools WHERE name = 'linux'")]
        c = transitions.claim(conn, runner_id=runner, pools=pools,
                              claim_token=transitions.new_claim_token(), lease_seconds=30)
    print(json.dumps({"job_id": c.job_id, "scheduler": scheduler.__file__,
                      "ours": pgdispatch.scheduler.main.__file__}))
""")


def test_the_wheel_installs_beside_pypi_scheduler_and_claims(tmp_path, new_database):
    """Built as a wheel (without a setuptools warning) and installed into a clean venv
    together with PyPI's `scheduler`, pgdispatch migrates an empty database from the files it ships, takes a job and claims
    it; `import scheduler` there is PyPI's, ours is pgdispatch.scheduler."""
    empty_database = new_database()
    wheels = tmp_path / "wheels"
    # verbose: the build backend's own output, where setuptools warns (make demo's first run
    # printed "Package 'pgdispatch.static' is absent from the `packages` configuration" for
    # every data folder); the package configuration of pyproject.toml leaves it nothing to say
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps",
                            "-w", str(wheels), str(ROOT)], check=True, capture_output=True,
                           text=True, timeout=300)
    assert re.findall(r"_Warning: .*|SetuptoolsDeprecationWarning: .*", built.stdout + built.stderr) == []
    wheel = next(wheels.glob("pgdispatch-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_ = venv / "bin"
    installed = subprocess.run([str(bin_ / "pip"), "install", "--quiet", str(wheel), "scheduler"],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "DATABASE_URL": empty_database}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(bin_ / "pgdispatch"), *args], env=env, cwd=tmp_path, text=True,
                              capture_output=True, timeout=120, input=stdin)
        assert proc.returncode == 0, (args, proc.stderr)
        return proc

    assert "Usage: pgdispatch" in run("--help").stdout
    assert json.loads(run("db", "upgrade", "--json").stdout)["applied"] == MIGRATIONS
    config = tmp_path / "config.toml"
    config.write_text('[[organizations]]\nname = "acme"\nmax_running = 2\n'
                      '[[pools]]\nname = "linux"\nslots = 2\n'
                      '[[projects]]\nname = "web"\norganization = "acme"\npools = ["linux"]\n')
    run("apply", str(config))
    job = json.loads(run("submit", "--project", "web", "--pool", "linux", "--", "true").stdout)
    proc = subprocess.run([str(bin_ / "python"), "-c", CLAIM], env=env, cwd=tmp_path, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["job_id"] == job["id"]
    site = str(venv / "lib")
    assert got["scheduler"].startswith(site) and "pgdispatch" not in got["scheduler"]
    assert got["ours"].startswith(site) and "/pgdispatch/scheduler/" in got["ours"]
    assert os.path.exists(Path(got["ours"]).parent.parent / "templates" / "base.html")
