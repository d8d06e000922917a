"""The encoder planner: how many encoders the current demand needs.

Its inputs are the encoders' own load reports (EncoderLoad, polled by every proxy), so every
proxy computes the same number from the same shared numbers; no leader is elected. Per report:
the tower's busy fraction and items per second over the encoder's last 10 s, and the items
queued. Summed over the encoders that are SERVING:

    work      = sum(busy_fraction)                 encoder-seconds of encoding per second:
                                                   the items/s the encoders take (held items
                                                   never reach them) times seconds per item
    per_item  = work / sum(items_per_second)       seconds per item, as the encoders measure it
                                                   (the last known value while none finish)
    backlog   = sum(queued_items + running_items)  encoder-seconds of work not done (an item in
                * per_item                         a forward counts whole: a burst lands in one
                                                   batch, which its queue does not show)
    need      = (work + backlog / wait_slo) / target_utilisation

`need` is in encoders: what runs now at the target utilisation, plus what it takes to clear
the queue within the encode-wait objective (`proxy.encoder_wait_slo_seconds`). A saturated
encoder's busy fraction stops at 1 while its queue grows, so the backlog term is what sees
demand beyond the encoders there are. The recommendation is ceil(need - 0.1) (a tenth of an
encoder of tolerance, so that noise around a whole number does not flap), at least 1 while any
work is queued or running. The planner's answer, `desired`, is the largest recommendation of
the last `encoder_scale_down_seconds`, clamped to [encoders_min, encoders_max]: scale-up is
immediate, scale-down waits until demand has stayed low for that long (the rule of Kubernetes'
HPA stabilisation window).

Consumers: `epd_encoders_desired` on /metrics (Kubernetes: an HPA through the Prometheus
adapter, which takes the max over proxies), the dashboard, and `{namespace}:planner` in Redis,
one field per proxy (`epd up --encoders auto` reads the max of the fresh ones).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

TOLERANCE = 0.1  # encoders of need below a whole number that do not ask for one more


def planner_key(namespace: str) -> str:
    """A hash, proxy id -> JSON Decision (with "time", unix seconds): each proxy's answer."""
    return f"{namespace}:planner"


@dataclass
class Decision:
    desired: int  # the answer: encoders wanted now (clamped, stabilised)
    recommended: int  # this tick's own ceil(need), before the scale-down window
    need: float  # encoders, unrounded
    serving: int  # encoders that reported (SERVING)
    work: float  # encoder-seconds per second being spent encoding
    items_per_second: float
    seconds_per_item: float | None
    queued_items: int
    running_items: int
    backlog_seconds: float

    def to_json(self, now: float) -> str:
        return json.dumps({**asdict(self), "time": round(now, 3)})


class Planner:
    def __init__(
        self,
        target_utilisation: float = 0.7,
        wait_slo: float = 1.0,
        minimum: int = 1,
        maximum: int = 8,
        scale_down_seconds: float = 60.0,
    ):
        self.target_utilisation = target_utilisation
        self.wait_slo = wait_slo
        self.minimum = minimum
        self.maximum = maximum
        self.scale_down_seconds = scale_down_seconds
        self.seconds_per_item: float | None = None  # last measured
        self.recent: deque[tuple[float, int]] = deque()  # (monotonic time, recommended)
        self.last: Decision | None = None

    def update(self, loads: Iterable[Any], now: float | None = None) -> Decision:
        """One decision from the SERVING encoders' last reports (EncoderLoad or alike)."""
        now = time.monotonic() if now is None else now
        loads = list(loads)
        work = sum(min(max(x.busy_fraction, 0.0), 1.0) for x in loads)
        per_second = sum(x.items_per_second for x in loads)
        if per_second > 0 and work > 0:
            self.seconds_per_item = work / per_second
        queued = sum(x.queued_items for x in loads)
        running = sum(x.running_items for x in loads)
        backlog = (queued + running) * (self.seconds_per_item or 0.0)
        need = (work + backlog / self.wait_slo) / self.target_utilisation
        recommended = max(math.ceil(need - TOLERANCE), 0)
        if queued or running:
            recommended = max(recommended, 1)
        horizon = now - self.scale_down_seconds
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        self.recent.append((now, recommended))
        wanted = max(r for _, r in self.recent)
        self.last = Decision(
            desired=min(max(wanted, self.minimum), self.maximum),
            recommended=recommended,
            need=round(need, 3),
            serving=len(loads),
            work=round(work, 4),
            items_per_second=round(per_second, 3),
            seconds_per_item=self.seconds_per_item and round(self.seconds_per_item, 4),
            queued_items=queued,
            running_items=running,
            backlog_seconds=round(backlog, 3),
        )
        return self.last


def fresh_desired(entries: dict, now: float, max_age: float) -> int | None:
    """The largest `desired` among the proxies' Redis entries younger than `max_age` seconds
    (None when none is): what a consumer of several proxies' answers acts on."""
    values = []
    for raw in entries.values():
        try:
            entry = json.loads(raw)
            if now - float(entry["time"]) <= max_age:
                values.append(int(entry["desired"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(values, default=None)
