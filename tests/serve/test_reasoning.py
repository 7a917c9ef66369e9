"""A thinking model's reasoning apart from its answer (serve/reasoning.py): the parser per family
on marker text cut at every point, then through /v1/chat/completions (streamed and not) on tiny
random models carrying each family's marker tokens and chat template (tests/conftest.py
THINKING_FAMILIES). A random model does not think by itself: a grammar (vLLM's guided_grammar)
makes it write the family's markers as tokens, which then take the server's real path (the
engine, the decoder that keeps marker tokens, the parser, the API)."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import THINKING_FAMILIES, make_thinking_model, thinking_grammar

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.reasoning import HarmonyParser, ReasoningParser, detect, reasoning_parser
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.serve.tools import HERMES, ToolParser

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
CASES = {   # family: (parser, the prompt's end, answer, reasoning, content)
    "qwen3": (lambda: ReasoningParser("<think>", "</think>"), QWEN_PROMPT,
              "<think>\nThe user says hi.\nGreet back.\n</think>\n\nHello! <thinking> is a word.",
              "The user says hi.\nGreet back.", "Hello! <thinking> is a word."),
    "qwen3.5": (lambda: ReasoningParser("<think>", "</think>"), QWEN_PROMPT + "<think>\n",
                "The user says hi.\n</think>\n\nHello!", "The user says hi.", "Hello!"),
    "gemma4": (lambda: ReasoningParser("<|channel>thought", "<channel|>"), "<|turn>model\n",
               "<|channel>thought\nPlan: greet.<channel|>Hello <|chan", "Plan: greet.", "Hello <|chan"),
    "gpt-oss": (HarmonyParser, "<|start|>user<|message|>hi<|end|><|start|>assistant",
                "<|channel|>analysis<|message|>User greets. <|end|><|start|>assistant<|channel|>commentary"
                "<|message|>Saying hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello <|end|",
                "User greets. ", "Saying hi.Hello <|end|"),
}


def run(make, prompt: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parser = make()
    parser.prime(prompt)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize("family", list(CASES))
def test_every_cut_of_the_answer_gives_the_same_split(family):
    make, prompt, answer, reasoning, content = CASES[family]
    assert run(make, prompt, [answer])[:2] == (reasoning, content)
    assert run(make, prompt, list(answer))[:2] == (reasoning, content)      # a character at a time
    for cut in range(len(answer) + 1):                                     # two pieces, cut anywhere
        assert run(make, prompt, [answer[:cut], answer[cut:]])[:2] == (reasoning, content), cut


def test_a_marker_split_across_deltas_is_held_until_it_resolves():
    _, _, deltas = run(CASES["qwen3"][0], QWEN_PROMPT, ["<thi", "nk>\nplan</th", "ink>\n\nok"])
    assert deltas == [("", ""), ("plan", ""), ("", "ok"), ("", "")]
    _, _, deltas = run(CASES["qwen3"][0], QWEN_PROMPT, ["<thi", "s is text"])
    assert deltas == [("", ""), ("", "<this is text"), ("", "")]


def test_unterminated_thinking_is_all_reasoning_and_a_partial_marker_comes_back_at_the_end():
    assert run(CASES["qwen3.5"][0], CASES["qwen3.5"][1], ["still thinking </thi"])[:2] == \
        ("still thinking </thi", "")
    assert run(HarmonyParser, CASES["gpt-oss"][1], ["<|channel|>analysis<|message|>hmm <|en"])[:2] == \
        ("hmm <|en", "")


def test_the_prompt_decides_where_the_answer_starts():
    parser = ReasoningParser("<think>", "</think>")
    parser.prime(QWEN_PROMPT + "<think>\n")
    assert parser.in_reasoning and not parser.closed_in_prompt
    parser = ReasoningParser("<think>", "</think>")
    parser.prime(QWEN_PROMPT + "<think>\n\n</think>\n\n")          # enable_thinking false
    assert not parser.in_reasoning and parser.closed_in_prompt
    parser = ReasoningParser("<think>", "</think>")                 # an earlier turn's block is not this one's
    parser.prime("<think>a</think>b<|im_end|>\n" + QWEN_PROMPT)
    assert not parser.in_reasoning and not parser.closed_in_prompt
    harmony = HarmonyParser()
    harmony.prime("<|start|>assistant<|channel|>analysis<|message|>")
    assert harmony.in_reasoning and harmony.feed("x") == ("x", "")


def test_text_without_a_harmony_header_is_content():
    assert run(HarmonyParser, "<|start|>assistant", ["just text"])[:2] == ("", "just text")
    long = "word " * 80
    r, c, deltas = run(HarmonyParser, "<|start|>assistant", [long, "more"])
    assert (r, c) == ("", long + "more") and deltas[1] == ("", "more")      # streamed once known


def test_tool_calls_after_thinking_and_inside_it():
    """Content goes on to the tool parser: a call after the reasoning is a call; one written inside
    the reasoning stays reasoning (vLLM and llama.cpp parse calls out of the content only)."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for text, calls, reasoning in ((f"<think>\nI need the time.\n</think>\n\n{call}", 1, "I need the time."),
                                   (f"<think>\nmaybe {call}\n</think>\n\nNo call.", 0, f"maybe {call}")):
        for pieces in ([text], list(text)):
            parser, tools, out = ReasoningParser("<think>", "</think>"), ToolParser(HERMES, ["get_time"]), []
            r_all = ""
            for piece in pieces + [None]:
                r, c = parser.feed(piece) if piece is not None else parser.finish()
                r_all += r
                out += tools.feed(c) if piece is not None else tools.feed(c) + tools.finish()
            assert r_all == reasoning and len(tools.tool_calls()) == calls
            if calls:
                assert tools.tool_calls()[0]["function"]["arguments"] == '{"city": "Oslo"}'


# ---------------------------------------------------------------- through the API, per family
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
        results[speculate] = (c.model_extra["token_ids"], reasoning_of(c.message), c.message.content)
    assert results[True] == results[False]
    ids, reasoning, content = results[True]
    assert c.finish_reason == "stop", c
    words = reasoning.split()
    assert 2 <= len(words) <= 4 and all(w.isalpha() for w in words), reasoning
    assert content and all(w.isalpha() for w in content.split()), content       # no marker text left
    kept = dict(detect(state.tokenizer).kept)
    assert kept and set(kept) & set(ids)            # the markers were tokens of their own
    body["extra_body"].pop("return_token_ids")
    r, text, chunks = streamed(client, **body)
    assert (r, text) == (reasoning, content)
    first = [i for i, ch in enumerate(chunks) if ch.choices and (ch.choices[0].delta.model_extra or {}).get(
        "reasoning_content")]
    later = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.content]
    assert first and later and max(first) < min(later)          # the reasoning streams before the answer
    assert chunks[-1].choices[0].finish_reason == "stop"


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
    if name in ("qwen3", "qwen3.5"):        # the template closed the block: no reasoning parser at all
        assert "reasoning_content" not in off.choices[0].message.model_extra
        assert off.usage.prompt_tokens != on.usage.prompt_tokens
    else:                                   # the model may still open a block: parsed, none came
        assert reasoning_of(off.choices[0].message) is None
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
    if name not in ("qwen3", "qwen3.5"):
        pytest.skip("the Hermes tool format of Qwen's templates")
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 8}}}}}]
    opened = ("<think>", "\n") if name == "qwen3" else ()
    g = grammar(state, *opened, "/[a-z]{2,6}( [a-z]{2,6}){1,2}/", "\n", "</think>", "\n\n", "<tool_call>",
                '\n{"name": "get_time", "arguments": {"city": "', "/[a-z]{1,6}/", '"}}\n', "</tool_call>")
    body = dict(model="m", messages=ASK, tools=tools, max_tokens=60, temperature=0, extra_body={"guided_grammar": g})
    c = client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_time", c
    assert reasoning_of(c.message) and not c.message.content
    r, text, chunks = streamed(client, **body)
    calls = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert r == reasoning_of(c.message) and text == "" and calls[0].function.name == "get_time"
    assert "".join(d.function.arguments or "" for d in calls) == c.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_family_is_read_from_template_and_vocabulary(family):
    name, _, state, _ = family
    fmt = detect(state.tokenizer)
    assert fmt.name == {"qwen3": "think", "qwen3.5": "think", "gemma4": "gemma4", "gpt-oss": "harmony"}[name]
    assert all(state.tokenizer.encode(text, add_special=False) == [token] for token, text in fmt.kept)


def test_chat_template_kwargs_are_checked(family):
    _, _, state, url = family
    for value, says in ((["enable_thinking"], "must be an object"), ({"messages": []}, "cannot set messages")):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": ASK,
                                                            "chat_template_kwargs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert says in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "chat_template_kwargs": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_models_without_thinking_markup_get_no_parser(tiny_models):
    from specdecode.tokenizer import Tokenizer
    tok = Tokenizer(tiny_models["llama"])
    assert detect(tok) is None

    class State:
        tokenizer, reasoning_format = tok, "auto"

    class Parsed:
        chat, prompt_ids = True, tok.encode("hi")
    assert reasoning_parser(State, Parsed) is None
