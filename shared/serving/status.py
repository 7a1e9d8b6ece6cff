"""Why a request failed, in one vocabulary for both public APIs: each status names the gRPC code
a gRPC client receives and the HTTP status (with OpenAI's error object) an HTTP client does."""

from __future__ import annotations

import enum

import grpc


class Status(enum.Enum):
    INVALID_ARGUMENT = 400
    FAILED_PRECONDITION = 412  # answered 400 over HTTP, as OpenAI's API has no 412
    RESOURCE_EXHAUSTED = 429
    INTERNAL = 500
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.name]

    @property
    def http_status(self) -> int:
        return 400 if self is Status.FAILED_PRECONDITION else self.value
