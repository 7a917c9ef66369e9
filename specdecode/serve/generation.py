"""One choice of a request on its trip through the engine, as every API's handler sees it
(chat / text completions in app.py, Responses in responses.py, Messages in anthropic.py): the
engine `Request` it submitted, its text stream, tool-call and reasoning parsers, and the pieces of
OpenAI's chunk and usage shapes built from them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from ..engine.sequence import Request
from ..params import SamplingParams
from ..structured import Structured
from .events import HeldTokens, Mailbox, TextStream
from .protocol import ParsedRequest, error_body
from .reasoning import HarmonyParser, marker_decoder, reasoned_params, reasoning_parser, reasoning_tokens
from .tools import call_parser, openai_deltas

log = logging.getLogger("specdecode.serve")


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class Generation:
    """One choice of a request on its trip through the engine, as seen by the handler. The
    choices of a request share one queue of (generation, event) pairs."""

    def __init__(self, state, parsed: ParsedRequest, queue: asyncio.Queue, mailbox: Mailbox, index: int = 0,
                 first: Generation | None = None, choice: int = 0) -> None:
        """Choice `index` of the request, its prompt's choice `choice` (n > 1: choice i is seeded
        seed + i when a seed is given; `first`: the prompt's first choice, whose id the others share
        and whose prompt blocks they wait for)."""
        self.state, self.parsed, self.index, self.choice_of_prompt = state, parsed, index, choice
        params = parsed.params
        if choice and params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + choice) % 2**63)
        self.reasoning = reasoning_parser(state, parsed)   # reasoning.py: thinking apart from the answer
        params = reasoned_params(self.reasoning, parsed, params)
        params = with_budget(self.reasoning, parsed.thinking_budget, params)
        post = lambda event: mailbox.post(queue, (self, event))         # noqa: E731
        self.request = Request(parsed.prompt_ids, params, self._sink(post, state.engine.config.stream_interval_ms),
                               parsed.speculate, parsed.num_speculative_tokens,
                               after=first.request.id if first is not None else None)
        tools = parsed.tools             # tools/: the calls are parsed out of the text as it comes
        self.tools = call_parser(tools) if tools is not None else None
        kept = (tools.fmt.kept_tokens() if tools is not None else {}) | (self.reasoning.kept if self.reasoning else {})
        self.text = TextStream(state.tokenizer, params, marker_decoder(state.tokenizer, kept) if kept else None)
        self.done = False
        self.held_logprobs: list[tuple[int, int, tuple]] = []   # (text start, end, entry) not yet released
        self.logprobs_at = 0                                     # the text offset after the held entries
        self._text_template: tuple[str, str] | None = None
        self.id = first.id if first is not None else ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = first.created if first is not None else int(time.time())

    def _sink(self, post: Callable[[object], None], interval_ms: float):
        """Where the engine's events for this choice go: held to its end (not streamed), paced
        (streamed text), or each step's as it comes (a stream whose chunks are steps: token ids or
        kinds asked for, or --stream-interval-ms 0)."""
        p = self.parsed
        if not p.stream:
            return HeldTokens(post)
        if p.return_token_kinds or p.return_token_ids or not interval_ms:
            return post
        return HeldTokens(post, interval_ms / 1000)

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

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer: reasoning None when the choice has no reasoning parser."""
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.feed(text)
        more, rest = self.reasoning.finish()
        return reasoning + more, content + rest

    def reasoning_tokens(self) -> int:
        """How many of the answer's tokens are its reasoning (OpenAI's usage.completion_tokens_details)."""
        parser = reasoning_parser(self.state, self.parsed)
        if not parser.in_reasoning and not parser.deciding and parser.open not in self.text.full_text(None):
            return 0                  # (no block opened: not worth a second detokenization, token by token)
        texts = TextStream(self.state.tokenizer, SamplingParams(), self.text.decode).add(self.text.ids, True)[1]
        return reasoning_tokens(parser, texts)

    def answer_deltas(self, text: str, final: bool = False) -> list[dict]:
        """OpenAI's chunk deltas of the answer's next text (`final`: its last): the reasoning's
        (`reasoning_content`), then the content's and tool calls' as the tool parser finds them."""
        out: list[dict] = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                more, rest = self.reasoning.finish()
                reasoning, text = reasoning + more, text + rest
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.tools is not None:
            out += openai_deltas(self.tools.feed(text) + (self.tools.finish() if final else []))
        elif text:
            out.append({"content": text})
        return out

    def delta_chunks(self, deltas: list[dict], first: dict | None = None) -> list[dict]:
        """Chunks of OpenAI deltas; `first` (a choice with the step's token kinds, ids, logprobs)
        carries the first delta, or goes alone when there is none."""
        chunks = []
        for i, delta in enumerate(deltas or ([{}] if first is not None else [])):
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


def with_budget(parser, budget: int | None, params: SamplingParams) -> SamplingParams:
    """`params` whose reasoning ends after at most `budget` tokens (Anthropic's thinking.budget_tokens),
    as vLLM's thinking_token_budget does it: once the budget is spent the end-of-reasoning marker is
    the only token allowed, and the answer follows. It is a constraint over the markers' own tokens
    (reasoning.py's `before_answer` with a bound): unbounded after the reasoning, or the request's
    own constraint (a forced call, a JSON schema) there. Unchanged when the model does not think,
    its markers are not one token each, the prompt closed the reasoning, or a constraint writes the
    answer from its start; gpt-oss's analysis channel is not bounded."""
    if parser is None or budget is None or isinstance(parser, HarmonyParser):
        return params
    bounded = parser.before_answer(budget)
    if bounded is None:
        return params
    if params.structured is None:        # then any token but the markers (a second block would be unbounded)
        markers = sorted(token for token, text in parser.kept.items() if text in (parser.close, parser.open)
                         or parser.open.startswith(text))
        rest = ",".join(map(str, markers))
        return dataclasses.replace(params, structured=Structured("grammar", f"start: {bounded} <[^{rest}]>*\n"))
    if params.structured.after is not None:
        return dataclasses.replace(params, structured=dataclasses.replace(params.structured, after=bounded))
    return params


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def merged_usage(usages: list[tuple[Generation, dict]]) -> dict:
    """The choices' usage: each prompt's tokens counted once (its first choice's), completion tokens
    summed (an echo of the prompt alone completes none)."""
    firsts = [u for g, u in usages if g.choice_of_prompt == 0]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    completion = sum(0 if g.parsed.echo_only else u["completion_tokens"] for g, u in usages)
    out = dict(usages[0][1], prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
               prompt_tokens_details={"cached_tokens": cached})
    thinking = [g.reasoning_tokens() for g, _ in usages if g.reasoning is not None]
    if thinking:
        out["completion_tokens_details"] = dict(out.get("completion_tokens_details") or {},
                                                reasoning_tokens=sum(thinking))
    return out


async def client_gone(http: HttpRequest) -> None:
    """Returns when the client of a request whose body was read disconnects."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
