"""Thinking models through Anthropic's Messages API: the reasoning parser's output (serve/reasoning.py)
as `thinking` blocks with a signature, before the answer's `text` block, streamed in the API's order
(thinking_delta, signature_delta, then text), on tiny random models carrying each family's markers and
template (tests/conftest.py THINKING_FAMILIES). A grammar makes the random model write the markers as
tokens, which then take the server's real path, as in test_reasoning.py."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import THINKING_FAMILIES, make_thinking_model, thinking_grammar

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
ASK = [{"role": "user", "content": "what is the weather in paris?"}]
WORDS, ANSWER = "/[a-z]{2,4}( [a-z]{2,4}){1,3}/", "/[a-z]{2,4}( [a-z]{2,4}){0,2}/"


@pytest.fixture(scope="module", params=list(THINKING_FAMILIES))
def thinker(request, tmp_path_factory):
    name = request.param
    folder = make_thinking_model(tmp_path_factory.mktemp("messages_thinking") / name, name)
    llm = LLM(model=str(folder), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=1024, served_model_name="m"))
    with BackgroundServer(create_app(state)) as srv:
        yield name, anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120), state, srv.url


def thinking_then_answer(name: str, state) -> str:
    """The family's markup of a short reasoning, then a short answer (a guided_grammar)."""
    def grammar(*parts: str) -> str:
        return thinking_grammar(state.tokenizer, state.ctx.vocab_size, state.ctx.eos_token_ids, *parts)
    if name == "qwen3":
        return grammar("<think>", "\n", WORDS, "\n", "</think>", "\n\n", ANSWER)
    if name == "qwen3.5":                          # the prompt opened <think>
        return grammar(WORDS, "\n", "</think>", "\n\n", ANSWER)
    if name == "gemma4":
        return grammar("<|channel>", "thought\n", WORDS, "<channel|>", ANSWER)
    return grammar("<|channel|>", "analysis", "<|message|>", WORDS, "<|end|>", "<|start|>", "assistant",
                   "<|channel|>", "final", "<|message|>", ANSWER)


def test_thinking_blocks_before_the_answer_streamed_and_not(thinker):
    name, client, state, url = thinker
    body = dict(model="m", max_tokens=100, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    extra = {"temperature": 0, "guided_grammar": thinking_then_answer(name, state)}
    on = client.messages.create(**body, extra_body=dict(extra, speculate=True))
    off = client.messages.create(**body, extra_body=dict(extra, speculate=False))
    assert [b.model_dump() for b in on.content] == [b.model_dump() for b in off.content]     # lossless
    assert [b.type for b in on.content] == ["thinking", "text"] and on.stop_reason == "end_turn"
    thought, answer = on.content
    assert 2 <= len(thought.thinking.split()) <= 4 and all(w.isalpha() for w in thought.thinking.split())
    assert thought.signature and answer.text and all(w.isalpha() for w in answer.text.split())
    with client.messages.stream(**body, extra_body=extra) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in on.content]
    raw = httpx.post(url + "/v1/messages", json=dict(body, stream=True, **extra), timeout=120).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    kinds = [(e["type"], (e.get("delta") or e.get("content_block") or {}).get("type")) for e in events]
    thinking = [k for k in kinds if k == ("content_block_delta", "thinking_delta")]
    text = [k for k in kinds if k == ("content_block_delta", "text_delta")]
    assert kinds == [("message_start", None), ("content_block_start", "thinking"), ("ping", None), *thinking,
                     ("content_block_delta", "signature_delta"), ("content_block_stop", None),
                     ("content_block_start", "text"), *text, ("content_block_stop", None),
                     ("message_delta", None), ("message_stop", None)] and thinking and text
    # the answer sent back as the next turn's history, thinking block and all
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in on.content]},
                   {"role": "user", "content": "and tomorrow?"}]
    assert client.messages.count_tokens(model="m", messages=turns).input_tokens > \
        client.messages.count_tokens(model="m", messages=ASK).input_tokens


def test_thinking_disabled_gives_text_alone(thinker):
    name, client, state, _ = thinker
    plain = thinking_grammar(state.tokenizer, state.ctx.vocab_size, state.ctx.eos_token_ids, ANSWER)
    message = client.messages.create(model="m", max_tokens=20, messages=ASK, thinking={"type": "disabled"},
                                     extra_body={"temperature": 0, "guided_grammar": plain})
    assert [b.type for b in message.content] == ["text"] and message.content[0].text.split()


def test_budget_tokens_ends_the_thinking(thinker):
    """thinking.budget_tokens: after that many tokens of reasoning the end marker is the only token
    allowed (vLLM's thinking_token_budget), then the answer follows. Where the prompt opens the
    reasoning (Qwen3.5) the random model would otherwise think until max_tokens."""
    from specdecode.params import SamplingParams
    from specdecode.serve.generation import with_budget
    from specdecode.serve.reasoning import HarmonyParser, thinking_format
    from specdecode.structured import grammar_tokenizer_for
    name, client, state, _ = thinker
    body = dict(model="m", max_tokens=40, messages=ASK, extra_body={"temperature": 0})
    unbounded = client.messages.create(**body, thinking={"type": "adaptive"})
    bounded = client.messages.create(**body, thinking={"type": "enabled", "budget_tokens": 4})
    thought = "".join(b.thinking for b in bounded.content if b.type == "thinking")
    assert len(state.tokenizer.encode(thought, add_special=False)) <= 4 + 1, bounded    # (its edges trimmed)
    if name == "qwen3.5":
        assert "text" not in [b.type for b in unbounded.content] and unbounded.stop_reason == "max_tokens"
        assert [b.type for b in bounded.content][-1] == "text", bounded
    # the constraint itself: inside the reasoning, after 4 tokens only the end marker may come
    parser = thinking_format(state.tokenizer).parser()
    parser.prime("<think>\n" if name != "gemma4" else "<|channel>thought\n")
    params = with_budget(parser, 4, SamplingParams())
    if isinstance(parser, HarmonyParser):
        assert params.structured is None                          # (gpt-oss: not bounded)
        return
    close = state.tokenizer.token_id(parser.close)
    constraint = grammar_tokenizer_for(state.tokenizer, state.ctx.vocab_size,
                                       state.ctx.eos_token_ids).constraint(params.structured)
    word = state.tokenizer.encode("the", add_special=False)[0]
    for _ in range(4):
        assert bool(constraint.allowed()[word])
        constraint.consume([word])
    allowed = constraint.allowed()
    assert bool(allowed[close]) and int(allowed.sum()) == 1
    constraint.consume([close])
    opener = state.tokenizer.token_id(parser.open) or state.tokenizer.token_id("<|channel>")
    assert not constraint.allowed()[opener] and constraint.allowed()[word]      # no second, unbounded block
    assert with_budget(parser, None, SamplingParams()).structured is None
