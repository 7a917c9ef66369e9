"""/v1/completions as real clients send it: prompt lists, `echo` with prompt log-probabilities
(evaluation harnesses), `suffix` and llama.cpp's /infill (editors' fill-in-the-middle)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import FIM_SPECIALS, check_openai_schema, make_model

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.params import SamplingParams
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["the quick brown fox", "def add(a, b):\n", "1 2 3 4"]
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("fim") / "m", "qwen2", seed=31, layers=2, tie=False,
                        specials=tuple(FIM_SPECIALS))
    return LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def url(llm):
    state = build_state(llm, EngineConfig(max_batch_size=4, max_queue=16, max_model_len=160, block_size=8,
                                          served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv.url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_a_prompt_list_is_one_choice_per_prompt_in_order(url):
    alone = [post(url, "/v1/completions", {**GREEDY, "prompt": p, "max_tokens": 6}).json() for p in PROMPTS]
    batch = post(url, "/v1/completions", {**GREEDY, "prompt": PROMPTS, "max_tokens": 6, "n": 2}).json()
    check_openai_schema(batch, "CreateCompletionResponse")
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for i, one in enumerate(alone):                          # n=2 greedy: both choices the prompt's answer
        assert [c["text"] for c in batch["choices"][2 * i:2 * i + 2]] == [one["choices"][0]["text"]] * 2
    assert batch["usage"]["prompt_tokens"] == sum(one["usage"]["prompt_tokens"] for one in alone)
    assert batch["usage"]["completion_tokens"] == 6 * 6
    ids = post(url, "/v1/completions", {**GREEDY, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2}).json()
    assert len(ids["choices"]) == 2


def test_prompt_list_limits(url):
    r = post(url, "/v1/completions", {**GREEDY, "prompt": ["a"] * 65, "max_tokens": 1})
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]
    r = post(url, "/v1/completions", {**GREEDY, "prompt": ["a"] * 9, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and "--max-queue" in r.json()["error"]["message"]
    r = post(url, "/v1/completions", {**GREEDY, "prompt": ["a", ""], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"


def test_echo_with_logprobs_scores_the_prompt(url, llm):
    """lm-evaluation-harness's log-likelihood request: echo, max_tokens 0, logprobs 1."""
    text = "the quick brown fox jumps"
    r = post(url, "/v1/completions", {**GREEDY, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1})
    body = r.json()
    choice = body["choices"][0]
    # the first token's null is what OpenAI's legacy API and vLLM answer (nothing comes before it),
    # which OpenAI's schema does not spell out: the rest must conform
    trimmed = json.loads(json.dumps(body))
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        del trimmed["choices"][0]["logprobs"][key][0]
    check_openai_schema(trimmed, "CreateCompletionResponse")
    expected = llm.generate(text, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["token_logprobs"][1:] == pytest.approx([v for _, v, _ in expected.prompt_logprobs[1:]], abs=1e-5)
    assert "".join(lps["tokens"]) == text and lps["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == 0
    # with an answer: the prompt's tokens, then the answer's, offsets running on
    r = post(url, "/v1/completions", {**GREEDY, "prompt": text, "max_tokens": 3, "echo": True, "logprobs": 0}).json()
    choice = r["choices"][0]
    assert choice["text"].startswith(text) and len(choice["logprobs"]["tokens"]) == len(expected.prompt_token_ids) + 3
    assert choice["logprobs"]["text_offset"][len(expected.prompt_token_ids)] == len(text)


def test_vllm_prompt_logprobs_and_stream_echo(url):
    r = post(url, "/v1/completions", {**GREEDY, "prompt": "the quick brown fox", "max_tokens": 1,
                                      "prompt_logprobs": 2}).json()
    entries = r["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) >= 2 for e in entries[1:])
    stream = post(url, "/v1/completions", {**GREEDY, "prompt": "the quick", "max_tokens": 3, "echo": True,
                                           "stream": True})
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in stream.text.splitlines()
             if line.startswith("data: {")]
    assert texts[0] == "the quick" and len("".join(texts)) > len("the quick")
    r = post(url, "/v1/completions", {**GREEDY, "prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = post(url, "/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_suffix_fills_in_the_middle(url, llm):
    prefix, suffix = "def add(a, b):\n", "\n\nprint(add(1, 2))\n"
    expected = llm.infill(prefix, suffix, SamplingParams(max_tokens=8, temperature=0))
    r = post(url, "/v1/completions", {"model": "tiny", "temperature": 0, "prompt": prefix, "suffix": suffix,
                                      "max_tokens": 8}).json()
    assert r["choices"][0]["text"] == expected.text
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    sdk = client.completions.create(model="tiny", prompt=prefix, suffix=suffix, max_tokens=8, temperature=0)
    assert sdk.choices[0].text == expected.text
    r = post(url, "/v1/completions", {**GREEDY, "prompt": [1, 2], "suffix": "x", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_infill_in_llama_cpp_shape(url, llm):
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n\nprint(add(1, 2))\n", "temperature": 0,
            "n_predict": 8, "input_extra": [{"filename": "util.py", "text": "x = 1\n"}]}
    r = post(url, "/infill", body).json()
    expected = llm.infill(body["input_prefix"], body["input_suffix"], SamplingParams(max_tokens=8, temperature=0),
                          extra=[("util.py", "x = 1\n")])
    assert r["content"] == expected.text and r["stop"] is True and r["tokens_predicted"] == len(expected.token_ids)
    events = [json.loads(line[6:]) for line in post(url, "/infill", {**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert "".join(e["content"] for e in events) == expected.text
    assert events[-1]["stop"] is True and all(not e["stop"] for e in events[:-1])
    assert events[-1]["tokens_predicted"] == len(expected.token_ids)
    r = post(url, "/infill", {"input_prefix": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"


def test_fim_on_a_model_without_fim_tokens_names_it(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="none", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=64, served_model_name="plain"))
    with BackgroundServer(create_app(state)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "suffix": "b"}, timeout=60)
        assert r.status_code == 400 and "model plain has no fill-in-the-middle tokens" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
