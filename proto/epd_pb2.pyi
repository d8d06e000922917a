from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_WAV: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM_S16LE: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM_F32LE: _ClassVar[AudioFormat]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]

class EncodeOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODE_OUTCOME_UNSPECIFIED: _ClassVar[EncodeOutcome]
    ENCODE_OUTCOME_STORED: _ClassVar[EncodeOutcome]
    ENCODE_OUTCOME_HELD: _ClassVar[EncodeOutcome]
    ENCODE_OUTCOME_FAILED: _ClassVar[EncodeOutcome]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality
AUDIO_FORMAT_WAV: AudioFormat
AUDIO_FORMAT_PCM_S16LE: AudioFormat
AUDIO_FORMAT_PCM_F32LE: AudioFormat
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
ENCODE_OUTCOME_UNSPECIFIED: EncodeOutcome
ENCODE_OUTCOME_STORED: EncodeOutcome
ENCODE_OUTCOME_HELD: EncodeOutcome
ENCODE_OUTCOME_FAILED: EncodeOutcome

class VideoFrames(_message.Message):
    __slots__ = ("frames", "fps")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    def __init__(self, frames: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ...) -> None: ...

class AudioClip(_message.Message):
    __slots__ = ("data", "format", "sample_rate")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: AudioFormat
    sample_rate: int
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("image", "video", "audio", "video_file", "uuid", "processor_kwargs")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FILE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_KWARGS_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    video: VideoFrames
    audio: AudioClip
    video_file: bytes
    uuid: str
    processor_kwargs: _struct_pb2.Struct
    def __init__(self, image: _Optional[bytes] = ..., video: _Optional[_Union[VideoFrames, _Mapping]] = ..., audio: _Optional[_Union[AudioClip, _Mapping]] = ..., video_file: _Optional[bytes] = ..., uuid: _Optional[str] = ..., processor_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "media_index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    media_index: int
    def __init__(self, text: _Optional[str] = ..., media_index: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "continue_final_message", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    continue_final_message: bool
    tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "structured")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "chat", "token_ids", "media", "sampling", "return_prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    chat: ChatPrompt
    token_ids: TokenIds
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    sampling: SamplingParams
    return_prompt_token_ids: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "mm_items", "mm_items_held", "mm_items_encoded", "mm_items_deduplicated")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_HELD_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_ENCODED_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    mm_items: int
    mm_items_held: int
    mm_items_encoded: int
    mm_items_deduplicated: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., mm_items: _Optional[int] = ..., mm_items_held: _Optional[int] = ..., mm_items_encoded: _Optional[int] = ..., mm_items_deduplicated: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("preprocess_seconds", "cache_lookup_seconds", "encode_seconds", "queue_seconds", "embedding_wait_seconds", "prefill_seconds", "time_to_first_token_seconds", "decode_seconds", "total_seconds")
    PREPROCESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LOOKUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    preprocess_seconds: float
    cache_lookup_seconds: float
    encode_seconds: float
    queue_seconds: float
    embedding_wait_seconds: float
    prefill_seconds: float
    time_to_first_token_seconds: float
    decode_seconds: float
    total_seconds: float
    def __init__(self, preprocess_seconds: _Optional[float] = ..., cache_lookup_seconds: _Optional[float] = ..., encode_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., embedding_wait_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "usage", "timings", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RealtimeConfig(_message.Message):
    __slots__ = ("model", "format", "sample_rate", "sampling", "session_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    format: AudioFormat
    sample_rate: int
    sampling: SamplingParams
    session_id: str
    def __init__(self, model: _Optional[str] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., sample_rate: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class RealtimeInputDone(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RealtimeRequest(_message.Message):
    __slots__ = ("config", "audio", "input_done")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    INPUT_DONE_FIELD_NUMBER: _ClassVar[int]
    config: RealtimeConfig
    audio: bytes
    input_done: RealtimeInputDone
    def __init__(self, config: _Optional[_Union[RealtimeConfig, _Mapping]] = ..., audio: _Optional[bytes] = ..., input_done: _Optional[_Union[RealtimeInputDone, _Mapping]] = ...) -> None: ...

class RealtimeResponse(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "finish_reason", "usage", "audio_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    audio_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., audio_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "architecture", "max_model_len", "modalities")
    ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    id: str
    architecture: str
    max_model_len: int
    modalities: _containers.RepeatedScalarFieldContainer[Modality]
    def __init__(self, id: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., modalities: _Optional[_Iterable[_Union[Modality, str]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("mm_hash", "media", "mm_hash_tag")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_TAG_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    media: MediaItem
    mm_hash_tag: bytes
    def __init__(self, mm_hash: _Optional[str] = ..., media: _Optional[_Union[MediaItem, _Mapping]] = ..., mm_hash_tag: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EncodeResult(_message.Message):
    __slots__ = ("mm_hash", "outcome", "num_embeddings", "width", "dtype", "nbytes", "error", "encode_seconds")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    outcome: EncodeOutcome
    num_embeddings: int
    width: int
    dtype: DType
    nbytes: int
    error: ItemError
    encode_seconds: float
    def __init__(self, mm_hash: _Optional[str] = ..., outcome: _Optional[_Union[EncodeOutcome, str]] = ..., num_embeddings: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ..., encode_seconds: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EncodeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EncodeResult, _Mapping]]] = ...) -> None: ...

class EncodeStreamStart(_message.Message):
    __slots__ = ("session_id", "format", "sample_rate")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    format: AudioFormat
    sample_rate: int
    def __init__(self, session_id: _Optional[str] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class EncodeStreamRequest(_message.Message):
    __slots__ = ("start", "audio", "input_done")
    START_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    INPUT_DONE_FIELD_NUMBER: _ClassVar[int]
    start: EncodeStreamStart
    audio: bytes
    input_done: RealtimeInputDone
    def __init__(self, start: _Optional[_Union[EncodeStreamStart, _Mapping]] = ..., audio: _Optional[bytes] = ..., input_done: _Optional[_Union[RealtimeInputDone, _Mapping]] = ...) -> None: ...

class EncodeStreamResponse(_message.Message):
    __slots__ = ("num_published", "audio_seconds", "done")
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    num_published: int
    audio_seconds: float
    done: bool
    def __init__(self, num_published: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderLoad(_message.Message):
    __slots__ = ("worker_id", "queued_items", "queued_tokens", "running_items", "items_per_second", "busy_fraction", "active_streams", "batch_items")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queued_items: int
    queued_tokens: int
    running_items: int
    items_per_second: float
    busy_fraction: float
    active_streams: int
    batch_items: float
    def __init__(self, worker_id: _Optional[str] = ..., queued_items: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., running_items: _Optional[int] = ..., items_per_second: _Optional[float] = ..., busy_fraction: _Optional[float] = ..., active_streams: _Optional[int] = ..., batch_items: _Optional[float] = ...) -> None: ...

class GridTHW(_message.Message):
    __slots__ = ("t", "h", "w")
    T_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    t: int
    h: int
    w: int
    def __init__(self, t: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ...) -> None: ...

class MMFeature(_message.Message):
    __slots__ = ("mm_hash", "modality", "offset", "length", "is_embed", "grid", "second_per_grid_t")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    modality: Modality
    offset: int
    length: int
    is_embed: _containers.RepeatedScalarFieldContainer[bool]
    grid: GridTHW
    second_per_grid_t: float
    def __init__(self, mm_hash: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., is_embed: _Optional[_Iterable[bool]] = ..., grid: _Optional[_Union[GridTHW, _Mapping]] = ..., second_per_grid_t: _Optional[float] = ...) -> None: ...

class LMGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "mm_features", "sampling", "realtime_session_id", "resumed_output_tokens", "resumed_text_chars", "kv_handover", "kv_target", "rope_delta")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REALTIME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOVER_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_features: _containers.RepeatedCompositeFieldContainer[MMFeature]
    sampling: SamplingParams
    realtime_session_id: str
    resumed_output_tokens: int
    resumed_text_chars: int
    kv_handover: bool
    kv_target: str
    rope_delta: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mm_features: _Optional[_Iterable[_Union[MMFeature, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., realtime_session_id: _Optional[str] = ..., resumed_output_tokens: _Optional[int] = ..., resumed_text_chars: _Optional[int] = ..., kv_handover: _Optional[bool] = ..., kv_target: _Optional[str] = ..., rope_delta: _Optional[int] = ...) -> None: ...

class LMGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "timings", "missing_mm_hashes", "rope_delta")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MISSING_MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings
    missing_mm_hashes: _containers.RepeatedScalarFieldContainer[str]
    rope_delta: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., missing_mm_hashes: _Optional[_Iterable[str]] = ..., rope_delta: _Optional[int] = ...) -> None: ...

class LMLoad(_message.Message):
    __slots__ = ("worker_id", "running_requests", "waiting_requests", "running_tokens", "waiting_tokens", "kv_blocks_used", "kv_blocks_total", "tokens_per_second", "waiting_for_embeddings", "ec_local_hits", "ec_local_misses", "ec_redis_hits", "ec_redis_misses", "batch_size", "max_model_len", "role", "kv_tier", "kv_bytes_sent", "kv_bytes_received", "kv_blocks_pulled", "kv_blocks_corrupt", "kv_address", "kv_send_seconds", "realtime_sessions", "realtime_rows", "kv_transfer_p50_seconds", "kv_transfer_p99_seconds", "realtime_waiting_steps", "prefix_block_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EC_LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    EC_LOCAL_MISSES_FIELD_NUMBER: _ClassVar[int]
    EC_REDIS_HITS_FIELD_NUMBER: _ClassVar[int]
    EC_REDIS_MISSES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REALTIME_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REALTIME_ROWS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REALTIME_WAITING_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running_requests: int
    waiting_requests: int
    running_tokens: int
    waiting_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_second: float
    waiting_for_embeddings: int
    ec_local_hits: int
    ec_local_misses: int
    ec_redis_hits: int
    ec_redis_misses: int
    batch_size: float
    max_model_len: int
    role: str
    kv_tier: str
    kv_bytes_sent: int
    kv_bytes_received: int
    kv_blocks_pulled: int
    kv_blocks_corrupt: int
    kv_address: str
    kv_send_seconds: float
    realtime_sessions: int
    realtime_rows: int
    kv_transfer_p50_seconds: float
    kv_transfer_p99_seconds: float
    realtime_waiting_steps: int
    prefix_block_size: int
    def __init__(self, worker_id: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., running_tokens: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., waiting_for_embeddings: _Optional[int] = ..., ec_local_hits: _Optional[int] = ..., ec_local_misses: _Optional[int] = ..., ec_redis_hits: _Optional[int] = ..., ec_redis_misses: _Optional[int] = ..., batch_size: _Optional[float] = ..., max_model_len: _Optional[int] = ..., role: _Optional[str] = ..., kv_tier: _Optional[str] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_blocks_pulled: _Optional[int] = ..., kv_blocks_corrupt: _Optional[int] = ..., kv_address: _Optional[str] = ..., kv_send_seconds: _Optional[float] = ..., realtime_sessions: _Optional[int] = ..., realtime_rows: _Optional[int] = ..., kv_transfer_p50_seconds: _Optional[float] = ..., kv_transfer_p99_seconds: _Optional[float] = ..., realtime_waiting_steps: _Optional[int] = ..., prefix_block_size: _Optional[int] = ...) -> None: ...
