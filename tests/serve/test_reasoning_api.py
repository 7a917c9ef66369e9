"""A thinking model's reasoning apart from its answer, through /v1/chat/completions (streamed and
not) on tiny random models carrying each family's marker tokens and chat template (tests/conftest.py
THINKING_FAMILIES). A random model does not think by itself: a grammar (vLLM's guided_grammar) or a
logit bias makes it write the family's markers as tokens, which then take the server's real path
(the engine, the decoder that keeps marker tokens, the parser, the API)."""
from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
from conftest import THINKING_FAMILIES, make_thinking_model, thinking_grammar

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.reasoning import detect
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.serve.tools import ToolSpec

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module", params=list(THINKING_FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = make_thinking_model(tmp_path_factory.mktemp("thinking") / name, name)
    llm = LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024, served_model_name="m",
                                         max_tokens_default=40))
    with BackgroundServer(create_app(state)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield name, client, state, srv.url


ASK = [{"role": "user", "content": "what is the weather in paris?"}]


def grammar(state, *parts: str) -> str:
    return thinking_grammar(state.tokenizer, state.ctx.vocab_size, state.ctx.eos_token_ids, *parts)


def thinking_then_answer(name: str, state) -> str:
    """The family's markup of a short reasoning, then a short answer."""
    words, answer = "/[a-z]{2,4}( [a-z]{2,4}){1,3}/", "/[a-z]{2,4}( [a-z]{2,4}){0,2}/"
    if name == "qwen3":
        return grammar(state, "<think>", "\n", words, "\n", "</think>", "\n\n", answer)
    if name == "qwen3.5":                          # the prompt opened <think>
        return grammar(state, words, "\n", "</think>", "\n\n", answer)
    if name == "gemma4":
        return grammar(state, "<|channel>", "thought\n", words, "<channel|>", answer)
    return grammar(state, "<|channel|>", "analysis", "<|message|>", words, "<|end|>", "<|start|>", "assistant",
                   "<|channel|>", "final", "<|message|>", answer)


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def streamed(client, **body) -> tuple[str, str, list]:
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    return ("".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas),
            "".join(d.content or "" for d in deltas), chunks)


def test_reasoning_content_beside_content_streamed_and_not(family):
    name, client, state, _ = family
    body = dict(model="m", messages=ASK, max_tokens=100, temperature=0,
                extra_body={"guided_grammar": thinking_then_answer(name, state), "chat_template_kwargs":
                            {"enable_thinking": True}, "return_token_ids": True})
    results = {}
    for speculate in (True, False):
        r = client.chat.completions.create(**dict(body, extra_body=dict(body["extra_body"], speculate=speculate)))
        c = r.choices[0]
        results[speculate] = (c.model_extra["token_ids"], reasoning_of(c.message), c.message.content,
                              r.usage.completion_tokens_details.reasoning_tokens)
    assert results[True] == results[False]
    ids, reasoning, content, thought = results[True]
    close = state.tokenizer.token_id({"qwen3": "</think>", "qwen3.5": "</think>", "gemma4": "<channel|>",
                                      "gpt-oss": "<|end|>"}[name])
    assert 0 < thought < len(ids)
    if close in ids:                                # the reasoning's tokens: from the start to its end marker
        assert thought == ids.index(close) + 1
    assert c.finish_reason == "stop", c
    words = reasoning.split()
    assert 2 <= len(words) <= 4 and all(w.isalpha() for w in words), reasoning
    assert content and all(w.isalpha() for w in content.split()), content       # no marker text left
    kept = dict(detect(state.tokenizer).kept)
    assert kept and set(kept) & set(ids)            # the markers were tokens of their own
    body["extra_body"].pop("return_token_ids")
    r, text, chunks = streamed(client, stream_options={"include_usage": True}, **body)
    assert (r, text) == (reasoning, content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought
    chunks = chunks[:-1]
    first = [i for i, ch in enumerate(chunks) if ch.choices and (ch.choices[0].delta.model_extra or {}).get(
        "reasoning_content")]
    later = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.content]
    assert first and later and max(first) < min(later)          # the reasoning streams before the answer
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_each_choice_has_its_reasoning(family):
    name, client, state, _ = family
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=100, temperature=0.8, seed=3, n=2,
                                       extra_body={"guided_grammar": thinking_then_answer(name, state),
                                                   "chat_template_kwargs": {"enable_thinking": True},
                                                   "return_token_ids": True})
    assert len(r.choices) == 2 and all(reasoning_of(c.message) and c.message.content for c in r.choices)
    single = [client.chat.completions.create(model="m", messages=ASK, max_tokens=100, temperature=0.8, seed=3 + i,
                                             extra_body={"guided_grammar": thinking_then_answer(name, state),
                                                         "chat_template_kwargs": {"enable_thinking": True}})
              for i in range(2)]
    assert [reasoning_of(c.message) for c in r.choices] == [reasoning_of(s.choices[0].message) for s in single]
    assert r.usage.completion_tokens_details.reasoning_tokens == sum(
        s.usage.completion_tokens_details.reasoning_tokens for s in single)


def test_thinking_cut_by_max_tokens_is_reasoning(family):
    name, client, state, _ = family
    long = "/[a-z]{3,6}( [a-z]{3,6}){30,40}/"
    parts = {"qwen3": ("<think>", "\n", long, "</think>", "ok"), "qwen3.5": (long, "</think>", "ok"),
             "gemma4": ("<|channel>", "thought\n", long, "<channel|>", "ok"),
             "gpt-oss": ("<|channel|>", "analysis", "<|message|>", long, "<|end|>")}[name]
    body = dict(model="m", messages=ASK, max_tokens=10, temperature=0,
                extra_body={"guided_grammar": grammar(state, *parts)})
    c = client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "length" and reasoning_of(c.message) and not c.message.content
    r, text, chunks = streamed(client, **body)
    assert (r, text) == (reasoning_of(c.message), "") and chunks[-1].choices[0].finish_reason == "length"


def test_thinking_turned_off_and_reasoning_format_none(family):
    name, client, state, url = family
    plain = grammar(state, "/[a-z]{2,6}( [a-z]{2,6}){1,3}/")
    off = client.chat.completions.create(model="m", messages=ASK, max_tokens=20, temperature=0,
                                         extra_body={"guided_grammar": plain,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model="m", messages=ASK, max_tokens=20, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                    "guided_grammar": plain})
    if name != "gpt-oss":                   # the template closed the block (harmony's cannot be turned off)
        assert off.usage.prompt_tokens != on.usage.prompt_tokens
    assert "reasoning_content" in off.choices[0].message.model_extra and reasoning_of(off.choices[0].message) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.choices[0].message.content.split() and all(w.isalpha() for w in off.choices[0].message.content.split())
    state.reasoning_format = "none"
    try:
        body = dict(model="m", messages=ASK, max_tokens=100, temperature=0,
                    extra_body={"guided_grammar": thinking_then_answer(name, state)})
        c = client.chat.completions.create(**body).choices[0]
        assert "reasoning_content" not in c.message.model_extra
        if name == "qwen3":                 # its markers are not special tokens: they stay in the text
            assert c.message.content.startswith("<think>") and "</think>" in c.message.content
    finally:
        state.reasoning_format = "auto"


def test_a_tool_call_after_thinking(family):
    name, client, state, _ = family
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 8}}}}}]
    words = "/[a-z]{2,6}( [a-z]{2,6}){1,2}/"
    if name == "gpt-oss":                           # harmony: a commentary message to functions.get_time
        g = grammar(state, "<|channel|>", "analysis", "<|message|>", words, "<|end|>", "<|start|>", "assistant",
                    "<|channel|>", "commentary to=functions.get_time ", "<|constrain|>", "json", "<|message|>",
                    '{"city": "', "/[a-z]{1,6}/", '"}')
    elif name == "qwen3":
        g = grammar(state, "<think>", "\n", words, "\n", "</think>", "\n\n", "<tool_call>",
                    '\n{"name": "get_time", "arguments": {"city": "', "/[a-z]{1,6}/", '"}}\n', "</tool_call>")
    else:                                           # Qwen3.5's XML, Gemma 4's notation (tools/markup.py)
        opened = ("<|channel>", "thought\n", words, "<channel|>") if name == "gemma4" else \
            (words, "\n", "</think>", "\n\n")
        call = ToolSpec(tools, "get_time", state.ctx.tool_format()).structured().value.replace("start:", "call:", 1)
        g = grammar(state, *opened).rstrip("\n") + " call\n" + call
    body = dict(model="m", messages=ASK, tools=tools, max_tokens=60, temperature=0, extra_body={"guided_grammar": g})
    c = client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time", c
    assert reasoning_of(c.message) and not c.message.content
    r, text, chunks = streamed(client, **body)
    calls = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert r == reasoning_of(c.message) and text == "" and calls[0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for d in calls) == c.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_constraint_applies_after_the_reasoning(family):
    """A forced call or a JSON schema starts after the reasoning (the model thinks first, as vLLM and
    llama.cpp let it), also where the generation prompt opened <think> (Qwen3.5): the answer is the
    call or the JSON, the reasoning apart; gpt-oss's forced call is a commentary message to the
    function. A logit bias on the markers makes the random model open and end its reasoning."""
    name, client, state, _ = family
    marks = {"qwen3": ("<think>", "</think>"), "qwen3.5": ("</think>",), "gemma4": ("<|channel>", "<channel|>"),
             "gpt-oss": ("analysis", "<|end|>")}[name]
    first = [state.tokenizer.encode(m, add_special=False)[0] for m in marks]
    bias = {str(token): 50 * (i + 1) for i, token in enumerate(first)}      # (the end wins inside)
    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "return_token_ids": True}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    c = client.chat.completions.create(model="m", messages=ASK, tools=tools, max_tokens=150, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       logit_bias=bias, extra_body=thinking).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time", c
    assert not c.message.content and first[-1] in c.model_extra["token_ids"]
    assert json.loads(c.message.tool_calls[0].function.arguments).keys() == {"city"}
    if name == "gpt-oss":                           # its own form: to=functions.get_time <|constrain|>json
        assert state.tokenizer.token_id("<|constrain|>") in c.model_extra["token_ids"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = dict(model="m", messages=ASK, max_tokens=100, temperature=0, logit_bias=bias, extra_body=thinking,
                response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    c = client.chat.completions.create(**body).choices[0]
    assert isinstance(json.loads(c.message.content)["ok"], bool), c
    ids = c.model_extra["token_ids"]
    assert first[-1] in ids and ids[0] == state.tokenizer.token_id(
        {"qwen3": "<think>", "qwen3.5": "</think>", "gemma4": "<|channel>", "gpt-oss": "<|channel|>"}[name])
    r, text, _ = streamed(client, **body)
    assert text == c.message.content and r == (reasoning_of(c.message) or "")
    plain = client.chat.completions.create(**dict(body, logit_bias=None, extra_body={  # thinking off: at once
        "chat_template_kwargs": {"enable_thinking": False}})).choices[0]
    if name != "gpt-oss":
        assert json.loads(plain.message.content) and not reasoning_of(plain.message)


def test_the_family_is_read_from_template_and_vocabulary(family):
    name, _, state, _ = family
    fmt = detect(state.tokenizer)
    assert fmt.name == {"qwen3": "think", "qwen3.5": "think", "gemma4": "gemma4", "gpt-oss": "harmony"}[name]
    assert all(state.tokenizer.encode(text, add_special=False) == [token] for token, text in fmt.kept)
    plain = copy.copy(state.tokenizer)              # a template that writes no markup: the vocabulary decides
    plain.chat_template, plain._template = "{% for m in messages %}{{ m.content }}{% endfor %}", None
    assert getattr(detect(plain), "name", None) == {"qwen3": "think", "qwen3.5": "think", "gemma4": "gemma4",
                                                    "gpt-oss": None}[name]     # (harmony: only with its template)


def test_an_earlier_answers_reasoning_reaches_the_template(family):
    name, _, state, url = family
    history = ASK + [{"role": "assistant", "content": "sunny", "reasoning_content": "look it up"},
                     {"role": "user", "content": "and tomorrow?"}]
    original = state.tokenizer.chat_template
    state.tokenizer.chat_template, state.tokenizer._template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.thinking or '' }}|{{ m.content }}\n"
        "{% endfor %}"), None
    try:
        r = httpx.post(url + "/tokenize", json={"model": "m", "messages": history})
        assert r.status_code == 200, r.text
        assert "assistant:look it up|look it up|sunny" in state.tokenizer.decode(r.json()["tokens"])
        history[1]["reasoning_content"] = ["not", "text"]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": history})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].reasoning_content", r.text
    finally:
        state.tokenizer.chat_template, state.tokenizer._template = original, None


def test_chat_template_kwargs_are_checked(family):
    _, _, state, url = family
    for value, says in ((["enable_thinking"], "must be an object"), ({"messages": []}, "cannot set messages")):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": ASK,
                                                            "chat_template_kwargs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert says in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "chat_template_kwargs": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
