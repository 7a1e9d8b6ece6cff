"""`pdserve bench NAME`: each benchmark is a module with a `main(argv)`."""

from __future__ import annotations

BENCHMARKS = {
    "transfer": "pdserve.bench.transfer",
    "serve": "pdserve.bench.serve",
    "ttft": "pdserve.bench.ttft",
    "engine": "pdserve.bench.engine",
    "roofline": "pdserve.bench.roofline",
    "peer": "pdserve.bench.peer",
    "tracing": "pdserve.bench.tracing",
    "structured": "pdserve.bench.structured",
    "grammars": "pdserve.bench.grammars",
    "profile": "pdserve.bench.profile",
    "plan-check": "pdserve.bench.plan_check",
    "speculative": "pdserve.bench.speculative",
    "lora": "pdserve.bench.lora",
    "offload": "pdserve.bench.offload",
    "encoder": "pdserve.bench.encoder",
}
