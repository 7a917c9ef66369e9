"""The load generator of `specdecode bench serve`: streaming requests against an
OpenAI-compatible server, with fixed concurrency or Poisson arrivals, one record per request.

Timing of one request (all client-side, perf_counter):
- TTFT: from sending the request to the first streamed chunk that carries text;
- ITL: the gaps between successive chunks that carry text (a speculative step may deliver
  several tokens in one chunk: its gap is one ITL sample, as in vLLM's benchmark);
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), for requests with >= 2 tokens.

Output tokens are counted from the server's `usage` when it sends one, else from the
`token_kinds` of each chunk (the extra field `return_token_kinds`), else one per chunk.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from ..datasets import Prompt

KINDS = ("accepted", "recovered", "bonus")


@dataclass
class Workload:
    """What every request of a run sends (besides its prompt and the speculation arm)."""
    model: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0


@dataclass
class Record:
    """One request as the client saw it. Times are seconds; start is relative to the level's start."""
    task: str
    prompt_id: str
    arm: str                     # "on", "off" (speculate field sent) or "server" (left to the server)
    round: int
    start: float = 0.0
    ok: bool = False
    status: int | None = None    # HTTP status; None when no response arrived
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None

    def as_dict(self) -> dict:
        row = asdict(self)
        for key in ("start", "ttft", "e2e", "tpot"):
            if row[key] is not None:
                row[key] = round(row[key], 6)
        row["itl"] = [round(x, 6) for x in self.itl]
        return row


def request_body(prompt: Prompt, workload: Workload, arm: str) -> tuple[str, dict]:
    """(path, JSON body) of one streaming request: chat prompts (Spec-Bench) go to
    /v1/chat/completions, raw ones (HumanEval) to /v1/completions."""
    body: dict = {"model": workload.model, "max_tokens": workload.max_tokens, "temperature": workload.temperature,
                  "stream": True, "stream_options": {"include_usage": True}, "return_token_kinds": True}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if arm in ("on", "off"):
        body["speculate"] = arm == "on"
    body.update(workload.extra_body)
    if prompt.chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt.text
    return "/v1/completions", body


def error_message(status: int, raw: bytes) -> str:
    """One line naming the HTTP status and the server's own message (OpenAI error format or not)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
        inner = body.get("error", body) if isinstance(body, dict) else body
        message = inner.get("message") or inner.get("detail") if isinstance(inner, dict) else None
        text = str(message) if message else text
    except ValueError:
        pass
    return f"HTTP {status}: {' '.join(text.split())[:300] or 'no message'}"


class StreamFailed(Exception):
    """A streamed request that did not complete: an HTTP error, an error event, a broken or
    malformed stream, or no `data: [DONE]` (the message says which, in one line)."""


async def stream_chunks(client: httpx.AsyncClient, path: str, body: dict, timeout_s: float, on_status=None):
    """The JSON chunks of one server-sent-events response, up to `data: [DONE]`; raises
    StreamFailed. `on_status`: called with the HTTP status once it is known."""
    try:
        async with client.stream("POST", path, json=body, timeout=timeout_s) as response:
            if on_status is not None:
                on_status(response.status_code)
            if response.status_code != 200:
                raise StreamFailed(error_message(response.status_code, await response.aread()))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error"):
                    err = chunk["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    raise StreamFailed(f"stream error: {message}")
                yield chunk
    except httpx.TimeoutException:
        raise StreamFailed(f"timeout after {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise StreamFailed(f"connection error: {type(exc).__name__}: {exc}") from None
    except (ValueError, AttributeError, TypeError) as exc:
        raise StreamFailed(f"malformed stream: {type(exc).__name__}: {exc}") from None
    raise StreamFailed("stream ended without data: [DONE]")


async def send(client: httpx.AsyncClient, prompt: Prompt, workload: Workload, record: Record, t0: float) -> Record:
    """Send one streaming request and fill `record` (never raises for request failures)."""
    path, body = request_body(prompt, workload, record.arm)
    start = time.perf_counter()
    record.start = start - t0
    chunks, from_kinds, usage_tokens, last = 0, 0, None, None
    try:
        async for chunk in stream_chunks(client, path, body, workload.timeout_s,
                                         lambda status: setattr(record, "status", status)):
            if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                usage_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                kinds = choice.get("token_kinds") or []
                for token in kinds:
                    kind = token.get("kind", "")
                    record.kinds[kind] = record.kinds.get(kind, 0) + 1
                if text or kinds:
                    now = time.perf_counter()
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                    chunks += 1
                    from_kinds += len(kinds)
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
    except StreamFailed as exc:
        record.error = str(exc)
        return record
    record.e2e = time.perf_counter() - start
    record.output_tokens = usage_tokens if usage_tokens is not None else (from_kinds or chunks)
    if record.output_tokens >= 2 and record.ttft is not None:
        record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    record.ok = True
    return record


@dataclass
class Shape:
    """How requests arrive: `concurrency` workers back to back, or Poisson arrivals at `rate`
    requests/s (optionally capped at `max_concurrency` in flight). A run ends after
    `num_requests` requests, or when `duration_s` has passed (requests in flight finish)."""
    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None


async def run_load(client: httpx.AsyncClient, prompts: list[Prompt], workload: Workload, shape: Shape,
                   arm: str, round_index: int, seed: int, t0: float) -> list[Record]:
    """Run one round; `prompts` cycle when more requests than prompts are sent."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    deadline = None if shape.duration_s is None else time.perf_counter() + shape.duration_s
    limit = shape.num_requests
    records: list[Record] = []
    issued = 0

    def next_record() -> tuple[Prompt, Record] | None:
        nonlocal issued
        if (limit is not None and issued >= limit) or (deadline is not None and time.perf_counter() >= deadline):
            return None
        prompt = prompts[issued % len(prompts)]
        issued += 1
        record = Record(task=prompt.task, prompt_id=prompt.id, arm=arm, round=round_index)
        records.append(record)
        return prompt, record

    if shape.concurrency is not None:
        async def worker() -> None:
            while (item := next_record()) is not None:
                await send(client, item[0], workload, item[1], t0)
        await asyncio.gather(*(worker() for _ in range(shape.concurrency)))
        return records

    rng = random.Random(seed)
    gate = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    tasks = []

    async def one(prompt: Prompt, record: Record) -> None:
        if gate is None:
            await send(client, prompt, workload, record, t0)
            return
        async with gate:
            await send(client, prompt, workload, record, t0)

    next_at = time.perf_counter()
    while True:
        next_at += rng.expovariate(shape.rate)
        pause = next_at - time.perf_counter()
        if deadline is not None and next_at >= deadline:
            break
        if pause > 0:
            await asyncio.sleep(pause)
        item = next_record()
        if item is None:
            break
        tasks.append(asyncio.create_task(one(*item)))
    await asyncio.gather(*tasks)
    return records


def make_client(url: str, connections: int | None, timeout_s: float) -> httpx.AsyncClient:
    """A client whose pool never queues the load's requests (None: no limit, for open-loop arrivals)."""
    size = None if connections is None else connections + 4
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    return httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=timeout_s)


async def first_model(url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model that GET /v1/models lists."""
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        try:
            response = await client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ConnectionError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise ConnectionError(f"{url}/v1/models answered {error_message(response.status_code, response.content)}")
        data = response.json().get("data") or []
        if not data:
            raise ConnectionError(f"{url}/v1/models lists no model")
        return str(data[0]["id"])
