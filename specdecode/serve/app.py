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
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
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
from .auth import DEFAULT_MAX_BODY_BYTES, Guard
from .prompts import echo_logprobs, infill_answer, infill_body, vllm_prompt_logprobs
from .protocol import ApiError, ParsedRequest, error_body, parse, stream_error
from .tokenize import detokenize, tokenize, tokenizer_info
from .tools import ToolParser, decoder, openai_deltas

log = logging.getLogger("specdecode.serve")
STATIC = Path(__file__).parent / "static"


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class Mailbox:
    """Events from the engine thread to one event loop: however many events a step produces, the
    loop is woken once (one `call_soon_threadsafe`) and hands each to its queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    @staticmethod
    def of(app_state) -> Mailbox:
        """The running loop's mailbox (made on first use)."""
        loop = asyncio.get_running_loop()
        boxes = app_state.__dict__.setdefault("_mailboxes", {})
        if loop not in boxes:
            boxes[loop] = Mailbox(loop)
        return boxes[loop]

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:           # the event loop is gone (shutdown)
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class HeldTokens:
    """The sink of a non-streamed choice: its tokens are kept on the engine thread, merged, and
    posted with its last event, so the event loop is woken once per answer instead of once per
    step (on a machine of few cores each wake-up takes a core from the engine's pass)."""

    def __init__(self, post: Callable[[object], None]) -> None:
        self.post, self.held = post, None

    def __call__(self, event) -> None:
        if isinstance(event, Tokens):
            if self.held is None:
                self.held = event.copy()
            else:
                self.held.extend(event)
            return
        if self.held is not None:
            self.post(self.held)
            self.held = None
        self.post(event)


class PacedTokens(HeldTokens):
    """The sink of a streamed choice: its first tokens are posted at once (the time to first
    token), later ones merged and posted at most every `interval` seconds (at the step that
    reaches it), and whatever is held goes before its last event. One chunk per step would cost
    the server a wake-up, a detokenization and an SSE event, and the client a parse, per step."""

    def __init__(self, post: Callable[[object], None], interval: float) -> None:
        self.post, self.held = post, None
        self.interval, self.last = interval, None

    def __call__(self, event) -> None:
        super().__call__(event)
        if self.held is not None:
            now = time.monotonic()
            if self.last is None or now - self.last >= self.interval:
                self.post(self.held)
                self.held, self.last = None, now


class TextStream:
    """Incremental detokenization: text deltas that never split a UTF-8 character and never
    show text that may still turn out to be part of a stop string. Each token is decoded once,
    with the few tokens before it (as vLLM does), so a long answer costs no more per token than a
    short one."""

    def __init__(self, tokenizer, params: SamplingParams, decode=None) -> None:
        """decode: ids -> text (default the tokenizer's, skipping special tokens)."""
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0
        self.decode = decode or tokenizer.decode
        self.text = ""                     # the text of ids[:read_at] (whole characters)
        self.prefix_at = self.read_at = 0  # ids[prefix_at:read_at]: the context the next tokens decode with
        self.stops = tuple(s for s in params.stop if s)
        self.hold = max((len(s) - 1 for s in self.stops), default=0)

    def _decode_new(self) -> str:
        """The text ids[read_at:] add, or '' while they end inside a character. Decoded after
        the tokens before them: a tokenizer that drops a word's leading space at the start of a
        decode drops it from both strings alike."""
        decode = self.decode
        prefix = decode(self.ids[self.prefix_at:self.read_at]) if self.read_at > self.prefix_at else ""
        full = decode(self.ids[self.prefix_at:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        self.text += full[len(prefix):]
        return full[len(prefix):]

    def add(self, ids: list[int], with_token_texts: bool) -> tuple[str, list[str]]:
        """(the text that may be sent now, each token's own text when asked)."""
        texts = []
        if with_token_texts:
            for token in ids:
                self.ids.append(token)
                texts.append(self._decode_new())
        else:
            self.ids += ids
            self._decode_new()
        text = self.text
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
        text = self.full_text(stop_text_index)
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta

    def full_text(self, stop_text_index: int | None) -> str:
        text = self.decode(self.ids)
        return text[:stop_text_index] if stop_text_index is not None else text


class Generation:
    """One choice of a request on its trip through the scheduler, as seen by the handler. The
    choices of a request share one queue of (generation, event) pairs."""

    def __init__(self, state, parsed: ParsedRequest, queue: asyncio.Queue, mailbox: Mailbox, index: int = 0,
                 after: str | None = None, choice: int = 0) -> None:
        """Choice `index` of the request, its prompt's choice `choice` (n > 1: choice i is seeded
        seed + i when a seed is given; `after`: the prompt's first choice's request id, whose prompt
        blocks the others wait for and share)."""
        self.state, self.parsed, self.index, self.choice_of_prompt = state, parsed, index, choice
        params = parsed.params
        if choice and params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + choice) % 2**63)
        post = lambda event: mailbox.post(queue, (self, event))         # noqa: E731
        self.request = Request(parsed.prompt_ids, params, self._sink(post, state.engine.config.stream_interval_ms),
                               parsed.speculate, parsed.num_speculative_tokens, after=after)
        tools = parsed.tools             # tools/: the calls are parsed out of the text as it comes
        self.tools = ToolParser(tools.fmt, [f["name"] for f in tools.functions()],
                                None if tools.parallel else 1) if tools is not None else None
        self.text = TextStream(state.tokenizer, params,
                               decoder(state.tokenizer, tools.fmt) if tools is not None else None)
        self.done = False
        self.held_logprobs: list[tuple[int, int, tuple]] = []   # (text start, end, entry) not yet released
        self.logprobs_at = 0                                     # the text offset after the held entries
        self._text_template: tuple[str, str] | None = None
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _sink(self, post: Callable[[object], None], interval_ms: float):
        """Where the engine's events for this choice go: held to its end (not streamed), paced
        (streamed text), or each step's as it comes (a stream whose chunks are steps: token ids or
        kinds asked for, or --stream-interval-ms 0)."""
        p = self.parsed
        if not p.stream:
            return HeldTokens(post)
        if p.return_token_kinds or p.return_token_ids or not interval_ms:
            return post
        return PacedTokens(post, interval_ms / 1000)

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
                                for t, v, top in lps], "refusal": None}
        texts = [decode([t]) for t, _, _ in lps]
        offsets, at, tops = [], offset, []
        for text, (token, value, top) in zip(texts, lps):
            offsets.append(at)
            at += len(text)
            alternatives = {decode([a]): w for a, w in top}
            if all(a != token for a, _ in top):     # OpenAI's legacy field: the N most likely tokens and
                alternatives[text] = value          # the chosen one (up to N + 1 entries)
            tops.append(alternatives)
        return {"tokens": texts, "token_logprobs": [v for _, v, _ in lps], "top_logprobs": tops,
                "text_offset": offsets}

    def release_logprobs(self, lps: list | None, texts: list[str], final: bool = False,
                         end: int | None = None) -> tuple[list | None, int]:
        """(the logprobs of the tokens whose text has been sent, the offset of their text): a stream's
        logprobs go with the text they belong to, so a token held back as a possible stop string's
        start has its logprob held too, and dropped with it when it was one (a whole answer's alike).
        `texts`: each new token's text in context (TextStream.add); at the answer's last event
        (`final`) the rest goes, but for the tokens from `end` on (the stop string's start; None: none)."""
        for entry, text in zip(lps or [], texts):
            self.held_logprobs.append((self.logprobs_at, self.logprobs_at + len(text), entry))
            self.logprobs_at += len(text)
        held, sent = self.held_logprobs, self.text.sent
        n = 0
        while n < len(held) and ((end is None or held[n][0] < end) if final else held[n][1] <= sent):
            n += 1
        out, self.held_logprobs = held[:n], ([] if final else held[n:])
        return ([e for _, _, e in out] if out else None), (out[0][0] if out else sent)

    def choice(self, text: str, kinds: list[str], ids: list[int], texts: list[str], finish: str | None,
               lps: list | None = None, offset: int = 0) -> dict:
        p = self.parsed
        out: dict = {"index": self.index}
        if p.chat:
            if p.stream:
                out["delta"] = {"content": text} if text else {}
            else:
                out["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            out["text"] = text
        out["logprobs"] = self.logprobs(lps, offset)
        out["finish_reason"] = finish
        if p.return_token_kinds:
            out["token_kinds"] = [{"text": t, "kind": k} for t, k in zip(texts, kinds)]
        if p.return_token_ids:
            out["token_ids"] = ids
        return out

    def tool_chunks(self, deltas: list[tuple], first: dict | None = None) -> list[dict]:
        """Chunks of the parser's deltas; `first` (a choice with the step's token kinds, ids,
        logprobs) carries the first delta, or goes alone when there is none."""
        chunks = []
        for i, delta in enumerate(openai_deltas(deltas) or ([{}] if first is not None else [])):
            choice = dict(first) if i == 0 and first is not None else {"index": self.index, "logprobs": None,
                                                                       "finish_reason": None}
            choice["delta"] = delta
            chunks.append(self.envelope([choice]))
        return chunks

    def text_chunk(self, delta: str) -> str:
        """The SSE event of a plain text delta (the chunk of nearly every step), from a template made
        once: the envelope around the text is the same every time."""
        if self._text_template is None:
            probe = "\u0000"
            event = sse(self.envelope([self.choice(probe, [], [], [], None)]))
            self._text_template = tuple(event.split(json.dumps(probe), 1))
        head, tail = self._text_template
        return head + json.dumps(delta, ensure_ascii=False) + tail

    def envelope(self, choices: list[dict], **extra) -> dict:
        p = self.parsed
        kind = ("chat.completion.chunk" if p.stream else "chat.completion") if p.chat else "text_completion"
        if p.stream and p.include_usage:      # OpenAI: every chunk has usage, null but in the last one
            extra.setdefault("usage", None)
        return {"id": self.id, "object": kind, "created": self.created, "model": p.model, "choices": choices,
                **extra}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def merged_usage(usages: list[tuple[Generation, dict]]) -> dict:
    """The choices' usage: each prompt's tokens counted once (its first choice's), completion tokens
    summed (an echo of the prompt alone completes none)."""
    firsts = [u for g, u in usages if g.choice_of_prompt == 0]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    completion = sum(0 if g.parsed.echo_only else u["completion_tokens"] for g, u in usages)
    return dict(usages[0][1], prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                prompt_tokens_details={"cached_tokens": cached})


def drain(first, queue: asyncio.Queue) -> list:
    """`first` and whatever else is already in the queue: the events of one or more engine steps."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def merge_tokens(items: list) -> list:
    """Consecutive Tokens events of a choice merged into one (a client that fell behind gets one
    chunk per choice for several steps); other events kept in order."""
    out, last = [], {}
    for gen, event in items:
        if isinstance(event, Tokens) and gen in last:
            last[gen].extend(event)
            continue
        if isinstance(event, Tokens):
            event = event.copy()
            last[gen] = event
        else:
            last.pop(gen, None)
        out.append((gen, event))
    return out


async def stream_events(gens: list[Generation], queue: asyncio.Queue):
    """Server-sent events of one request's choices, interleaved as their tokens come; cancelled
    (client gone) -> every unfinished choice is aborted."""
    p = gens[0].parsed
    usages: list[tuple[Generation, dict]] = []
    try:
        if p.chat:
            for g in gens:
                yield sse(g.envelope([{"index": g.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
        elif p.echo:                                   # the prompt's text first (its logprobs: not streamed)
            for g in gens:
                yield sse(g.envelope([g.choice(g.state.tokenizer.decode(g.parsed.prompt_ids), [], [], [], None)]))
        live = len(gens)
        per_step = p.return_token_kinds or p.return_token_ids       # then a chunk is a step
        while live:
            items = drain(await queue.get(), queue)
            for gen, event in (items if per_step else merge_tokens(items)):
                if isinstance(event, Tokens) and p.echo_only:
                    continue                           # the token run to read the prompt is not sent
                if isinstance(event, Tokens):
                    delta, texts = gen.text.add(event.ids, p.return_token_kinds or event.logprobs is not None)
                    lps, at = gen.release_logprobs(event.logprobs, texts)
                    if gen.tools is not None:        # content and tool calls as the parser finds them
                        extra = p.return_token_kinds or p.return_token_ids or lps
                        first = gen.choice("", event.kinds, event.ids, texts, None, lps, at) if extra else None
                        for chunk in gen.tool_chunks(gen.tools.feed(delta), first):
                            yield sse(chunk)
                    elif p.return_token_kinds or p.return_token_ids or lps:
                        yield sse(gen.envelope([gen.choice(delta, event.kinds, event.ids, texts, None, lps, at)]))
                    elif delta:
                        yield gen.text_chunk(delta)
                elif isinstance(event, Finished):
                    gen.done = True
                    live -= 1
                    usages.append((gen, event.usage))
                    delta = "" if p.echo_only else gen.text.finish(event.stop_text_index)
                    lps, at = gen.release_logprobs(None, [], final=True, end=event.stop_text_index)
                    reason = "length" if p.echo_only else event.reason
                    if gen.tools is not None:
                        for chunk in gen.tool_chunks(gen.tools.feed(delta) + gen.tools.finish()):
                            yield sse(chunk)
                        if gen.tools.calls and reason == "stop" and gen.tools.calls_complete():
                            reason = "tool_calls"            # (a stop string inside a call: "stop")
                        delta = ""
                    yield sse(gen.envelope([gen.choice(delta, [], [], [], reason, lps, at)],
                                           speculation=event.speculation))
                else:
                    gen.done = True
                    yield sse(stream_error(event.status, event.message))
                    yield "data: [DONE]\n\n"
                    return
        if p.include_usage:
            yield sse(gens[0].envelope([], usage=merged_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        for g in gens:
            if not g.done:
                g.state.engine.abort(g.request.id)


async def client_gone(http: HttpRequest) -> None:
    """Returns when the client of a request whose body was read disconnects."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


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
                text = gen.text.full_text(event.stop_text_index)
                lps += gen.release_logprobs(None, [], final=True, end=event.stop_text_index)[0] or []
                choice = gen.choice(text, kinds, ids, texts, event.reason, lps if lps else None)
                if gen.tools is not None:
                    content, calls = gen.tools.result(text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content, "refusal": None,
                                             "tool_calls": calls}
                        if event.reason == "stop" and gen.tools.calls_complete():
                            choice["finish_reason"] = "tool_calls"
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


async def read_json(http: HttpRequest):
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None


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
        gens = []
        for i, ids in enumerate(parsed.prompts):       # a prompt's choices, then the next prompt's
            one = dataclasses.replace(parsed, prompt_ids=ids)
            first = Generation(state, one, queue, mailbox, i * parsed.n)
            gens += [first] + [Generation(state, one, queue, mailbox, i * parsed.n + j, after=first.request.id,
                                          choice=j) for j in range(1, parsed.n)]
        for g in gens[1:]:
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


async def completions(http: HttpRequest) -> Response:
    return await generate(http, chat=False)


async def chat_completions(http: HttpRequest) -> Response:
    return await generate(http, chat=True)


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
    async for event in events:
        line = event.decode() if isinstance(event, bytes) else event
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            yield line
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
    return error(exc.status_code, f"{exc.detail}: {http.method} {http.url.path}")


async def internal_error(http: HttpRequest, exc: Exception) -> Response:
    log.error("unhandled %s on %s", type(exc).__name__, http.url.path)
    return error(500, f"internal server error ({type(exc).__name__})")


def create_app(state, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               engine_thread: bool = True) -> Starlette:
    """`state`: a `server.ServeState` (scheduler, tokenizer, parsing context); api_key: required as
    `Authorization: Bearer KEY` on every endpoint but /health and the dashboard's files (auth.py);
    max_body_bytes: larger request bodies get 413; engine_thread: the app's lifespan starts and
    stops the engine loop in a thread of its own (False: the caller runs `scheduler.run()`, as
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

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
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
