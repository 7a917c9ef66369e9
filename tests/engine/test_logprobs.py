"""Log-probabilities (SamplingParams.logprobs; OpenAI `logprobs` / `top_logprobs`): the target's
log-softmax of the transformed logits at each emitted token, equal to a direct computation from
the model, identical with speculation on and off (greedy and seeded sampling, chain and tree
drafters), in OpenAI's shapes through the unchanged client, streamed and not."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.config import EngineConfig
from specdecode.params import ParamError
from specdecode.sampling import transform_logits
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False, adaptive=False)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_same_with_speculation_on_and_off(tiny_models, method):
    llm = LLM(model=str(tiny_models["llama"]), method=method, dtype="fp32", progress=False, adaptive=False,
              num_speculative_tokens=8)
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3)
    plain = llm.generate([PROMPT], params, num_speculative_tokens=0)[0]
    spec = llm.generate([PROMPT], params)[0]
    assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs
    assert spec.stats["mean_accepted_length"] > 1.2                       # drafts were accepted
    assert len(spec.logprobs) == len(spec.token_ids)
    for _token, value, top in spec.logprobs:
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and value <= top[0][1] + 1e-6
        assert value <= 0.0


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 5}])
def test_values_equal_the_model(llm, sampling):
    """Speculative runs (greedy, and sampled: there the tokens differ from a plain run's, the
    values at the tokens drawn do not) report the model's own transformed log-probabilities."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, repetition_penalty=1.2, **sampling)
    out = llm.generate([PROMPT], params)[0]
    assert out.stats["drafted_tokens"] > 0
    model = llm.target.model
    ids = out.prompt_token_ids
    for j, (token, value, top) in enumerate(out.logprobs):
        history = ids + out.token_ids[:j]
        logits = model.forward(torch.tensor([history]), model.new_cache(1, len(history) + 1), 0)[:, -1:]
        expected = transform_logits(logits, [params], [history], [len(ids)]).log_softmax(-1)[0, 0]
        assert token == out.token_ids[j]
        assert abs(value - float(expected[token])) < 1e-5
        assert [a for a, _ in top] == expected.topk(2).indices.tolist()


def test_bad_logprobs():
    with pytest.raises(ParamError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


@pytest.fixture(scope="module")
def server(llm):
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=256, block_size=8, served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv


def test_openai_client_shapes_and_speculation(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    base = dict(model="tiny", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    on = client.completions.create(prompt=PROMPT, logprobs=3, **dict(base, extra_body={"ignore_eos": True,
                                                                                        "speculate": True}))
    off = client.completions.create(prompt=PROMPT, logprobs=3, **dict(base, extra_body={"ignore_eos": True,
                                                                                         "speculate": False}))
    lp = on.choices[0].logprobs
    assert lp.token_logprobs == off.choices[0].logprobs.token_logprobs and lp.tokens == off.choices[0].logprobs.tokens
    assert len(lp.tokens) == 16 and all(len(t) <= 3 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == on.choices[0].text
    # the legacy field holds the N most likely and the chosen token (up to N + 1), as OpenAI's
    sampled = client.completions.create(prompt=PROMPT, logprobs=1, **dict(base, temperature=2.0, seed=1)).choices[0]
    assert all(tops[token] == value and len(tops) <= 2 for token, value, tops in
               zip(sampled.logprobs.tokens, sampled.logprobs.token_logprobs, sampled.logprobs.top_logprobs))
    assert any(len(tops) == 2 for tops in sampled.logprobs.top_logprobs)    # chosen outside the top 1
    zero = client.completions.create(prompt=PROMPT, logprobs=0, **base).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]
    streamed = [c for c in client.completions.create(prompt=PROMPT, logprobs=3, stream=True, **base)]
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices[0].logprobs) == 16
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **base)
    content = chat.choices[0].logprobs.content
    assert len(content) == 16 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    chunks = [c for c in client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, stream=True,
                                                         **base) if c.choices and c.choices[0].logprobs]
    assert [e.logprob for c in chunks for e in c.choices[0].logprobs.content] == [c.logprob for c in content]
    plain = client.chat.completions.create(messages=messages, **base)
    assert plain.choices[0].logprobs is None


def test_logprobs_end_where_a_stop_string_cuts_the_text(server):
    """The tokens that wrote a stop string are not in the answer's logprobs (non-streamed and
    streamed alike: a stream holds a token's logprob while its text is held as a possible stop)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    base = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})
    free = client.completions.create(**base).choices[0]
    assert free.text.startswith(" quick quick quick")            # the tiny model's answer
    for stop, text in (("k q", " quic"), ("quick quick", " ")):
        answer = client.completions.create(**base, stop=[stop]).choices[0]
        lp = answer.logprobs
        assert answer.text == text and answer.finish_reason == "stop"
        assert lp.tokens == [" quick"] and lp.text_offset == [0]     # the token the text ends in, no more
        chunks = [c.choices[0] for c in client.completions.create(**base, stop=[stop], stream=True)]
        assert "".join(c.text for c in chunks) == answer.text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_bad_requests(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_n_choices(server):
    """n > 1: n samples of one prompt as choices 0..n-1 (choice i seeded seed + i: reproducible),
    streamed and not; usage counts the prompt once."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    # plain decoding: with speculation a sampled row's draws follow the draft sizes the server's
    # policy picks for the batch, so a seed fixes the distribution, not the sample
    base = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9, seed=11, n=3,
                extra_body={"ignore_eos": True, "speculate": False})
    first, again = client.completions.create(**base), client.completions.create(**base)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]       # seeded
    assert len({c.text for c in first.choices}) > 1                                  # distinct samples
    assert first.usage.completion_tokens == 30 and first.usage.prompt_tokens == again.usage.prompt_tokens
    texts = {i: "" for i in range(3)}
    for chunk in client.completions.create(stream=True, **base):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in first.choices]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], n=2,
                                          max_tokens=6, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "n": 17}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
