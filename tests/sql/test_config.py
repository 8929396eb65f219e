"""``pgdispatch apply``: idempotent, exact about pool grants, and all-or-nothing on bad input."""

from __future__ import annotations

import pytest

from pgdispatch.sql import InvalidInput
from pgdispatch.sql.config import apply_config

ENV = {"ALICE_PASSWORD": "correct horse battery", "BOB_PASSWORD": "tr0ub4dor&3"}

BASE = """
[[organizations]]
name = "acme"
max_running = 5

[[pools]]
name = "linux"
slots = 8

[[pools]]
name = "mac"
slots = 2

[[projects]]
name = "web"
organization = "acme"
pools = ["linux", "mac"]
weight = 2
max_running = 3

[[projects]]
name = "api"
organization = "acme"
pools = ["linux"]

[[targets]]
name = "production"

[[users]]
username = "alice"
role = "operator"
password_env = "ALICE_PASSWORD"
"""

TABLES = {
    "organizations": "SELECT name, max_running, pgd_organization_running(id) AS running "
                     "FROM organizations ORDER BY name",
    "pools": "SELECT name, slots, pgd_pool_running(id) AS running FROM pools ORDER BY name",
    # a limit of n is split over 8 stripes whose caps sum to n (sql/functions/capacity.sql):
    # written with the limit, or not at all
    "organization_stripes": "SELECT o.name, s.stripe_no, s.cap, s.held FROM capacity_stripes s "
                            "JOIN organizations o ON s.kind = 'organization' AND o.id = s.owner_id "
                            "ORDER BY 1, 2",
    "pool_stripes": "SELECT q.name, s.stripe_no, s.cap, s.held FROM capacity_stripes s "
                    "JOIN pools q ON s.kind = 'pool' AND q.id = s.owner_id ORDER BY 1, 2",
    "debts": "SELECT kind, owner_id, owed FROM capacity_debts ORDER BY 1, 2",
    "projects": "SELECT name, organization_id, weight, max_running FROM projects ORDER BY name",
    "grants": "SELECT p.name AS project, q.name AS pool FROM project_pools pp JOIN projects p "
              "ON p.id = pp.project_id JOIN pools q ON q.id = pp.pool_id ORDER BY 1, 2",
    "targets": "SELECT name, state, requires_approval, approver_role FROM targets ORDER BY name",
    "runner_grants": "SELECT g.login, q.name AS pool FROM runner_grants g JOIN pools q ON q.id = g.pool_id "
                     "ORDER BY 1, 2",
    "users": "SELECT username, role, password_hash FROM users ORDER BY username",
    "audit": "SELECT id, actor, action FROM audit_events ORDER BY id",
}


def snapshot(conn) -> dict[str, list]:
    return {name: conn.execute(sql).fetchall() for name, sql in TABLES.items()}


def stripe_caps(snap: dict[str, list], table: str, name: str) -> list[int]:
    """The caps of the stripes of organization or pool ``name`` in a snapshot, in stripe
    order."""
    return [r["cap"] for r in snap[table] if r["name"] == name]


def grants(conn, project: str) -> list[str]:
    return [r["pool"] for r in snapshot(conn)["grants"] if r["project"] == project]


def apply(conn, text: str, env=ENV) -> dict:
    return apply_config(conn, text, actor="ops", env=env)


def test_apply_is_idempotent(conn):
    first = apply(conn, BASE)
    assert first["changed_rows"] > 0
    assert {k: first[k] for k in ("organizations", "pools", "projects", "targets", "users")} == {
        "organizations": 1, "pools": 2, "projects": 2, "targets": 1, "users": 1}
    after_first = snapshot(conn)
    assert [r["action"] for r in after_first["audit"]] == ["apply_config"]
    assert grants(conn, "web") == ["linux", "mac"]
    assert [r["running"] for r in after_first["organizations"] + after_first["pools"]] == [0, 0, 0]
    assert stripe_caps(after_first, "organization_stripes", "acme") == [1, 1, 1, 1, 1, 0, 0, 0]
    assert stripe_caps(after_first, "pool_stripes", "mac") == [1, 1, 0, 0, 0, 0, 0, 0]
    assert stripe_caps(after_first, "pool_stripes", "linux") == [1] * 8
    assert all(r["held"] == 0 for r in after_first["organization_stripes"] + after_first["pool_stripes"])
    assert after_first["debts"] == []

    second = apply(conn, BASE)
    assert second["changed_rows"] == 0
    assert snapshot(conn) == after_first  # not even an audit event

    changed = apply(conn, BASE.replace("max_running = 5", "max_running = 6"))
    assert changed["changed_rows"] == 1  # the organization row; its re-split stripes are not counted
    assert snapshot(conn)["organizations"][0]["max_running"] == 6
    assert stripe_caps(snapshot(conn), "organization_stripes", "acme") == [1, 1, 1, 1, 1, 1, 0, 0]

    lowered = apply(conn, BASE.replace("slots = 8", "slots = 3"))
    assert lowered["changed_rows"] == 2  # acme back to 5, linux down to 3
    assert stripe_caps(snapshot(conn), "organization_stripes", "acme") == [1, 1, 1, 1, 1, 0, 0, 0]
    assert stripe_caps(snapshot(conn), "pool_stripes", "linux") == [1, 1, 1, 0, 0, 0, 0, 0]
    assert snapshot(conn)["debts"] == []


def test_pool_grants_are_exactly_those_in_the_file(conn):
    apply(conn, BASE)
    assert grants(conn, "web") == ["linux", "mac"]
    narrowed = BASE.replace('pools = ["linux", "mac"]', 'pools = ["linux"]')
    assert apply(conn, narrowed)["changed_rows"] == 1  # the mac grant revoked
    assert grants(conn, "web") == ["linux"]
    assert apply(conn, narrowed)["changed_rows"] == 0
    widened = BASE.replace('pools = ["linux", "mac"]', 'pools = ["mac"]')
    assert apply(conn, widened)["changed_rows"] == 2  # mac granted, linux revoked
    assert grants(conn, "web") == ["mac"]
    assert grants(conn, "api") == ["linux"]  # other projects untouched


NEW_ORG = """
[[organizations]]
name = "initech"
max_running = 3
"""

BAD_FILES = {
    "runner unknown pool": ('[[runners]]\nlogin = "mac1"\npools = ["nope"]\n',
                            "runner login mac1: unknown pool nope"),
    "runner pools not a list": ('[[runners]]\nlogin = "mac1"\npools = "linux"\n',
                                "runner login mac1: pools must be a list of pool names"),
    "runner bad login": ('[[runners]]\nlogin = "mac 1"\npools = ["linux"]\n',
                         "runners[0]: login \"mac 1\" is not allowed"),
    "runner twice": ('[[runners]]\nlogin = "m"\npools = []\n[[runners]]\nlogin = "m"\npools = []\n',
                     "runners[1]: 'm' is declared twice"),
    "approver role": ('[[targets]]\nname = "p"\nrequires_approval = true\napprover_role = "root"\n',
                      "target p: approver_role must be one of operator, admin"),
    "approver without approval": ('[[targets]]\nname = "p"\napprover_role = "admin"\n',
                                  "target p: approver_role needs requires_approval = true"),
    "approval not a boolean": ('[[targets]]\nname = "p"\nrequires_approval = "yes"\n',
                               "target p: requires_approval must be true or false"),
    "bad TOML": (NEW_ORG + "[[pools]\nname = 'x'\n", "not valid TOML"),
    "unknown key": (NEW_ORG + '[[pools]]\nname = "arm"\nslots = 1\ncolour = "red"\n',
                    "pools[0]: unknown key 'colour'"),
    "unknown section": (NEW_ORG + '[[queues]]\nname = "q"\n', "unknown section 'queues'"),
    "bad organization name": ('[[organizations]]\nname = "a b/c"\nmax_running = 1\n',
                              "organizations[0]: name \"a b/c\" is not allowed: 1 to 63 of letters, "
                              "digits, '_', '.', '-', starting with a letter or digit"),
    "bad pool name": (NEW_ORG + '[[pools]]\nname = "-arm"\nslots = 1\n',
                      'pools[0]: name "-arm" is not allowed'),
    "bad username": (NEW_ORG + '[[users]]\nusername = "bob smith"\nrole = "admin"\n'
                     'password_env = "NO_SUCH_VARIABLE"\n', 'users[0]: username "bob smith" is not allowed'),
    "non-ASCII name": ('[[organizations]]\nname = "acmé"\nmax_running = 1\n',
                       'organizations[0]: name "acmé" is not allowed'),
    "negative organization limit": ('[[organizations]]\nname = "initech"\nmax_running = -1\n',
                                    "organization initech max_running must be between 0 and 100000, got -1"),
    "negative pool slots": (NEW_ORG + '[[pools]]\nname = "arm"\nslots = -2\n',
                            "pool arm slots must be between 0 and 100000, got -2"),
    "negative project bound": (NEW_ORG + '[[projects]]\nname = "ops"\norganization = "initech"\n'
                               'max_running = -1\n', "project ops max_running must be between"),
    "missing password variable": (NEW_ORG + '[[users]]\nusername = "bob"\nrole = "admin"\n'
                                  'password_env = "NO_SUCH_VARIABLE"\n',
                                  "user bob: environment variable NO_SUCH_VARIABLE is not set"),
    "unknown organization": (NEW_ORG + '[[projects]]\nname = "ops"\norganization = "umbrella"\n',
                             "project ops: unknown organization umbrella"),
    "unknown pool": (NEW_ORG + '[[projects]]\nname = "ops"\norganization = "initech"\npools = ["sparc"]\n',
                     "project ops: unknown pool sparc"),
    "project moved": (NEW_ORG + '[[projects]]\nname = "web"\norganization = "initech"\n',
                      "project web belongs to acme; it cannot move to initech"),
    "unknown role": (NEW_ORG + '[[users]]\nusername = "bob"\nrole = "root"\npassword_env = "BOB_PASSWORD"\n',
                     "user bob: role must be one of"),
    # passes the Python checks, refused by the database's name CHECK after initech was written:
    # the transaction must take initech back with it
    "name refused by the database": (NEW_ORG + '[[pools]]\nname = "bad pool"\nslots = 1\n', ""),
}


def test_bad_files_are_refused_and_write_nothing(conn):
    apply(conn, BASE)
    before = snapshot(conn)
    for case, (text, message) in BAD_FILES.items():
        with pytest.raises(InvalidInput) as info:
            apply(conn, text)
        assert message in str(info.value), case
        assert "\n" not in str(info.value), case  # one line for the CLI's stderr
        assert snapshot(conn) == before, f"{case}: something was written"


def test_runner_grants_and_target_rules_are_exactly_those_in_the_file(conn):
    """[[runners]] is the whole truth about runner hosts when present (a login it does not
    name loses its grants); a file without it leaves them alone. Target rules change in
    place. Applying the same file twice changes nothing."""
    hosts = BASE + """
[[runners]]
login = "mac1"
pools = ["mac"]

[[runners]]
login = "build1"
pools = ["linux", "mac"]

[[targets]]
name = "staging"
requires_approval = true

[[targets]]
name = "prod-eu"
requires_approval = true
approver_role = "admin"
"""
    apply(conn, hosts)
    snap = snapshot(conn)
    assert [(r["login"], r["pool"]) for r in snap["runner_grants"]] == [
        ("build1", "linux"), ("build1", "mac"), ("mac1", "mac")]
    assert [(r["name"], r["requires_approval"], r["approver_role"]) for r in snap["targets"]] == [
        ("prod-eu", True, "admin"), ("production", False, "operator"), ("staging", True, "operator")]
    assert apply(conn, hosts)["changed_rows"] == 0
    assert snapshot(conn) == snap
    # without a [[runners]] section: grants untouched
    apply(conn, BASE)
    assert snapshot(conn)["runner_grants"] == snap["runner_grants"]
    # with one: mac1 is not named any more, build1 keeps only linux; prod-eu is unprotected
    changed = apply(conn, BASE + '[[runners]]\nlogin = "build1"\npools = ["linux"]\n'
                    '[[targets]]\nname = "prod-eu"\n')
    assert changed["changed_rows"] == 3
    snap = snapshot(conn)
    assert [(r["login"], r["pool"]) for r in snap["runner_grants"]] == [("build1", "linux")]
    assert ("prod-eu", False, "operator") in [(r["name"], r["requires_approval"], r["approver_role"])
                                              for r in snap["targets"]]
