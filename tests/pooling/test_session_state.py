"""What session state does behind PgBouncer in transaction pooling, as docs/operations.md ("Deployment guide")
states it: a session-level setting made by one client stays on the server connection for
the next client of it.

pgdispatch's own one is ``sql.db.bound_idle_transactions``: every new connection sets
``idle_in_transaction_session_timeout`` for its session (unless the configuration sets one).
Behind the pooler that lands on whichever server connection ran it and applies to every
later client of that server connection, pgdispatch's or not, while a server connection that
never ran it has no bound at all: set the bound for the role or the database instead, which
the code then leaves alone.
"""

from __future__ import annotations

import psycopg
import psycopg.conninfo

from pgdispatch.sql import db


def shown_timeout(url: str) -> str:
    """``idle_in_transaction_session_timeout`` as a plain client of ``url`` sees it."""
    with psycopg.connect(url, prepare_threshold=None, autocommit=True) as conn:
        return conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0]


def test_pgdispatchs_session_bound_reaches_the_next_client_of_the_server_connection(
        db_url, pgbouncer_url):
    pooled = pgbouncer_url(db_url)
    assert shown_timeout(db_url) == "0"  # the server's default: no bound
    with db.connect(pooled):
        pass
    assert shown_timeout(pooled) == "1min"  # another client, not pgdispatch's
    assert shown_timeout(db_url) == "0"  # a direct session is its own


def test_a_bound_set_for_the_database_is_left_alone(db_url, pgbouncer_url, conn):
    name = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    conn.execute(f"ALTER DATABASE {name} SET idle_in_transaction_session_timeout = '15s'")
    pooled = pgbouncer_url(db_url)
    with db.connect(pooled):  # the pooler's first server connection to it starts now
        pass
    assert shown_timeout(pooled) == "15s"
