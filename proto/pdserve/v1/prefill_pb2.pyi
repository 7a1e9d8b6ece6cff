from proto.pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDestination(_message.Message):
    __slots__ = ("ucx_address", "transfer_id", "transfer_token", "block_ids", "first_block_index", "layout_fingerprint", "skipped_blocks", "prefill_instance_id", "decode_instance_id")
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ucx_address: str
    transfer_id: int
    transfer_token: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block_index: int
    layout_fingerprint: str
    skipped_blocks: _containers.RepeatedScalarFieldContainer[int]
    prefill_instance_id: int
    decode_instance_id: int
    def __init__(self, ucx_address: _Optional[str] = ..., transfer_id: _Optional[int] = ..., transfer_token: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_block_index: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., skipped_blocks: _Optional[_Iterable[int]] = ..., prefill_instance_id: _Optional[int] = ..., decode_instance_id: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "destination", "layerwise", "deadline_unix", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    seed: int
    destination: KvDestination
    layerwise: bool
    deadline_unix: float
    images: _containers.RepeatedCompositeFieldContainer[PromptImage]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ..., layerwise: _Optional[bool] = ..., deadline_unix: _Optional[float] = ..., images: _Optional[_Iterable[_Union[PromptImage, _Mapping]]] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("rgb", "height", "width")
    RGB_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    rgb: bytes
    height: int
    width: int
    def __init__(self, rgb: _Optional[bytes] = ..., height: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes_sent", "messages", "queue_seconds", "prefill_seconds", "transfer_tail_seconds", "first_layer_sent_unix", "last_layer_computed_unix", "last_byte_sent_unix")
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_COMPUTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTE_SENT_UNIX_FIELD_NUMBER: _ClassVar[int]
    bytes_sent: int
    messages: int
    queue_seconds: float
    prefill_seconds: float
    transfer_tail_seconds: float
    first_layer_sent_unix: float
    last_layer_computed_unix: float
    last_byte_sent_unix: float
    def __init__(self, bytes_sent: _Optional[int] = ..., messages: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_tail_seconds: _Optional[float] = ..., first_layer_sent_unix: _Optional[float] = ..., last_layer_computed_unix: _Optional[float] = ..., last_byte_sent_unix: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "cached_tokens", "stats", "first_token_logprobs", "prompt_logprobs", "choice_first_token_ids", "choice_first_token_logprobs", "instance_id", "mrope_delta")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    cached_tokens: int
    stats: TransferStats
    first_token_logprobs: _generation_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    choice_first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choice_first_token_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    instance_id: int
    mrope_delta: int
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., stats: _Optional[_Union[TransferStats, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., choice_first_token_ids: _Optional[_Iterable[int]] = ..., choice_first_token_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., instance_id: _Optional[int] = ..., mrope_delta: _Optional[int] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelPrefillResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdaptersResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...
