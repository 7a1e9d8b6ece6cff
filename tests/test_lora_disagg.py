"""LoRA adapters across the split: the adapter travels in the Prefill RPC, the prefill node
computes the prompt's KV with it and the decode node decodes with it, greedy tokens equal to
transformers with peft's LoRA forward for the base and two adapters mixed; a decode node sends a
request only to prefill nodes that report its adapter, and a prefill node without the adapter
refuses with INVALID_ARGUMENT naming it (real gRPC, real UCX, real torch)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from pdserve.client import generate
from proto.pdserve.v1 import prefill_pb2
from shared.engine.config import EngineConfig
from shared.engine.sampling.sampling_params import SamplingParams
from tests.engine_helpers import random_prompts
from tests.support.cluster import pd_cluster
from tests.test_lora_engine import MAX_TOKENS, SPECS, setup  # noqa: F401  (the fixture)

ADAPTERS = ("all-r4", "qv-r8")


def _config(base, paths: dict[str, str], names: tuple[str, ...]) -> EngineConfig:
    modules = tuple((n, paths[n]) for n in names)
    return EngineConfig(
        model=str(base), num_kv_blocks=512, max_num_tokens=32, lora_modules=modules, max_lora_rank=8
    )


def test_adapters_across_the_split_match_peft(setup) -> None:  # noqa: F811
    base, paths, prompts, want = setup
    engine = _config(base, paths, ADAPTERS)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    jobs = [(i, n) for i in range(len(prompts)) for n in (None, *ADAPTERS)]

    async def body() -> None:
        async with pd_cluster(base, prefill_engine=engine, decode_engine=engine) as c:
            results = await asyncio.gather(
                *(
                    generate(c.targets[0], prompts[i], replace(greedy, lora_adapter=n), timeout=120)
                    for i, n in jobs
                )
            )
            for (i, n), r in zip(jobs, results, strict=True):
                assert r.token_ids == want[n][i], (n, len(prompts[i]))
            assert all(node.core.num_steps > 0 for node in c.prefills)
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_prefill_node_without_the_adapter_refuses_naming_it(setup) -> None:  # noqa: F811
    base, paths, _, _ = setup
    decode = _config(base, paths, ADAPTERS)
    prefill = _config(base, paths, ("all-r4",))
    prompt = random_prompts(1, 512, min_len=40, max_len=40, seed=5)[0]

    async def body() -> None:
        async with pd_cluster(base, prefill_engine=prefill, decode_engine=decode) as c:
            # as if the decode node had not learnt its adapters yet: it asks, and is refused
            (peer,) = c.decodes[0].pool.replicas
            await peer.learn()
            peer.lora_adapters = None
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(
                    c.targets[0], prompt, SamplingParams(max_tokens=4, lora_adapter="qv-r8")
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "'qv-r8' is not loaded" in (err.value.details() or ""), err.value
            # the adapter it has still serves
            ok = await generate(
                c.targets[0], prompt, SamplingParams(max_tokens=4, lora_adapter="all-r4")
            )
            assert len(ok.token_ids) == 4
            await c.assert_idle_and_conserved()

    asyncio.run(body())


def test_requests_go_only_to_prefill_nodes_that_have_their_adapter(setup) -> None:  # noqa: F811
    """Two prefill nodes, one without qv-r8, taken in turn (round-robin): every qv-r8 request
    goes to the other (learnt from ModelInfo.lora_adapters), the base model's to both; an
    adapter no prefill node has is UNAVAILABLE naming it, or prefilled by the decode node
    itself when its local fallback is on."""
    base, paths, prompts, want = setup
    both = _config(base, paths, ADAPTERS)
    one = _config(base, paths, ("all-r4",))
    decode = _config(base, paths, (*ADAPTERS, "mlp-r2"))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def body(fallback: bool) -> None:
        overrides = {"prefill_routing": "round-robin", "local_prefill_fallback": fallback}
        async with pd_cluster(
            base, prefill_engines=(one, both), decode_engine=decode, decode_overrides=overrides
        ) as c:
            for peer in c.decodes[0].pool.replicas:
                await peer.learn()
            target = c.targets[0]
            jobs = [(i, "qv-r8") for i in range(len(prompts))] * 2
            results = await asyncio.gather(
                *(generate(target, prompts[i], replace(greedy, lora_adapter=n)) for i, n in jobs)
            )
            assert [r.token_ids for r in results] == [want[n][i] for i, n in jobs]
            assert c.prefills[0].core.num_steps == 0  # never asked for qv-r8
            for i in range(len(prompts)):  # the base model: either node
                r = await generate(target, prompts[i], greedy)
                assert r.token_ids == want[None][i]
            assert c.prefills[0].core.num_steps > 0
            mlp = replace(greedy, lora_adapter="mlp-r2")  # only the decode node has it
            if fallback:
                r = await generate(target, prompts[0], mlp)
                assert r.token_ids == want["mlp-r2"][0]
            else:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(target, prompts[0], mlp)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert "no healthy prefill node has LoRA adapter 'mlp-r2'" in (
                    err.value.details() or ""
                ), err.value
            await c.assert_idle_and_conserved()

    asyncio.run(body(fallback=False))
    asyncio.run(body(fallback=True))


def test_a_runtime_load_reaches_the_prefill_nodes(setup) -> None:  # noqa: F811
    """The decode node's runtime load is passed on: the prefill node started with
    --allow-runtime-lora loads it and prefills its requests (local prefill is off, so nothing
    else could); one started without it says so and is not sent them. An unload goes the same
    way, and the prefill node's refusals are precise gRPC statuses."""
    base, paths, prompts, want = setup
    slots = EngineConfig(model=str(base), num_kv_blocks=512, max_num_tokens=32, max_loras=2)
    slots = replace(slots, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora_adapter="a")

    async def body() -> None:
        async with pd_cluster(
            base,
            prefill_engines=(slots, slots),
            prefill_overrides={"allow_runtime_lora": True},
            decode_engine=slots,
            decode_overrides={"allow_runtime_lora": True},
        ) as c:
            decode, (taker, refuser) = c.decodes[0], c.prefills
            refuser.config = replace(refuser.config, allow_runtime_lora=False)
            for peer in decode.pool.replicas:
                await peer.learn()
            missed = await decode.load_lora("a", paths["all-r4"])
            assert len(missed) == 1 and f":{refuser.port}: FAILED_PRECONDITION" in missed[0]
            assert "--allow-runtime-lora" in missed[0], missed
            for i in range(len(prompts)):
                r = await generate(c.targets[0], prompts[i], greedy)
                assert r.token_ids == want["all-r4"][i]
            assert taker.core.num_steps > 0 and refuser.core.num_steps == 0
            stub = next(p.stub for p in decode.pool.replicas if p.target.endswith(f":{taker.port}"))
            for request, code in [
                (
                    prefill_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path=paths["qv-r8"]),
                    "INVALID_ARGUMENT",
                ),
                (prefill_pb2.UnloadLoraAdapterRequest(lora_name="zz"), "NOT_FOUND"),
            ]:
                call = (
                    stub.LoadLoraAdapter
                    if request.DESCRIPTOR.name.startswith("Load")
                    else stub.UnloadLoraAdapter
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(request)
                assert err.value.code().name == code, err.value
            assert await decode.unload_lora("a") == []
            assert all(not p.lora_adapters for p in decode.pool.replicas)
            assert taker.info.lora_adapters == {}
            await c.assert_idle_and_conserved()

    asyncio.run(body())
