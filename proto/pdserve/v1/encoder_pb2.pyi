from proto.pdserve.v1 import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "destination", "landing_block_rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LANDING_BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_prefill_pb2.PromptImage]
    destination: _prefill_pb2.KvDestination
    landing_block_rows: int
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_prefill_pb2.PromptImage, _Mapping]]] = ..., destination: _Optional[_Union[_prefill_pb2.KvDestination, _Mapping]] = ..., landing_block_rows: _Optional[int] = ...) -> None: ...

class Embeddings(_message.Message):
    __slots__ = ("data", "tokens", "hidden_size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    tokens: int
    hidden_size: int
    def __init__(self, data: _Optional[bytes] = ..., tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings", "cached", "pushed")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embeddings]
    cached: int
    pushed: bool
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embeddings, _Mapping]]] = ..., cached: _Optional[int] = ..., pushed: _Optional[bool] = ...) -> None: ...
