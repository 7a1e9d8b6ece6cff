"""The flags of a decode node's HTTP API (the OpenAI-compatible front door) and of what one
HTTP client may hold there."""

from __future__ import annotations

import argparse

from shared.serving import limits


def http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="OpenAI-compatible HTTP API, also /metrics /health /version (0: ephemeral, -1: off)",
    )
    p.add_argument("--served-model-name", default="", help="the `model` HTTP requests name")
    p.add_argument("--api-key", default=None, help="require this HTTP bearer token")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="override the model's")
    tool_call_parser_arg(p)
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts whose http(s) image URLs this node fetches (vision models); none by "
        "default: images come inline as data URLs",
    )
    p.add_argument(
        "--responses-store-mb",
        type=int,
        default=64,
        help="memory for stored Responses API answers (GET /v1/responses/{id}, "
        "previous_response_id); least recently used evicted first; 0: keep none",
    )
    p.add_argument(
        "--responses-store-entries", type=int, default=10_000, help="stored answers at most"
    )
    _http_connection_args(p)


def tool_call_parser_arg(p: argparse.ArgumentParser) -> None:
    why = (
        'how tool_choice "auto" reads calls (hermes: Qwen, Hermes; llama3_json: Llama 3.x; '
        "mistral: Mistral); default: chosen from the chat template, plain text if it has none"
    )
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], help=why)


def _http_connection_args(p: argparse.ArgumentParser) -> None:
    """What one HTTP client may hold (shared/serving/connection_limits.py)."""
    p.add_argument(
        "--http-header-timeout",
        type=float,
        default=limits.HTTP_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take to arrive (from its first byte, or from "
        "the connection's opening); then 408 and the connection is closed",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=limits.HTTP_BODY_TIMEOUT_S,
        help="seconds a request's whole body may take to arrive after its headers; then 408 and "
        "the connection is closed",
    )
    p.add_argument(
        "--http-keep-alive-timeout",
        type=float,
        default=limits.HTTP_KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open",
    )
    p.add_argument(
        "--http-max-connections",
        type=int,
        default=limits.HTTP_MAX_CONNECTIONS,
        help="open HTTP connections at most; past it a request gets 503 with Retry-After "
        "(keep the process's open-file limit above it)",
    )
