"""A runner host is a database login, and the server decides which pools it may take
(sql/functions/claim.sql, "Runner grants"): with real logins, each connected as itself.

* a host granted linux cannot register for macos (PD403, naming the login and the pool);
* a host cannot claim, heartbeat, report or recover with another host's runner id;
* revoking the grant (an apply without it), the login (NOLOGIN) or its membership of
  pgdispatch_scheduler stops its claims at once, fences its heartbeats and reports, and the
  expiry pass ends its running attempts as a lost runner's: builds queued again,
  deployments uncertain.

Each refusal is also run against a deliberately over-privileged variant of the check
(tests/variants.py) to show that the test sees the difference.
"""

from __future__ import annotations

import pytest

from pgdispatch.sql import FencedOut, Forbidden, NotFound, db, reads, transitions
from pgdispatch.sql.explain import explain_job

from .. import variants
from ..factories import World
from ..logins import Logins

pytestmark = pytest.mark.own_database

GROUP = "pgdispatch_scheduler"

# A check that believes the command line: every login may take every pool.
ALL_POOLS = ("ELSE ARRAY(SELECT g.pool_id FROM runner_grants g WHERE g.login = p_login ORDER BY g.pool_id)",
             "ELSE ARRAY(SELECT q.id FROM pools q ORDER BY q.id)")
# A check that believes the runner id: any login may act for any runner.
ANY_RUNNER = ("IF v.login <> session_user AND NOT pgd_login_is_unbound(session_user) THEN",
              "IF false THEN")


@pytest.fixture
def logins(db_url):
    """Makes real logins in pgdispatch_scheduler (db upgrade created the group roles)."""
    made = Logins(db_url)
    yield made
    made.drop()


def granted_world(conn, runners: list[dict]) -> World:
    """acme/web on pools linux and macos (and a production target), runner grants as given."""
    w = World(conn)
    w.apply({"organizations": [{"name": "acme", "max_running": 10}],
             "pools": [{"name": "linux", "slots": 10}, {"name": "macos", "slots": 10}],
             "projects": [{"name": "web", "organization": "acme", "pools": ["linux", "macos"]}],
             "targets": [{"name": "production"}],
             "runners": runners})
    return w


def host(logins, stem: str):
    login, url = logins.make(stem, groups=(GROUP,))
    return login, db.connect(url, application_name=f"host-{stem}")


def register(conn, pools, name="host"):
    return transitions.register_runner(conn, name=name, pools=list(pools), slots=2, hostname="h")


def try_register(conn, pools) -> str | None:
    """The refusal's message, or None when the registration went through."""
    try:
        register(conn, pools)
    except Forbidden as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("check", ["real", "over-privileged"])
def test_a_host_granted_linux_cannot_register_for_macos(conn, logins, check):
    login, _ = logins.make("runner_linux", groups=(GROUP,))
    w = granted_world(conn, [{"login": login, "pools": ["linux"]}])
    if check == "over-privileged":
        conn.execute(variants.variant_sql(conn, "pgd_runner_login_pools", [ALL_POOLS]))
    with db.connect(logins_url(logins, login)) as hc:
        refusal = try_register(hc, ["macos"])
        both = try_register(hc, ["linux", "macos"])
        ok = register(hc, ["linux"])
    if check == "over-privileged":
        assert refusal is None and both is None  # the test above would have failed
        return
    assert refusal == (f"login {login} is not granted pool macos (granted: linux); "
                       f"an apply file's [[runners]] grants it")
    assert both is not None and "pool macos" in both
    row = w.row("runners", ok)
    assert row["login"] == login
    # nothing of the refused registrations was written
    assert conn.execute("SELECT count(*) AS n FROM runners").fetchone()["n"] == 1


def logins_url(logins: Logins, login: str) -> str:
    from ..logins import url_as
    return url_as(logins.db_url, login)


def test_a_login_with_no_grant_takes_nothing_and_an_unknown_pool_is_still_not_found(conn, logins):
    granted_world(conn, [])
    login, hc = host(logins, "nogrant")
    with hc:
        assert try_register(hc, ["linux"]).startswith(f"login {login} is not granted pool linux (granted: none)")
        with pytest.raises(NotFound):
            register(hc, ["nosuchpool"])


@pytest.mark.parametrize("check", ["real", "over-privileged"])
def test_a_host_cannot_claim_with_another_hosts_runner_id(conn, logins, check):
    a_login, a_url = logins.make("host_a", groups=(GROUP,))
    b_login, b_url = logins.make("host_b", groups=(GROUP,))
    w = granted_world(conn, [{"login": a_login, "pools": ["linux"]}, {"login": b_login, "pools": ["linux"]}])
    if check == "over-privileged":
        conn.execute(variants.variant_sql(conn, "pgd_require_runner_login", [ANY_RUNNER]))
    job = w.job()
    linux = w.pool_ids(("linux",))
    with db.connect(a_url) as a, db.connect(b_url) as b:
        runner_a = register(a, ["linux"])
        register(b, ["linux"])
        try:
            stolen = transitions.claim(b, runner_id=runner_a, pools=linux,
                                       claim_token=transitions.new_claim_token(), lease_seconds=30)
            refusal = None
        except Forbidden as exc:
            stolen, refusal = None, str(exc)
        if check == "over-privileged":
            assert stolen is not None and stolen.job_id == job["id"]  # the test would have failed
            return
        assert refusal == f"runner {runner_a} belongs to login {a_login}; login {b_login} cannot act for it"
        with pytest.raises(Forbidden):
            transitions.claim_batch(b, runner_id=runner_a, pools=linux, lease_seconds=30,
                                    claim_tokens=[transitions.new_claim_token() for _ in range(2)])
        with pytest.raises(Forbidden):
            transitions.recover_claims(b, claim_tokens=[transitions.new_claim_token()], runner_id=runner_a)
        assert w.row("jobs", job["id"])["state"] == "queued"
        # its own runner claims it; the other host can neither beat nor report for it
        mine = transitions.claim(a, runner_id=runner_a, pools=linux,
                                 claim_token=transitions.new_claim_token(), lease_seconds=30)
        assert mine.job_id == job["id"]
        with pytest.raises(FencedOut):
            transitions.heartbeat(b, attempt_id=mine.attempt_id, generation=mine.generation, lease_seconds=30)
        with pytest.raises(FencedOut):
            transitions.complete(b, attempt_id=mine.attempt_id, generation=mine.generation,
                                 outcome="succeeded", receipt_key=mine.receipt_key)
        transitions.heartbeat(a, attempt_id=mine.attempt_id, generation=mine.generation, lease_seconds=30)
        transitions.complete(a, attempt_id=mine.attempt_id, generation=mine.generation,
                             outcome="succeeded", receipt_key=mine.receipt_key)
    assert w.row("jobs", job["id"])["state"] == "succeeded"


def revoke(conn, w: World, how: str, login: str) -> None:
    if how == "grant":
        w.apply({"runners": [{"login": "someone_else", "pools": ["linux"]}]})
    elif how == "nologin":
        conn.execute(f'ALTER ROLE "{login}" NOLOGIN')
    else:
        conn.execute(f'REVOKE {GROUP} FROM "{login}"')


# A check that reads the grant once, at registration, and never again.
NO_RECHECK = ("SELECT CASE\n        WHEN NOT pgd_login_may_run(p_login) THEN '{}'::bigint[]",
              "SELECT CASE\n        WHEN false THEN '{}'::bigint[]")


@pytest.mark.parametrize("how", ["grant", "nologin", "group", "over-privileged"])
def test_revoking_a_host_stops_its_claims_and_its_attempts_end_as_a_lost_runners(conn, logins, how):
    login, url = logins.make("revoked", groups=(GROUP,))
    w = granted_world(conn, [{"login": login, "pools": ["linux"]}])
    if how == "over-privileged":
        # revoked by NOLOGIN, against checks that do not look again: the test sees it
        conn.execute(variants.variant_sql(conn, "pgd_runner_login_pools", [ALL_POOLS, NO_RECHECK]))
        conn.execute(variants.variant_sql(conn, "pgd_require_runner_grant",
                                          [("IF NOT pgd_login_may_run(v.login) THEN", "IF false THEN")]))
    build = w.job()
    deploy = w.job(target="production")
    waiting = w.job()
    linux = w.pool_ids(("linux",))
    with db.connect(url) as hc:
        runner = register(hc, ["linux"])
        claims = [transitions.claim(hc, runner_id=runner, pools=linux, lease_seconds=30,
                                    claim_token=transitions.new_claim_token()) for _ in range(2)]
        assert {c.job_id for c in claims} == {build["id"], deploy["id"]}
        revoke(conn, w, "nologin" if how == "over-privileged" else how, login)
        if how == "over-privileged":
            again = transitions.claim(hc, runner_id=runner, pools=linux, lease_seconds=30,
                                      claim_token=transitions.new_claim_token())
            transitions.heartbeat(hc, attempt_id=claims[0].attempt_id,
                                  generation=claims[0].generation, lease_seconds=30)
            assert again is not None and again.job_id == waiting["id"]  # the test would fail
            return
        # the open session lives on, but the server no longer believes it
        with pytest.raises(Forbidden) as refused:
            transitions.claim(hc, runner_id=runner, pools=linux, lease_seconds=30,
                              claim_token=transitions.new_claim_token())
        if how == "group":  # out of pgdispatch_scheduler: PostgreSQL's own EXECUTE check refuses
            assert "permission denied for function pgd_claim" in str(refused.value)
        else:
            assert login in str(refused.value)
        if how == "grant":
            assert str(refused.value) == f"login {login} of runner {runner} is not granted pool linux"
        refusal = Forbidden if how == "group" else FencedOut
        for c in claims:
            with pytest.raises(refusal):
                transitions.heartbeat(hc, attempt_id=c.attempt_id, generation=c.generation, lease_seconds=30)
            with pytest.raises(refusal):
                transitions.complete(hc, attempt_id=c.attempt_id, generation=c.generation,
                                     outcome="succeeded", receipt_key=c.receipt_key)
        # the batch path fences it too
        if how == "group":
            with pytest.raises(Forbidden):
                transitions.complete_batch(hc, items=[{
                    "attempt_id": claims[0].attempt_id, "generation": claims[0].generation,
                    "outcome": "succeeded", "receipt_key": claims[0].receipt_key + "-b"}])
        else:
            answer = transitions.complete_batch(hc, items=[{
                "attempt_id": claims[0].attempt_id, "generation": claims[0].generation,
                "outcome": "succeeded", "receipt_key": claims[0].receipt_key + "-b"}])
            assert answer[0]["status"] == "fenced"
    assert w.row("jobs", waiting["id"])["state"] == "queued"
    # the lease lapses; the expiry pass (any scheduler's) ends them as a lost runner's
    by_job = {c.job_id: c for c in claims}
    for c in claims:
        w.expire_now(c.attempt_id)
    transitions.expire_leases(conn)
    assert w.row("attempts", by_job[build["id"]].attempt_id)["state"] == "expired"
    assert w.row("jobs", build["id"])["state"] in ("queued", "failed")
    assert w.row("attempts", by_job[deploy["id"]].attempt_id)["state"] == "lost"
    assert w.row("jobs", deploy["id"])["state"] == "uncertain"


def test_an_unbound_login_takes_every_pool_without_a_grant(conn):
    """The superuser the tests run as (and members of pgdispatch_owner) are unbound."""
    w = granted_world(conn, [])
    w.job(pool="macos")
    runner = register(conn, ["linux", "macos"])
    assert w.claim(runner, pools=("linux", "macos")) is not None


def test_console_and_explain_show_an_ungranted_runner(conn, logins):
    login, url = logins.make("mac1", groups=(GROUP,))
    w = granted_world(conn, [{"login": login, "pools": ["macos"]}])
    job = w.job(pool="macos")
    with db.connect(url) as hc:
        runner = register(hc, ["macos"])
        w.apply({"runners": [{"login": login, "pools": ["linux"]}]})  # macos revoked
        transitions.beat_runner(hc, runner_id=runner)
    [r] = reads.list_runners(conn, live_seconds=90)
    assert (r["login"], r["pools"], r["granted_pools"], r["ungranted_pools"]) == (login, ["macos"], ["linux"], ["macos"])
    e = explain_job(conn, job_id=job["id"])
    assert e["reason"] == "no_authorized_runner"
    assert e["message"] == f"no live runner is granted pool macos (asked for by login {login}, not granted it)"
    assert e["reasons"][0]["details"]["ungranted_logins"] == [login]


def test_a_hosts_backoff_settings_reach_only_the_pools_it_serves(conn, logins):
    """Any scheduler's expiry pass ends any lapsed lease (safety never waits on the lease's
    own host), but the backoff it asks for applies to its own pools' jobs only: a linux host
    asking for 30 days cannot push back a macos job's retry past the default cap (300 s)."""
    linux_login, linux_url = logins.make("bk_linux", groups=(GROUP,))
    mac_login, mac_url = logins.make("bk_mac", groups=(GROUP,))
    w = granted_world(conn, [{"login": linux_login, "pools": ["linux"]},
                             {"login": mac_login, "pools": ["macos"]}])
    month = 30 * 86400.0
    jobs = {pool: w.job(pool=pool, max_attempts=3)["id"] for pool in ("linux", "macos")}
    for pool, url in (("linux", linux_url), ("macos", mac_url)):
        with db.connect(url) as hc:
            runner = register(hc, [pool])
            transitions.claim(hc, runner_id=runner, pools=w.pool_ids((pool,)), lease_seconds=30,
                              claim_token=transitions.new_claim_token())
    conn.execute("UPDATE attempts SET lease_expires_at = now() - interval '1 second'")
    with db.connect(linux_url) as hc:
        while transitions.expire_one(hc, backoff_base_seconds=month, backoff_cap_seconds=month):
            pass
    delay = {pool: conn.execute("SELECT extract(epoch FROM ready_at - now())::float8 AS s FROM jobs "
                                "WHERE id = %s", (job,)).fetchone()["s"] for pool, job in jobs.items()}
    assert delay["macos"] <= 300, delay
    assert delay["linux"] > 86400, delay  # its own pool: its settings


@pytest.mark.parametrize("how", ["grant", "nologin"])
def test_a_revoked_host_gives_up_its_duties_and_takes_none(conn, logins, how):
    # The elected duties (sql/functions/runners.sql, pgd_beat_runner) expire every pool's
    # leases and mark runners lost: a host the server no longer believes holds none of them.
    login, url = logins.make("dutyholder", groups=(GROUP,))
    w = granted_world(conn, [{"login": login, "pools": ["linux"]}])
    with db.connect(url) as hc:
        runner = register(hc, ["linux"])
        rows = transitions.beat_runner(hc, runner_id=runner)
        assert {r["duty"] for r in rows if r["is_mine"]} == {"cleanup", "expiry", "summaries"}
        revoke(conn, w, how, login)
        rows = transitions.beat_runner(hc, runner_id=runner)
        assert not [r["duty"] for r in rows if r["is_mine"]]
        held = conn.execute("SELECT duty FROM duty_leases WHERE runner_id = %s "
                            "AND expires_at > now()", (runner,)).fetchall()
        assert held == []  # released at once, not left to lapse
