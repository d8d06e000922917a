"""Mistral's Tekken tokenizer (tekken.json, read by mistral-common) behind the interface the
roles use (models.tokenizer.Tokenizer): encode, decode, streaming detokenization.

This family has no chat template: a transcription prompt is BOS then one streaming-pad token
per left-pad and delay position (`transcription_prompt`), and the audio fills every position
from the first one on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.tekken import Tekkenizer

from models.checkpoint import CheckpointError
from models.tokenizer import IncrementalDetokenizer, Tokenizer


class TekkenTokenizer(Tokenizer):
    # The base class reads tokenizer.json; this one wraps mistral-common's Tekkenizer.

    def __init__(self, tekken: Tekkenizer):
        self._tekken = tekken
        self.chat_template = None
        self.special_token_strings = {"bos_token": "<s>", "eos_token": "</s>"}
        self.eos_token_id = tekken.eos_id
        self.bos_token_id = tekken.bos_id
        self._template = None

    @classmethod
    def from_dir(cls, checkpoint_dir: str | Path) -> TekkenTokenizer:
        path = Path(checkpoint_dir) / "tekken.json"
        if not path.exists():
            raise CheckpointError(f"{path.parent}: no tekken.json")
        try:
            return cls(Tekkenizer.from_file(path))
        except (ValueError, KeyError, AssertionError) as e:
            raise CheckpointError(f"{path}: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self._tekken.n_words

    def to_json(self) -> str | None:
        return None  # tekken.json is not a tokenizer.json: no structured outputs

    def token_to_id(self, token: str) -> int | None:
        try:
            return self._tekken.get_special_token(token)
        except Exception:
            ids = self._tekken.encode(token, bos=False, eos=False)
            return ids[0] if len(ids) == 1 else None

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self.vocab_size:
            return None
        return self._tekken.id_to_piece(token_id)

    def required_id(self, token: str) -> int:
        try:
            return self._tekken.get_special_token(token)
        except Exception as e:
            raise CheckpointError(f"tekken.json has no {token} token") from e

    def encode(self, text: str) -> list[int]:
        return self._tekken.encode(text, bos=False, eos=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        policy = SpecialTokenPolicy.IGNORE if skip_special_tokens else SpecialTokenPolicy.KEEP
        return self._tekken.decode(list(ids), special_token_policy=policy)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        raise CheckpointError(
            "Voxtral Realtime has no chat template: it serves transcriptions of audio"
        )

    def transcription_prompt(self, num_left_pad_tokens: int, num_delay_tokens: int) -> list[int]:
        """BOS, then a streaming pad per left-pad and delay position."""
        pad = self.required_id("[STREAMING_PAD]")
        return [self.bos_token_id] + [pad] * (num_left_pad_tokens + num_delay_tokens)
