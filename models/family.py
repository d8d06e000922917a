"""The model-family interface: everything a role needs from a model, behind one object.

The roles never name a model class, a family or a modality. They load the family of the
checkpoint they serve (`models.load_family(path)`, which reads config.json's `architectures`)
and ask it:

    proxy     tokenizer(), placeholder_token_ids, processor().grid(item) (headers only),
              modalities, fingerprint(dtype), text.max_position_embeddings; for
              `prompt_from_media` families (speech transcription) media_prompt(grid)
    encoder   processor().preprocess(item), load_encoder(dtype, device), processor().warmup_item()
    LM        text (sizes), eos_token_ids, tokenizer(), load_language_model(backend, dtype,
              device), model_state(model)

A family is one module (or package) under models/ plus one line in models/registry.py.
Per-family behaviour inside the LM runner goes through `ModelState` (vLLM's model_states):
position scheme, the multimodal-pruning hook, what graph capture feeds the model.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from models.attention import AttentionBackend
from models.media import (
    MediaError,
    MediaGrid,
    MediaInput,
    MMFeature,
    Modality,
    ProcessedMedia,
)
from models.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDims:
    """The LM's sizes: what the LM worker sizes its KV cache, buffers and checks by."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int

    @classmethod
    def of(cls, config: Any) -> TextDims:
        """The sizes of a family's text config (which has fields of these names)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class MediaProcessor(Protocol):
    """A family's media preprocessing (thread-safe; every problem raises MediaError)."""

    def grid(self, item: MediaInput) -> MediaGrid:
        """The item's placeholder count (and grid) from its header alone: no decoding."""
        ...

    def preprocess(self, item: MediaInput) -> ProcessedMedia:
        """Decode and preprocess the item into its encoder's input (CPU work)."""
        ...

    def warmup_item(self) -> MediaInput:
        """A small synthetic item an encoder runs once before it says SERVING."""
        ...


class MediaEncoder(Protocol):
    """A family's encoder(s): items in, one [num_tokens, width] embedding per item out."""

    width: int  # channels per embedding (the LM's hidden size)
    dtype: torch.dtype
    device: torch.device

    def embed(self, batch: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """One forward over `batch` (any mix of the family's modalities); one output per item,
        in order, on the encoder's device and in its dtype."""
        ...


class MediaStream(Protocol):
    """One realtime session's encoder state (speech encoders that stream: `open_stream`)."""

    num_embeddings: int  # embeddings returned so far
    audio_seconds: float  # the client's audio taken so far

    def push(self, samples: np.ndarray) -> torch.Tensor:
        """Mono float32 samples at the model's rate -> the embeddings they complete, in
        order, [n, width] on the encoder's device."""
        ...

    def finish(self) -> torch.Tensor:
        """No more audio: the embeddings still owed."""
        ...


class LanguageModel(Protocol):
    """What the LM runner calls on a family's language model (an nn.Module). Optional: a
    `decoder_weights()` describing its decoder (models/layers.py's DecoderWeights), for the LM
    worker's fused CPU decode (lm_worker/cpu_decode.py), which the runner calls in place of
    the forward for the decode steps it takes; and `prefill_beyond_decoder`, naming what its
    prefill adds besides that decoder (Qwen3-VL's deepstack levels), which the
    batch-invariant C forward cannot run."""

    # Capabilities, read once by the runner.
    requires_raw_input_tokens: bool  # forward needs input_ids even when embeddings are given
    supports_realtime: bool  # decode steps take per-position embeddings (streaming audio)
    supports_multimodal_pruning: bool  # pruned (EVS) embeddings, wider than the hidden size

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,  # [T]
        mm_embeds: list[torch.Tensor] | None = None,  # each [n_i, hidden]
        is_mm_embed: torch.Tensor | None = None,  # [T] bool
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def __call__(
        self,
        input_ids: torch.Tensor | None,  # [T]; None when inputs_embeds is given
        positions: torch.Tensor,  # [axes, T] or [T] (ModelState.position_axes)
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]
        attn_metadata: Any = None,
        intermediate_tensors: Any = None,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab]
        ...


class EmbeddingMismatch(ValueError):
    """An embedding that cannot fill its placeholders (wrong width or row count)."""


@dataclass(frozen=True)
class LoadedEmbedding:
    """A fetched embedding made ready by the model state: the rows that fill its placeholders,
    and what the family's position scheme reads from it (EVS: the kept tokens' positions, which
    the encoder sent as trailing channels); None where the embedding carries nothing more."""

    embeds: torch.Tensor  # [num_embeds, hidden]
    positions: Any = None


@dataclass(frozen=True)
class FamilyOptions:
    """Cluster settings a family honours (None: the checkpoint's or the family's default)."""

    video_pruning_rate: float | None = None  # EVS; 0: off
    max_video_frames: int | None = None  # frames one video may bring to the encoder
    max_video_seconds: float | None = None  # a video container's duration
    max_audio_seconds: float | None = None  # an audio clip's duration (from its header)


class ModelState:
    """A family's hooks in the LM runner (vLLM's ModelState). This default: plain 1-D
    positions, embeddings taken as they are, capture fed from the runner's buffer.

    - `process_mm_embeds`: checks one fetched embedding before it is used and splits off what
      the position scheme needs (the pruning hook: EVS video embeddings carry their kept
      tokens' positions as trailing channels) -> LoadedEmbedding;
    - `rope_state` / `positions`: the position scheme. The runner's positions buffer is
      [position_axes, T]; a request's per-request state (e.g. M-RoPE's prompt positions and
      decode delta) is made once its embeddings are in, from its features and the
      `LoadedEmbedding.positions` of its items, and kept on the request;
    - `dummy_inputs_embeds`: what warm-up and CUDA-graph capture feed the model instead of
      running an encoder: a slice of the runner's preallocated buffer (`inputs_embeds`, set by
      the runner once it has allocated its buffers).
    """

    position_axes: ClassVar[int] = 1

    def __init__(self, model: LanguageModel, hidden_size: int):
        self.model = model
        self.hidden_size = hidden_size
        self.inputs_embeds: torch.Tensor | None = None  # the runner's [max_tokens, hidden]

    def rope_state(
        self,
        num_prompt_tokens: int,
        features: Sequence[MMFeature],
        media_positions: Mapping[str, Any] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Any:
        """Per-request position state, made once the request's embeddings are in.
        `media_positions`: LoadedEmbedding.positions by mm_hash (items that carry some);
        `token_ids`: the prompt as the model takes it (after any `relayout`)."""
        return None

    def relayout(
        self, token_ids: Sequence[int], feature: MMFeature, positions: Any
    ) -> tuple[list[int], np.ndarray] | None:
        """For an item whose run's layout depends on its embedding (a pruned Qwen3-VL video:
        how many tokens each frame kept): the run's tokens as the model takes them and their
        is_embed flags (the run keeps its length); None: the run stays as the proxy wrote
        it. `positions`: the item's LoadedEmbedding.positions."""
        return None

    def rope_delta(self, rope: Any) -> int | None:
        """What another worker needs of `rope` to position a request's tokens past its media
        (`rope_past_media`); None: nothing (plain positions)."""
        return None

    def rope_past_media(self, num_prompt_tokens: int, delta: int | None) -> Any:
        """Per-request position state for a request whose media positions this worker never
        computes (their KV came from the one that prefilled it), from that worker's
        `rope_delta`: exact for the tokens past the last media item only. ValueError when
        `delta` is not enough to make it."""
        return None

    def positions(
        self, rope: Any, num_prompt_tokens: int, start: int, end: int
    ) -> np.ndarray:  # [position_axes, end - start] int64
        """Positions of the request's tokens at sequence indices [start, end)."""
        return np.arange(start, end, dtype=np.int64)[None]

    def process_mm_embeds(
        self, mm_hash: str, embeds: torch.Tensor, num_embeds: int
    ) -> LoadedEmbedding:
        """Check (and for pruning models, split) one fetched embedding before it is used."""
        if embeds.dim() != 2:
            raise EmbeddingMismatch(f"embedding {mm_hash} has shape {tuple(embeds.shape)}, not 2-D")
        width = embeds.shape[1]
        if width != self.hidden_size:
            if width > self.hidden_size and not self.model.supports_multimodal_pruning:
                raise EmbeddingMismatch(
                    f"embedding {mm_hash} is {width} wide, the model's hidden size is "
                    f"{self.hidden_size}: pruned (EVS) embeddings need a model with multimodal "
                    "pruning"
                )
            raise EmbeddingMismatch(
                f"embedding {mm_hash} is {width} wide; the hidden size is {self.hidden_size}"
            )
        if embeds.shape[0] != num_embeds:
            raise EmbeddingMismatch(
                f"embedding {mm_hash} has {embeds.shape[0]} rows for {num_embeds} placeholder "
                "embeddings in the prompt"
            )
        return LoadedEmbedding(embeds)

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor:
        return self.inputs_embeds[:num_tokens]


class ModelFamily(ABC):
    """One checkpoint of one family. Cheap to construct: it reads the checkpoint's JSON files;
    weights load only when a role asks for its module."""

    architectures: ClassVar[tuple[str, ...]]  # config.json `architectures` it serves
    # The family builds the whole prompt from the request's one media item (speech
    # transcription: `media_prompt`); text and chat prompts do not apply.
    prompt_from_media: ClassVar[bool] = False

    def __init__(self, path: str | Path, options: FamilyOptions | None = None):
        self.path = Path(path)
        self.options = options or FamilyOptions()

    # -- what the checkpoint is ----------------------------------------------------------------

    @property
    @abstractmethod
    def architecture(self) -> str: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype the weights were saved in (`model.dtype: auto`)."""

    @property
    @abstractmethod
    def modalities(self) -> tuple[Modality, ...]: ...

    @property
    @abstractmethod
    def text(self) -> TextDims: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def placeholder_token_ids(self) -> dict[Modality, int]:
        """The one placeholder token a prompt holds per media item, by modality."""

    # -- what the roles load -------------------------------------------------------------------

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def processor(self, max_image_pixels: int | None = None) -> MediaProcessor: ...

    def media_prompt(self, grid: MediaGrid) -> tuple[list[int], int, int]:
        """(prompt token ids, offset, length) of a request made of one media item, for
        `prompt_from_media` families. The placeholders may run past the prompt: positions the
        decode steps fill (realtime models)."""
        raise NotImplementedError(f"{type(self).__name__} takes text or chat prompts")

    # -- realtime audio sessions (speech families) --------------------------------------------

    @property
    def realtime_sample_rate(self) -> int:
        """The audio rate a realtime session's chunks must come at."""
        raise MediaError(f"{self.architecture} does not take realtime audio sessions")

    def realtime_prompt(self) -> list[int]:
        """The prompt of a realtime session; its positions, and every decode step's after
        it, take the session's streamed embeddings in order (from position 0)."""
        raise MediaError(f"{self.architecture} does not take realtime audio sessions")

    def realtime_positions(self, seconds: float) -> int:
        """LM positions a realtime session with `seconds` of audio fills, padding included."""
        raise MediaError(f"{self.architecture} does not take realtime audio sessions")

    def realtime_audio_seconds(self, num_positions: int) -> float:
        """Seconds of the client's audio that a session's first `num_positions` cover."""
        raise MediaError(f"{self.architecture} does not take realtime audio sessions")

    @abstractmethod
    def fingerprint(self, dtype: torch.dtype) -> str:
        """A short id of everything that decides the encoders' outputs (checkpoint, processor
        settings, `dtype`): the EC connector's key component."""

    @abstractmethod
    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> MediaEncoder: ...

    @abstractmethod
    def load_language_model(
        self, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device
    ) -> LanguageModel: ...

    def model_state(self, model: LanguageModel) -> ModelState:
        return ModelState(model, self.text.hidden_size)
