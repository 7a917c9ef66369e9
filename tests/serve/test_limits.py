"""No runaway requests: a request without max_tokens gets the server's default (at most the rest
of the context), and a client that goes away stops its request within about one engine step,
streamed or not."""
from __future__ import annotations

import socket
import time

import pytest

from specdecode import LLM
from specdecode.engine.config import EngineConfig
from specdecode.params import ParamError
from specdecode.serve.app import create_app
from specdecode.serve.protocol import ApiError, ServeContext, parse
from specdecode.serve.server import BackgroundServer, build_state
from specdecode.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_max_tokens_default_capped_by_the_context(tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    ctx = ServeContext(tok, tok.vocab_size, 128, ("tiny",), False, max_tokens_default=32)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    prompt = len(parse(chat, ctx, chat=True).prompt_ids)
    assert parse(chat, ctx, chat=True).params.max_tokens == 32
    assert parse(dict(chat, max_tokens=100), ctx, chat=True).params.max_tokens == 100     # its own, up to the context
    long = {"messages": [{"role": "user", "content": "the quick brown fox " * 20}]}
    room = 128 - len(parse(dict(long, max_tokens=1), ctx, chat=True).prompt_ids)
    assert 0 < room < 32 and parse(long, ctx, chat=True).params.max_tokens == room
    assert parse({"prompt": "hi"}, ctx, chat=False).params.max_tokens == 16              # completions: OpenAI's 16
    with pytest.raises(ApiError) as err:
        parse(dict(chat, max_tokens=128), ctx, chat=True)
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"
    assert f"prompt ({prompt} tokens) + max_tokens (128)" in err.value.message
    with pytest.raises(ParamError, match=r"max_tokens_default must be an integer in \[1, "):
        EngineConfig(max_tokens_default=0)


def test_max_tokens_default_option():
    from specdecode.cli import build_parser
    parse_args = lambda *a: build_parser().parse_args(["serve", *a])      # noqa: E731
    assert parse_args().max_tokens_default == 2048 and parse_args("--max-tokens-default", "64").max_tokens_default == 64
    with pytest.raises(SystemExit):
        parse_args("--max-tokens-default", "0")


@pytest.fixture(scope="module")
def slow_server(tiny_models):
    """Steps slowed to ~50 ms, so how many run after a client leaves can be counted."""
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    state = build_state(llm, EngineConfig(max_batch_size=2, max_model_len=256, block_size=8, served_model_name="tiny"))
    engine = state.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.05)
        return step(*args, **kwargs)
    engine.step = slow_step
    with BackgroundServer(create_app(state)) as srv:
        yield srv, state


def _post_and_leave(url: str, body: bytes, state, after_steps: int, path: str = "/v1/completions") -> int:
    """POST `body` on a raw connection, close it once the engine ran `after_steps` steps for it;
    returns the engine's step count at the close."""
    totals = state.engine.metrics.totals
    host, port = url.removeprefix("http://").split(":")
    start = totals["steps"]
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while totals["steps"] < start + after_steps:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        closed_at = totals["steps"]
    return closed_at


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
def test_a_client_that_leaves_stops_its_request_within_a_step(slow_server, stream, path):
    srv, state = slow_server
    stats = state.engine.metrics.stats
    aborted = stats()["requests"]["aborted"]
    prompt, limit = ("prompt", "max_tokens") if path == "/v1/completions" else ("input", "max_output_tokens")
    body = (f'{{"{prompt}": "the quick brown fox", "{limit}": 200, "ignore_eos": true, "temperature": 0, '
            f'"stream": {"true" if stream else "false"}}}').encode()
    closed_at = _post_and_leave(srv.url, body, state, after_steps=5, path=path)
    deadline = time.monotonic() + 10
    while stats()["requests"]["aborted"] == aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.005)
    steps_after = state.engine.metrics.totals["steps"] - closed_at
    # the step running when the client left, and at most one more before the abort is applied
    assert steps_after <= 2, steps_after
    assert stats()["requests"]["finished"] == 0
    assert state.engine.runner.cache.used_blocks == 0
