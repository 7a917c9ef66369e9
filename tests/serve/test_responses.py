"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) through the official openai
SDK and OpenAI's Agents SDK against a server on the embedded model: plain and streamed answers
(the API's event order, numbered), input items, a function-call round trip beside a tool type the
server skips, text.format, stored responses, max_output_tokens clamped to the context, the prompt
that cannot fit, speculation on = off, what Codex CLI sends, and every bad field answered with a
400 naming it. `Output` (the events of an answer's items) is tested alone too, thinking included."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import jsonschema
import openai
import pytest
from conftest import make_thinking_model, thinking_grammar
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.responses import Output, ResponseStore, feed, skeleton
from specdecode.serve.server import BackgroundServer, build_state

MAX_MODEL_LEN = 1024
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GREEDY = {"temperature": 0, "max_output_tokens": 48}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=4, max_model_len=MAX_MODEL_LEN, served_model_name="smollm2"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def raw_events(server, body: dict) -> list[dict]:
    """A streamed request's events, each checked against the SDK's event types."""
    r = httpx.post(server.url + "/v1/responses", json=dict(body, stream=True), timeout=120)
    assert r.status_code == 200, r.text
    lines = r.text.splitlines()
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.mark.slow
def test_create_and_stream_say_the_same_in_the_apis_shape(server, client):
    made = client.responses.create(model="smollm2", input="Name three fruits.", **GREEDY)
    assert made.id.startswith("resp_") and made.object == "response" and made.output_text
    assert made.status in ("completed", "incomplete")
    message = made.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    usage = made.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= GREEDY["max_output_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    again = client.responses.create(model="smollm2", input="Name three fruits.", **GREEDY)
    assert again.usage.input_tokens_details.cached_tokens > 0          # the prefix cache's blocks
    raw = httpx.post(server.url + "/v1/responses", json={"model": "smollm2", "input": "Hi", **GREEDY}, timeout=120)
    Response.model_validate(raw.json())
    with client.responses.stream(model="smollm2", input="Name three fruits.", temperature=0,
                                 max_output_tokens=400) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and final.status == "completed"
    assert final.output_text.startswith(made.output_text)               # greedy: the same answer, longer


@pytest.mark.slow
def test_max_output_tokens_cuts_the_answer_as_incomplete(server):
    events = raw_events(server, {"model": "smollm2", "input": "Count to fifty.", "temperature": 0,
                                 "max_output_tokens": 5, "ignore_eos": True})
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 5
    assert last["response"]["output"][0]["status"] == "incomplete"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == last["response"]["output"][0]["content"][0]["text"]


@pytest.mark.slow
def test_input_items_render_as_the_same_chat(server, client):
    items = [{"role": "developer", "content": "Answer in one short sentence."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And 3 + 3?"}]}]
    made = client.responses.create(model="smollm2", input=items, instructions="You are a calculator.", **GREEDY)
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=GREEDY["max_output_tokens"],
                                          messages=[{"role": "system", "content": "You are a calculator.\n\n"
                                                                                  "Answer in one short sentence."},
                                                    {"role": "user", "content": "What is 2 + 2?"},
                                                    {"role": "assistant", "content": "4."},
                                                    {"role": "user", "content": "And 3 + 3?"}])
    assert made.output_text == chat.choices[0].message.content
    assert made.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_a_function_call_round_trip_beside_a_skipped_tool_type(server, client, caplog):
    tools = [WEATHER, {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}]
    with caplog.at_level(logging.WARNING, logger="specdecode.serve"):
        called = client.responses.create(model="smollm2", input="What is the weather in Paris?", tools=tools,
                                         tool_choice="required", **GREEDY)
        client.responses.create(model="smollm2", input="Weather in Rome?", tools=tools, tool_choice="required",
                                **GREEDY)
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "namespace, web_search" in skipped[0].getMessage()     # once, not per request
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments)["city"], str)
    assert [t.name for t in called.tools] == ["get_weather"]
    answer = client.responses.create(model="smollm2", previous_response_id=called.id, tools=tools, **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}])
    assert answer.output_text and answer.previous_response_id == called.id
    whole = client.responses.create(model="smollm2", tools=tools, **GREEDY, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert whole.output_text == answer.output_text       # previous_response_id = the items sent again
    events = raw_events(server, {"model": "smollm2", "input": "What is the weather in Paris?", "tools": tools,
                                 "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY})
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"])["city"] and done["name"] == "get_weather"
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert pieces == done["arguments"] == events[-1]["response"]["output"][-1]["arguments"]


@pytest.mark.slow
def test_text_format_json_schema_and_json_object(client):
    made = client.responses.create(model="smollm2", input="Describe Ada, 36.", temperature=0, max_output_tokens=96,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                    "strict": True}})
    jsonschema.validate(json.loads(made.output_text), PERSON)
    assert made.text.format.type == "json_schema"
    loose = client.responses.create(model="smollm2", input="Describe Ada as JSON.", temperature=0,
                                    max_output_tokens=96, text={"format": {"type": "json_object"}})
    assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)


@pytest.mark.slow
def test_stored_responses_chain_and_are_retrieved(server, client):
    first = client.responses.create(model="smollm2", input="My name is Ada. Say hi.", **GREEDY)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="smollm2", previous_response_id=first.id, input="What is my name?",
                                     **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model="smollm2", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="smollm2", previous_response_id="resp_unknown", input="Hi", **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(limit=2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")
    store.put({"id": "c"}, [])
    assert list(store.entries) == ["a", "c"] and store.get("b") is None


@pytest.mark.slow
def test_max_output_tokens_is_clamped_and_a_prompt_too_long_is_one_400(client):
    made = client.responses.create(model="smollm2", input="Say hello.", temperature=0, max_output_tokens=32000)
    assert made.max_output_tokens == MAX_MODEL_LEN - made.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="smollm2", input="word " * (2 * MAX_MODEL_LEN), max_output_tokens=32000)
    body = caught.value.body
    assert body["param"] == "input" and body["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in body["message"] and "tokens" in body["message"]


@pytest.mark.slow
def test_greedy_text_is_identical_with_speculation_on_and_off(client):
    prompt = "Repeat exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, apples, bananas, cherries."
    runs = {on: client.responses.create(model="smollm2", input=prompt, temperature=0, max_output_tokens=64,
                                        extra_body={"speculate": on}) for on in (True, False)}
    assert runs[True].output_text == runs[False].output_text
    assert runs[False].speculation["mode"] == "off" and runs[False].speculation["drafted_tokens"] == 0
    assert runs[True].speculation["mode"] == "on"


@pytest.mark.slow
def test_what_codex_sends_is_served(server):
    codex = {"model": "smollm2", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
             "reasoning": {"summary": "auto", "effort": "a-later-effort"}, "store": False,
             "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0198a-session",
             "client_metadata": {"originator": "codex_exec"},
             "max_output_tokens": 32, "temperature": 0, "input": [
                 {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
                 {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "No tools."}]},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>/tmp</env>"}]},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say done."}]}],
             "tools": [dict(WEATHER, strict=False), {"type": "web_search", "external_web_access": False},
                       {"type": "namespace", "name": "mcp", "description": "d", "tools": [WEATHER]},
                       {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}]}
    events = raw_events(server, codex)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["store"] is False
    assert events[-1]["response"]["reasoning"] == {"effort": None, "summary": "auto"}     # a value it does not know


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": 5}, "input"), ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}, {"type": "function"}]}, "tools[1].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "speculate": "maybe"}, "speculate"),
])
def test_every_bad_field_is_a_400_naming_it(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param.split("[")[0] in r.json()["error"]["message"]


@pytest.mark.slow
def test_the_agents_sdk_runs_a_function_tool(server):
    """The Agents SDK's Runner with a function tool (its result ends the run: the embedded model
    calls the tool again when asked to go on), then a streamed run of an agent without tools."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        called.append(city)
        return f"sunny, 21 C in {city}"

    def model():            # a client per event loop (run_sync runs its own)
        return agents.OpenAIResponsesModel(model="smollm2", openai_client=openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0))
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool's result.", tools=[get_weather],
                         model=model(), model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert called and result.final_output == f"sunny, 21 C in {called[0]}"

    async def streamed():
        run = agents.Runner.run_streamed(agents.Agent(name="greeter", instructions="Be brief.", model=model(),
                                                      model_settings=agents.ModelSettings(temperature=0,
                                                                                          max_tokens=32)),
                                         "Say hello.")
        kinds = [event.type async for event in run.stream_events()]
        return run.final_output, kinds
    text, kinds = asyncio.run(streamed())
    assert isinstance(text, str) and text and "raw_response_event" in kinds


class Gen:
    """What `feed` reads of a Generation: its tool parser and its reasoning parser."""
    tools = None

    def __init__(self, reasoning) -> None:
        self.reasoning = reasoning


class Think:
    """A reasoning parser over `<think>...</think>` whose markers arrive whole."""

    def __init__(self) -> None:
        self.inside = None

    def feed(self, text: str) -> tuple[str, str]:
        if self.inside is None and text.startswith("<think>"):
            self.inside, text = True, text[len("<think>"):]
        if self.inside and "</think>" in text:
            thought, rest = text.split("</think>", 1)
            self.inside = False
            return thought, rest
        return (text, "") if self.inside else ("", text)

    def finish(self) -> tuple[str, str]:
        return "", ""


def test_thinking_becomes_a_reasoning_item_before_the_message():
    parsed = type("P", (), {"params": type("S", (), {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0})(),
                            "model": "m"})()
    out = Output(skeleton({"input": "x"}, parsed, {}))
    gen = Gen(Think())
    events = feed(gen, out, "<think>a b") + feed(gen, out, " c</think>Hi") + feed(gen, out, " there", final=True)
    events += out.close()
    kinds = [e["type"] for e in events]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done"]
    reasoning, message = out.items
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "a b c"
    assert message["content"][0]["text"] == "Hi there" and [e["output_index"] for e in events[-3:]] == [1, 1, 1]
    for event in events:
        EVENTS.validate_python(dict(event, sequence_number=0))
    Response.model_validate(dict(out.response, status="completed"))


@pytest.fixture(scope="module", params=["qwen3.5", "gpt-oss"])
def thinking(request, tmp_path_factory):
    """A tiny random model with a thinking family's markup (conftest.THINKING_FAMILIES) behind a server."""
    folder = make_thinking_model(tmp_path_factory.mktemp("thinking") / request.param, request.param)
    llm = LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=512, served_model_name="m"))
    with BackgroundServer(create_app(state)) as srv:
        yield request.param, state, srv


def test_a_thinking_models_reasoning_is_a_reasoning_item(thinking):
    name, state, srv = thinking
    words, answer = "/[a-z]{2,4}( [a-z]{2,4}){1,3}/", "/[a-z]{2,4}( [a-z]{2,4}){0,2}/"
    parts = (words, "\n", "</think>", "\n\n", answer) if name == "qwen3.5" else (      # the prompt opened <think>
        "<|channel|>", "analysis", "<|message|>", words, "<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
        "<|message|>", answer)
    body = {"model": "m", "input": "what is the weather in paris?", "temperature": 0, "max_output_tokens": 80,
            "guided_grammar": thinking_grammar(state.tokenizer, state.ctx.vocab_size, state.ctx.eos_token_ids,
                                               *parts)}
    made = {on: httpx.post(srv.url + "/v1/responses", json=dict(body, speculate=on), timeout=60).json()
            for on in (True, False)}
    assert [i["content"] for i in made[True]["output"]] == [i["content"] for i in made[False]["output"]]
    Response.model_validate(made[True])
    reasoning, message = made[True]["output"]
    thought, text = reasoning["content"][0]["text"], message["content"][0]["text"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and message["type"] == "message"
    assert 2 <= len(thought.split()) <= 4 and all(w.isalpha() for w in thought.split() + text.split()), (thought, text)
    assert 0 < made[True]["usage"]["output_tokens_details"]["reasoning_tokens"] < made[True]["usage"]["output_tokens"]
    events = raw_events(srv, body)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=4, max_model_len=256, block_size=8, served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as srv:
        yield srv


FUZZ_VALUES = [None, True, 0, -1, 2**70, 1.5, float("nan"), "", "x", "auto", [], [None], [{}], {}, {"type": "x"},
               [{"type": "function"}], {"type": "function", "name": 3}, [{"role": "user", "content": {"a": 1}}],
               [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}],
               {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}, {"effort": "none"}]
FUZZ_BASE = {"model": "tiny", "input": "hello", "max_output_tokens": 4, "instructions": "be brief",
             "tools": [{"type": "web_search"}], "tool_choice": "auto", "text": {"format": {"type": "text"}},
             "temperature": 0, "top_p": 1, "store": True, "reasoning": {"effort": "low"}, "include": [], "metadata": {},
             "previous_response_id": None, "parallel_tool_calls": True, "chat_template_kwargs": {},
             "speculate": None, "stream": False}


@pytest.mark.usefixtures("one_thread")
def test_fuzzed_fields_never_get_a_5xx(tiny_server, caplog):
    """Each field of a valid request, and each input item's, set to values of every JSON type (a
    bounded sweep): a 200 or a 4xx in OpenAI's error shape naming a field, never a 5xx or a traceback."""
    import random
    rng = random.Random(0)
    bodies = [dict(FUZZ_BASE, **{name: value}) for name in FUZZ_BASE for value in FUZZ_VALUES]
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    bodies += [dict(FUZZ_BASE, input=[dict(item, **{key: value})]) for key in item for value in FUZZ_VALUES]
    bodies += [dict(FUZZ_BASE, **{n: rng.choice(FUZZ_VALUES) for n in rng.sample(list(FUZZ_BASE), 4)})
               for _ in range(60)]
    statuses = []
    with caplog.at_level(logging.ERROR, logger="specdecode.serve"), httpx.Client(timeout=60) as http:
        for body in bodies:
            r = http.post(tiny_server.url + "/v1/responses", content=json.dumps(body, allow_nan=True),
                          headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, (body, r.text)
            elif body.get("stream") is not True:
                Response.model_validate(r.json())
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback in the server log"
    assert statuses.count(200) > len(bodies) / 10 and statuses.count(400) > len(bodies) / 10, \
        {s: statuses.count(s) for s in set(statuses)}     # the sweep reached both answers and refusals


def test_the_api_key_guards_responses_too(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=256, block_size=8, served_model_name="tiny"))
    with BackgroundServer(create_app(state, api_key="sesame")) as srv:
        body = {"model": "tiny", "input": "hello", "max_output_tokens": 2}
        assert httpx.post(srv.url + "/v1/responses", json=body, timeout=60).status_code == 401
        made = httpx.post(srv.url + "/v1/responses", json=body, headers={"Authorization": "Bearer sesame"}, timeout=60)
        assert made.status_code == 200
        assert httpx.get(srv.url + "/v1/responses/" + made.json()["id"], timeout=60).status_code == 401
        got = httpx.get(srv.url + "/v1/responses/" + made.json()["id"], headers={"Authorization": "Bearer sesame"})
        assert got.json() == made.json()
