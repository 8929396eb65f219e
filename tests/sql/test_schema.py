"""One place for each truth: a database built by ``db upgrade`` from empty (the migrations,
then the function files) is the database the readable files describe (sql/schema.sql, then
sql/functions/*.sql, run as they are) — tables, columns, constraints, indexes, triggers,
types and function bodies — and the check sees a drift when there is one."""

from __future__ import annotations

import re
import shutil

import pytest

from pgdispatch.sql import PgDispatchError, db, migrate

from ..conftest import MIGRATIONS
from .catalog import describe, differences


def from_readable_files(url: str, schema_text: str | None = None) -> None:
    """Build the database the readable files describe: schema.sql, then every function
    file in load order, in one transaction."""
    with db.connect(url) as conn, conn.transaction():
        conn.execute(schema_text if schema_text is not None else migrate.SCHEMA_FILE.read_text())
        for _, text in migrate.function_sources():
            conn.execute(text)


def test_a_database_built_by_db_upgrade_is_the_one_the_readable_files_describe(new_database):
    upgraded, readable = new_database(), new_database()
    assert migrate.upgrade(upgraded) == MIGRATIONS
    from_readable_files(readable)
    with db.connect(upgraded) as a, db.connect(readable) as b:
        want, got = describe(b), describe(a)
    assert differences(want, got) == []
    # and the comparison looked at something: every kind the issue names is there
    assert {"jobs", "attempts", "capacity_stripes"} <= {t[0] for t in want["tables"]}
    assert any(f[0].startswith("pgd_claim(") for f in want["functions"])
    assert any(t[1] == "pgd_sync_stripes" for t in want["triggers"])
    assert any(i[1] == "jobs_claim_idx" for i in want["indexes"])


@pytest.mark.parametrize("drift", ["column", "index", "constraint", "function body"])
def test_the_check_sees_a_readable_file_that_drifted(new_database, drift, tmp_path):
    """The same comparison against readable files with one deliberate difference of each
    kind (as a schema.sql edit without its migration, or a function edited in the database
    by hand) reports it."""
    upgraded, readable = new_database(), new_database()
    migrate.upgrade(upgraded)
    schema = migrate.SCHEMA_FILE.read_text()
    if drift == "column":
        schema = schema.replace("    last_error           text,\n",
                                "    last_error           text,\n    note text,\n", 1)
    elif drift == "index":
        schema = schema.replace("CREATE INDEX jobs_state_idx ON jobs (state, id);",
                                "CREATE INDEX jobs_state_idx ON jobs (state);", 1)
    elif drift == "constraint":
        schema = schema.replace("CHECK (priority BETWEEN -1000 AND 1000)",
                                "CHECK (priority BETWEEN -100 AND 100)", 1)
    assert drift == "function body" or schema != migrate.SCHEMA_FILE.read_text()
    from_readable_files(readable, schema)
    with db.connect(readable) as conn:
        if drift == "function body":
            conn.execute(re.sub(r"'another actor'", "'someone'", _source("pgd_last_actor")))
        want = describe(conn)
    with db.connect(upgraded) as conn:
        got = describe(conn)
    assert differences(want, got) != []


def _source(name: str) -> str:
    from .catalog import function_source

    return function_source(name)


def test_every_function_is_defined_once_and_every_file_is_loaded():
    """One CREATE OR REPLACE per function name across sql/functions/, and no file there that
    the upgrade would not load (migrate.function_sources raises for one)."""
    names = []
    for _, text in migrate.function_sources():
        names += re.findall(r"^CREATE OR REPLACE FUNCTION (\w+)\(", text, re.M)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "pgd_claim" in names and "pgd_complete" in names
    # no function body is left in a migration, except an index expression's, which is the
    # schema's (sql/schema.sql) and never in a function file (pgd_command_text)
    schema = migrate.SCHEMA_FILE.read_text()
    for path in migrate.MIGRATIONS_DIR.glob("*.sql"):
        for name in re.findall(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(\w+)", path.read_text(), re.I):
            assert name not in names, (path.name, name)
            assert re.search(rf"^CREATE FUNCTION {name}\(", schema, re.M), (path.name, name)
            assert re.search(rf"^    USING \w+ \({name}\(", schema, re.M), (path.name, name)


def test_editing_a_function_file_and_upgrading_changes_a_live_database(db_url, tmp_path):
    """No migration pending, one function edited: `db upgrade` loads it (and says it applied
    no migration); run again, it changes nothing."""
    functions = tmp_path / "functions"
    shutil.copytree(migrate.FUNCTIONS_DIR, functions)
    audit = functions / "audit.sql"
    audit.write_text(audit.read_text().replace("'another actor'", "'someone else'"))
    with db.connect(db_url) as conn:
        before = conn.execute("SELECT pgd_last_actor('nothing') AS a, loaded_at "
                              "FROM _pgdispatch_definitions").fetchone()
        assert before["a"] == "another actor"
    reloaded = migrate.upgrade(db_url, functions_dir=functions)
    assert reloaded == [] and reloaded.functions_reloaded
    with db.connect(db_url) as conn:
        after = conn.execute("SELECT pgd_last_actor('nothing') AS a, loaded_at "
                             "FROM _pgdispatch_definitions").fetchone()
    assert after["a"] == "someone else" and after["loaded_at"] > before["loaded_at"]
    again_applied = migrate.upgrade(db_url, functions_dir=functions)
    assert again_applied == [] and not again_applied.functions_reloaded
    with db.connect(db_url) as conn:
        again = conn.execute("SELECT loaded_at FROM _pgdispatch_definitions").fetchone()
    assert again["loaded_at"] == after["loaded_at"]  # nothing to do: not even reloaded


def test_a_function_file_that_does_not_load_changes_nothing_and_is_named(db_url, tmp_path):
    """A syntax error in one file rolls the whole upgrade back (the files before it included)
    and the error names the file, in one line."""
    functions = tmp_path / "functions"
    shutil.copytree(migrate.FUNCTIONS_DIR, functions)
    audit = functions / "audit.sql"
    audit.write_text(audit.read_text().replace("'another actor'", "'someone else'"))
    claim = functions / "claim.sql"
    claim.write_text(claim.read_text().replace("RETURN QUERY SELECT v_job.id", "RETURN QUERY SELEC v_job.id", 1))
    with db.connect(db_url) as conn:
        before = conn.execute("SELECT digest, loaded_at FROM _pgdispatch_definitions").fetchone()
    with pytest.raises(PgDispatchError, match=r"^sql/functions/claim\.sql: syntax error .*\(nothing was changed\)$"):
        migrate.upgrade(db_url, functions_dir=functions)
    with db.connect(db_url) as conn:
        assert conn.execute("SELECT digest, loaded_at FROM _pgdispatch_definitions").fetchone() == before
        assert conn.execute("SELECT pgd_last_actor('nothing') AS a").fetchone()["a"] == "another actor"
