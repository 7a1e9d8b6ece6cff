"""`pdserve generate`: one completion streamed from a node's gRPC endpoint to stdout, the
summary line (finish reason, token counts, TTFT) after it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import IO

from pdserve.cli.flags import client_tls, from_args
from shared.engine.sampling.sampling_params import SamplingParams
from shared.serving.tls import ClientTls


def cmd_generate(a: argparse.Namespace) -> int:
    tls = client_tls(a, "")
    params = from_args(SamplingParams, a, stop=tuple(a.stop))
    return stream_to_stdout(a.target, a.prompt, params, timeout=a.timeout, tls=tls)


def stream_to_stdout(
    target: str,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    timeout: float | None = None,
    tls: ClientTls | None = None,
    summary: IO[str] = sys.stderr,
) -> int:
    """Stream a completion's text as it arrives; then a summary line, to `summary`."""
    import grpc

    from pdserve.client import finish_reason_name, generate_stream

    async def run() -> int:
        channel = None
        if tls is not None:
            tls.validate()
            channel = grpc.aio.secure_channel(target, tls.credentials())
        finish = ""
        usage = timing = None
        async with contextlib.aclosing(
            generate_stream(target, prompt, params, timeout=timeout, channel=channel)
        ) as stream:
            async for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    finish = finish_reason_name(chunk.finish_reason)
                    usage, timing = chunk.usage, chunk.timing
        print(flush=True)
        if usage is None or timing is None:
            print("error: the stream ended without a final message", file=sys.stderr)
            return 2
        print(
            f"[finish={finish} prompt_tokens={usage.prompt_tokens} completion_tokens="
            f"{usage.completion_tokens} cached_tokens={usage.cached_tokens} "
            f"ttft={timing.time_to_first_token_seconds * 1e3:.1f}ms]",
            file=summary,
            flush=True,
        )
        return 0

    try:
        return asyncio.run(run())
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2
