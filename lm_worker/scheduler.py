"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running requests first (decodes, then the rest of partial prefills), then waiting
requests in arrival order while the token budget, the sequence cap and the KV blocks allow. A
prefill chunk may stop anywhere, through the middle of an image's placeholders included. When a
running request cannot get a block, the most recently admitted other one is preempted (never the
request being scheduled while another runs): its blocks are freed and it goes back to the front
of the queue, to be recomputed (its outputs so far are kept).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lm_worker.block_manager import BlockManager
from lm_worker.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # decodes first, then prefill chunks
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0  # leading requests with exactly one new token
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        is_ready: Callable[[Request], bool] = lambda request: True,
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Realtime requests decode only once the embedding for their next position is there.
        self.is_ready = is_ready
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            if budget == 0:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            if not self.is_ready(request):
                continue
            num_new = min(remaining, budget)
            while not self.blocks.can_append(request, num_new):
                # The most recently admitted other request gives its blocks; if it was
                # already scheduled this step it leaves the step. Only a request running
                # alone preempts itself (the start-up check makes a lone request fit).
                victim = next((r for r in reversed(self.running) if r is not request), request)
                for scheduled in (decodes, prefills):
                    for i, (r, n) in enumerate(scheduled):
                        if r is victim:
                            del scheduled[i]
                            budget += n
                            break
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                continue
            self.blocks.append(request, num_new)
            (decodes if num_new == 1 else prefills).append((request, num_new))
            budget -= num_new

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if preempted:
                break  # KV is short this step: no admissions
            request = self.waiting[0]
            if not self.is_ready(request):
                break  # a preempted realtime request: its recompute waits for its rows
            cached = self.blocks.cached_prefix(request)
            num_new = min(request.num_tokens - len(cached) * self.blocks.block_size, budget)
            if not self.blocks.can_allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            self.blocks.allocate(request, num_new, cached)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = Status.RUNNING
            self.running.append(request)
            (decodes if num_new == 1 else prefills).append((request, num_new))
            budget -= num_new

        batch = ScheduledBatch(preempted=preempted, num_decodes=len(decodes))
        for request, num_new in decodes + prefills:
            batch.requests.append(request)
            batch.num_scheduled_tokens.append(num_new)
        return batch

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free_request(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request, reason: str) -> None:
        if request.status is Status.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
            self.blocks.free_request(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason

    def find(self, request_id: str) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None
