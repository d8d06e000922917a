"""From a client request to what the cluster works on, before any media is decoded.

    prompt (text | chat | token ids) + media items
      -> mm_hash per item (model fingerprint, modality, processor kwargs, raw bytes; or the
         client's uuid within its tenant)                       [never decodes a pixel]
      -> grid and placeholder count per item, from its header alone
      -> token ids from the chat template, placeholders expanded, (offset, length) per item

Both APIs (gRPC Inference and the OpenAI HTTP API) come here with the same `ChatMessage` form.
Every problem with the input raises BadInput (INVALID_ARGUMENT / HTTP 400).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.media import MODALITIES
from common.served_model import ServedModel
from common.tracing import Stages
from models import MediaError, MediaGrid, MediaInput, expand_media
from proto import epd_pb2

HASH_VERSION = b"epd-mm-hash-v1"


class BadInput(ValueError):
    """The request cannot be served as sent; the message says why (INVALID_ARGUMENT / 400)."""


@dataclass(frozen=True)
class Part:
    """One content part of a chat message: text, or a reference to a media item."""

    text: str | None = None
    media_index: int | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    parts: tuple[Part, ...]


@dataclass
class PreparedItem:
    mm_hash: str
    media: MediaInput
    grid: MediaGrid
    offset: int = 0  # first placeholder token in the expanded prompt
    length: int = 0  # placeholder tokens
    # Where the item's run holds other tokens too (MediaRun): the ones that take embeddings.
    is_embed: tuple[bool, ...] | None = None


def new_request_id() -> str:
    """An id the proxy assigns: 128 random bits, so no one guesses another caller's."""
    return f"req-{secrets.token_hex(16)}"


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    items: list[PreparedItem]  # in prompt order
    sampling: epd_pb2.SamplingParams
    return_prompt_token_ids: bool = False
    preprocess_seconds: float = 0.0
    arrival: float = field(default_factory=time.monotonic)
    # Who may abort it (proxy/server.py): a key, or the connection that started it; "" for
    # HTTP requests, which no Abort names (their client ends one by going away).
    owner: str = ""
    # Where its time goes (common/tracing.py): the client's trace context (`traceparent`),
    # the proxy's span for it and its stages here.
    trace_parent: Any = None
    span: Any = None
    stages: Stages = field(default_factory=Stages)

    def item(self, mm_hash: str) -> PreparedItem:
        return next(i for i in self.items if i.mm_hash == mm_hash)

    def lm_request(self) -> epd_pb2.LMGenerateRequest:
        """What an LM worker gets: token ids, and per item its hash, placeholders and grid."""
        msg = epd_pb2.LMGenerateRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
        )
        for item in self.items:
            t, h, w = item.grid.grid_thw
            msg.mm_features.add(
                mm_hash=item.mm_hash,
                modality=MODALITIES[item.grid.modality],
                offset=item.offset,
                length=item.length,
                is_embed=item.is_embed or (),
                grid=epd_pb2.GridTHW(t=t, h=h, w=w),
                second_per_grid_t=item.grid.second_per_grid_t or 0.0,
            )
        return msg


def mm_hash(fingerprint: str, item: MediaInput, tenant: str = "") -> str:
    """The item's cache identity: its raw bytes (or the client's uuid), modality and processor
    kwargs, under the model's fingerprint. Equal bytes give equal hashes whatever URL or
    filename they came from.

    A uuid is only a name the client chose, so it is scoped by the caller's tenant (its API
    key's): another tenant sending other bytes under the same uuid gets another hash, never
    this tenant's embedding. Content hashes are shared: equal bytes are the same item."""
    h = hashlib.blake2b(HASH_VERSION, digest_size=20)
    for piece in (fingerprint, item.modality, json.dumps(item.kwargs, sort_keys=True)):
        h.update(len(piece).to_bytes(4, "little") + piece.encode())
    if item.uuid:
        h.update(b"tenant:" + len(tenant).to_bytes(4, "little") + tenant.encode())
        h.update(b"uuid:" + item.uuid.encode())
    elif item.modality == "image":
        h.update(item.image)
    elif item.modality == "video" and item.video:
        # The container's raw bytes; its sampling settings are in the kwargs above.
        h.update(b"container:" + item.video)
    elif item.modality == "video":
        h.update(repr(float(item.fps)).encode())
        for frame in item.frames:
            h.update(len(frame).to_bytes(8, "little") + frame)
    else:
        audio = item.audio
        h.update(f"{audio.format}:{audio.sample_rate}:".encode() + audio.data)
    return h.hexdigest()


class RequestBuilder:
    """Turns prompts and media into PreparedRequests for one served model."""

    def __init__(self, served: ServedModel, max_item_tokens: int | None = None):
        family = served.family
        self.served = served
        self.family = family
        self.tokenizer = family.tokenizer()
        # Headers only, here (the video limits come with the family's options).
        self.processor = family.processor()
        self.modalities = family.modalities
        self.placeholder = family.placeholder_token_ids
        # Placeholder tokens one item may become (None: no limit); checked before the prompt
        # is expanded, so an absurd size is refused before anything is allocated for it.
        self.max_item_tokens = max_item_tokens

    def build(
        self,
        prompt: str | Sequence[ChatMessage] | Sequence[int],
        media: Sequence[MediaInput],
        sampling: epd_pb2.SamplingParams,
        request_id: str = "",
        continue_final_message: bool = False,
        return_prompt_token_ids: bool = False,
        tenant: str = "",
        tools: Sequence[dict[str, Any]] = (),
    ) -> PreparedRequest:
        """`tools`: function definitions shown to the model in a chat prompt
        (proxy/tools.py)."""
        started = time.perf_counter()
        if self.family.prompt_from_media:
            ids, items = self._media_prompt(prompt, media)
            return PreparedRequest(
                request_id=request_id or new_request_id(),
                prompt_token_ids=ids,
                items=items,
                sampling=sampling,
                return_prompt_token_ids=return_prompt_token_ids,
                preprocess_seconds=time.perf_counter() - started,
            )
        if isinstance(prompt, str):
            ids, order = self.tokenizer.encode(prompt), list(range(len(media)))
        elif prompt and isinstance(prompt[0], ChatMessage):
            ids, order = self._chat(prompt, media, continue_final_message, tools)
        else:
            ids, order = [int(t) for t in prompt], list(range(len(media)))
        if not ids:
            raise BadInput("the prompt is empty")
        items = []
        for index in order:
            item = media[index]
            if item.modality not in self.modalities:
                raise BadInput(self._unsupported(index, item.modality))
            try:
                grid = self.processor.grid(item)
            except MediaError as e:
                raise BadInput(f"media item {index}: {e.reason}") from None
            except (ArithmeticError, TypeError, ValueError) as e:  # kwargs the math refuses
                raise BadInput(f"media item {index}: its settings cannot be used: {e}") from None
            self._check_size(index, grid)
            items.append(PreparedItem(mm_hash(self.served.fingerprint, item, tenant), item, grid))
        ids = self._expand(ids, items)
        return PreparedRequest(
            request_id=request_id or new_request_id(),
            prompt_token_ids=ids,
            items=items,
            sampling=sampling,
            return_prompt_token_ids=return_prompt_token_ids,
            preprocess_seconds=time.perf_counter() - started,
        )

    def _media_prompt(
        self, prompt: str | Sequence[ChatMessage] | Sequence[int], media: Sequence[MediaInput]
    ) -> tuple[list[int], list[PreparedItem]]:
        """The family builds the prompt from the one item (e.g. a transcription)."""
        kinds = ", ".join(self.modalities)
        if prompt and isinstance(prompt[0], ChatMessage):  # a chat that only holds the item
            prompt = "".join(p.text or "" for m in prompt for p in m.parts).strip()
        if prompt:
            raise BadInput(f"this model takes one {kinds} item and no prompt (send an empty one)")
        if len(media) != 1:
            raise BadInput(f"this model takes exactly one {kinds} item, got {len(media)}")
        item = media[0]
        if item.modality not in self.modalities:
            raise BadInput(self._unsupported(0, item.modality))
        try:
            grid = self.processor.grid(item)
            self._check_size(0, grid)
            ids, offset, length = self.family.media_prompt(grid)
        except MediaError as e:
            raise BadInput(f"media item 0: {e.reason}") from None
        prepared = PreparedItem(mm_hash(self.served.fingerprint, item), item, grid, offset, length)
        return ids, [prepared]

    def _chat(
        self,
        messages: Sequence[ChatMessage],
        media: Sequence[MediaInput],
        continue_final: bool,
        tools: Sequence[dict[str, Any]] = (),
    ) -> tuple[list[int], list[int]]:
        """Token ids of the rendered template, and the media indices in prompt order."""
        rendered, order = [], []
        for m in messages:
            if m.role not in ("system", "user", "assistant"):
                raise BadInput(f"unknown chat role {m.role!r} (system, user or assistant)")
            content: list[dict[str, Any]] = []
            for part in m.parts:
                if part.media_index is None:
                    content.append({"type": "text", "text": part.text or ""})
                    continue
                if not 0 <= part.media_index < len(media):
                    raise BadInput(
                        f"media_index {part.media_index} is out of range ({len(media)} items)"
                    )
                if part.media_index in order:
                    raise BadInput(f"media item {part.media_index} is referenced twice")
                order.append(part.media_index)
                kind = media[part.media_index].modality
                if kind not in self.modalities:
                    raise BadInput(self._unsupported(part.media_index, kind))
                content.append({"type": kind})
            rendered.append({"role": m.role, "content": content})
        if len(order) != len(media):
            unused = sorted(set(range(len(media))) - set(order))
            raise BadInput(f"media items {unused} are not referenced by any message part")
        extra = {}
        if tools:
            if "tools" in (self.tokenizer.chat_template or ""):  # the template renders them
                extra["tools"] = [{"type": "function", "function": f} for f in tools]
            elif rendered and rendered[0]["role"] == "system":
                rendered[0]["content"].append(
                    {"type": "text", "text": "\n\n" + tools_section(tools)}
                )
            else:
                section = {"type": "text", "text": tools_section(tools)}
                rendered.insert(0, {"role": "system", "content": [section]})
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt=not continue_final, **extra
            )
        except Exception as e:  # the checkpoint's template rejected the conversation
            raise BadInput(f"the chat template refused the messages: {e}") from None
        if continue_final:
            # Cut the rendered text right after the final message's last text, so the model
            # continues it instead of opening a new turn.
            tail = next((p.text for p in reversed(messages[-1].parts) if p.text), None)
            if not tail or tail not in text:
                raise BadInput("continue_final_message needs a final message ending in text")
            text = text[: text.rindex(tail) + len(tail)]
        return self.tokenizer.encode(text), order

    def _check_size(self, index: int, grid: MediaGrid) -> None:
        if self.max_item_tokens is None or grid.num_tokens <= self.max_item_tokens:
            return
        hint = "" if grid.modality == "audio" else "; lower its max_pixels"
        raise BadInput(
            f"media item {index} becomes {grid.num_tokens} tokens, more than "
            f"{self.max_item_tokens} (proxy.max_item_tokens{hint})"
        )

    def _unsupported(self, index: int, modality: str) -> str:
        return (
            f"media item {index}: {modality} items are not supported by this model "
            f"(it takes {', '.join(self.modalities)})"
        )

    def _expand(self, ids: list[int], items: list[PreparedItem]) -> list[int]:
        placeholder_ids = set(self.placeholder.values())
        found = [t for t in ids if t in placeholder_ids]
        if len(found) != len(items):
            raise BadInput(
                f"the prompt has {len(found)} media placeholders for {len(items)} media items "
                "(text must not contain placeholder tokens; in chat prompts media goes in "
                "media parts)"
            )
        for token, item in zip(found, items, strict=True):
            if token != self.placeholder[item.grid.modality]:
                raise BadInput(f"a {item.grid.modality} item sits at another kind's placeholder")
        try:
            expanded, runs = expand_media(
                ids,
                tuple(self.placeholder.values()),
                [i.grid.expansion for i in items],
            )
        except ValueError as e:
            raise BadInput(str(e)) from None
        for item, (offset, length, is_embed) in zip(items, runs, strict=True):
            item.offset, item.length, item.is_embed = offset, length, is_embed
        return expanded


def tools_section(functions: Sequence[dict[str, Any]]) -> str:
    """Tools for the system message of a chat template that does not render them, and how to
    call one (the `<tool_call>` blocks proxy/tools.py parses)."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "# Tools\n\nYou can call these functions:\n<tools>\n"
        f"{listed}\n</tools>\n\n"
        "To call one, reply with its name and arguments as JSON between tool_call tags:\n"
        '<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>'
    )
