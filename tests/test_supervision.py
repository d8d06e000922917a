"""`epd up`'s supervision, in-process: roles are fake children, the clock is the test's.

A role that keeps dying is backed off (retried less and less often) while the others serve; the
cluster stops only on a signal or when no role of a kind can run at all (issue 58 item 5: six
deaths of one role within 5 minutes used to stop the whole cluster, healthy roles included).
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import pytest

from common.config import load_config
from epd import launcher
from epd.launcher import LocalCluster, Supervision


class FakeChild:
    """A role's process: alive until the test kills it."""

    def __init__(self):
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


@pytest.fixture
def cluster(monkeypatch):
    """cluster(encoders, lm_workers) -> a LocalCluster whose roles are FakeChild objects, all
    SERVING (as after start-up), that writes its restart records to `cluster.records`."""
    made: list[LocalCluster] = []

    def make(encoders: int = 1, lm_workers: int = 2, max_restarts: int = 5) -> LocalCluster:
        config = load_config(None, environ={})
        # Nothing listens there: a record that reached Redis would only log a warning.
        connector = dataclasses.replace(config.connector, url="redis://127.0.0.1:1/0")
        c = LocalCluster(
            dataclasses.replace(config, connector=connector),
            num_encoders=encoders,
            num_lm_workers=lm_workers,
            max_restarts=max_restarts,
        )
        made.append(c)
        c.records = {}
        c.health = {}  # role name -> what its health check answers (default SERVING)
        monkeypatch.setattr(c, "_spawn", lambda role: setattr(role, "child", FakeChild()))
        monkeypatch.setattr(c, "_status", lambda role: c.health.get(role.name, "SERVING"))

        monkeypatch.setattr(c, "_write_record", lambda name, value: c.records.update({name: value}))
        for role in c.roles:
            role.child = FakeChild()
            role.supervision.serving = True
            role.supervision.started = 0.0
        return c

    yield make
    for c in made:
        shutil.rmtree(c.run_dir, ignore_errors=True)


def role(c: LocalCluster, name: str) -> launcher.Role:
    return next(r for r in c.roles if r.name == name)


def test_a_role_past_its_budget_is_backed_off_longer_and_longer():
    sup = Supervision("lm-1")
    delays = [sup.died(float(t), -9, 5) for t in range(12)]
    # Within the budget (5 deaths in 300 s): 0.5 s doubling to 8 s, as before. Past it: backed
    # off, 16 s doubling to 5 minutes, and still retried (before: None, the cluster stopped).
    assert delays == [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_one_role_dying_past_its_budget_leaves_the_cluster_running(cluster, monkeypatch):
    """The defect, through the launcher's own loop: lm-1 killed 8 times (budget 5) while the
    encoder, lm-0 and the proxy are healthy. The launcher keeps supervising (before: it returned
    1 at the sixth death and `epd up` stopped everything)."""
    monkeypatch.setattr(launcher, "BACKOFF_FIRST", 0.001)
    monkeypatch.setattr(launcher, "BACKOFF_MAX", 0.002)
    monkeypatch.setattr(launcher, "BACKOFF_LONG", 0.01)
    c = cluster()
    healthy = {r.name: r.child for r in c.roles if r.name != "lm-1"}
    result: list[int] = []
    supervisor = threading.Thread(target=lambda: result.append(c.wait()), daemon=True)
    supervisor.start()
    lm1 = role(c, "lm-1")
    for death in range(1, 9):
        child = lm1.child
        child.code = -9
        c._wake.set()
        deadline = time.monotonic() + 10
        while lm1.child is child:
            assert not result, f"the launcher stopped (code {result}) at lm-1's death {death}"
            assert time.monotonic() < deadline, f"lm-1 not restarted after death {death}"
            time.sleep(0.005)
    assert not result and supervisor.is_alive()
    assert {r.name: r.child for r in c.roles if r.name != "lm-1"} == healthy  # untouched
    assert lm1.supervision.restarts == 8
    c.stopping = True
    c._wake.set()
    supervisor.join(10)
    assert result == [0]  # a signal stops it, cleanly


def test_the_record_says_backed_off_until_when(cluster, capsys):
    c = cluster()
    lm1 = role(c, "lm-1")
    now = 1000.0
    for _ in range(6):
        lm1.child.code = -9
        assert c.supervise(now) is None
        now = lm1.supervision.due
        assert c.supervise(now) is None  # the restart
        now += 0.1
        assert c.supervise(now) is None  # its health check: SERVING again
    lm1.child.code = -9
    before = time.time()
    assert c.supervise(now) is None
    record = c.records["lm-1"]
    assert record["backed_off"] and record["state"] == "waiting"
    assert record["exit_code"] == -9 and record["reason"] == "exit code -9"
    assert record["deaths"] == 7 and record["window_seconds"] == 300
    assert record["restarts"] == 6 and not record["cannot_run"]
    assert before + 32 - 1 <= record["until"] <= time.time() + 32 + 1  # the second backoff
    err = capsys.readouterr().err
    assert "lm-1 stopped unexpectedly (exit code -9); restarting in 0.5s" in err
    assert "lm-1 stopped unexpectedly (exit code -9); backed off: restarting in 16s" in err
    assert "the other roles keep serving" in err
    assert "lm-1 SERVING again" in err

    now = lm1.supervision.due
    c.supervise(now)
    assert c.records["lm-1"]["state"] == "starting" and c.records["lm-1"]["until"] is None
    c.supervise(now + 0.1)
    assert c.records["lm-1"]["state"] == "serving"
    assert c.records["lm-1"]["backed_off"]  # until it has served a whole window unbroken


def test_the_backoff_ends_after_a_window_served_unbroken(cluster, capsys):
    c = cluster(max_restarts=0)
    enc = role(c, "encoder-0")
    enc.child.code = 1
    c.supervise(10.0)
    assert enc.supervision.backoffs == 1 and enc.supervision.due == 10.0 + 16
    c.supervise(26.0)  # restarted
    c.supervise(27.0)  # SERVING
    assert c.records["encoder-0"]["state"] == "serving" and c.records["encoder-0"]["backed_off"]
    assert c._next_wake(27.0) == pytest.approx(26.0 + 300 - 27.0)  # it wakes to say so
    c.supervise(26.0 + 300)
    assert not c.records["encoder-0"]["backed_off"]
    assert "encoder-0 has served 300s unbroken: no longer backed off" in capsys.readouterr().err
    enc.child.code = 1  # the next death starts over: budget 0, backed off again at 16 s
    c.supervise(400.0)
    assert enc.supervision.due == 400.0 + 16


def test_a_hostile_client_that_keeps_killing_a_role_never_stops_the_cluster(cluster):
    """The only encoder, killed after every restart reaches SERVING: backed off at 5 minutes
    at most, never given up on (each restart could run)."""
    c = cluster(encoders=1, max_restarts=5)
    enc = role(c, "encoder-0")
    now, delays = 0.0, []
    for _ in range(30):
        enc.child.code = -11
        assert c.supervise(now) is None
        delays.append(enc.supervision.due - now)
        now = enc.supervision.due
        assert c.supervise(now) is None
        now += 1
        assert c.supervise(now) is None
        assert enc.supervision.serving
    assert max(delays) == 300 and delays[-1] == 300


def test_a_kind_that_cannot_run_at_all_stops_the_cluster(cluster, capsys):
    """Every encoder's restarts die before SERVING (a model that no longer loads, say) more
    than --max-restarts times in a row: no encoder can run, `epd up` stops, saying why."""
    c = cluster(encoders=2, max_restarts=2)
    c.health = {"encoder-0": "NOT_SERVING", "encoder-1": "NOT_SERVING"}
    now = 0.0

    def fail_until_cannot_run(name: str) -> int | None:
        nonlocal now
        r = role(c, name)
        while True:
            r.child.code = 1
            code = c.supervise(now)
            if code is not None or r.supervision.cannot_run(2):
                return code
            now = r.supervision.due
            assert c.supervise(now) is None  # restarted; never SERVING

    # One encoder that cannot run while the other serves: the cluster goes on without it.
    assert fail_until_cannot_run("encoder-0") is None
    assert role(c, "encoder-0").supervision.unserved == 3
    err = capsys.readouterr().err
    assert "encoder-0 cannot run here: 3 restarts in a row died before SERVING" in err
    assert c.records["encoder-0"]["cannot_run"]
    # The second one too: nothing can encode, the cluster stops.
    assert fail_until_cannot_run("encoder-1") == 1
    err = capsys.readouterr().err
    assert "no encoder can run: encoder-0, encoder-1 each died more than --max-restarts 2" in err
    assert "stopping the cluster" in err


def test_a_restart_that_reaches_serving_clears_its_failed_starts(cluster):
    c = cluster(encoders=1, max_restarts=1)
    enc = role(c, "encoder-0")
    c.health["encoder-0"] = "NOT_SERVING"
    enc.child.code = 1  # died while serving: not a failed start
    c.supervise(0.0)
    c.supervise(enc.supervision.due)
    enc.child.code = 1  # died while starting: one failed start
    c.supervise(5.0)
    assert enc.supervision.unserved == 1 and not enc.supervision.cannot_run(1)
    c.supervise(enc.supervision.due)
    c.health["encoder-0"] = "SERVING"
    c.supervise(enc.supervision.started + 1)
    assert enc.supervision.serving and enc.supervision.unserved == 0
