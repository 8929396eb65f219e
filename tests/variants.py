"""Deliberately changed copies of the database's functions, for tests that show a check can
fail (and for the fairness benchmark's claim variants).

A variant is built from the definition the database runs, read with ``pg_get_functiondef``,
whatever file holds its source; installed, it replaces the real function in that database
only. ``pg_get_functiondef`` renders ``CREATE OR REPLACE FUNCTION public.name(...)`` and the
header its own way, but gives the body between its ``$function$`` quotes verbatim, so the
text a variant replaces is the text of the source file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# The last ORDER BY of a function body up to its LIMIT (pgd_claim_candidates: the fairness
# order); an ORDER BY inside an EXISTS ends in LIMIT 1 OFFSET 0 and is passed over.
_FINAL_ORDER_BY = re.compile(r"(\n\s*ORDER BY )((?:(?!ORDER BY).)*?)(\n\s*LIMIT \d+;?)(?=\n)", re.S)


def function_sql(conn, name: str) -> str:
    """``CREATE OR REPLACE FUNCTION ...`` of the function ``name`` as the database on
    ``conn`` defines it. Fails when no function, or more than one, has that name."""
    rows = conn.execute("SELECT pg_get_functiondef(p.oid) AS sql FROM pg_proc p WHERE p.proname = %s",
                        (name,)).fetchall()
    assert len(rows) == 1, f"{len(rows)} functions named {name}; a variant needs exactly one"
    return rows[0]["sql"]


def variant_sql(conn, name: str, replace: Sequence[tuple[str, str]] = (), *,
                order_by: str | None = None) -> str:
    """``function_sql(conn, name)`` with each ``(old, new)`` of ``replace`` substituted (each
    ``old`` must occur) and, when given, its final ORDER BY (up to its LIMIT) replaced by
    ``order_by``. Execute it to install the variant."""
    sql = function_sql(conn, name)
    for old, new in replace:
        assert old in sql, f"not in the live {name}: {old!r}; update the variant with the function"
        sql = sql.replace(old, new)
    if order_by is not None:
        sql, n = _FINAL_ORDER_BY.subn(lambda m: m.group(1) + order_by + m.group(3), sql, count=1)
        assert n == 1, f"no final ORDER BY ... LIMIT n in the live {name}"
    return sql


def candidate_order(conn) -> str:
    """The fairness ORDER BY of the live pgd_claim_candidates, on one line (for reports)."""
    match = _FINAL_ORDER_BY.search(function_sql(conn, "pgd_claim_candidates"))
    assert match, "pgd_claim_candidates' ORDER BY not found: update tests/variants.py"
    return " ".join(match.group(2).split())
