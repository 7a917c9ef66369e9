"""Tool calls through the unchanged openai client: tools reach the model (its template, or a
system instruction in the Hermes format), `tool_choice` naming a function constrains the answer to
one call whose arguments follow the function's schema, parsed into OpenAI `tool_calls`
(finish_reason "tool_calls"), streamed as OpenAI streams them (the call's name, then its
arguments in pieces) and not; bad tools get a 400 naming the field. The families' own formats:
test_tool_formats.py."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.serve.tools import extract_calls

pytestmark = pytest.mark.usefixtures("one_thread")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client():
    llm = LLM(method="ngram", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024, served_model_name="m"))
    with BackgroundServer(create_app(state)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120), srv


def test_named_tool_choice_gives_a_valid_call(client):
    c, _ = client
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=80,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=named,
                                            max_tokens=80, temperature=0, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    # as OpenAI streams a call: index, id, type and name first, then the arguments in pieces
    assert deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert deltas[0].id.startswith("call_")
    assert len(deltas) >= 2 and all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    required = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                         max_tokens=80, temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")


def test_auto_and_none(client):
    c, _ = client
    messages = [{"role": "user", "content": "Say hello."}]
    none = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                                     temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    auto = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_earlier_call_reaches_the_prompt_and_a_malformed_one_is_a_400(client):
    """SmolLM2's template writes only each turn's content: the call it made earlier is written into
    the assistant turn in the Hermes format (its arguments count in the prompt), the result as it is."""
    c, srv = client

    def prompt_tokens(arguments: str, result: str = "12 C") -> int:
        history = [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": arguments}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": result}]
        return c.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=1,
                                         temperature=0).usage.prompt_tokens
    short = prompt_tokens('{"city": "Oslo", "unit": "celsius"}')
    assert prompt_tokens('{"city": "Oslo, Norway", "unit": "celsius"}') > short
    assert prompt_tokens('{"city": "Oslo", "unit": "celsius"}', "12 C, wind 5 m/s") > short
    for calls in ("zz", [5], [{"function": {"arguments": "{}"}}]):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={"max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[1].tool_calls"), r.text


def test_a_stop_string_inside_a_call_is_not_a_finished_call(client):
    """stop=["}"] cuts a forced call inside its arguments: finish_reason "stop", not "tool_calls" (whose
    arguments a client would parse as whole JSON)."""
    c, _ = client
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for stream in (False, True):
        kw = dict(model="m", messages=messages, tools=TOOLS, max_tokens=60, temperature=0, stop=["}"],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if stream:
            reasons = [ch.choices[0].finish_reason for ch in c.chat.completions.create(stream=True, **kw)
                       if ch.choices and ch.choices[0].finish_reason]
        else:
            reasons = [c.chat.completions.create(**kw).choices[0].finish_reason]
        assert reasons == ["stop"], (stream, reasons)


def test_parsing():
    content, calls = extract_calls('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "ok" and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert extract_calls("no calls here") == ("no calls here", [])
    assert extract_calls("<tool_call>{not json}</tool_call>")[1] == []


@pytest.mark.parametrize("body,param", [
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools(client, body, param):
    _, srv = client
    r = httpx.post(srv.url + "/v1/chat/completions",
                   json=dict(body, messages=[{"role": "user", "content": "hi"}], max_tokens=4), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_bad_parameters_schema_is_a_400_whatever_tool_choice(client):
    _, srv = client
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": bad,
                             "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "tools[0].function.parameters" in r.json()["error"]["message"]


def test_forced_call_arguments_are_compact_and_closed():
    """A schema that does not close its objects still gets arguments with only its properties,
    on one line (a 135M model otherwise copies the schema into the arguments)."""
    from specdecode.serve.tools import ToolSpec, closed
    open_schema = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "where": {"type": "object", "properties": {"x": {}}}}}
    shut = closed(open_schema)
    assert shut["additionalProperties"] is False and shut["properties"]["where"]["additionalProperties"] is False
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in open_schema           # the caller's schema is not changed
    spec = ToolSpec([{"type": "function", "function": {"name": "f", "parameters": open_schema}}], "f")
    lark = spec.structured().value
    assert '"x-guidance"' in lark and '"whitespace_flexible": false' in lark


def test_open_schema_forced_call_closes(client):
    c, _ = client
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 20}}}}}]
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                  tools=tools, tool_choice="required", max_tokens=48, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) <= {"city"}


def test_keywords_the_grammar_cannot_compile_are_left_out_once_for_every_api(caplog):
    """propertyNames (Claude Code's tools send it) is stripped from the tools of chat completions,
    Responses and Messages alike (they all pass spec.parse_tools), with one warning in the log; the
    rest of the schema is kept, and a schema invalid for another reason is still a 400 naming it."""
    import logging

    from specdecode.params import ParamError
    from specdecode.serve.anthropic_request import translate
    from specdecode.serve.responses_input import chat_body
    from specdecode.serve.tools import parse_tools
    from specdecode.serve.tools import schema as schema_module
    labels = {"type": "object", "properties": {"labels": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                                                          "additionalProperties": {"type": "string"}}},
              "required": ["labels"]}
    chat = {"tools": [{"type": "function", "function": {"name": "tag", "parameters": labels}}]}
    responses = chat_body({"input": "hi", "tools": [{"type": "function", "name": "tag", "parameters": labels}]},
                          [])[0]
    messages = translate({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"name": "tag", "input_schema": labels}]}).chat
    schema_module._warned.clear()
    with caplog.at_level(logging.WARNING, logger="specdecode.serve"):
        for body in (chat, responses, messages):
            spec = parse_tools(body)
            kept = spec.tools[0]["function"]["parameters"]
            assert "propertyNames" not in json.dumps(kept) and kept["required"] == ["labels"]
            assert kept["properties"]["labels"]["additionalProperties"] == {"type": "string"}
    warnings = [r for r in caplog.records if "propertyNames" in r.getMessage()]
    assert len(warnings) == 1
    assert labels["properties"]["labels"]["propertyNames"]            # the request's own schema is untouched
    with pytest.raises(ParamError, match=r"tools\[0\]\.function\.parameters"):
        parse_tools({"tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "nope"}}}]})
