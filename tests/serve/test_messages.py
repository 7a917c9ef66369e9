"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official anthropic
SDK and raw HTTP, on the embedded model: create / stream / count_tokens, system blocks, a tool_use /
tool_result round trip, max_tokens clamped to the context, errors in Anthropic's shape (a bad
message, auth by x-api-key or bearer, an oversized body), `?beta=true`, the stream's exact event
order, and greedy text identical with speculation on and off."""
from __future__ import annotations

import json
import logging

import anthropic
import httpx
import jsonschema
import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
KEY = "messages-test-key"
CONTEXT = 512
MAX_BODY = 64 * 1024
SYSTEM = [{"type": "text", "text": "You are a terse assistant.", "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Answer in one sentence."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "tag", "description": "Label things",                          # propertyNames: llguidance
          "input_schema": {"type": "object", "properties": {"labels": {               # does not implement it
              "type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}}}},         # (Claude Code sends it)
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},     # a server tool: skipped
         {"type": "bash_20250124", "name": "bash"}]
GREEDY = {"temperature": 0}      # the SDK of 2026 has no sampling arguments: the API's fields, sent as extra_body
REPEAT = "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes."


@pytest.fixture(scope="module")
def server():
    llm = LLM(method="ngram", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=CONTEXT, served_model_name="m"))
    with BackgroundServer(create_app(state, api_key=KEY, max_body_bytes=MAX_BODY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def events_of(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of a raw Anthropic SSE body."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def post(server, body: dict, path: str = "/v1/messages", **headers) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, headers={"x-api-key": KEY, **headers})


def test_create_stream_and_count_tokens_agree(client):
    greedy = dict(model="m", max_tokens=40, extra_body=GREEDY, system=SYSTEM,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Name three fruits."}]}])
    message = client.messages.create(**greedy)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "m" and message.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    usage = message.usage
    assert 0 < usage.output_tokens <= 40 and usage.cache_creation_input_tokens == 0
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert client.messages.count_tokens(model="m", system=SYSTEM, messages=greedy["messages"]).input_tokens == prompt
    # a system turn inside the conversation, as Claude Code sends one: rendered where it is
    inside = [{"role": "system", "content": "Tools: none."}] + greedy["messages"]
    assert client.messages.count_tokens(model="m", system=SYSTEM, messages=inside).input_tokens > prompt
    with client.messages.stream(**greedy) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == usage.output_tokens
    # the second time the prompt comes from the prefix cache, counted as a cache read
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


def test_stream_events_in_the_apis_order(server):
    body = dict(model="m", max_tokens=12, temperature=0, stream=True, ignore_eos=True,
                messages=[{"role": "user", "content": REPEAT}])
    response = post(server, body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = events_of(response.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                          "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12


def test_stop_sequences_and_speculation_off_give_the_same_greedy_text(client):
    base = dict(model="m", max_tokens=40, messages=[{"role": "user", "content": REPEAT}])
    on = client.messages.create(**base, extra_body=dict(GREEDY, speculate=True, ignore_eos=True))
    off = client.messages.create(**base, extra_body=dict(GREEDY, speculate=False, ignore_eos=True))
    assert on.content[0].text == off.content[0].text                    # lossless
    assert off.model_extra["speculation"]["drafted_tokens"] == 0 and on.model_extra["speculation"]["mode"] == "on"
    text = on.content[0].text
    word = next(w for w in ("cherries", "dates", "figs", "apples", " ") if w in text)
    stopped = client.messages.create(**base, extra_body=GREEDY, stop_sequences=["never here", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]


def test_tool_use_and_tool_result_round_trip(client, caplog):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with caplog.at_level(logging.WARNING, logger="specdecode.serve"):
        called = client.messages.create(model="m", max_tokens=60, extra_body=GREEDY, messages=ask, tools=TOOLS,
                                        tool_choice={"type": "tool", "name": "get_weather"})
    assert any("web_search_20250305" in r.getMessage() for r in caplog.records)
    assert called.stop_reason == "tool_use"
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="m", max_tokens=60, extra_body=GREEDY, messages=ask, tools=TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        pieces = [e.partial_json for e in stream if e.type == "input_json"]
        streamed = stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and json.loads("".join(pieces)) == streamed_use.input
    # the call's result back: the model answers in text
    turns = ask + [{"role": "assistant", "content": [b.model_dump() for b in called.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": "18 C and sunny"}]},
                                                {"type": "text", "text": "Thanks, so?"}]}]
    answer = client.messages.create(model="m", max_tokens=30, extra_body=GREEDY, messages=turns, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    failed = turns[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "timeout", "is_error": True}]}]
    assert client.messages.count_tokens(model="m", messages=failed, tools=TOOLS).input_tokens > \
        client.messages.count_tokens(model="m", messages=ask, tools=TOOLS).input_tokens


def test_max_tokens_is_clamped_to_the_context_and_a_long_prompt_refused(client, server):
    body = dict(model="m", max_tokens=32000, messages=[{"role": "user", "content": "Hi"}],
                thinking={"type": "adaptive"}, metadata={"user_id": "u"}, output_config={"effort": "low"},
                service_tier="auto", container=None)       # Claude Code's fields, besides (beta) those below
    message = client.messages.create(**body, extra_body=dict(GREEDY, ignore_eos=True, context_management={
        "edits": []}, mcp_servers=[], future_field={"x": 1}))
    usage = message.usage
    assert message.stop_reason == "max_tokens"
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == CONTEXT
    long = [{"role": "user", "content": "word " * CONTEXT}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=10, messages=long)
    message = refused.value.body["error"]["message"]
    tokens = client.messages.count_tokens(model="m", messages=long).input_tokens
    assert tokens > CONTEXT and str(tokens) in message and str(CONTEXT) in message


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 10}, "messages"),
    ({"max_tokens": 10, "messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "messages.0.content.0"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "maybe"}},
     "tool_choice"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
     "thinking.budget_tokens"),
    ({"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, "tools.0.input_schema"),
])
def test_a_bad_request_is_a_400_in_anthropics_shape(server, client, body, param):
    response = post(server, dict(body, model="m"))
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"] and "Traceback" not in response.text
    rest = {k: v for k, v in body.items() if k not in ("max_tokens", "messages")}
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=body.get("max_tokens", 10), messages=body.get("messages", []),
                               extra_body=rest if "max_tokens" in body else dict(rest, max_tokens=None))


def test_auth_beta_paths_and_other_errors_in_anthropics_shape(server, client):
    hi = dict(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    for wrong in (anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0),
                  anthropic.Anthropic(base_url=server.url, auth_token="nope", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(**hi)
        assert denied.value.body["error"]["type"] == "authentication_error" and KEY not in str(denied.value.body)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=120)
    assert bearer.messages.create(**hi).content is not None
    beta = client.beta.messages.create(**hi, betas=["context-management-2025-06-27"])    # ?beta=true
    assert beta.id.startswith("msg_") and beta.usage.output_tokens <= 5
    assert post(server, dict(hi), "/v1/messages?beta=true", **{"anthropic-version": "2023-06-01"}).status_code == 200
    assert post(server, hi, "/v1/messages/count_tokens?beta=true").json()["input_tokens"] > 0
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(**dict(hi, model="claude-sonnet-4-5"))
    assert unknown.value.body["error"]["type"] == "not_found_error"
    big = post(server, dict(hi, system="x" * MAX_BODY))
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    assert httpx.post(server.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY}).json()[
        "error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
