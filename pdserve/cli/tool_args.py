"""The flags of the tool commands, which run no node themselves: `pdserve export-hf`, `proxy`,
`plan`, `bench`, `generate` and `build-kernels` (proxy, plan and build-kernels declare theirs in
their own modules). `sub` is the parser's subparsers action."""

from __future__ import annotations

import argparse

from pdserve.cli.tls_args import client_tls_args
from pdserve.log_level import log_level_arg


def add_export_hf(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export-hf", help="write a model as a Hugging Face directory")
    ex.add_argument("--model", required=True, help="tiny, smollm2, a GGUF file or an HF directory")
    ex.add_argument("out_dir", help="directory to write (created if missing)")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    log_level_arg(ex)


def add_proxy(sub: argparse._SubParsersAction) -> None:
    from pdserve.cli.proxy_args import add_arguments as add_proxy_arguments

    add_proxy_arguments(sub.add_parser("proxy", help="gRPC proxy in front of the decode nodes"))


def add_plan(sub: argparse._SubParsersAction) -> None:
    from pdserve.cli.plan_args import add_parser

    add_parser(sub)


def add_bench(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import BENCHMARKS

    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)}")
    log_level_arg(bench)
    bench.add_argument("name", choices=list(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")


def add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a decode node")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=120.0)
    log_level_arg(gen)
    client_tls_args(gen, "", "verify the server with this CA (enables TLS)")


def add_build_kernels(sub: argparse._SubParsersAction) -> None:
    from shared.model.kernel_build import add_arguments as add_build_arguments

    build = sub.add_parser("build-kernels", help="compile the C kernels for every CPU variant")
    add_build_arguments(build)
    log_level_arg(build)
