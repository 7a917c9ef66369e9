"""Responses as OpenAI's published schema requires (tests/serve/data: the response schemas trimmed
from github.com/openai/openai-openapi by scripts/setup/trim_openapi.py): strictly typed clients
generated from it accept what the server answers."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import check_openai_schema as check

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def url(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=4, max_model_len=128, block_size=8,
                                          served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv.url


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


BASE = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"n": 2, "temperature": 0.7, "seed": 1}, {"stop": "fox"}])
def test_completions(url, extra):
    r = httpx.post(url + "/v1/completions", json={**BASE, "prompt": "the quick brown fox", **extra}, timeout=60)
    assert r.status_code == 200
    check(r.json(), "CreateCompletionResponse")


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "temperature": 0.7},
                                   {"response_format": {"type": "json_object"}, "max_tokens": 16}])
def test_chat(url, extra):
    body = {**BASE, "messages": [{"role": "user", "content": "hello"}], **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    check(r.json(), "CreateChatCompletionResponse")


def test_chat_stream_chunks(url):
    body = {**BASE, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}
    chunks = events(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
    assert len(chunks) > 2
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")


def test_models_and_errors(url):
    check(httpx.get(url + "/v1/models").json(), "ListModelsResponse")
    check(httpx.get(url + "/v1/models/tiny").json(), "Model")
    r = httpx.post(url + "/v1/completions", json={**BASE, "prompt": "x", "temperature": -1}, timeout=60)
    assert r.status_code == 400
    check(r.json(), "ErrorResponse")
