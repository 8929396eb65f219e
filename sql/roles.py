"""The database roles (docs/operations.md, "Database roles"): the group roles of
``sql/roles.sql``, the schema's owner (``sql/owner.sql``), what each group may do
(``sql/grants.sql``), and the logins that are members of a group.

Roles are cluster-wide: one server's databases share them, and creating them needs
CREATEROLE (or a superuser). Ownership and grants are per database.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from psycopg import sql as pgsql

from .db import connect
from .errors import Conflict, Forbidden, InvalidInput, PgDispatchError

SQL_DIR = Path(__file__).parent
ROLES_FILE = SQL_DIR / "roles.sql"
OWNER_FILE = SQL_DIR / "owner.sql"
GRANTS_FILE = SQL_DIR / "grants.sql"
ADVISORY_FILE = SQL_DIR / "advisory.sql"

OWNER = "pgdispatch_owner"
# `pgdispatch db login --role X`: the group role a login of each kind is made a member of
GROUPS = {"migrator": "pgdispatch_migrator", "scheduler": "pgdispatch_scheduler",
          "web": "pgdispatch_web", "reader": "pgdispatch_reader",
          "operator": "pgdispatch_operator", "admin": "pgdispatch_admin"}
ROLE_NAMES = (OWNER, *GROUPS.values())
# A login's name: an unquoted PostgreSQL identifier, not one of ours nor a pg_ role.
LOGIN_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

_STATUS = """
    SELECT r.rolsuper AS is_superuser, r.rolcreaterole AS can_create_roles,
           ARRAY(SELECT n FROM unnest(%(names)s::text[]) n
                  WHERE NOT EXISTS (SELECT 1 FROM pg_roles x WHERE x.rolname = n)) AS missing,
           EXISTS (SELECT 1 FROM pg_roles x WHERE x.rolname = %(owner)s)
           AND pg_has_role(current_user, %(owner)s, 'SET') AS may_become_owner,
           EXISTS (SELECT 1 FROM pg_roles x WHERE x.rolname = 'pgdispatch_migrator')
           AND pg_has_role(current_user, 'pgdispatch_migrator', 'SET') AS is_migrator
      FROM pg_roles r WHERE r.rolname = current_user"""


def role_status(conn) -> dict[str, Any]:
    """What the current login is and may do about the roles: ``is_superuser``,
    ``can_create_roles``, ``missing`` (the names of ROLE_NAMES that do not exist) and
    ``may_become_owner`` (it may SET ROLE pgdispatch_owner), ``is_migrator``. ``conn``: a
    connection or cursor with dict rows."""
    row = dict(conn.execute(_STATUS, {"names": list(ROLE_NAMES), "owner": OWNER}).fetchone())
    row["missing"] = list(row["missing"])
    return row


def create_roles(conn) -> None:
    """Create the group roles that are missing (``sql/roles.sql``; idempotent). A login that
    is not a superuser is made a member of pgdispatch_migrator, so that it may hand the
    schema to the owner and upgrade it.

    Raises:
        Forbidden: the login may not create roles (neither CREATEROLE nor superuser).
    """
    status = role_status(conn)
    if not (status["is_superuser"] or status["can_create_roles"]):
        raise Forbidden("creating the database roles needs a login with CREATEROLE (or a "
                        "superuser); see docs/operations.md, \"Database roles\"")
    conn.execute(ROLES_FILE.read_text())
    if not status["is_superuser"] and not role_status(conn)["is_migrator"]:
        conn.execute("GRANT pgdispatch_migrator TO CURRENT_USER WITH INHERIT TRUE, SET TRUE")


def adopt_schema(conn) -> None:
    """Make pgdispatch_owner own every object of the schema (``sql/owner.sql``); run as the
    login that owns them (or a superuser), before ``become_owner``."""
    conn.execute(OWNER_FILE.read_text())


def become_owner(conn) -> bool:
    """``SET LOCAL ROLE pgdispatch_owner`` when the login may: what the transaction then
    creates, the owner owns. Returns whether it did (call it inside a transaction)."""
    if not role_status(conn)["may_become_owner"]:
        return False
    conn.execute(f"SET LOCAL ROLE {OWNER}")
    return True


def restrict_advisory_locks(conn) -> bool:
    """When the login is a superuser: only the owner and the migrator may take advisory locks
    in this database (``sql/advisory.sql``). Returns whether it could (False: not a superuser;
    a managed server's operator runs that file as its superuser, if the provider allows)."""
    if not role_status(conn)["is_superuser"]:
        return False
    conn.execute(ADVISORY_FILE.read_text())
    return True


def apply_grants(conn) -> None:
    """Revoke everything and grant each group what ``sql/grants.sql`` says (run as the owner
    or a superuser, after the function files are loaded)."""
    conn.execute(GRANTS_FILE.read_text())


def set_up(url: str) -> dict[str, Any]:
    """``pgdispatch db roles``: in one transaction, create the missing group roles, then, if
    the database is migrated, hand every object to pgdispatch_owner and apply the grants.
    Returns {"created": [role names], "schema": "owned and granted" | "not migrated yet"}.

    Raises:
        Forbidden: the login may not create roles, or may not become the owner.
    """
    with connect(url, application_name="pgdispatch-roles") as conn, conn.transaction():
        missing = role_status(conn)["missing"]
        create_roles(conn)
        if conn.execute("SELECT to_regclass('jobs') IS NULL AS is_empty").fetchone()["is_empty"]:
            return {"created": missing, "schema": "not migrated yet: run `pgdispatch db upgrade`"}
        adopt_schema(conn)
        restrict_advisory_locks(conn)
        if not become_owner(conn):
            raise Forbidden("this login may not become pgdispatch_owner (SET ROLE): run "
                            "`pgdispatch db roles` as the database's owner or a superuser")
        apply_grants(conn)
    return {"created": missing, "schema": "owned by pgdispatch_owner, grants applied"}


def set_login(url: str, *, name: str, kind: str, password: str | None,
              connection_limit: int | None = None) -> dict[str, Any]:
    """Create or update the LOGIN role ``name`` as a member of the group of ``kind`` (a key
    of GROUPS) and of no other pgdispatch group, with ``password`` (sent to the server as a
    SCRAM-SHA-256 verifier, never in clear), and, when given, at most ``connection_limit``
    connections at once (-1: no limit), so that one runner host cannot take the server's
    every connection slot. Returns {"login", "group", "created"}.

    Raises:
        InvalidInput: a bad name, an unknown kind, an empty password, a connection limit
            below -1.
        Conflict: ``name`` is a superuser, or one of the group roles.
        Forbidden: the login running this may not manage roles.
    """
    if kind not in GROUPS:
        raise InvalidInput(f"role must be one of {', '.join(GROUPS)}, got {kind!r}")
    if not isinstance(name, str) or not LOGIN_NAME.match(name) or name.startswith("pg_"):
        raise InvalidInput("a login name is 1 to 63 lower-case letters, digits and _, not "
                           f"starting with a digit or pg_, got {name!r}")
    if name in ROLE_NAMES:
        raise Conflict(f"{name} is a group role of pgdispatch, not a login")
    if not password:
        raise InvalidInput("the password is empty")
    if connection_limit is not None and (isinstance(connection_limit, bool)
                                         or not isinstance(connection_limit, int)
                                         or not -1 <= connection_limit <= 100000):
        raise InvalidInput(f"connection limit must be -1 (none) to 100000, got {connection_limit!r}")
    group = GROUPS[kind]
    with connect(url, application_name="pgdispatch-roles") as conn, conn.transaction():
        if role_status(conn)["missing"]:
            raise PgDispatchError("the database roles do not exist yet: run `pgdispatch db "
                                  "roles` first")
        row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
        if row is not None and row["rolsuper"]:
            raise Conflict(f"{name} is a superuser; pgdispatch does not change it")
        verifier = conn.pgconn.encrypt_password(password.encode(), name.encode(),
                                                b"scram-sha-256").decode()
        ident = pgsql.Identifier(name)
        try:
            if row is None:
                conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    ident, pgsql.Literal(verifier)))
            else:
                conn.execute(pgsql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(
                    ident, pgsql.Literal(verifier)))
            for other in GROUPS.values():
                if other != group and conn.execute(
                        "SELECT EXISTS (SELECT 1 FROM pg_auth_members m WHERE m.roleid = "
                        "%s::regrole AND m.member = %s::regrole) AS is_member",
                        (other, name)).fetchone()["is_member"]:
                    conn.execute(pgsql.SQL("REVOKE {} FROM {}").format(pgsql.Identifier(other), ident))
            conn.execute(pgsql.SQL("GRANT {} TO {}").format(pgsql.Identifier(group), ident))
            if connection_limit is not None:
                conn.execute(pgsql.SQL("ALTER ROLE {} CONNECTION LIMIT {}").format(
                    ident, pgsql.Literal(int(connection_limit))))
        except Exception as exc:
            if getattr(exc, "sqlstate", None) == "42501":
                raise Forbidden(f"this login may not manage roles: {str(exc).splitlines()[0]}") from None
            raise
    return {"login": name, "group": group, "created": row is None}
