"""The ASGI app (Starlette): OpenAI-compatible endpoints, health, metrics, stats, dashboard.

Handlers parse and validate a request (`protocol.parse`), submit it to the scheduler and
turn the scheduler's events into an OpenAI response or server-sent events. A stream whose
client goes away aborts its request (the scheduler frees its blocks between two steps).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..params import SamplingParams
from .auth import DEFAULT_MAX_BODY_BYTES, Guard
from .tools import extract_calls
from .protocol import ApiError, ParsedRequest, error_body, parse, stream_error
from .scheduler import Failed, Finished, QueueFull, Request, Tokens

log = logging.getLogger("specdecode.serve")
STATIC = Path(__file__).parent / "static"


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


DISCONNECT_CHECK = 0.5    # seconds between checks that a non-streamed request's client is still connected


class TextStream:
    """Incremental detokenization: text deltas that never split a UTF-8 character and never
    show text that may still turn out to be part of a stop string."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0
        self.stops = tuple(s for s in params.stop if s)
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.token_text_len = 0

    def add(self, ids: list[int], with_token_texts: bool) -> tuple[str, list[str]]:
        texts = []
        for token in ids:
            self.ids.append(token)
            if with_token_texts:
                text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
                texts.append(text[self.token_text_len:])
                self.token_text_len = max(self.token_text_len, len(text))
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        # a stop string's prefix at the end is held back, so none can start before self.sent;
        # a whole one (completed by these tokens) cuts the text where it starts
        cut = len(text) - self.hold
        for stop in self.stops:
            found = text.find(stop, self.sent)
            if found >= 0:
                cut = min(cut, found)
        text = text[:max(self.sent, cut)]
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta, texts

    def finish(self, stop_text_index: int | None) -> str:
        text = self.tokenizer.decode(self.ids)
        if stop_text_index is not None:
            text = text[:stop_text_index]
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta

    def full_text(self, stop_text_index: int | None) -> str:
        text = self.tokenizer.decode(self.ids)
        return text[:stop_text_index] if stop_text_index is not None else text


class Generation:
    """One request's trip through the scheduler, as seen by the handler."""

    def __init__(self, state, parsed: ParsedRequest, index: int = 0) -> None:
        """Choice `index` of the request (n > 1: choice i is seeded seed + i when a seed is given)."""
        self.state, self.parsed, self.index = state, parsed, index
        params = parsed.params
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % 2**63)
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event) -> None:
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            except RuntimeError:       # the event loop is gone (shutdown)
                pass
        self.request = Request(parsed.prompt_ids, params, sink, parsed.speculate, parsed.num_speculative_tokens)
        self.text = TextStream(state.tokenizer, params)
        self.done = False
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def logprobs(self, lps: list | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat `{"content": [...]}`, completions the
        legacy `tokens / token_logprobs / top_logprobs / text_offset` (offsets from `offset`)."""
        if lps is None or self.parsed.params.logprobs is None:
            return None
        decode = self.state.tokenizer.decode
        if self.parsed.chat:
            def entry(token: int, value: float) -> dict:
                text = decode([token])
                return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
            return {"content": [dict(entry(t, v), top_logprobs=[entry(a, w) for a, w in top])
                                for t, v, top in lps]}
        texts = [decode([t]) for t, _, _ in lps]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": [v for _, v, _ in lps],
                "top_logprobs": [{decode([a]): w for a, w in top} for _, _, top in lps], "text_offset": offsets}

    def choice(self, text: str, kinds: list[str], ids: list[int], texts: list[str], finish: str | None,
               lps: list | None = None, offset: int = 0) -> dict:
        p = self.parsed
        out: dict = {"index": self.index}
        if p.chat:
            out["message" if not p.stream else "delta"] = (
                {"role": "assistant", "content": text} if not p.stream else ({"content": text} if text else {}))
        else:
            out["text"] = text
        out["logprobs"] = self.logprobs(lps, offset)
        out["finish_reason"] = finish
        if p.return_token_kinds:
            out["token_kinds"] = [{"text": t, "kind": k} for t, k in zip(texts, kinds)]
        if p.return_token_ids:
            out["token_ids"] = ids
        return out

    def envelope(self, choices: list[dict], **extra) -> dict:
        p = self.parsed
        kind = ("chat.completion.chunk" if p.stream else "chat.completion") if p.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": p.model, "choices": choices,
                **extra}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def merged_usage(usages: list[dict]) -> dict:
    """One prompt, several choices: prompt tokens counted once, completion tokens summed."""
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    return dict(usages[0], prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def stream_events(gens: list[Generation]):
    """Server-sent events of one request's choices, interleaved as their tokens come; cancelled
    (client gone) -> every unfinished choice is aborted."""
    p = gens[0].parsed
    pending = {asyncio.ensure_future(g.queue.get()): g for g in gens}
    usages: list[dict] = []
    try:
        if p.chat:
            for g in gens:
                yield sse(g.envelope([{"index": g.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                gen = pending.pop(task)
                event = task.result()
                if isinstance(event, Tokens):
                    sent = gen.text.sent
                    delta, texts = gen.text.add(event.ids, p.return_token_kinds)
                    if p.tools is not None:          # tool calls are parsed from the whole answer
                        pass
                    elif delta or p.return_token_kinds or p.return_token_ids or event.logprobs:
                        yield sse(gen.envelope([gen.choice(delta, event.kinds, event.ids, texts, None,
                                                           event.logprobs, sent)]))
                    pending[asyncio.ensure_future(gen.queue.get())] = gen
                elif isinstance(event, Finished):
                    gen.done = True
                    usages.append(event.usage)
                    delta = gen.text.finish(event.stop_text_index)
                    reason = event.reason
                    if p.tools is not None:
                        content, calls = extract_calls(gen.text.full_text(event.stop_text_index))
                        if content:
                            yield sse(gen.envelope([{"index": gen.index, "delta": {"content": content},
                                                     "logprobs": None, "finish_reason": None}]))
                        if calls:
                            reason = "tool_calls"
                            yield sse(gen.envelope([{"index": gen.index, "delta": {"tool_calls": [
                                dict(c, index=i) for i, c in enumerate(calls)]}, "logprobs": None,
                                "finish_reason": None}]))
                        delta = ""
                    yield sse(gen.envelope([gen.choice(delta, [], [], [], reason)],
                                           speculation=event.speculation))
                else:
                    gen.done = True
                    yield sse(stream_error(event.status, event.message))
                    for other in pending:
                        other.cancel()
                    pending.clear()
                    yield "data: [DONE]\n\n"
                    return
        if p.include_usage:
            yield sse(gens[0].envelope([], usage=merged_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        for task in pending:
            task.cancel()
        for g in gens:
            if not g.done:
                g.state.scheduler.abort(g.request.id)


async def collect_one(gen: Generation, http: HttpRequest):
    """(choice, usage, speculation) of one choice, or an error Response."""
    ids: list[int] = []
    kinds: list[str] = []
    texts: list[str] = []
    lps: list = []
    check_at = time.monotonic() + DISCONNECT_CHECK
    while True:
        try:                             # whether the client is still there, every DISCONNECT_CHECK s
            event = await asyncio.wait_for(gen.queue.get(), timeout=max(check_at - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            event = None
        if time.monotonic() >= check_at:
            check_at = time.monotonic() + DISCONNECT_CHECK
            if await http.is_disconnected():
                gen.state.scheduler.abort(gen.request.id)
                return Response(status_code=499)
        if event is None:
            continue
        if isinstance(event, Tokens):
            ids += event.ids
            kinds += event.kinds
            lps += event.logprobs or []
            texts += gen.text.add(event.ids, gen.parsed.return_token_kinds)[1]
        elif isinstance(event, Finished):
            gen.done = True
            text = gen.text.full_text(event.stop_text_index)
            choice = gen.choice(text, kinds, ids, texts, event.reason, lps if lps else None)
            if gen.parsed.tools is not None:
                content, calls = extract_calls(text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice["finish_reason"] = "tool_calls"
            return choice, event.usage, event.speculation
        else:
            gen.done = True
            return error(event.status, event.message)


async def collect(gens: list[Generation], http: HttpRequest) -> Response:
    results = []
    for gen in gens:                     # they run concurrently in the scheduler; collected in order
        result = await collect_one(gen, http)
        if isinstance(result, Response):
            for other in gens:
                if not other.done:
                    other.state.scheduler.abort(other.request.id)
            return result
        results.append(result)
    speculation = results[0][2] if len(results) == 1 else [r[2] for r in results]
    return JSONResponse(gens[0].envelope([r[0] for r in results], usage=merged_usage([r[1] for r in results]),
                                         speculation=speculation))


async def generate(http: HttpRequest, chat: bool) -> Response:
    state = http.app.state.serve
    try:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}") from None
        parsed = parse(body, state.ctx, chat)
        needed = len(parsed.prompt_ids) + parsed.params.max_tokens
        if not state.scheduler.engine.fits(needed):
            cache = state.scheduler.engine.cache
            raise ApiError(400, f"prompt ({len(parsed.prompt_ids)} tokens) + max_tokens ({parsed.params.max_tokens}) "
                                f"needs {cache.blocks_for(needed)} KV blocks of {cache.block_size} tokens, more than "
                                f"the {cache.usable_blocks} the server has (--num-blocks)", param="max_tokens",
                           code="context_length_exceeded")
        if parsed.n > state.scheduler.config.max_queue:
            raise ApiError(400, f"n ({parsed.n}) is more than this server queues at once "
                                f"({state.scheduler.config.max_queue}, --max-queue)", param="n")
        gens = [Generation(state, parsed, i) for i in range(parsed.n)]
        for g in gens[1:]:
            g.id, g.created = gens[0].id, gens[0].created
        for i, g in enumerate(gens):
            try:
                state.scheduler.submit(g.request)
            except QueueFull as exc:
                for submitted in gens[:i]:
                    state.scheduler.abort(submitted.request.id)
                raise ApiError(429, str(exc), code="queue_full") from None
        if parsed.stream:
            return StreamingResponse(stream_events(gens), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(gens, http)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except Exception as exc:  # noqa: BLE001 -- never a traceback to the client
        log.exception("request failed")
        return error(500, f"internal server error ({type(exc).__name__})")


async def completions(http: HttpRequest) -> Response:
    return await generate(http, chat=False)


async def chat_completions(http: HttpRequest) -> Response:
    return await generate(http, chat=True)


async def models(http: HttpRequest) -> Response:
    state = http.app.state.serve
    return JSONResponse({"object": "list", "data": [
        {"id": state.ctx.model_names[0], "object": "model", "created": state.created, "owned_by": "specdecode",
         "max_model_len": state.ctx.max_model_len}]})


async def health(http: HttpRequest) -> Response:
    """200 only when a one-token generation through the engine finishes within the timeout."""
    state = http.app.state.serve
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    request = Request([state.health_token], SamplingParams(max_tokens=1, ignore_eos=True),
                      lambda e: loop.call_soon_threadsafe(queue.put_nowait, e), speculate=False, internal=True)
    state.scheduler.submit(request)
    timeout = state.scheduler.config.health_timeout
    deadline = time.monotonic() + timeout
    try:
        while True:
            event = await asyncio.wait_for(queue.get(), timeout=max(deadline - time.monotonic(), 0.001))
            if isinstance(event, Finished):
                return JSONResponse({"status": "ok"})
            if isinstance(event, Failed):
                return error(503, f"unhealthy: a one-token generation failed ({event.message})")
    except asyncio.TimeoutError:
        state.scheduler.abort(request.id)
        return error(503, f"unhealthy: a one-token generation did not finish within {timeout:g} s")


async def metrics(http: HttpRequest) -> Response:
    return Response(http.app.state.serve.scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def stats(http: HttpRequest) -> Response:
    return JSONResponse(http.app.state.serve.scheduler.metrics.stats())


async def index(http: HttpRequest) -> Response:
    page = STATIC / "index.html"
    if page.is_file():
        return FileResponse(page)
    return error(404, "no dashboard installed (specdecode/serve/static/index.html is missing)")


async def http_error(http: HttpRequest, exc: HTTPException) -> Response:
    return error(exc.status_code, f"{exc.detail}: {http.method} {http.url.path}")


async def internal_error(http: HttpRequest, exc: Exception) -> Response:
    log.error("unhandled %s on %s", type(exc).__name__, http.url.path)
    return error(500, f"internal server error ({type(exc).__name__})")


def create_app(state, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """`state`: a `server.ServeState` (scheduler, tokenizer, parsing context); api_key: required as
    `Authorization: Bearer KEY` on every endpoint but /health and the dashboard's files (auth.py);
    max_body_bytes: larger request bodies get 413."""

    @asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/api/stats", stats, methods=["GET"]),
        Route("/", index, methods=["GET"]),
    ]
    if STATIC.is_dir():
        routes.append(Mount("/static", app=StaticFiles(directory=STATIC), name="static"))
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)],
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.serve = state
    return app
