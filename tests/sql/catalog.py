"""A database's schema as plain data, read from the system catalogs, for comparing two
databases: tables and their columns, options, constraints, indexes, triggers, composite
types and functions (each body as PostgreSQL keeps it). Only the ``public`` schema; the
migration tools' own bookkeeping tables are left out."""

from __future__ import annotations

from typing import Any

BOOKKEEPING = ("_yoyo_%", "yoyo_lock", "_pgdispatch_definitions")


def _rows(conn, sql: str) -> list[tuple]:
    return [tuple(r.values()) for r in conn.execute(sql, {"skip": list(BOOKKEEPING)})]


def describe(conn) -> dict[str, Any]:
    """``{"tables", "columns", "constraints", "indexes", "triggers", "types", "functions"}``,
    each a sorted list of tuples, for the public schema of ``conn``'s database."""
    own = ("c.relnamespace = 'public'::regnamespace AND NOT (c.relname LIKE ANY (%(skip)s))")
    return {
        "tables": sorted(_rows(conn, f"""
            SELECT c.relname, c.relkind::text, coalesce(c.reloptions, '{{}}')::text
              FROM pg_class c WHERE c.relkind IN ('r', 'p', 'v', 'm') AND {own}""")),
        "columns": sorted(_rows(conn, f"""
            SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                   a.attidentity::text, coalesce(pg_get_expr(d.adbin, d.adrelid), '')
              FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
              LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
             WHERE c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped AND {own}""")),
        "constraints": sorted(_rows(conn, f"""
            SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
              FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid WHERE {own}""")),
        "indexes": sorted(_rows(conn, f"""
            SELECT c.relname AS table_name, i.relname AS index_name, pg_get_indexdef(i.oid)
              FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
              JOIN pg_class c ON c.oid = x.indrelid WHERE {own}""")),
        "triggers": sorted(_rows(conn, f"""
            SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
              FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
             WHERE NOT t.tgisinternal AND {own}""")),
        "types": sorted(_rows(conn, """
            SELECT t.typname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod)
              FROM pg_type t JOIN pg_class c ON c.oid = t.typrelid AND c.relkind = 'c'
              JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
             WHERE t.typnamespace = 'public'::regnamespace""")),
        "functions": sorted(_rows(conn, """
            SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
              FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace""")),
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Lines saying what is in ``a`` and not in ``b`` ("-") and the reverse ("+"), per kind;
    empty when the two describe the same schema. Functions are compared by signature and
    body."""
    out = []
    for kind in a:
        left, right = set(a[kind]), set(b[kind])
        for row in sorted(left - right):
            out.append(f"- {kind}: {row[:2] if kind == 'functions' else row}")
        for row in sorted(right - left):
            out.append(f"+ {kind}: {row[:2] if kind == 'functions' else row}")
    return out


def function_source(name: str) -> str:
    """The ``CREATE OR REPLACE FUNCTION name(...) ... $$;`` statement of ``name`` as its file
    in sql/functions/ holds it, for tests that install a deliberately broken variant.

    Raises:
        AssertionError: the files define ``name`` other than exactly once.
    """
    from pgdispatch.sql import migrate

    head = f"CREATE OR REPLACE FUNCTION {name}("
    found = []
    for _, text in migrate.function_sources():
        start = text.find(head)
        while start >= 0:
            body = text.index("AS $$", start)
            found.append(text[start:text.index("$$;", body + len("AS $$")) + len("$$;")])
            start = text.find(head, start + 1)
    assert len(found) == 1, f"{name} is defined {len(found)} times in sql/functions/"
    return found[0]
