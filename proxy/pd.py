"""Prefill / decode split: which LM worker takes each stage of a request.

With prefill workers and decode workers up (each says its role in GetLoad), a request runs in
two stages over the frontend's one retry loop:

    prefill   a prefill worker computes the prompt's KV and the first token, capped at one
              (kv_handover: its prompt blocks, the partial last one included, are in the KV
              tier before its last message); the client gets that token at once
    decode    a decode worker takes the prompt + that token: its KV comes from the tier, it
              computes the one new position and streams the rest

The decode stage is the frontend's migration (prompt + tokens already sent, max_tokens
lowered by them), so a decode worker dying mid-stream is the same case as before: the next
decode worker re-prefills, from the tier where it holds the blocks. A prefill worker dying
before its token is retried on another prefill worker. Without both roles up (or for a request
that wants one token) a request runs whole on one worker, as before.
"""

from __future__ import annotations

from proto import epd_pb2
from proxy.affinity import Affinity, PromptChains
from proxy.workers import Worker, WorkerPool, least_loaded

PREFILL = "prefill"
DECODE = "decode"


def role_of(worker: Worker) -> str:
    """The role the worker last reported ("both" before its first GetLoad answer)."""
    return (worker.load.role if worker.load is not None else "") or "both"


class PDRouter:
    """Chooses the LM worker of each call, split or not, with prefix-cache affinity
    (proxy/affinity.py) over the plain load rule of each stage."""

    def __init__(self, lms: WorkerPool, affinity: Affinity | None = None):
        self.lms = lms
        self.affinity = affinity or Affinity(0, 0)

    def _usable(self, role: str, exclude: set[str]) -> list[Worker]:
        return [w for w in self.lms.usable(exclude) if role_of(w) == role]

    def split(self) -> bool:
        """Both roles are up."""
        return bool(self._usable(PREFILL, set())) and bool(self._usable(DECODE, set()))

    def stage(self, msg: epd_pb2.LMGenerateRequest, sent: list[int]) -> str | None:
        """The stage of this call: decode once a token is out, prefill before (when the request
        wants more than one); None without a split."""
        if not self.split():
            return None
        if sent:
            return DECODE
        if msg.sampling.HasField("max_tokens") and msg.sampling.max_tokens <= 1:
            return None
        return PREFILL

    def pick(
        self,
        stage: str,
        exclude: set[str],
        prefer: Worker | None = None,
        chains: PromptChains | None = None,
    ) -> Worker | None:
        """A prefill worker by least queued tokens; a decode worker by most free KV blocks,
        then least queued tokens (`prefer`: the one its KV was sent to, while usable); either
        way the one holding the longest prefix of the prompt, within the affinity's margin."""
        workers = self._usable(stage, exclude)
        if prefer is not None and prefer in workers:
            return prefer
        if stage == PREFILL:
            baseline = least_loaded(workers)
        else:
            baseline = min(
                workers,
                key=lambda w: (-_free_blocks(w), w.queued_tokens(), w.address),
                default=None,
            )
        return self.affinity.choose(workers, baseline, chains)

    def pick_any(self, exclude: set[str], chains: PromptChains | None = None) -> Worker | None:
        """A whole request (no split): any role, least queued tokens, with affinity."""
        workers = self.lms.usable(exclude)
        return self.affinity.choose(workers, least_loaded(workers), chains)

    def record(self, worker: Worker, chains: PromptChains | None) -> None:
        """A call on `worker` completed: it holds the prompt's blocks now."""
        self.affinity.record(worker, chains)

    def cap(
        self, msg: epd_pb2.LMGenerateRequest, chains: PromptChains | None = None
    ) -> Worker | None:
        """Make `msg` a prefill stage: one token, its KV handed over. With direct KV, the
        decode worker is chosen now and the blocks go straight to it: that worker (else
        None)."""
        msg.sampling.max_tokens = 1
        msg.kv_handover = True
        target = self.pick(DECODE, set(), chains=chains)
        if target is None or not target.load.kv_address:
            return None
        msg.kv_target = target.load.kv_address
        return target

    @staticmethod
    def handed_over(worker: Worker, msg: epd_pb2.LMGenerateRequest, finish: int) -> bool:
        """Whether a prefill stage ending with `finish` goes on to decode: it stopped at the
        one-token cap (not on a stop, and not at the worker's context)."""
        if finish != epd_pb2.FINISH_REASON_LENGTH:
            return False
        context = worker.load.max_model_len if worker.load is not None else 0
        return not context or len(msg.prompt_token_ids) + 1 < context


# A realtime session's LM worker, by role. A session runs whole on one worker: its prompt is a
# few tokens (the audio arrives during decode, one embedding per step from its stream), so a
# prefill stage would have nothing to take off the decode worker and would add a handover to
# its first token. `both` workers first; without one, decode workers (sized for KV and decode
# steps) before prefill workers: any role serves a whole request.
REALTIME_ROLES = ("both", DECODE, PREFILL)


def realtime_pick(lms: WorkerPool, exclude: set[str]) -> Worker | None:
    """The LM worker for a realtime session: the first role of REALTIME_ROLES with a usable
    worker, least queued tokens among them."""
    return min(
        lms.usable(exclude),
        key=lambda w: (REALTIME_ROLES.index(role_of(w)), w.queued_tokens(), w.address),
        default=None,
    )


def _free_blocks(worker: Worker) -> int:
    load = worker.load
    return 0 if load is None else load.kv_blocks_total - load.kv_blocks_used


__all__ = ["DECODE", "PREFILL", "REALTIME_ROLES", "PDRouter", "realtime_pick", "role_of"]
