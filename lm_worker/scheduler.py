"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running requests first (decodes, then the rest of partial prefills), then waiting
requests in arrival order while the token budget, the sequence cap and the KV blocks allow. A
prefill chunk may stop anywhere, through the middle of an image's placeholders included, and
stops at the first item whose embedding has not arrived (`ready_tokens`): the text before an
image is prefilled while the image is encoded, and the request stays resident (a waiting one
keeps its place without holding up those behind it) until the embedding comes. When a
running request cannot get a block, the most recently admitted other one is preempted (never the
request being scheduled while another runs): its blocks are freed and it goes back to the front
of the queue, to be recomputed (its outputs so far are kept).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lm_worker.block_manager import BlockManager
from lm_worker.kv_connector import KVConnector, NoKVConnector
from lm_worker.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)  # decodes first, then prefill chunks
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0  # leading requests with exactly one new token
    preempted: list[Request] = field(default_factory=list)
    # Requests that had nothing ready to compute this step (their inputs are not in yet).
    stalled: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def halves(self) -> tuple[ScheduledBatch, ScheduledBatch]:
        """The batch split in two (decodes stay first in each), to isolate a failing request."""
        half = len(self) // 2
        pairs = list(zip(self.requests, self.num_scheduled_tokens, strict=True))
        return _batch_of(pairs[:half]), _batch_of(pairs[half:])

    def running(self) -> ScheduledBatch:
        """The part of the batch whose requests still run (others may have finished since)."""
        pairs = zip(self.requests, self.num_scheduled_tokens, strict=True)
        return _batch_of([(r, n) for r, n in pairs if r.status is Status.RUNNING])


def _batch_of(pairs: list[tuple[Request, int]]) -> ScheduledBatch:
    return ScheduledBatch(
        requests=[r for r, _ in pairs],
        num_scheduled_tokens=[n for _, n in pairs],
        num_decodes=sum(1 for _, n in pairs if n == 1),
    )


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        ready_tokens: Callable[[Request], int] = lambda request: request.num_tokens,
        kv: KVConnector | None = None,  # None: NoKVConnector
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # How many of a request's tokens can be computed now: up to its first item whose
        # embedding has not arrived (realtime: up to the last position with an embedding);
        # the engine's is lm_worker/inputs.py's `ready_tokens`.
        self.ready_tokens = ready_tokens
        self.kv = kv or NoKVConnector()  # the engine's KV connector: what remotes hold
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
        stalled: list[Request] = []

        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this loop
                continue
            if budget == 0:
                break
            ready = min(request.num_tokens, self.ready_tokens(request))
            remaining = ready - request.num_computed_tokens
            if remaining <= 0:
                stalled.append(request)
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

        blocked: list[Request] = []  # waiting requests with nothing to compute yet
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if preempted:
                break  # KV is short this step: no admissions
            request = self.waiting[0]
            ready = min(request.num_tokens, self.ready_tokens(request))
            cached = self.blocks.cached_prefix(request)
            num_local = len(cached) * self.blocks.block_size
            # Tokens a KV connector holds past the local prefix (loaded before the forward).
            num_remote = self.kv.num_matched_tokens(request, num_local)
            # Held KV, local or remote, may reach past an item whose embedding is still being
            # fetched (block hashes include the items' hashes: it is that very item's KV). The
            # request then waits for the embedding rather than compute past it, and keeps the
            # hit: prefilling the text before the item now would give the blocks past it up.
            num_new = min(ready - num_local - num_remote, budget)
            if num_new <= 0:  # nothing to compute yet: it keeps its place
                blocked.append(self.waiting.popleft())
                stalled.append(request)
                continue
            if not self.blocks.can_allocate(request, num_remote + num_new, cached):
                break
            self.waiting.popleft()
            self.blocks.allocate(request, num_remote + num_new, cached)
            request.num_computed_tokens += num_remote
            self.kv.on_allocated(request, num_local, num_remote)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = Status.RUNNING
            self.running.append(request)
            (decodes if num_new == 1 else prefills).append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(blocked))

        batch = ScheduledBatch(preempted=preempted, num_decodes=len(decodes), stalled=stalled)
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
