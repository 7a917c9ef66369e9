"""Tool calls in each family's own format, through the unchanged openai client, on tiny random
models whose tokenizers hold the family's markers as added tokens and whose chat templates write
tools and calls the family's way (Qwen2.5 / Hermes, Llama 3.1, Mistral, Phi-4-mini; templates
written for these tests). With random weights the content of a forced call is whatever the grammar
allows: the tests check that it is a call of the right function in the family's exact tokens (a
marker that is one token is emitted as that one token), that its arguments are valid against the
schema, that streaming sends the same call as OpenAI streams it, and that speculation on and off
give the same tokens at temperature 0."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import make_marker_model
from pydantic import BaseModel, Field

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.serve.tools import HERMES, ToolParser, ToolSpec, with_tools

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
          "the quick brown fox jumps over the lazy dog. what is the weather in paris? 1 2 3 4 5 6 7 8 9 10",
          '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}']
NL = "{{ '\\n' }}"
QWEN = ("{% if tools %}<|im_start|>system" + NL + "You are a helpful assistant." + NL + NL + "# Tools" + NL + "<tools>"
        "{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}" + NL + "</tools>" + NL +
        "Return each call as <tool_call>" + NL + "{\"name\": <function-name>, \"arguments\": <args>}" + NL +
        "</tool_call><|im_end|>" + NL + "{% endif %}"
        "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
        "{% for c in m.tool_calls %}" + NL + "<tool_call>" + NL + "{\"name\": \"{{ c.function.name }}\", "
        "\"arguments\": {{ c.function.arguments | tojson }}}" + NL + "</tool_call>{% endfor %}<|im_end|>" + NL +
        "{% elif m.role == 'tool' %}<|im_start|>user" + NL + "<tool_response>" + NL + "{{ m.content }}" + NL +
        "</tool_response><|im_end|>" + NL + "{% else %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" +
        NL + "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}")
LLAMA = ("{{ bos_token }}<|start_header_id|>system<|end_header_id|>" + NL + NL +
         "{% if tools %}Environment: ipython" + NL + "Respond with a call as {\"name\": function name, "
         "\"parameters\": dictionary of argument name and its value}, or <|python_tag|> for code." + NL +
         "{% for t in tools %}{{ t | tojson }}" + NL + "{% endfor %}{% endif %}<|eot_id|>"
         "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>" +
         NL + NL + "{% if m.tool_calls %}{\"name\": \"{{ m.tool_calls[0].function.name }}\", \"parameters\": "
         "{{ m.tool_calls[0].function.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}<|eot_id|>"
         "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL +
         "{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
           "{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
           "[INST] {{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
           "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, "
           "\"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
           "{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]"
           "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
PHI4 = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message %}<|system|>"
        "{{ message['content'] }}<|tool|>{{ message['tools'] }}<|/tool|><|end|>{% else %}<|{{ message['role'] }}|>"
        "{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
FAMILIES = {   # name: (added tokens, eos, more eos, bos, template, detected format, the call's first marker)
    "qwen2.5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], "<|im_end|>", [],
                None, QWEN, "hermes", "<tool_call>"),
    "llama3.1": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], "<|eot_id|>", ["<|eom_id|>"], "<|begin_of_text|>", LLAMA, "llama3", None),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>", [], "<s>", MISTRAL, "mistral",
                "[TOOL_CALLS]"),
    "phi4-mini": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                   "<|tool_call|>", "<|/tool_call|>"], "<|end|>", [], None, PHI4, "phi4", "<|tool_call|>"),
}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 12}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "Person", "description": "Record a person", "parameters": PERSON}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Maria Lopez is 34 and lives in Valencia."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=12)


def make_family_model(folder, family: str):
    """The family's added tokens (llguidance treats such <...> / [...] tokens as special; Qwen's tool
    markers are added with special: false, decoded as text), its end tokens and chat template."""
    added, eos, more_eos, bos, template = FAMILIES[family][:5]
    return make_marker_model(folder, {t: t not in ("<tool_call>", "</tool_call>") for t in added}, [eos] + more_eos,
                             bos, template, CORPUS, seed=5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = make_family_model(tmp_path_factory.mktemp("family") / name, name)
    llm = LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024, served_model_name="m",
                                         max_tokens_default=12))
    with BackgroundServer(create_app(state)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield name, client, state


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_the_format_is_read_from_template_and_vocabulary(family):
    name, _, state = family
    fmt = state.ctx.tool_format()
    assert fmt.name == FAMILIES[name][5]
    first = FAMILIES[name][6]
    if first is not None:
        assert fmt.start.text == first and fmt.start.token == state.tokenizer.token_id(first) and fmt.start.special
        assert f"<[{fmt.start.token}]>" in ToolSpec(TOOLS, "Person", fmt).structured().value
    expected = {"hermes": ("\n", "\n", "arguments"), "llama3": ("", "", "parameters"),
                "mistral": (" ", "", "arguments"), "phi4": ("", "", "arguments")}[fmt.name]
    assert (fmt.gap_start, fmt.gap_end, fmt.args_key) == expected
    # the tools reach the model: in the template's own place, or the system message's tools field
    messages, template_tools = with_tools(ASK, ToolSpec(TOOLS, "auto", fmt), state.tokenizer)
    assert "Record a person" in state.tokenizer.apply_chat_template(messages, tools=template_tools)


def test_forced_calls_streamed_and_not_speculation_on_and_off(family):
    name, client, state = family
    fmt = state.ctx.tool_format()
    for choice in (named("Person"), "required"):
        results = {}
        for speculate in (True, False):
            r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               max_tokens=120, temperature=0,
                                               extra_body={"speculate": speculate, "return_token_ids": True})
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0]
            assert call.type == "function" and (call.function.name == "Person" or choice == "required")
            assert len(call.id) == 9 if fmt.name == "mistral" else call.id.startswith("call_")
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            ids = c.model_extra["token_ids"]
            if fmt.start is not None:            # the marker is its one token, once, first
                assert ids[0] == fmt.start.token and ids.count(fmt.start.token) == 1
            if fmt.end is not None:
                assert ids.count(fmt.end.token) == 1
            assert c.message.content is None
            results[speculate] = (ids, call.function.name, call.function.arguments)
        assert results[True] == results[False]
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                     max_tokens=120, temperature=0, stream=True))
        deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == results[True][1] and deltas[0].id and deltas[0].type == "function"
        assert len(deltas) >= 2 and all(d.index == 0 and d.id is None for d in deltas[1:])
        assert "".join(d.function.arguments or "" for d in deltas) == results[True][2]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_auto_parses_the_familys_calls_and_leaves_text_alone(family):
    """"auto": the model's own choice; here a grammar (vLLM's guided_grammar, allowed with "auto")
    makes the random model write a call in the family's format, which the parser must find."""
    name, client, state = family
    fmt = state.ctx.tool_format()
    grammar = ToolSpec(TOOLS, "get_time", fmt).structured().value
    body = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    r = client.chat.completions.create(**body, extra_body={"guided_grammar": grammar})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time", c
    assert set(json.loads(c.message.tool_calls[0].function.arguments)) <= {"city"}
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body={"guided_grammar": grammar}))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for d in deltas) == c.message.tool_calls[0].function.arguments
    text = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    # (a random model's text; its special tokens, skipped, may leave it empty)
    assert text.choices[0].message.tool_calls is None and text.choices[0].finish_reason in ("stop", "length")
    assert isinstance(text.choices[0].message.content, str)


def test_openai_parse_helpers_with_pydantic(family):
    _, client, _ = family
    tool = openai.pydantic_function_tool(Person)
    r = client.chat.completions.parse(model="m", messages=ASK, tools=[tool], tool_choice=named("Person"),
                                      max_tokens=120, temperature=0.7, seed=3)
    person = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(person, Person) and 0 <= person.age <= 120
    r = client.chat.completions.parse(model="m", messages=ASK, response_format=Person, max_tokens=120, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_a_call_that_cannot_finish_ends_with_length(family):
    _, client, _ = family
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("Person"),
                                       max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("Person"),
                                       temperature=0)         # no max_tokens: the server's default (12)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_earlier_calls_and_results_reach_the_model_as_objects_whatever_the_template(family):
    """A conversation going on after a call: the openai client sends the call's arguments as a
    JSON string; the template writes them with tojson, so they must reach it as an object. Every
    family's prompt holds the call and the tool's result: the template's own way, or written in the
    model's call format where the template drops calls (Phi-4-mini's writes only content)."""
    _, _, state = family
    fmt = state.ctx.tool_format()
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "12:00"}]
    messages, template_tools = with_tools(history, ToolSpec(TOOLS, "auto", fmt), state.tokenizer)
    text = state.tokenizer.apply_chat_template(messages, tools=template_tools)
    assert '{"city": "Oslo"}' in text and '"{\\"city' not in text and '"get_time"' in text
    assert text.index("Oslo") < text.index("12:00")


def test_a_template_without_tool_turns_gets_them_as_text(tiny_models):
    """A template that writes only each turn's role and content (SmolLM2's) and one that refuses any
    role but user and model (Gemma's): the earlier calls are written in the Hermes format after the
    assistant's content, the results as a user turn of <tool_response> blocks (one per turn)."""
    from specdecode.tokenizer import Tokenizer
    calls = [{"id": "a", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}}]
    history = ASK + [{"role": "assistant", "content": "Checking.", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "a", "content": "12:00"},
                     {"role": "tool", "tool_call_id": "b", "content": "13:00"}]
    plain = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    gemma = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Conversation "
             "roles must alternate user/assistant') }}{% endif %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
             "<end_of_turn>\n{% endfor %}")
    for template in (plain, gemma):
        tok = Tokenizer(tiny_models["llama"])
        tok.chat_template = template
        messages, _ = with_tools(history, ToolSpec(TOOLS, "auto", HERMES), tok)
        roles = [m["role"] for m in messages]        # (the plain template's first: the tools' instruction)
        assert roles == (["user", "assistant", "user"] if template == gemma else
                         ["system", "user", "assistant", "tool", "tool"])
        messages = messages[roles.index("user"):]
        assert messages[1]["content"] == ('Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"city": '
                                          '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                                          '{"city": "Rome"}}\n</tool_call>')
        text = tok.apply_chat_template(messages)
        assert text.index("Rome") < text.index("12:00") < text.index("13:00")
    assert messages[2]["content"] == ("<tool_response>\n12:00\n</tool_response>\n"
                                      "<tool_response>\n13:00\n</tool_response>")


def test_parser_units():
    from specdecode.serve.tools import Marker, ToolFormat, extract_calls
    llama = ToolFormat("llama3", None, args_key="parameters", also=(Marker("<|python_tag|>"),))
    mistral = ToolFormat("mistral", Marker("[TOOL_CALLS]"), listed=True, gap_start=" ")

    def streamed(fmt, text, names=None, max_calls=None):
        parser, deltas = ToolParser(fmt, names, max_calls), []
        for ch in text:                          # one character at a time: the same as all at once
            deltas += parser.feed(ch)
        deltas += parser.finish()
        content = "".join(d[1] for d in deltas if d[0] == "content")
        calls = [(d[3], "".join(a[2] for a in deltas if a[0] == "arguments" and a[1] == d[1]))
                 for d in deltas if d[0] == "call"]
        whole = ToolParser(fmt, names, max_calls).result(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]] == calls
        assert (whole[0] or "") == content.strip()
        return content, calls
    assert streamed(HERMES, 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>') == \
        ("ok", [("f", '{"a": [1, "}"]}')])
    assert streamed(HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call> then') == \
        ("then", [("g", '{"x": 1}')])
    text = '<tool_call>{"name": "h", "arguments": "{\\"x\\": 2}"}</tool_call>'
    assert streamed(HERMES, text)[1] == [("h", '{"x": 2}')]
    assert streamed(HERMES, "Hello <tool_ca world") == ("Hello <tool_ca world", [])
    assert streamed(HERMES, "<tool_call>{not json}</tool_call>")[1] == []
    assert streamed(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1') == ("", [("f", '{"a": 1')])
    assert streamed(llama, ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')[1] == \
        [("f", '{"a": 1}'), ("g", "{}")]
    assert streamed(llama, '<|python_tag|>{"name": "f", "parameters": {"a": true}}')[1] == [("f", '{"a": true}')]
    assert streamed(llama, '{"answer": 3} is json') == ('{"answer": 3} is json', [])
    assert streamed(llama, 'The answer {"name": "x"}') == ('The answer {"name": "x"}', [])
    assert streamed(mistral, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')[1] \
        == [("f", '{"a": 1}'), ("g", "{}")]
    assert streamed(mistral, "[TOOL_CALLS] nothing") == ("[TOOL_CALLS] nothing", [])
    assert extract_calls("no calls here") == ("no calls here", [])
    # a call without markers at the answer's start, bare or fenced, when it names one of the functions
    fenced = '```json\n{\n  "name": "Person",\n  "arguments": {\n    "age": 34\n  }\n}\n```\nDone.'
    assert streamed(HERMES, fenced, ["Person"]) == ("Done.", [("Person", '{\n    "age": 34\n  }')])
    assert streamed(HERMES, fenced, ["get_time"]) == (fenced, [])
    assert streamed(HERMES, ' {"name": "Person", "arguments": {}}', ["Person"]) == ("", [("Person", "{}")])
    assert streamed(HERMES, "```python\nprint(1)\n```", ["Person"]) == ("```python\nprint(1)\n```", [])
    assert streamed(llama, '{"name": "nope", "parameters": {}}', ["f"]) == ('{"name": "nope", "parameters": {}}', [])
    # several calls without markers: one object per line in a fence (Qwen2.5-Coder-1.5B's "auto" for two
    # files), or a list; an object after a call that is not one stays text
    one = '{"name": "Person", "arguments": {"age": 1}}'
    two = '{"name": "Person", "arguments": {"age": 2}}'
    assert streamed(HERMES, f"```json\n{one}\n{two}\n```", ["Person"]) == ("", [("Person", '{"age": 1}'),
                                                                                ("Person", '{"age": 2}')])
    assert streamed(HERMES, f"```json\n[{one}, {two}]\n```", ["Person"])[1] == [("Person", '{"age": 1}'),
                                                                              ("Person", '{"age": 2}')]
    assert streamed(HERMES, f'{one}\n{{"name": "nope", "arguments": {{}}}}', ["Person"]) == \
        ('{"name": "nope", "arguments": {}}', [("Person", '{"age": 1}')])
    assert streamed(HERMES, "[1, 2] and [{\"a\": 1}]", ["Person"]) == ("[1, 2] and [{\"a\": 1}]", [])
    # a call that max_tokens ends before its name is complete is neither a call nor content (its markup)
    assert streamed(HERMES, 'ok <tool_call>\n{"name": "Per', ["Person"]) == ("ok", [])
    assert streamed(HERMES, '<tool_call>', ["Person"]) == ("", [])
    assert streamed(HERMES, '<tool_call>hello', ["Person"]) == ("<tool_call>hello", [])
    cut = ToolParser(HERMES, ["Person"])
    cut.result('<tool_call>\n{"name": "Person", "arguments": {"age": 1')          # a stop string cut it
    assert cut.tool_calls() and not cut.calls_complete()
    # parallel_tool_calls false: the first call only, nothing after it
    two = ('ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call> bye')
    assert streamed(HERMES, two) == ("okbye", [("f", "{}"), ("g", "{}")])
    assert streamed(HERMES, two, max_calls=1) == ("ok", [("f", "{}")])
    assert streamed(mistral, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                    max_calls=1)[1] == [("f", '{"a": 1}')]


def test_a_long_answer_streams_through_the_parser():
    """Decided text is dropped as the answer grows (no copy of the whole answer per step); what
    comes out is the text, then a call after it."""
    parser, out = ToolParser(HERMES, ["Person"]), []
    words = [f"word{i} " for i in range(3000)]
    for w in words:
        out += parser.feed(w)
    out += parser.feed('<tool_call>\n{"name": "Person", "arguments": {"age": 1}}\n</tool_call>') + parser.finish()
    assert "".join(d[1] for d in out if d[0] == "content") == "".join(words).rstrip()
    assert len(parser.text) < 8192 and parser.tool_calls()[0]["function"]["arguments"] == '{"age": 1}'


def test_a_template_without_a_system_role_gets_the_instruction_in_the_user_turn(tiny_models):
    """Gemma 2's template defines no tool format and refuses a system message: the Hermes
    instruction opens the first user turn instead."""
    from specdecode.tokenizer import Tokenizer
    tok = Tokenizer(tiny_models["llama"])
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
                         "{% endfor %}<start_of_turn>model\n")
    fmt = format_of_tokenizer(tok)
    assert fmt.name == "hermes" and fmt.start.token is None          # its text, spelled out
    messages, template_tools = with_tools(ASK, ToolSpec(TOOLS, "auto", fmt), tok)
    assert template_tools is None and [m["role"] for m in messages] == ["user"]
    text = tok.apply_chat_template(messages)
    assert "<tool_call>" in text and text.index("Record a person") < text.index("Maria Lopez")


def format_of_tokenizer(tok):
    from specdecode.serve.tools import detect
    return detect(tok, lambda token: True)
