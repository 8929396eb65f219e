"""The elected duties (scheduler/duties.py, sql/functions/runners.sql): one holder per duty,
taken over when its lease lapses, released by a draining or stopped runner, fenced by term;
the cleanup duty; and the expiry fallback that keeps safety off the election."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pgdispatch.sql import InvalidInput, Settings, db, transitions

from ..concurrency import processes
from .conftest import FAST, wait_until


def beat(conn, runner_id: int, *, draining: bool = False, lease: float = 20.0) -> dict:
    """One beat; the duty rows by name."""
    rows = transitions.beat_runner(conn, runner_id=runner_id, is_draining=draining,
                                   beat_seconds=1.0, duty_lease_seconds=lease)
    return {r["duty"]: r for r in rows}


def lapse(conn, duty: str | None = None) -> None:
    """Move duty leases into the past, as a holder dead for a lease would leave them."""
    conn.execute("UPDATE duty_leases SET expires_at = now() - interval '1 second' "
                 "WHERE %s::text IS NULL OR duty = %s", (duty, duty))


def mine(rows: dict) -> set[str]:
    return {d for d, r in rows.items() if r["is_mine"]}


# -- the election, in SQL (one rolled-back transaction: times are moved by hand) ------------

def test_a_lapsed_duty_is_taken_over_once_and_the_old_holder_is_fenced_out(world):
    world.setup()
    a, b = world.runner(name="a"), world.runner(name="b")
    first = beat(world.conn, a)
    assert mine(first) == {"summaries", "expiry", "cleanup"}
    assert first["summaries"]["runner_name"] == "a"
    assert mine(beat(world.conn, b)) == set()  # held: b takes nothing
    term = first["summaries"]["term"]
    assert beat(world.conn, a)["summaries"]["term"] == term  # a renewal keeps the term

    lapse(world.conn, "summaries")
    taken = beat(world.conn, b)
    assert mine(taken) == {"summaries"}
    assert taken["summaries"]["term"] == term + 1
    assert not beat(world.conn, a)["summaries"]["is_mine"]

    # a's runs under its old term are refused; b's are done and stamped
    assert transitions.run_summaries(world.conn, runner_id=a, term=term) is False
    assert transitions.run_summaries(world.conn, runner_id=b, term=term + 1) is True
    expiry_term = first["expiry"]["term"]
    assert transitions.expiry_done(world.conn, runner_id=b, term=expiry_term) is False
    assert transitions.expiry_done(world.conn, runner_id=a, term=expiry_term) is True
    row = world.conn.execute("SELECT * FROM duty_leases WHERE duty = 'summaries'").fetchone()
    assert (row["runner_id"], row["done_count"], row["last_done_at"] is not None) == (b, 1, True)
    # the summaries duty wrote the history of every pool for the current minute
    history = world.conn.execute("SELECT count(*) AS n FROM queue_history").fetchone()
    assert history["n"] == 1


def test_a_draining_or_stopped_runner_gives_up_its_duties_at_once(world):
    world.setup()
    a, b, c = world.runner(name="a"), world.runner(name="b"), world.runner(name="c")
    assert mine(beat(world.conn, a)) == {"summaries", "expiry", "cleanup"}
    assert mine(beat(world.conn, a, draining=True)) == set()
    assert mine(beat(world.conn, a, draining=True)) == set()  # and takes none back
    assert mine(beat(world.conn, b)) == {"summaries", "expiry", "cleanup"}
    transitions.stop_runner(world.conn, runner_id=b)
    assert mine(beat(world.conn, b)) == set()  # stopped: beats take nothing
    assert mine(beat(world.conn, c)) == {"summaries", "expiry", "cleanup"}
    assert world.row("runners", b)["stop_reason"] == "stopped"


def test_cleanup_marks_silent_runners_lost_and_prunes_old_history(world):
    world.setup()
    holder, silent, other = world.runner(name="h"), world.runner(name="s"), world.runner(name="o")
    term = beat(world.conn, holder)["cleanup"]["term"]
    beat(world.conn, silent)
    beat(world.conn, other)
    # silent for five of its 1 s beats; other for two
    world.conn.execute("UPDATE runners SET last_heartbeat_at = now() - interval '5 seconds' "
                       "WHERE id = %s", (silent,))
    world.conn.execute("UPDATE runners SET last_heartbeat_at = now() - interval '2 seconds' "
                       "WHERE id = %s", (other,))
    pool_id = world.pool_ids(("linux",))[0]
    world.conn.execute("INSERT INTO queue_history (at, pool_id, waiting, running) VALUES "
                       "(now() - interval '8 days', %(p)s, 1, 0), "
                       "(now() - interval '6 days', %(p)s, 1, 0)", {"p": pool_id})
    assert transitions.run_cleanup(world.conn, runner_id=other, term=term) is None
    assert world.row("runners", silent)["stopped_at"] is None  # a non-holder changed nothing

    assert transitions.run_cleanup(world.conn, runner_id=holder, term=term) == {
        "lost": [silent], "pruned": 1}
    lost = world.row("runners", silent)
    assert (lost["stop_reason"], lost["stopped_at"] is not None) == ("lost", True)
    assert world.row("runners", other)["stopped_at"] is None
    assert world.conn.execute("SELECT count(*) AS n FROM queue_history").fetchone()["n"] == 1
    # a lost runner that beats again was only slow: it is live again
    beat(world.conn, silent)
    back = world.row("runners", silent)
    assert (back["stopped_at"], back["stop_reason"]) == (None, None)


def test_the_expiry_pass_can_be_limited_to_some_pools(world):
    world.setup(pools=("linux", "mac"))
    world.job(pool="linux")
    world.job(pool="mac")
    dead = world.runner(pools=("linux", "mac"))
    on_linux, on_mac = world.claim(dead), world.claim(dead, pools=("mac",))
    world.expire_now(on_linux.attempt_id)
    world.expire_now(on_mac.attempt_id)
    done = transitions.expire_leases(world.conn, pool_ids=world.pool_ids(("linux",)))
    assert [d["attempt_id"] for d in done] == [on_linux.attempt_id]
    assert world.row("attempts", on_mac.attempt_id)["state"] == "running"


def test_the_duty_lease_must_be_longer_than_the_runner_beat():
    with pytest.raises(InvalidInput, match="DUTY_LEASE"):
        Settings.from_env({"PGDISPATCH_DUTY_LEASE_SECONDS": "10",
                           "PGDISPATCH_RUNNER_BEAT_SECONDS": "10"})
    s = Settings.from_env({})
    assert (s.duty_lease_seconds, s.runner_beat_seconds) == (20.0, 15.0)


# -- the fallback: a wedged holder (beats, never expires) --------------------------------

def test_a_wedged_expiry_holder_does_not_stop_schedulers_expiring_their_own_pools(
        world, db_url, start_scheduler):
    world.setup(pools=("linux", "mac"))
    world.job(pool="linux")
    world.job(pool="mac")
    dead = world.runner(pools=("linux", "mac"))
    on_linux = world.claim(dead, lease_seconds=0.5)
    on_mac = world.claim(dead, pools=("mac",), lease_seconds=0.5)
    wedged = world.runner(pools=("mac",), name="wedged")
    stop = threading.Event()

    def keep_beating():  # the holder stays alive but never does its duties
        with db.connect(db_url) as c:
            while not stop.is_set():
                beat(c, wedged, lease=FAST.duty_lease_seconds)
                stop.wait(0.2)

    assert mine(beat(world.conn, wedged, lease=FAST.duty_lease_seconds)) == {
        "summaries", "expiry", "cleanup"}
    world.conn.execute("UPDATE duty_leases SET held_since = now() - interval '1 minute'")
    t = threading.Thread(target=keep_beating, daemon=True)
    t.start()
    try:
        s, _ = start_scheduler(pools=("linux",))
        wait_until(lambda: world.row("attempts", on_linux.attempt_id)["state"] == "expired",
                   timeout=10, what="the scheduler to expire its own pool's lapsed lease")
        # its own pools only: mac's lapsed lease is the holder's (or mac's schedulers') to end
        assert world.row("attempts", on_mac.attempt_id)["state"] == "running"
        holders = world.conn.execute("SELECT DISTINCT runner_id FROM duty_leases").fetchall()
        assert [h["runner_id"] for h in holders] == [wedged]
    finally:
        stop.set()
        t.join(5)


# -- real processes: one holder, takeover after SIGKILL, handover at a clean stop ---------

LEASE_S = 6.0


def function_calls(conn, name: str) -> int:
    row = conn.execute("SELECT coalesce(sum(calls), 0) AS n FROM pg_stat_user_functions "
                       "WHERE funcname = %s", (name,)).fetchone()
    return row["n"]


def duty(conn, name: str) -> dict:
    return conn.execute("SELECT d.*, d.expires_at > now() AS is_held, r.name AS runner_name "
                        "FROM duty_leases d LEFT JOIN runners r ON r.id = d.runner_id "
                        "WHERE d.duty = %s", (name,)).fetchone()


def test_scheduler_processes_elect_one_holder_which_is_replaced_within_a_lease(
        world, db_url, tmp_path):
    world.setup()
    c = world.conn
    dbname = c.execute("SELECT current_database() AS d").fetchone()["d"]
    c.execute(f'ALTER DATABASE "{dbname}" SET track_functions = \'all\'')  # new sessions
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGDISPATCH_")}
    env.update(DATABASE_URL=db_url, PGDISPATCH_LEASE_SECONDS="10",
               PGDISPATCH_CLAIM_INTERVAL_SECONDS="0.5", PGDISPATCH_EXPIRE_INTERVAL_SECONDS="0.3",
               PGDISPATCH_SUMMARY_INTERVAL_SECONDS="0.3", PGDISPATCH_RUNNER_BEAT_SECONDS="1",
               PGDISPATCH_DUTY_LEASE_SECONDS=str(LEASE_S),
               PGDISPATCH_DATA_DIR=str(tmp_path / "data"))
    procs = processes.start_schedulers(env, tmp_path, 3, lambda i: [
        "--pool", "linux", "--slots", "1", "--name", f"s{i}", "--no-listen"])
    by_name = {f"s{i}": p for i, (p, _) in enumerate(procs)}
    try:
        def all_held():
            rows = [duty(c, d) for d in ("summaries", "expiry", "cleanup")]
            return all(r["is_held"] and r["runner_name"] in by_name for r in rows) and rows
        wait_until(all_held, timeout=20, what=f"every duty held\n{processes.logs(procs)}")
        wait_until(lambda: duty(c, "summaries")["done_count"] >= 3, timeout=10,
                   what="summaries done by the holder")

        # SIGKILL the holder: another takes over once its lease ends, not before, within a lease
        old = duty(c, "summaries")
        victim = by_name[old["runner_name"]]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        final = duty(c, "summaries")
        assert final["term"] == old["term"], "taken over before the holder's lease ended"
        new = wait_until(lambda: (r := duty(c, "summaries"))["term"] > old["term"] and r,
                         timeout=LEASE_S * 3, what="a takeover of the summaries duty")
        gap = (new["held_since"] - final["expires_at"]).total_seconds()
        assert 0 <= gap < LEASE_S, (gap, processes.logs(procs))
        assert new["runner_name"] != old["runner_name"]
        wait_until(lambda: (r := duty(c, "summaries"))["last_done_at"]
                   and r["last_done_at"] > new["held_since"], timeout=10,
                   what="the new holder doing the duty")

        # a clean stop of the holder: handed over before its lease would have ended
        before = duty(c, "summaries")
        holder = by_name[before["runner_name"]]
        holder.terminate()
        after = wait_until(lambda: (r := duty(c, "summaries"))["term"] > before["term"] and r,
                           timeout=LEASE_S * 3, what="a handover at a clean stop")
        assert after["held_since"] < before["expires_at"], processes.logs(procs)
        assert holder.wait(30) == 0
        assert world.conn.execute("SELECT stop_reason FROM runners WHERE name = %s",
                                  (before["runner_name"],)).fetchone()["stop_reason"] == "stopped"
    finally:
        processes.stop(procs)

    # Only holders' sessions ran the summary: every call of pgd_summarize_queue (flushed by
    # each backend as it ended) was a fenced, stamped run of the duty.
    wait_until(lambda: function_calls(c, "pgd_summarize_queue")
               >= duty(c, "summaries")["done_count"], timeout=5, what="function statistics")
    calls = function_calls(c, "pgd_summarize_queue")
    assert calls == duty(c, "summaries")["done_count"] > 3, processes.logs(procs)
    # and the takeovers were logged, with their terms
    text = "".join(path.read_text() for _, path in procs)
    assert f"took over duty summaries (term {new['term']})" in text


def test_a_holder_that_cannot_renew_stops_doing_its_duties(world, db_url):
    """Duties.term counts the lease from the renewing beat's sending: once a lease passed
    without a renewal, the holder does no duty (here its clock is moved on instead)."""
    from pgdispatch.scheduler import duties as duties_mod
    from pgdispatch.sql.scheduling import make_scheduler_pool
    world.setup()
    runner = world.runner()
    pool = make_scheduler_pool(db_url, slots=1)
    try:
        d = duties_mod.Duties(pool, FAST, runner_id=runner)
        d.beat()
        term = d.term("summaries")
        assert term is not None
        held = d._held["summaries"]
        d._held["summaries"] = (held[0], held[1] - FAST.duty_lease_seconds)
        assert d.term("summaries") is None
        assert d.next_beat_delay() == pytest.approx(FAST.duty_lease_seconds / 3)
    finally:
        pool.close()



def test_a_holder_that_stamps_its_expiry_without_doing_it_does_not_stop_the_fallback(
        world, db_url, start_scheduler):
    # A host may stamp the expiry duty done without running a pass (pgd_expiry_done needs
    # only the term). The fallback reads the lapsed leases themselves (leases_overdue in
    # pgd_beat_runner's answer), so lapsed work of a scheduler's pools is still expired.
    world.setup(pools=("linux",))
    world.job(pool="linux")
    dead = world.runner(pools=("linux",))
    lapsed = world.claim(dead, lease_seconds=0.5)
    liar = world.runner(pools=("linux",), name="liar")
    stop = threading.Event()

    def beat_and_stamp():  # renews every duty and stamps expiry done, never expiring anything
        with db.connect(db_url) as c:
            while not stop.is_set():
                rows = beat(c, liar, lease=FAST.duty_lease_seconds)
                term = rows["expiry"]["term"]
                c.execute("SELECT pgd_expiry_done(%s, %s)", (liar, term))
                stop.wait(0.2)

    assert mine(beat(world.conn, liar, lease=FAST.duty_lease_seconds)) == {
        "summaries", "expiry", "cleanup"}
    t = threading.Thread(target=beat_and_stamp, daemon=True)
    t.start()
    try:
        start_scheduler(pools=("linux",))
        wait_until(lambda: world.row("attempts", lapsed.attempt_id)["state"] == "expired",
                   timeout=15, what="the scheduler to expire its own pool's lapsed lease")
        assert duty(world.conn, "expiry")["runner_id"] == liar  # the liar still holds it
    finally:
        stop.set()
        t.join(5)


def test_an_idle_expiry_holder_sends_no_expiry_pass(world, db_url, start_scheduler):
    # The holder's beats say when the first running lease lapses (next_lease_expiry) and
    # stamp the duty while none has: with nothing running it sends no pass at all.
    world.setup()
    c = world.conn
    dbname = c.execute("SELECT current_database() AS d").fetchone()["d"]
    c.execute(f'ALTER DATABASE "{dbname}" SET track_functions = \'all\'')  # new sessions
    stamped = duty(c, "expiry")["done_count"]
    s, _ = start_scheduler()
    wait_until(lambda: duty(c, "expiry")["runner_id"] == s.runner_id, what="it to hold expiry")
    wait_until(lambda: duty(c, "expiry")["done_count"] >= stamped + 3, timeout=15,
               what="three beats to stamp the expiry duty")
    s.stop(grace_seconds=0)
    c.execute("SELECT pg_stat_clear_snapshot()")
    time.sleep(1.5)  # the scheduler's sessions flushed their function counts when they closed
    assert function_calls(c, "pgd_expire_one") == 0
