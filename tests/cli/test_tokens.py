"""``pgdispatch tokens create | list | revoke`` as an admin's login runs them: expiry, listing
without hashes, revocation, and the database deciding who acts (no --actor, no
PGDISPATCH_ACTOR)."""

from __future__ import annotations

import json
import uuid

import pytest

from pgdispatch.sql import accounts, db

from ..conftest import as_login
from .support import CONFIG, run_pgdispatch


@pytest.fixture
def pgd(db_url, tmp_path):
    def run(*args: str, check: bool = True, url: str | None = None, **env):
        proc = run_pgdispatch(url or db_url, tmp_path, *args, **env)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    (tmp_path / "config.toml").write_text(CONFIG)
    run("apply", str(tmp_path / "config.toml"))
    return run


def _authenticates(conn, token: str) -> bool:
    return accounts.find_api_token(conn, token=token) is not None


def test_create_list_revoke(pgd, conn):
    token = pgd("tokens", "create", "--user", "alice", "--name", "ci", "--expires-in", "3600"
                ).stdout.strip()
    assert _authenticates(conn, token)
    listed = pgd("tokens", "list", "--json").stdout
    [row] = json.loads(listed)
    assert (row["username"], row["name"], row["is_live"]) == ("alice", "ci", True)
    assert row["expires_at"] is not None and token not in listed
    stored_hash = conn.execute("SELECT token_hash FROM api_tokens").fetchone()["token_hash"]
    assert stored_hash not in listed and stored_hash not in pgd("tokens", "list").stdout
    assert "live" in pgd("tokens", "list").stdout
    out = pgd("tokens", "revoke", str(row["id"]), "--reason", "rotated").stdout
    assert out.strip() == f"token {row['id']} of alice revoked"
    assert not _authenticates(conn, token)
    again = pgd("tokens", "revoke", str(row["id"]), check=False)
    assert again.returncode == 4 and "already revoked" in again.stderr
    missing = pgd("tokens", "revoke", "999999", check=False)
    assert missing.returncode == 3 and len(missing.stderr.strip().splitlines()) == 1
    actions = [r["action"] for r in conn.execute(
        "SELECT action FROM audit_events WHERE subject = 'user:alice' ORDER BY id")]
    assert actions == ["create_api_token", "revoke_api_token"]


def test_an_expired_token_authenticates_nothing(pgd, conn):
    token = pgd("tokens", "create", "--user", "alice", "--expires-at",
                "2999-01-01T00:00:00+00:00").stdout.strip()
    assert _authenticates(conn, token)
    # test-only: move the expiry into the past rather than wait for it
    conn.execute("UPDATE api_tokens SET expires_at = now() - interval '1 second'")
    assert not _authenticates(conn, token)
    [row] = json.loads(pgd("tokens", "list", "--json").stdout)
    assert row["is_live"] is False and row["revoked_at"] is None
    assert "expired" in pgd("tokens", "list").stdout


@pytest.mark.parametrize("args, message", [
    (("--expires-in", "0"), "expires-in"),
    (("--expires-at", "tomorrow"), "ISO 8601"),
    (("--expires-at", "2999-01-01T00:00:00"), "UTC offset"),
    (("--expires-at", "2000-01-01T00:00:00+00:00"), "not in the future"),
    (("--expires-in", "60", "--expires-at", "2999-01-01T00:00:00+00:00"), "not both"),
])
def test_a_bad_expiry_is_one_line_exit_2_and_changes_nothing(pgd, conn, args, message):
    proc = pgd("tokens", "create", "--user", "alice", *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert conn.execute("SELECT count(*) AS n FROM api_tokens").fetchone()["n"] == 0


def test_disabling_revokes_tokens_and_enabling_revives_none(pgd, conn):
    token = pgd("tokens", "create", "--user", "alice").stdout.strip()
    accounts.upsert_user(conn, username="ada", password="ada-admin-password", role="admin")
    accounts.set_user_disabled(conn, username="alice", is_disabled=True, actor="ada")
    assert not _authenticates(conn, token)
    accounts.set_user_disabled(conn, username="alice", is_disabled=False, actor="ada")
    assert not _authenticates(conn, token)
    [row] = json.loads(pgd("tokens", "list", "--json").stdout)
    assert row["revoked_at"] is not None


def test_there_is_no_actor_flag_or_variable(pgd, conn):
    flag = pgd("tokens", "create", "--user", "alice", "--actor", "ada", check=False)
    assert flag.returncode == 2 and "--actor" in flag.stderr
    pgd("projects", "pause", "web", "--reason", "freeze", PGDISPATCH_ACTOR="ada")
    [event] = conn.execute("SELECT actor FROM audit_events WHERE action = 'pause_project'").fetchall()
    assert event["actor"] == conn.info.user != "ada"


def test_a_login_that_is_not_an_admins_cannot_mint_a_token(pgd, conn, server_url, db_url):
    """``PGDISPATCH_ACTOR=view pgdispatch tokens create --user adm`` minted an admin token;
    now a login outside pgdispatch_admin is refused by the database (pgd_authorize), whatever
    the environment says, and nothing is written."""
    login = f"pgd_test_plain_{uuid.uuid4().hex[:8]}"
    with db.connect(server_url) as admin_conn:
        admin_conn.execute(f"CREATE ROLE {login} LOGIN PASSWORD 'plain-login-pw'")
    try:
        accounts.upsert_user(conn, username="ada", password="ada-admin-password", role="admin")
        before = conn.execute("SELECT (SELECT count(*) FROM api_tokens) AS t, "
                              "(SELECT count(*) FROM audit_events) AS a").fetchone()
        url = as_login(db_url, login, "plain-login-pw")
        proc = pgd("tokens", "create", "--user", "ada", check=False, url=url,
                   PGDISPATCH_ACTOR="ada")
        assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "pgdispatch_admin" in proc.stderr or "permission denied" in proc.stderr, proc.stderr
        assert not proc.stdout.strip().startswith("pgd_")
        after = conn.execute("SELECT (SELECT count(*) FROM api_tokens) AS t, "
                             "(SELECT count(*) FROM audit_events) AS a").fetchone()
        assert after == before
    finally:
        with db.connect(server_url) as admin_conn:
            admin_conn.execute(f"DROP OWNED BY {login}")
            admin_conn.execute(f"DROP ROLE {login}")
