"""vLLM's /tokenize and /detokenize on a live decode node, checked against transformers'
AutoTokenizer on the same checkpoint (what vLLM calls: encode, convert_ids_to_tokens, decode)
and against the prompt the chat endpoint actually runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from shared.serving.http import create_app
from shared.serving.http.service import HttpApiConfig
from shared.serving.metrics import AsgiServer
from tests.fuzz_loop import LiveHttp
from tests.support.checkpoints import BOS_TOKEN, EOS_TOKEN, special_ids

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
KEYS = {"count", "max_model_len", "tokens", "token_strs"}


class Live(LiveHttp):
    def __init__(self, path: Path, template: Path) -> None:
        super().__init__(path, chat_template=str(template))
        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.max_model_len = self.client.get("/v1/models").json()["data"][0]["max_model_len"]


@pytest.fixture(scope="module")
def api(checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    node = Live(checkpoint("llama"), template)
    yield node
    node.close()


def _ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_tokenize_a_prompt_as_vllm(api: Live) -> None:
    text = "Hello there"
    got = _ok(api.post("/tokenize", {"model": api.model, "prompt": text}))
    want = api.hf.encode(text)  # add_special_tokens defaults to true: BOS first
    assert set(got) == KEYS and got["token_strs"] is None
    assert got["tokens"] == want and got["count"] == len(want)
    assert got["max_model_len"] == api.max_model_len
    bare = _ok(api.post("/tokenize", {"prompt": text, "add_special_tokens": False}))
    assert bare["tokens"] == api.hf.encode(text, add_special_tokens=False) == want[1:]
    strs = _ok(api.post("/tokenize", {"prompt": text, "return_token_strs": True}))
    assert strs["token_strs"] == api.hf.convert_ids_to_tokens(want)  # e.g. "Ġthe"


def test_tokenize_messages_is_the_prompt_chat_runs(api: Live) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}]
    got = _ok(api.post("/tokenize", {"model": api.model, "messages": messages}))
    rendered = "[system] be brief\n[user] Hi!\n[assistant] "
    assert got["tokens"] == api.hf.encode(rendered, add_special_tokens=False)
    chat = {"model": api.model, "messages": messages, "max_tokens": 1}
    usage = _ok(api.post("/v1/chat/completions", chat))["usage"]
    assert usage["prompt_tokens"] == got["count"]
    no_gen = _ok(api.post("/tokenize", {"messages": messages, "add_generation_prompt": False}))
    assert no_gen["tokens"] == api.hf.encode(
        rendered[: -len("[assistant] ")], add_special_tokens=False
    )
    special = _ok(api.post("/tokenize", {"messages": messages, "add_special_tokens": True}))
    assert special["tokens"] == api.hf.encode(rendered)


def test_detokenize_as_vllm(api: Live) -> None:
    ids = api.hf.encode("Hello there")
    got = _ok(api.post("/detokenize", {"model": api.model, "tokens": ids}))
    assert got == {"prompt": api.hf.decode(ids)}  # specials kept: "<s>Hello there"
    assert _ok(api.post("/detokenize", {"tokens": []})) == {"prompt": ""}


def test_tokenizer_routes_refuse_bad_requests_by_field(api: Live) -> None:
    assert _error(api.post("/tokenize", {"model": "other", "prompt": "x"}), 404)["param"] == (
        "model"
    )
    assert _error(api.post("/detokenize", {"model": "other", "tokens": [1]}), 404)["param"] == (
        "model"
    )
    vocab = api.cluster.decodes[0].core.model_config.vocab_size  # the model's, as prompts
    assert _error(api.post("/detokenize", {"tokens": [1, vocab]}), 400)["param"] == "tokens"
    assert _error(api.post("/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens.0"
    assert _error(api.post("/detokenize", {"tokens": ["a"]}), 400)["param"] == "tokens.0"
    assert _error(api.post("/tokenize", {"model": api.model}), 400)["param"] == "prompt"
    assert _error(api.post("/tokenize", {"prompt": 5}), 400)["param"] == "prompt"
    assert _error(api.post("/tokenize", {"messages": []}), 400)["param"] == "messages"
    refused = {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}
    assert _error(api.post("/tokenize", refused), 400)["param"] == "continue_final_message"
    assert _error(api.post("/tokenize", ["prompt"]), 400)["message"]
    raw = api.client.post("/tokenize", content=b"{not json", headers={"content-type": "x"})
    assert raw.status_code == 400, raw.text
    api.runner.run(api.still_serving())


def test_tokenizer_routes_take_the_api_key(api: Live) -> None:
    node = api.cluster.decodes[0]
    config = HttpApiConfig(
        api_key="sesame", chat_template=node.config.http_api(node.core.loaded).chat_template
    )
    app = create_app(node, config, CollectorRegistry())
    server = api.runner.run(AsgiServer.start(app, "127.0.0.1", 0))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                assert client.post(path, json=body).status_code == 401
                auth = {"authorization": "Bearer sesame"}
                assert client.post(path, json=body, headers=auth).status_code == 200
    finally:
        api.runner.run(server.close())


def test_tokenizer_info_lets_a_client_count_tokens_without_tokenizer_files(api: Live) -> None:
    """What lm-evaluation-harness's remote tokenizer reads: the specials as text (it encodes
    `eos_token` through /tokenize to find the id it stops on) and the template it renders."""
    info = _ok(api.client.get("/tokenizer_info"))
    # the checkpoint's own EOS (the lowest stop id; EOT is the second one) and BOS, as text
    assert (info["eos_token"], info["bos_token"]) == (EOS_TOKEN, BOS_TOKEN)
    assert info["chat_template"] == TEMPLATE
    assert info["model_max_length"] == api.max_model_len
    assert info["vocab_size"] == len(api.hf)
    eos = _ok(api.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}))
    assert eos["tokens"] == [special_ids()[EOS_TOKEN]]
