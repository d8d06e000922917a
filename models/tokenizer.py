"""A Hugging Face checkpoint's tokenizer, its chat template, streaming detokenization and
placeholder expansion (any family whose checkpoint ships tokenizer.json).

`tokenizer.json` is loaded with `tokenizers`. The chat template is the checkpoint's own Jinja
(tokenizer_config.json `chat_template`, or chat_template.jinja / chat_template.json as newer
tools write it), rendered in a sandbox with the same helpers transformers gives templates
(`raise_exception`, a `tojson` that keeps non-ASCII text, `strftime_now`, `{% generation %}`).

A prompt refers to each media item with ONE placeholder token (the family says which, e.g.
Qwen2-VL's `<|image_pad|>`); `expand_placeholders` repeats each to the item's token count, known
from its header (the family processor's `grid`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from models.checkpoint import CheckpointError, read_json
from models.media import MediaRun

# Token names transformers passes to every template (bos_token, eos_token, ...).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, chat_template: str | None, config: dict[str, Any]):
        self._tok = tokenizer
        self.chat_template = chat_template
        # bos_token, eos_token, ... as strings, for the template.
        self.special_token_strings = {
            k: _token_content(config.get(k)) for k in _SPECIAL_KEYS if config.get(k) is not None
        }
        eos = self.special_token_strings.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, checkpoint_dir: str | Path) -> Tokenizer:
        root = Path(checkpoint_dir)
        if not (root / "tokenizer.json").exists():
            raise CheckpointError(f"{root}: no tokenizer.json")
        tok = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        config = {}
        if (root / "tokenizer_config.json").exists():
            config = read_json(root / "tokenizer_config.json")
        return cls(tok, _find_chat_template(root, config), config)

    # -- ids -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the LM's rows may be more)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str | None:
        """tokenizer.json's text (what a grammar library reads the vocabulary from); None
        for a tokenizer that has none."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def required_id(self, token: str) -> int:
        """The id of a token the family needs (a placeholder); CheckpointError without it."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"tokenizer.json has no {token} token")
        return token_id

    # -- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. <|im_start|>) are recognised."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages`; content is a string or a list of parts
        `{"type": "text", "text": ...}`, `{"type": "image", ...}`, `{"type": "video", ...}`.
        Each media part becomes one placeholder token run of length one."""
        if self.chat_template is None:
            raise CheckpointError("the checkpoint has no chat template")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        variables = {**self.special_token_strings, **_plain(kwargs)}
        return self._template.render(
            messages=_plain(list(messages)),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    A byte-level BPE token may hold part of a UTF-8 character, so text is released only once
    it no longer ends in an incomplete character. Each step decodes a short window
    (`prefix_offset:`) rather than everything, and compares it with the window's already
    released part, so tokenizers that drop a leading space on decode stay right too.
    Joining all deltas and `flush()` gives `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: already-released tokens kept for context
        self._read_offset = 0  # tokens before this are released

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self.token_ids
        decode = self._tokenizer.decode
        released = decode(ids[self._prefix_offset : self._read_offset], self._skip)
        text = decode(ids[self._prefix_offset :], self._skip)
        # NOTE: text ending in an invalid byte sequence is held only until any complete
        # character follows, or the stream ends.
        if len(ids) == self._read_offset or (text.endswith("\ufffd") and not final):
            return ""
        delta = text[len(released) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return delta


def expand_placeholders(
    token_ids: Sequence[int], placeholder_ids: Iterable[int], counts: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Repeat the i-th placeholder token (in prompt order) counts[i] times.

    Returns the expanded ids and, per item, (offset, length) of its placeholder run in them.
    """
    ids, spans = expand_media(token_ids, placeholder_ids, counts)
    return ids, [(offset, length) for offset, length, _ in spans]


def expand_media(
    token_ids: Sequence[int], placeholder_ids: Iterable[int], items: Sequence[int | MediaRun]
) -> tuple[list[int], list[tuple[int, int, tuple[bool, ...] | None]]]:
    """The i-th placeholder token (in prompt order) repeated items[i] times, or, where items[i]
    is a MediaRun (tokens besides the placeholders, e.g. Qwen3-VL's frame timestamps), that
    placeholder with the run's `before` / `after` tokens around it replaced by the run's tokens.

    Returns the expanded ids and, per item, (offset, length, is_embed) of its run in them
    (is_embed None: every token of the run is a placeholder). ValueError when the prompt does
    not fit the items."""
    placeholders = set(placeholder_ids)
    ids = list(token_ids)
    found = [i for i, t in enumerate(ids) if t in placeholders]
    if len(found) != len(items):
        raise ValueError(f"the prompt has {len(found)} media placeholders but {len(items)} items")
    out: list[int] = []
    spans: list[tuple[int, int, tuple[bool, ...] | None]] = []
    cursor = 0
    for at, item in zip(found, items, strict=True):
        if not isinstance(item, MediaRun):
            if item <= 0:
                raise ValueError(f"item {len(spans)} has {item} placeholder tokens")
            out.extend(ids[cursor:at])
            spans.append((len(out), item, None))
            out.extend([ids[at]] * item)
            cursor = at + 1
            continue
        start, end = at - len(item.before), at + 1 + len(item.after)
        if (
            start < cursor
            or tuple(ids[start:at]) != item.before
            or (tuple(ids[at + 1 : end]) != item.after)
        ):
            raise ValueError(
                f"item {len(spans)}: its placeholder must stand between {list(item.before)} "
                f"and {list(item.after)} (the chat template's markers)"
            )
        out.extend(ids[cursor:start])
        spans.append((len(out), len(item.tokens), item.is_embed))
        out.extend(item.tokens)
        cursor = end
    out.extend(ids[cursor:])
    return out, spans


# -- chat template environment ------------------------------------------------------------------


def _find_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    if (root / "chat_template.jinja").exists():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (root / "chat_template.json").exists():
        template = read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _token_content(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or AddedToken dicts.
    return value["content"] if isinstance(value, dict) else str(value)


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the sandbox; media bytes become a short marker."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training); renders
    its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: Jinja's own tojson escapes <, >, & for HTML; prompts need the text as written.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
