"""A thinking model's reasoning apart from its answer (serve/reasoning.py): the parser per family on
marker text cut at every point, tool calls after and inside the reasoning, the count of reasoning
tokens, the family's detection and the option. Through the API: test_reasoning_api.py."""
from __future__ import annotations

import pytest

from specdecode.serve.reasoning import HarmonyParser, ReasoningParser, detect, reasoning_parser, reasoning_tokens
from specdecode.serve.tools import HERMES, ToolParser

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


def test_reasoning_tokens_count_the_markers_with_the_reasoning():
    think = ["<think>", "\n", "a", " b", "</", "think", ">", "\n\n", "ok", " <", "x"]
    gemma = ["<|channel>", "thought", "\n", "x", "<channel|>", "y"]
    harmony = ["<|channel|>", "analysis", "<|message|>", "x", "<|end|>", "<|start|>", "assistant", "<|channel|>",
               "final", "<|message|>", "y"]
    for make, prompt, texts, count in ((CASES["qwen3"][0], QWEN_PROMPT, think, 7),
                                       (CASES["qwen3.5"][0], QWEN_PROMPT + "<think>\n", think[1:], 6),
                                       (CASES["gemma4"][0], "", gemma, 5),
                                       (HarmonyParser, "<|start|>assistant", harmony, 5)):
        parser = make()
        parser.prime(prompt)
        assert reasoning_tokens(parser, texts) == count, texts


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


def test_harmony_calls_reach_the_tool_parser_in_its_format():
    """gpt-oss writes a call as a commentary message to functions.NAME (its arguments the message,
    `<|call|>` ends the answer): the tool parser gets it in the request's call format."""
    answer = ("<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_time <|constrain|>json<|message|>{"city": "Oslo"}')
    for pieces in ([answer], list(answer)):
        parser, tools = HarmonyParser(calls=HERMES), ToolParser(HERMES, ["get_time"])
        parser.prime("<|start|>assistant")
        reasoning = content = ""
        for piece in pieces + [None]:
            r, c = parser.feed(piece) if piece is not None else parser.finish()
            reasoning += r
            content += "".join(d[1] for d in tools.feed(c) + (tools.finish() if piece is None else [])
                               if d[0] == "content")
        assert reasoning == "Need the time." and content == ""
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in tools.tool_calls()] == \
            [("get_time", '{"city": "Oslo"}')]
    no_tools = HarmonyParser()                      # a request without tools: the message is content
    no_tools.prime("<|start|>assistant")
    assert no_tools.feed(answer)[1] + no_tools.finish()[1] == '{"city": "Oslo"}'


def test_harmony_recipient_before_the_channel():
    parser = HarmonyParser(calls=HERMES)
    parser.prime("<|start|>assistant")
    r, c = parser.feed("<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary"
                       "<|message|>{}")
    assert r == "x" and c + parser.finish()[1] == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_models_without_thinking_markup_get_no_parser(tiny_models):
    from specdecode.tokenizer import Tokenizer
    tok = Tokenizer(tiny_models["llama"])
    assert detect(tok) is None

    class State:
        tokenizer, reasoning_format = tok, "auto"

    class Parsed:
        chat, prompt_ids = True, tok.encode("hi")
    assert reasoning_parser(State, Parsed) is None


def test_the_reasoning_format_option_reaches_one_server_and_the_replicas():
    from specdecode.cli import build_parser
    from specdecode.serve.ray_cli import ray_spec
    parse = lambda *a: build_parser().parse_args(["serve", *a])      # noqa: E731
    assert parse().reasoning_format == "auto" and parse("--reasoning-format", "none").reasoning_format == "none"
    assert ray_spec(parse("--replicas", "2", "--reasoning-format", "none"))["reasoning_format"] == "none"
    with pytest.raises(SystemExit):
        parse("--reasoning-format", "deepseek")
