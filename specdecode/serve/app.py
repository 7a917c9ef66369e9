"""The ASGI app (Starlette): OpenAI-compatible endpoints, health, metrics, stats, dashboard.

Handlers parse and validate a request (`protocol.parse`), submit it to the engine core and
turn the engine's events into an OpenAI response or server-sent events. A stream whose
client goes away aborts its request (the engine frees its blocks between two steps).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..engine.sequence import Failed, Finished, QueueFull, Request, ShuttingDown, Tokens
from ..params import SamplingParams
from .anthropic import anthropic_error
from .anthropic import count_tokens as anthropic_count_tokens
from .anthropic import messages as anthropic_messages
from .auth import ANTHROPIC_PREFIX, DEFAULT_MAX_BODY_BYTES, Guard
from .errors import read_json
from .events import Mailbox, drain, merge_tokens
from .generation import Generation, client_gone, error, merged_usage, sse
from .prompts import echo_logprobs, infill_answer, infill_body, vllm_prompt_logprobs
from .protocol import ApiError, parse, stream_error
from .tokenize import detokenize, tokenize, tokenizer_info

log = logging.getLogger("specdecode.serve")
STATIC = Path(__file__).parent / "static"
POSTED = ("/v1/completions", "/v1/chat/completions", "/infill", "/tokenize", "/detokenize")   # the rest: GET
POSTED += ("/v1/responses", "/v1/responses/{response_id}/cancel")
METHODS = {"/v1/responses/{response_id}": ["GET", "DELETE"]}     # the paths that take more than one method
POSTED += ("/v1/messages", "/v1/messages/count_tokens")          # Anthropic's Messages API (anthropic.py)


async def stream_events(gens: list[Generation], queue: asyncio.Queue):
    """Server-sent events of one request's choices, interleaved as their tokens come; cancelled
    (client gone) -> every unfinished choice is aborted. The events of one wake-up (one or more
    engine steps: a choice's text, its end, the usage, [DONE]) go out in one write: each write is a
    socket send and a wake-up of the client, dearer than the chunk it carries."""
    p = gens[0].parsed
    usages: list[tuple[Generation, dict]] = []
    try:
        if p.chat:
            yield "".join(sse(g.envelope([{"index": g.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}])) for g in gens)
        elif p.echo:                                   # the prompt's text first (its logprobs: not streamed)
            yield "".join(sse(g.envelope([g.choice(g.state.tokenizer.decode(g.parsed.prompt_ids), [], [], [], None)]))
                          for g in gens)
        live = len(gens)
        per_step = p.return_token_kinds or p.return_token_ids       # then a chunk is a step
        while live:
            items = drain(await queue.get(), queue)
            out: list[str] = []
            for gen, event in (items if per_step else merge_tokens(items)):
                if isinstance(event, Tokens) and p.echo_only:
                    continue                           # the token run to read the prompt is not sent
                if isinstance(event, Tokens):
                    out += token_events(gen, event)
                elif isinstance(event, Finished):
                    gen.done = True
                    live -= 1
                    usages.append((gen, event.usage))
                    out += finish_events(gen, event)
                else:
                    gen.done = True
                    yield "".join(out) + sse(stream_error(event.status, event.message)) + "data: [DONE]\n\n"
                    return
            if not live:
                if p.include_usage:
                    out.append(sse(gens[0].envelope([], usage=merged_usage(usages))))
                out.append("data: [DONE]\n\n")
            if out:
                yield "".join(out)
    finally:
        for g in gens:
            if not g.done:
                g.state.engine.abort(g.request.id)


def token_events(gen: Generation, event: Tokens) -> list[str]:
    """The SSE events of a choice's new tokens: its text delta (a template's chunk), or, with
    reasoning, tool calls, token kinds / ids or logprobs, the chunks that carry them."""
    p = gen.parsed
    delta, texts = gen.text.add(event.ids, p.return_token_kinds or event.logprobs is not None)
    lps, at = gen.release_logprobs(event.logprobs, texts)
    if gen.tools is not None or gen.reasoning is not None:   # reasoning, content, tool calls
        extra = p.return_token_kinds or p.return_token_ids or lps
        first = gen.choice("", event.kinds, event.ids, texts, None, lps, at) if extra else None
        return [sse(chunk) for chunk in gen.delta_chunks(gen.answer_deltas(delta), first)]
    if p.return_token_kinds or p.return_token_ids or lps:
        return [sse(gen.envelope([gen.choice(delta, event.kinds, event.ids, texts, None, lps, at)]))]
    return [gen.text_chunk(delta)] if delta else []


def finish_events(gen: Generation, event: Finished) -> list[str]:
    """The SSE events of a choice's end: the text held back (a possible stop string's start), the
    finish reason and the speculation summary."""
    p = gen.parsed
    out = []
    delta = "" if p.echo_only else gen.text.finish(event.stop_text_index)
    lps, at = gen.release_logprobs(None, [], final=True, end=event.stop_text_index)
    reason = "length" if p.echo_only else event.reason
    if gen.tools is not None or gen.reasoning is not None:
        out += [sse(chunk) for chunk in gen.delta_chunks(gen.answer_deltas(delta, final=True))]
        if gen.tools is not None and gen.tools.calls and reason == "stop" and gen.tools.calls_complete():
            reason = "tool_calls"            # (a stop string inside a call: "stop")
        delta = ""
    out.append(sse(gen.envelope([gen.choice(delta, [], [], [], reason, lps, at)], speculation=event.speculation)))
    return out


def echoed(gen: Generation, choice: dict, seq) -> None:
    """`echo`: the prompt's text (and log-probabilities) before the answer's (the answer left out
    when max_tokens was 0); vLLM's `prompt_logprobs` field beside them."""
    decode, parsed = gen.state.tokenizer.decode, gen.parsed
    if parsed.echo:
        prompt_text = decode(parsed.prompt_ids)
        answer = "" if parsed.echo_only else choice["text"]
        if parsed.params.logprobs is not None:
            choice["logprobs"] = echo_logprobs(decode, parsed.prompt_ids, seq.prompt_logprobs,
                                               None if parsed.echo_only else choice["logprobs"], len(prompt_text))
        choice["text"] = prompt_text + answer
        if parsed.echo_only:
            choice["finish_reason"] = "length"
    if parsed.prompt_logprobs:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(decode, seq.prompt_logprobs)


async def collect(gens: list[Generation], queue: asyncio.Queue, http: HttpRequest) -> Response:
    """The whole answer of a non-streamed request; a client that disconnects aborts it at once."""
    watcher = asyncio.ensure_future(client_gone(http))
    watcher.add_done_callback(lambda task: task.cancelled() or queue.put_nowait((None, None)))
    parts = {g: ([], [], [], []) for g in gens}           # ids, kinds, token texts, logprobs
    results: dict = {}
    try:
        while len(results) < len(gens):
            gen, event = await queue.get()
            if gen is None:                                # the client went away
                return Response(status_code=499)
            ids, kinds, texts, lps = parts[gen]
            if isinstance(event, Tokens):
                ids += event.ids
                kinds += event.kinds
                new = gen.text.add(event.ids, gen.parsed.return_token_kinds or event.logprobs is not None)[1]
                texts += new
                lps += gen.release_logprobs(event.logprobs, new)[0] or []
            elif isinstance(event, Finished):
                gen.done = True
                reasoning, text = gen.split(gen.text.full_text(event.stop_text_index))
                lps += gen.release_logprobs(None, [], final=True, end=event.stop_text_index)[0] or []
                choice = gen.choice(text, kinds, ids, texts, event.reason, lps if lps else None)
                if gen.tools is not None:
                    content, calls = gen.tools.result(text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content, "refusal": None,
                                             "tool_calls": calls}
                        if event.reason == "stop" and gen.tools.calls_complete():
                            choice["finish_reason"] = "tool_calls"
                if gen.reasoning is not None:
                    choice["message"]["reasoning_content"] = reasoning or None
                if gen.parsed.echo or gen.parsed.prompt_logprobs:
                    echoed(gen, choice, event.sequence)
                results[gen] = (choice, event.usage, event.speculation)
            else:
                gen.done = True
                return error(event.status, event.message)
    finally:
        watcher.cancel()
        for g in gens:
            if not g.done:
                g.state.engine.abort(g.request.id)
    ordered = [results[g] for g in gens]
    speculation = ordered[0][2] if len(ordered) == 1 else [r[2] for r in ordered]
    return JSONResponse(gens[0].envelope([r[0] for r in ordered],
                                         usage=merged_usage([(g, r[1]) for g, r in zip(gens, ordered)]),
                                         speculation=speculation))


async def generate(http: HttpRequest, chat: bool, body=None) -> Response:
    """/v1/completions or /v1/chat/completions (`body`: already read and translated, /infill's)."""
    state = http.app.state.serve
    try:
        body = await read_json(http) if body is None else body
        parsed = parse(body, state.ctx, chat)
        needed = max(len(ids) for ids in parsed.prompts) + parsed.params.max_tokens
        if not state.engine.runner.fits(needed):
            cache = state.engine.runner.cache
            raise ApiError(400, f"prompt ({needed - parsed.params.max_tokens} tokens) + max_tokens "
                                f"({parsed.params.max_tokens}) "
                                f"needs {cache.blocks_for(needed)} KV blocks of {cache.block_size} tokens, more than "
                                f"the {cache.usable_blocks} the server has (--num-blocks)", param="max_tokens",
                           code="context_length_exceeded")
        choices = parsed.n * len(parsed.prompts)
        if choices > state.engine.config.max_queue:
            raise ApiError(400, f"{choices} choices (n {parsed.n} times {len(parsed.prompts)} prompts) are more than "
                                f"this server queues at once ({state.engine.config.max_queue}, --max-queue)",
                           param="n" if len(parsed.prompts) == 1 else "prompt")
        queue: asyncio.Queue = asyncio.Queue()
        mailbox = Mailbox.of(http.app.state)
        gens: list[Generation] = []
        for i, ids in enumerate(parsed.prompts):       # a prompt's choices, then the next prompt's
            one = dataclasses.replace(parsed, prompt_ids=ids)
            first = Generation(state, one, queue, mailbox, i * parsed.n)
            gens += [first] + [Generation(state, one, queue, mailbox, i * parsed.n + j, first=first, choice=j)
                               for j in range(1, parsed.n)]
        for g in gens[1:]:                             # one answer: one id
            g.id, g.created = gens[0].id, gens[0].created
        for i, g in enumerate(gens):
            try:
                state.engine.submit(g.request)
            except (QueueFull, ShuttingDown) as exc:
                for submitted in gens[:i]:
                    state.engine.abort(submitted.request.id)
                if isinstance(exc, ShuttingDown):
                    raise ApiError(503, str(exc), code="service_unavailable") from None
                raise ApiError(429, str(exc), code="queue_full") from None
        if parsed.stream:
            return StreamingResponse(stream_events(gens, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(gens, queue, http)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except Exception as exc:  # noqa: BLE001 -- never a traceback to the client
        log.exception("request failed")
        return error(500, f"internal server error ({type(exc).__name__})")


async def infill(http: HttpRequest) -> Response:
    """llama.cpp's /infill (editors' code completion): a completion in the model's FIM format,
    answered in llama.cpp's shape (`content`; streamed as `data: {"content", "stop"}` events)."""
    state = http.app.state.serve
    try:
        body = infill_body(await read_json(http), state.ctx)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    response = await generate(http, chat=False, body=body)
    if response.status_code != 200:
        return response
    if isinstance(response, StreamingResponse):
        return StreamingResponse(infill_events(response.body_iterator, len(body["prompt"])),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(infill_answer(json.loads(response.body), len(body["prompt"])))


async def infill_events(events, prompt_tokens: int):
    """A completions stream as llama.cpp's: each text delta as {"content", "stop": false}, the end
    as the whole answer's fields with "stop": true."""
    last = None                      # the chunk with the finish reason, sent once the usage comes
    async for data in events:        # (one write may hold several events)
        text = data.decode() if isinstance(data, bytes) else data
        for line in text.split("\n\n"):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield line + "\n\n"
                return
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                yield sse({"content": chunk["choices"][0]["text"], "stop": False})
            elif chunk.get("choices"):
                last = chunk
            elif last is not None:       # the usage chunk
                yield sse(infill_answer(dict(last, usage=chunk.get("usage")), prompt_tokens))
                last = None
    if last is not None:
        yield sse(infill_answer(last, prompt_tokens))


async def models(http: HttpRequest) -> Response:
    """GET /v1/models (the list) and GET /v1/models/{model} (one: the served name or an alias)."""
    state = http.app.state.serve
    card = {"id": state.ctx.model_names[0], "object": "model", "created": state.created, "owned_by": "specdecode",
            "max_model_len": state.ctx.max_model_len}
    name = http.path_params.get("model")
    if name is None:
        return JSONResponse({"object": "list", "data": [card]})
    if name not in state.ctx.model_names:
        return error(404, f"The model `{name}` does not exist; this server serves `{card['id']}`",
                     param="model", code="model_not_found")
    return JSONResponse(dict(card, id=name))


async def health(http: HttpRequest) -> Response:
    """200 only when a one-token generation through the engine finishes within the timeout. Checks
    that come while one is in flight wait for its answer: /health needs no key, and 100 checks at
    once had queued 100 generations ahead of every request."""
    state = http.app.state.serve
    probe = state.health_probe
    if probe is None or probe.done():
        probe = state.health_probe = asyncio.ensure_future(health_probe(http.app.state))
    status, message = await asyncio.shield(probe)
    return JSONResponse({"status": "ok"}) if status == 200 else error(status, message)


async def health_probe(app_state) -> tuple[int, str]:
    """(200, "") or (503, why) of one one-token generation through the engine."""
    state = app_state.serve
    queue: asyncio.Queue = asyncio.Queue()
    mailbox = Mailbox.of(app_state)
    request = Request([state.health_token], SamplingParams(max_tokens=1, ignore_eos=True),
                      lambda e: mailbox.post(queue, e), speculate=False, internal=True)
    try:
        state.engine.submit(request)
    except ShuttingDown as exc:
        return 503, f"unhealthy: {exc}"
    timeout = state.engine.config.health_timeout
    deadline = time.monotonic() + timeout
    try:
        while True:
            event = await asyncio.wait_for(queue.get(), timeout=max(deadline - time.monotonic(), 0.001))
            if isinstance(event, Finished):
                return 200, ""
            if isinstance(event, Failed):
                return 503, f"unhealthy: a one-token generation failed ({event.message})"
    except asyncio.TimeoutError:
        state.engine.abort(request.id)
        return 503, f"unhealthy: a one-token generation did not finish within {timeout:g} s"


async def metrics(http: HttpRequest) -> Response:
    return Response(http.app.state.serve.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def stats(http: HttpRequest) -> Response:
    return JSONResponse(http.app.state.serve.engine.metrics.stats())


async def index(http: HttpRequest) -> Response:
    page = STATIC / "index.html"
    if page.is_file():
        return FileResponse(page)
    return error(404, "no dashboard installed (specdecode/serve/static/index.html is missing)")


async def http_error(http: HttpRequest, exc: HTTPException) -> Response:
    answer = anthropic_error if http.url.path.startswith(ANTHROPIC_PREFIX) else error
    return answer(exc.status_code, f"{exc.detail}: {http.method} {http.url.path}")


async def internal_error(http: HttpRequest, exc: Exception) -> Response:
    log.error("unhandled %s on %s", type(exc).__name__, http.url.path)
    answer = anthropic_error if http.url.path.startswith(ANTHROPIC_PREFIX) else error
    return answer(500, f"internal server error ({type(exc).__name__})")


def api_app(handlers: dict[str, Callable], api_key: str | None, max_body_bytes: int, lifespan=None) -> Starlette:
    """The API's routes on `handlers` (path -> handler: POST for the completions, GET for the rest),
    the dashboard's files, `Guard` and OpenAI-shaped errors: one server's app, and the Ray ingress's."""
    routes = [Route(path, handler, methods=METHODS.get(path, ["POST" if path in POSTED else "GET"]))
              for path, handler in handlers.items()]
    routes.append(Route("/", index, methods=["GET"]))
    if STATIC.is_dir():
        routes.append(Mount("/static", app=StaticFiles(directory=STATIC), name="static"))
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)],
                     exception_handlers={HTTPException: http_error, Exception: internal_error})


def create_app(state, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               engine_thread: bool = True) -> Starlette:
    """`state`: a `server.ServeState` (engine core, tokenizer, parsing context); api_key: required as
    `Authorization: Bearer KEY` on every endpoint but /health and the dashboard's files (auth.py);
    max_body_bytes: larger request bodies get 413; engine_thread: the app's lifespan starts and
    stops the engine loop in a thread of its own (False: the caller runs `EngineCore.run()`, as
    `specdecode serve` does on its main thread)."""

    @asynccontextmanager
    async def lifespan(app):
        if engine_thread:
            state.engine.start()
        try:
            yield
        finally:
            if engine_thread:
                state.engine.stop()

    from .responses import cancel_response, create_response, response_by_id  # (they build on Generation)
    app = api_app({"/v1/completions": partial(generate, chat=False),
                   "/v1/responses": create_response, "/v1/responses/{response_id}": response_by_id,
                   "/v1/responses/{response_id}/cancel": cancel_response,
                   "/v1/chat/completions": partial(generate, chat=True), "/infill": infill, "/tokenize": tokenize,
                   "/detokenize": detokenize, "/tokenizer_info": tokenizer_info, "/v1/models": models,
                   "/v1/models/{model:path}": models, "/health": health, "/metrics": metrics, "/api/stats": stats,
                   "/v1/messages": anthropic_messages, "/v1/messages/count_tokens": anthropic_count_tokens},
                  api_key, max_body_bytes, lifespan)
    app.state.serve = state
    return app
