"""``pgdispatch apply FILE.toml``: declare organizations, pools, projects, targets, runner hosts'
pool grants and users.

The file is validated whole before anything is written, then applied in one transaction:
idempotent (applying the same file twice changes nothing) and all-or-nothing.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

from .db import in_transaction
from .errors import InvalidInput
from . import roles
from .queries import Q
from .accounts import ROLES, declare_user
from .validate import _shown, check_int, check_text

SECTIONS = ("organizations", "pools", "projects", "targets", "runners", "users")
# who may approve a deployment to a protected target (targets.approver_role)
APPROVER_ROLES = ("operator", "admin")
# the order deployments to a target are claimed in (targets.deploy_order)
DEPLOY_ORDERS = ("oldest_first", "newest_ready_first")
# The names the tables' CHECKs accept (sql/schema.sql): checked here first, so that a bad
# name is refused with its entry named instead of with the constraint's name.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
USERNAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}")


def _entries(doc: dict[str, Any], section: str, allowed: set[str], required: set[str]) -> list[dict]:
    entries = doc.get(section, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise InvalidInput(f"[[{section}]] must be an array of tables")
    seen = set()
    for i, entry in enumerate(entries):
        where = f"{section}[{i}]"
        unknown = set(entry) - allowed
        if unknown:
            raise InvalidInput(f"{where}: unknown key {sorted(unknown)[0]!r}")
        missing = required - set(entry)
        if missing:
            raise InvalidInput(f"{where}: missing key {sorted(missing)[0]!r}")
        for k in ("name", "username", "login", "organization", "role", "password_env", "approver_role",
                  "deploy_order"):
            if k in entry and not isinstance(entry[k], str):
                raise InvalidInput(f"{where}: {k} must be a string")
        for k, pattern, allowed_chars in (("name", NAME_RE, "letters, digits, '_', '.', '-'"),
                                          ("username", USERNAME_RE, "letters, digits, '_', '.', '@', '-'"),
                                          ("login", USERNAME_RE, "letters, digits, '_', '.', '@', '-'")):
            if k in entry and not pattern.fullmatch(entry[k]):
                raise InvalidInput(f"{where}: {k} {_shown(entry[k])} is not allowed: 1 to 63 of "
                                   f"{allowed_chars}, starting with a letter or digit")
        key = entry.get("name", entry.get("username", entry.get("login")))
        if key in seen:
            raise InvalidInput(f"{where}: {key!r} is declared twice")
        seen.add(key)
    return entries


def load_config(text: str, env: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Parse and validate an apply file; passwords are read from their ``password_env``.

    Returns:
        {"organizations": [...], "pools": [...], "projects": [...], "targets": [...],
         "users": [{"username", "role", "password"}]}.
    Raises:
        InvalidInput: bad TOML, unknown or missing keys, values out of range, a missing
        password variable.
    """
    env = os.environ if env is None else env
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        # tomllib recurses per nested array or inline table; no valid file nests past four
        raise InvalidInput("not valid TOML: arrays or inline tables nested too deeply") from None
    except ValueError as exc:  # TOMLDecodeError; an integer of more than 4300 digits
        raise InvalidInput(f"not valid TOML: {' '.join(str(exc).split())[:200]}") from None
    unknown = set(doc) - set(SECTIONS)
    if unknown:
        raise InvalidInput(f"unknown section {sorted(unknown)[0]!r}")
    orgs = _entries(doc, "organizations", {"name", "max_running"}, {"name", "max_running"})
    pools = _entries(doc, "pools", {"name", "slots"}, {"name", "slots"})
    projects = _entries(doc, "projects", {"name", "organization", "pools", "weight", "max_running",
                                          "supersede_targets"},
                        {"name", "organization"})
    targets = _entries(doc, "targets", {"name", "requires_approval", "approver_role", "supersede",
                                        "deploy_order"}, {"name"})
    # None: the file says nothing of runner hosts, and their grants stay as they are
    runners = (_entries(doc, "runners", {"login", "pools"}, {"login", "pools"})
               if "runners" in doc else None)
    users = _entries(doc, "users", {"username", "role", "password_env"},
                     {"username", "role", "password_env"})
    for e in orgs:
        check_text("organization name", e["name"], max_len=63)
        e["max_running"] = check_int(f"organization {e['name']} max_running", e["max_running"], 0, 100000, strict=True)
    for e in pools:
        check_text("pool name", e["name"], max_len=63)
        e["slots"] = check_int(f"pool {e['name']} slots", e["slots"], 0, 100000, strict=True)
    for e in projects:
        check_text("project name", e["name"], max_len=63)
        check_text(f"project {e['name']} organization", e["organization"], max_len=63)
        e["weight"] = check_int(f"project {e['name']} weight", e.get("weight", 1), 1, 1000, strict=True)
        if e.get("max_running") is not None:
            e["max_running"] = check_int(f"project {e['name']} max_running", e["max_running"], 0, 100000, strict=True)
        else:
            e["max_running"] = None
        e["pools"] = e.get("pools", [])
        if not isinstance(e["pools"], list):
            raise InvalidInput(f"project {e['name']} pools must be a list of pool names")
        for p in e["pools"]:
            check_text(f"project {e['name']} pool", p, max_len=63)
        st = e.get("supersede_targets", [])
        if not isinstance(st, list) or not all(isinstance(t, str) for t in st):
            raise InvalidInput(f"project {e['name']} supersede_targets must be a list of target names")
        for t in st:
            check_text(f"project {e['name']} supersede target", t, max_len=63)
        e["supersede_targets"] = sorted(set(st))
    for e in targets:
        check_text("target name", e["name"], max_len=63)
        if not isinstance(e.setdefault("requires_approval", False), bool):
            raise InvalidInput(f"target {e['name']}: requires_approval must be true or false")
        if "approver_role" in e and not e["requires_approval"]:
            raise InvalidInput(f"target {e['name']}: approver_role needs requires_approval = true")
        e.setdefault("approver_role", "operator")
        if e["approver_role"] not in APPROVER_ROLES:
            raise InvalidInput(f"target {e['name']}: approver_role must be one of {', '.join(APPROVER_ROLES)}")
        if not isinstance(e.setdefault("supersede", False), bool):
            raise InvalidInput(f"target {e['name']}: supersede must be true or false")
        if e.setdefault("deploy_order", "oldest_first") not in DEPLOY_ORDERS:
            raise InvalidInput(f"target {e['name']}: deploy_order must be one of {', '.join(DEPLOY_ORDERS)}")
    for e in runners or []:
        if not isinstance(e["pools"], list) or not all(isinstance(p, str) for p in e["pools"]):
            raise InvalidInput(f"runner login {e['login']}: pools must be a list of pool names")
        for p in e["pools"]:
            check_text(f"runner login {e['login']} pool", p, max_len=63)
        e["pools"] = sorted(set(e["pools"]))
    out_users = []
    for e in users:
        check_text("username", e["username"], max_len=63)
        if e["role"] not in ROLES:
            raise InvalidInput(f"user {e['username']}: role must be one of {', '.join(ROLES)}")
        password = env.get(e["password_env"])
        if not password:
            raise InvalidInput(f"user {e['username']}: environment variable {e['password_env']} is not set")
        if len(password) < 8:
            raise InvalidInput(f"user {e['username']}: password must be at least 8 characters")
        out_users.append({"username": e["username"], "role": e["role"], "password": password})
    return {"organizations": orgs, "pools": pools, "projects": projects, "targets": targets,
            "runners": runners, "users": out_users}


def _apply(conn, cfg: dict[str, list[dict]], actor: str | None) -> dict[str, int]:
    # apply writes the tables directly, as their owner: a migrator's login (or a superuser)
    # may become pgdispatch_owner for this transaction (docs/operations.md, "Database
    # roles"); any other login meets PostgreSQL's "permission denied" (Forbidden).
    roles.become_owner(conn)
    if actor is None:
        actor = conn.execute("SELECT session_user AS login").fetchone()["login"]
    org_names = {r["name"] for r in Q.list_organizations(conn)} | {o["name"] for o in cfg["organizations"]}
    pool_names = {r["name"] for r in Q.list_pools(conn)} | {p["name"] for p in cfg["pools"]}
    target_names = set(Q.list_target_names(conn)) | {t["name"] for t in cfg["targets"]}
    for p in cfg["projects"]:
        if p["organization"] not in org_names:
            raise InvalidInput(f"project {p['name']}: unknown organization {p['organization']}")
        for pool in p["pools"]:
            if pool not in pool_names:
                raise InvalidInput(f"project {p['name']}: unknown pool {pool}")
        for target in p["supersede_targets"]:
            if target not in target_names:
                raise InvalidInput(f"project {p['name']}: supersede_targets names unknown target {target}")
        current = Q.get_project_organization(conn, name=p["name"])
        if current is not None and current != p["organization"]:
            raise InvalidInput(f"project {p['name']} belongs to {current}; it cannot move to {p['organization']}")
    # Targets first: inserting a target name waits for any transaction that has just updated
    # that target (claims, completions, expiry of deployments), and those go on to lock the
    # project; holding a project meanwhile would close a cycle (found by a stress run).
    for r in cfg["runners"] or []:
        for pool in r["pools"]:
            if pool not in pool_names:
                raise InvalidInput(f"runner login {r['login']}: unknown pool {pool}")
    changed = 0
    for t in sorted(cfg["targets"], key=lambda e: e["name"]):
        changed += Q.upsert_target(conn, name=t["name"], requires_approval=t["requires_approval"],
                                   approver_role=t["approver_role"], supersede=t["supersede"],
                                   deploy_order=t["deploy_order"])
        # only a changed rule writes (and so locks) an existing target
        changed += Q.set_target_rule(conn, name=t["name"], requires_approval=t["requires_approval"],
                                     approver_role=t["approver_role"], supersede=t["supersede"],
                                     deploy_order=t["deploy_order"])
    # Then the existing rows are locked, in the documented lock order (projects, then
    # organizations, then pools, each kind by id), because an upsert locks its row even when
    # nothing changes; upserting in another order deadlocks against claims and completions.
    # The upserts that follow wait for nothing: each row is either locked already or new.
    projects = sorted(cfg["projects"], key=lambda e: e["name"])
    list(Q.lock_declared_projects(conn, names=[p["name"] for p in projects]))
    org_ids = {r["name"]: r["id"] for r in Q.lock_declared_organizations(
        conn, names=[o["name"] for o in cfg["organizations"]])}
    pool_ids = {r["name"]: r["id"] for r in Q.lock_declared_pools(
        conn, names=[p["name"] for p in cfg["pools"]])}
    # Existing organizations and pools are upserted by id, new ones after: a changed limit
    # locks every stripe of its owner (sql/functions/capacity.sql), and releases lock stripes by kind,
    # owner id and stripe number, so the two take the stripes of several owners in the same
    # order.
    for o in sorted(cfg["organizations"], key=lambda e: _by_id(org_ids, e["name"])):
        changed += Q.upsert_organization(conn, name=o["name"], max_running=o["max_running"])
    for p in projects:
        changed += Q.upsert_project(conn, name=p["name"], organization=p["organization"],
                                    weight=p["weight"], max_running=p["max_running"])
    for p in sorted(cfg["pools"], key=lambda e: _by_id(pool_ids, e["name"])):
        changed += Q.upsert_pool(conn, name=p["name"], slots=p["slots"])
    for p in projects:
        changed += Q.set_project_pools(conn, project=p["name"], pools=p["pools"])
        changed += Q.revoke_other_pools(conn, project=p["name"], pools=p["pools"])
        # a project-and-target pair that supersedes: exactly the listed targets
        changed += Q.set_project_supersede_targets(conn, project=p["name"], targets=p["supersede_targets"])
        changed += Q.revoke_other_supersede_targets(conn, project=p["name"], targets=p["supersede_targets"])
    if cfg["runners"] is not None:
        # A [[runners]] section is the whole truth about runner hosts: exactly these pools for
        # these logins, and none for a login it does not name. Claims only read the grants
        # and check them on every claim and heartbeat: a revocation takes effect at commit.
        for r in sorted(cfg["runners"], key=lambda e: e["login"]):
            changed += Q.grant_runner_pools(conn, login=r["login"], pools=r["pools"])
            changed += Q.revoke_other_runner_pools(conn, login=r["login"], pools=r["pools"])
        changed += Q.revoke_undeclared_runner_logins(conn, logins=[r["login"] for r in cfg["runners"]])
    for u in cfg["users"]:
        changed += declare_user(conn, username=u["username"], password=u["password"], role=u["role"])
    counts = {k: len(v) for k, v in cfg.items() if v is not None}
    if changed:
        import json
        # no actor named (the CLI): the database says who the login acts as
        Q.record_event(conn, actor=actor or Q.acting_login(conn, required="admin"),
                       action="apply_config", subject="config", reason=None,
                       details=json.dumps({"changed_rows": changed, **counts}))
    counts["changed_rows"] = changed
    return counts


def _by_id(ids: dict[str, int], name: str) -> tuple[bool, int, str]:
    """Sort key: existing rows by id (``ids``: name -> id), then new ones by name."""
    return (name not in ids, ids.get(name, 0), name)


def apply_config(conn, text: str, *, actor: str | None = None, env: dict[str, str] | None = None) -> dict[str, int]:
    """Validate and apply an apply file in one transaction, as pgdispatch_owner when the
    login may become it; audited when anything changed, as ``actor`` (None: the login).

    Returns:
        counts per section and ``changed_rows`` (0 when the database already matched).
    Raises:
        InvalidInput: see ``load_config``; unknown organization or pool; a project moved
        between organizations. Nothing is written then.
        Forbidden: the login may not write the tables (not a migrator).
    """
    cfg = load_config(text, env)
    return in_transaction(conn, _apply, cfg, actor, tx_name="apply_config")


# A declaration of thousands of entries is a few hundred KiB; more is not a config file.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


def read_config_file(path: str | Path) -> str:
    """The text of a config file (UTF-8, at most MAX_CONFIG_BYTES). Raises InvalidInput when
    it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidInput(f"cannot read {path}: larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"cannot read {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def apply_file(conn, path: str | Path, *, actor: str | None = None) -> dict[str, int]:
    """``apply_config`` on a file. Raises InvalidInput when it cannot be read."""
    return apply_config(conn, read_config_file(path), actor=actor)
