"""The proxy's choice of LM worker between load reports (proxy/workers.py).

Loads are polled (every `proxy.load_poll_seconds`), so between two reports the proxy corrects
the last one by what it has itself sent and seen finish since.
"""

from __future__ import annotations

from proto import epd_pb2
from proxy.workers import Breaker, Worker, least_loaded


def lm(address: str) -> Worker:
    return Worker(
        role="lm",
        address=address,
        source="static",
        channel=None,
        stub=None,
        breaker=Breaker(failures_to_open=3, cooldown=1.0),
        status="SERVING",
    )


def pick(workers: list[Worker]) -> str:
    return least_loaded(workers).address


def test_work_finished_since_a_busy_report_counts_as_gone():
    a, b = lm("a:1"), lm("b:1")
    a.set_load(epd_pb2.LMLoad(running_tokens=0))
    b.set_load(epd_pb2.LMLoad(running_tokens=0))
    a.sent(300)
    b.sent(100)
    # Both report while busy: a's 300-token prompt has generated 50 tokens so far.
    a.set_load(epd_pb2.LMLoad(running_tokens=350))
    b.set_load(epd_pb2.LMLoad(running_tokens=120))
    assert pick([a, b]) == "b:1"
    # a's request finishes before the next poll: the stale report no longer keeps work away.
    a.finished(300, generated=64)
    assert a.outstanding == 0 and a.queued_tokens() == 0
    assert pick([a, b]) == "a:1"
    # The next report replaces the correction.
    a.set_load(epd_pb2.LMLoad(running_tokens=0, waiting_tokens=40))
    assert a.finished_since_load == 0 and a.queued_tokens() == 40


def test_work_sent_since_an_idle_report_counts():
    a, b = lm("a:1"), lm("b:1")
    a.set_load(epd_pb2.LMLoad())
    b.set_load(epd_pb2.LMLoad(running_tokens=150))
    assert pick([a, b]) == "a:1"
    a.sent(200)  # a burst goes to a before it reports again
    assert a.queued_tokens() == 200
    assert pick([a, b]) == "b:1"


def test_other_proxies_work_stays_counted():
    # Work that this proxy did not send (another proxy's) is not taken off the report.
    a = lm("a:1")
    a.sent(100)
    a.set_load(epd_pb2.LMLoad(running_tokens=500))
    a.finished(100, generated=10)
    assert a.queued_tokens() == 390
