"""How the engine refuses a request: bad input, or no room now."""

from __future__ import annotations


class RequestRejected(ValueError):
    """Bad input: the message names the field (mapped to INVALID_ARGUMENT)."""


class ResourcesExhausted(RuntimeError):
    """The request is valid but cannot be admitted now (mapped to RESOURCE_EXHAUSTED);
    `retry_after_s` is a hint for the client (HTTP Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s
