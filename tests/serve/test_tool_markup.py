"""Tool calls of the families whose arguments are not JSON (serve/tools/markup.py): Qwen3.5's /
Qwen3-Coder's XML and Gemma 4's notation. The parser alone (every cut of the text, values typed by
the schema, calls cut short), then through chat completions, the Responses API and the Messages API
on tiny random models with each family's markers and chat template (tests/conftest.py
THINKING_FAMILIES, the same models as the thinking tests). A grammar writes the random model's
calls (the forced call's grammar, or vLLM's guided_grammar with tool_choice auto), which then take
the server's real path: the decoder keeping the marker tokens, the reasoning parser, the tool parser."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import make_thinking_model, thinking_grammar

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.serve.tools import MarkupParser, ToolSpec
from specdecode.serve.tools.formats import GEMMA, QUOTE, XML, Marker, ToolFormat

pytestmark = pytest.mark.usefixtures("one_thread")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "Person", "description": "Record a person", "parameters": PERSON}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "what is the weather in paris?"}]
FAMILIES = {"qwen3.5": XML, "gemma4": GEMMA}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


# ---------------------------------------------------------------------------------- the parser alone
XML_FMT = ToolFormat(XML, Marker("<tool_call>"), Marker("</tool_call>"), gap_start="\n", gap_end="\n",
                     also=(Marker("<function="),))
GEMMA_FMT = ToolFormat(GEMMA, Marker("<|tool_call>"), Marker("<tool_call|>"), inner=(Marker(QUOTE),))
SCHEMAS = {"Person": PERSON, "f": {"type": "object", "properties": {
    "n": {"type": "number"}, "ok": {"type": "boolean"}, "maybe": {"type": ["integer", "null"]},
    "obj": {"type": "object"}, "s": {"type": "string"}}}}


def parsed(fmt, text: str, max_calls=None) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, [(name, arguments)], calls complete), fed a character at a time; the same as fed whole."""
    parser, deltas = MarkupParser(fmt, list(SCHEMAS), max_calls, SCHEMAS), []
    for ch in text:
        deltas += parser.feed(ch)
    deltas += parser.finish()
    content = "".join(d[1] for d in deltas if d[0] == "content")
    calls = [(d[3], "".join(a[2] for a in deltas if a[0] == "arguments" and a[1] == d[1]))
             for d in deltas if d[0] == "call"]
    whole = MarkupParser(fmt, list(SCHEMAS), max_calls, SCHEMAS)
    content_whole, tool_calls = whole.result(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls] == calls
    assert (content_whole or "") == content.strip()
    return content, calls, parser.calls_complete()


def test_the_xml_parser():
    call = ("<tool_call>\n<function=Person>\n<parameter=name>\nMaria Lopez\n</parameter>\n<parameter=age>\n34\n"
            "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>")
    args = '{"name": "Maria Lopez", "age": 34, "tags": ["a", "b"]}'
    assert parsed(XML_FMT, "Let me record her.\n\n" + call) == ("Let me record her.", [("Person", args)], True)
    assert parsed(XML_FMT, call + "\n" + call.replace("34", "35"))[1] == [("Person", args),
                                                                          ("Person", args.replace("34", "35"))]
    assert parsed(XML_FMT, call + "\n" + call, max_calls=1)[1] == [("Person", args)]
    # values typed by the schema: numbers, booleans, null, objects; a string stays text (line breaks kept)
    typed = ("<tool_call>\n<function=f>\n<parameter=n>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
             "<parameter=maybe>\nnull\n</parameter>\n<parameter=obj>\n{\"a\": [1]}\n</parameter>\n<parameter=s>\n"
             "34\nline two\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(parsed(XML_FMT, typed)[1][0][1]) == {"n": 2.5, "ok": True, "maybe": None, "obj": {"a": [1]},
                                                          "s": "34\nline two", "extra": 7}
    # without the outer marker, a missing </parameter>, no parameters at all
    assert parsed(XML_FMT, "<function=f>\n<parameter=n>\n3\n</function>")[1] == [("f", '{"n": 3}')]
    assert parsed(XML_FMT, "<tool_call>\n<function=f>\n</function>\n</tool_call>")[1] == [("f", "{}")]
    # cut short (max_tokens): the arguments so far, not complete; a call without its name is dropped
    assert parsed(XML_FMT, "ok <tool_call>\n<function=Person>\n<parameter=age>\n3") == \
        ("ok", [("Person", "")], False)
    assert parsed(XML_FMT, "ok <tool_call>\n<function=Pers") == ("ok", [], True)
    # markers that open no call are text, with the spaces around them
    assert parsed(XML_FMT, "a < b and <tool_call> no") == ("a < b and <tool_call> no", [], True)


def test_the_gemma4_parser():
    call = '<|tool_call>call:Person{age:34,name:<|"|>Ma "Lu"<|"|>,tags:[<|"|>x<|"|>]}<tool_call|>'
    args = '{"age": 34, "name": "Ma \\"Lu\\"", "tags": ["x"]}'
    assert parsed(GEMMA_FMT, "Sure." + call) == ("Sure.", [("Person", args)], True)
    assert parsed(GEMMA_FMT, call + call, max_calls=1)[1] == [("Person", args)]
    values = '<|tool_call>call:f{n:-1.5e2,ok:True,maybe:None,obj:{<|"|>k<|"|>:[1,{a:false}]},s:"j\\"s"}<tool_call|>'
    assert json.loads(parsed(GEMMA_FMT, values)[1][0][1]) == {"n": -150.0, "ok": True, "maybe": None,
                                                              "obj": {"k": [1, {"a": False}]}, "s": 'j"s'}
    assert parsed(GEMMA_FMT, '<|tool_call>call:Person{age:3') == ("", [("Person", '{"age": 3')], False)
    assert parsed(GEMMA_FMT, "plain <|tool_call>oops") == ("plain <|tool_call>oops", [], True)


# ---------------------------------------------------------------------------------- through the APIs
@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = make_thinking_model(tmp_path_factory.mktemp("markup") / name, name)
    llm = LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024, served_model_name="m",
                                         max_tokens_default=60))
    with BackgroundServer(create_app(state)) as srv:
        yield name, state, srv.url


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def call_grammar(state, name: str = "get_time") -> str:
    """A guided_grammar that writes one call of `name` in the family's notation."""
    return ToolSpec(TOOLS, name, state.ctx.tool_format()).structured().value


def test_the_family_is_read_from_template_and_vocabulary(family):
    name, state, _ = family
    fmt = state.ctx.tool_format()
    assert fmt.name == FAMILIES[name] and fmt.markup
    kept = fmt.kept_tokens()
    assert kept[state.tokenizer.token_id(fmt.start.text)] == fmt.start.text and fmt.end.token in kept
    if name == "gemma4":                         # its quote is a special token the decoder must keep
        assert fmt.inner[0].text == QUOTE and fmt.inner[0].token in kept and fmt.inner[0].special


def test_forced_calls_in_the_familys_form(family):
    """tool_choice named and required: one call written in the family's own notation (its markers one
    token each, once), arguments valid against the schema, the same tokens with speculation on and
    off, the same call streamed; thinking off, so that the call is the answer's start."""
    name, state, url = family
    client, fmt = openai_client(url), state.ctx.tool_format()
    for choice in ({"type": "function", "function": {"name": "Person"}}, "required"):
        results = {}
        for speculate in (True, False):
            body = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0,
                        extra_body=dict(NO_THINKING, speculate=speculate, return_token_ids=True))
            c = client.chat.completions.create(**body).choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and not c.message.content, c
            call = c.message.tool_calls[0]
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            ids = c.model_extra["token_ids"]
            assert ids[0] == fmt.start.token and ids.count(fmt.start.token) == 1 and ids.count(fmt.end.token) == 1
            results[speculate] = (ids, call.function.name, call.function.arguments)
        assert results[True] == results[False]
        chunks = list(client.chat.completions.create(**dict(body, stream=True, extra_body=NO_THINKING)))
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == results[True][1] and deltas[0].id
        assert "".join(d.function.arguments or "" for d in deltas) == results[True][2]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_calls_through_the_responses_api(family):
    """function_call items, streamed (argument deltas) and not, with tool_choice auto (a grammar writes
    the call) and a named function (the forced path writes it)."""
    _, state, url = family
    client = openai_client(url)
    auto = dict(model="m", input="what time is it in oslo?", tools=[
        {"type": "function", "name": "get_time", "parameters": TIME}], temperature=0, max_output_tokens=60)
    for body in (dict(auto, extra_body=dict(NO_THINKING, guided_grammar=call_grammar(state))),
                 dict(auto, tool_choice={"type": "function", "name": "get_time"}, extra_body=NO_THINKING)):
        r = client.responses.create(**body)
        calls = [item for item in r.output if item.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_time", r
        assert set(json.loads(calls[0].arguments)) == {"city"}
        with client.responses.stream(**body) as stream:
            events = list(stream)
            final = stream.get_final_response()
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert pieces and "".join(pieces) == calls[0].arguments
        assert [i.type for i in final.output] == [i.type for i in r.output]


def test_calls_through_the_messages_api(family):
    """tool_use blocks (input as an object), streamed as input_json_delta, with stop_reason tool_use:
    tool_choice auto (a grammar writes the call) and a named tool (the forced path)."""
    _, state, url = family
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    base = dict(model="m", max_tokens=60, messages=ASK, thinking={"type": "disabled"},
                tools=[{"name": "get_time", "description": "Local time", "input_schema": TIME}])
    for body in (dict(base, extra_body={"temperature": 0, "guided_grammar": call_grammar(state)}),
                 dict(base, tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0})):
        m = client.messages.create(**body)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_time", m
        assert set(uses[0].input) == {"city"}
        raw = httpx.post(url + "/v1/messages", json=dict({k: v for k, v in body.items() if k != "extra_body"},
                                                         stream=True, **body["extra_body"]), timeout=120).text
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                  and e["delta"]["type"] == "input_json_delta"]
        assert json.loads("".join(pieces)) == uses[0].input


def test_a_call_after_thinking_in_every_api(family):
    """Reasoning, then a call in the family's notation: reasoning_content and tool_calls (chat), a
    reasoning item then a function_call item (Responses), a thinking block then tool_use (Messages)."""
    name, state, url = family
    words = "/[a-z]{2,6}( [a-z]{2,6}){1,2}/"
    opened = ("<|channel>", "thought\n", words, "<channel|>") if name == "gemma4" else (words, "\n", "</think>", "\n\n")
    head = thinking_grammar(state.tokenizer, state.ctx.vocab_size, state.ctx.eos_token_ids, *opened)
    call = call_grammar(state).replace("start:", "call:", 1)
    grammar = head.rstrip("\n") + " call\n" + call
    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "guided_grammar": grammar, "temperature": 0}
    client = openai_client(url)
    c = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS[1:], max_tokens=80,
                                       extra_body=thinking).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time", c
    assert c.message.model_extra["reasoning_content"] and not c.message.content
    r = client.responses.create(model="m", input=ASK, tools=[{"type": "function", "name": "get_time",
                                                               "parameters": TIME}], max_output_tokens=80,
                                extra_body=thinking)
    assert [i.type for i in r.output] == ["reasoning", "function_call"], r
    assert r.output[1].arguments == c.message.tool_calls[0].function.arguments
    m = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120).messages.create(
        model="m", max_tokens=80, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[{"name": "get_time", "input_schema": TIME}],
        extra_body={"guided_grammar": grammar, "temperature": 0})
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use", m
    assert m.content[1].input == json.loads(c.message.tool_calls[0].function.arguments)


def test_results_go_in_the_calling_turn_where_the_template_takes_tool_responses(family):
    """Gemma 4's first template writes results only as a message's `tool_responses` (a `tool` message
    would be a turn of role "tool"): the results of a call become its turn's tool_responses, a JSON
    object's content as the object."""
    name, state, _ = family
    if name != "gemma4":
        pytest.skip("Gemma 4's templates")
    from specdecode.serve.tools import with_tools
    tok = state.tokenizer
    original = tok.chat_template
    tok.chat_template, tok._template = (
        "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{% endfor %}"
        "{% for r in m.tool_responses or [] %}<|tool_response>response:{{ r.name }}{{ r.response | tojson }}"
        "<tool_response|>{% endfor %}{{ m.content }}<turn|>\n{% endfor %}"), None
    try:
        history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "Person", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": '{"ok": true}'},
            {"role": "tool", "tool_call_id": "a", "content": "12:00"}]
        messages, _ = with_tools(history, ToolSpec(TOOLS, "auto", state.ctx.tool_format()), tok)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[1]["tool_responses"] == [{"name": "Person", "response": {"ok": True}},
                                                 {"name": "get_time", "response": "12:00"}]
        text = tok.apply_chat_template(messages)
        assert '<|tool_response>response:get_time"12:00"' in text and "<|turn>tool" not in text
    finally:
        tok.chat_template, tok._template = original, None
