"""Continuous batching under load, and the automatic speculation switch, end to end.

* 32 concurrent streaming requests (a mix of prompts, lengths, speculation on/off/automatic,
  k, greedy and sampled) with 4 cancelled mid-stream, through a batch of 6 with chunked prefill
  and small KV blocks: the 28 others finish with exactly their requested tokens, greedy outputs
  equal plain decoding of each request alone, and KV block usage returns to idle.
* A drafter that is never accepted is switched off automatically (visible in /metrics) and
  back on once its drafts are good.
"""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from conftest import mixed_rows_through_server

from specdecode import LLM, SamplingParams
from specdecode.drafters.base import Drafter, DraftProposal
from specdecode.engine.config import EngineConfig
from specdecode.serve.app import create_app
from specdecode.serve.server import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["the quick brown fox jumps over the lazy dog. the quick brown fox",
         "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
         "Summarize the following text. The cat sat on the mat. The mat was red.",
         "1 2 3 4 5 6 7 8 9 10 11 12",
         "speculative decoding drafts tokens and verifies them in one pass of the target model."]


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_32_concurrent_streams_with_4_cancelled(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), draft=str(tiny_models["llama_draft"]), dtype="fp32", progress=False)
    tok = llm.tokenizer
    jobs = []
    for i in range(32):
        text = TEXTS[i % len(TEXTS)] + " " + " ".join(TEXTS[(i + j) % 5][:8] for j in range(i % 4))
        extra = {"ignore_eos": True, "return_token_ids": True}
        if i % 4 == 1:
            extra["speculate"] = False
        elif i % 4 == 2:
            extra.update(speculate=True, num_speculative_tokens=1 + i % 7)
        cancel = i in (3, 10, 17, 26)
        # a cancelled request asks for as many tokens as fit, so the server cannot finish it in the
        # moment between the client's second token and its disconnect reaching the server
        max_tokens = 160 - len(tok.encode(text)) - 4 if cancel else 6 + (5 * i) % 29
        jobs.append(dict(prompt=text, max_tokens=max_tokens, temperature=0.9 if i % 8 == 7 else 0.0,
                         seed=i, extra=extra, cancel=cancel))
    # references: each greedy request alone, plain decoding (k = 0), before the server starts
    for job in jobs:
        if job["temperature"] == 0 and not job["cancel"]:
            params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
            job["want"] = llm.generate([tok.encode(job["prompt"])], params, num_speculative_tokens=0)[0].token_ids
    state = build_state(llm, EngineConfig(max_batch_size=6, max_queue=64, block_size=4, prefill_chunk=24,
                                         max_model_len=160, served_model_name="tiny"))
    caches = [state.engine.runner.cache, state.engine.runner.draft_cache]

    async def run(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(job):
            stream = await client.completions.create(
                model="tiny", prompt=job["prompt"], max_tokens=job["max_tokens"], temperature=job["temperature"],
                seed=job["seed"], stream=True, stream_options={"include_usage": True}, extra_body=job["extra"])
            ids, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    ids += chunk.choices[0].token_ids or []
                usage = chunk.usage or usage
                if job["cancel"] and len(ids) >= 2:
                    await stream.close()                   # the client goes away mid-stream
                    return ids, None
            return ids, usage
        return await asyncio.gather(*(one(job) for job in jobs))

    with BackgroundServer(create_app(state)) as server:
        results = asyncio.run(run(server.url))
        wait_for(lambda: all(c.used_blocks == 0 and c.reserved_blocks == 0 for c in caches))
        stats = httpx.get(server.url + "/api/stats", timeout=10).json()
    for job, (ids, usage) in zip(jobs, results):
        if job["cancel"]:
            assert job["max_tokens"] >= 60 and usage is None and len(ids) < job["max_tokens"]
            continue
        assert len(ids) == job["max_tokens"] == usage.completion_tokens
        if "want" in job:
            assert ids == job["want"], job
    assert stats["requests"]["finished"] == 28
    wait_for(lambda: state.engine.metrics.stats()["requests"]["aborted"] == 4)
    assert stats["memory"]["kv_bytes_used"] == {"target": 0, "draft": 0}
    assert stats["speculation"]["drafted_tokens"] > 0 and stats["speculation"]["accepted_tokens"] > 0


class Oracle(Drafter):
    """Drafts the target's own greedy continuation once a request has `good_after` output tokens,
    and tokens the target never picks before that. A lookup drafter: no model, no cache."""

    name = "oracle"

    def __init__(self, continuation: dict[tuple, list[int]], vocab: int, good_after: int) -> None:
        self.continuation, self.vocab, self.good_after = continuation, vocab, good_after

    def propose(self, seqs, max_tokens):
        drafts = []
        for s, k in zip(seqs, max_tokens):
            truth = self.continuation[tuple(s.prompt_ids)][s.num_output:s.num_output + k]
            good = s.num_output >= self.good_after
            drafts.append(truth if good else [(t + 1) % self.vocab for t in truth])
        return DraftProposal.from_lists(drafts)


def metric(text: str, name: str, **labels) -> float:
    """The value of one Prometheus series (labels in any order), 0 when absent."""
    for line in text.splitlines():
        found = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if found and found.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', found.group(2) or "")) == labels:
            return float(found.group(3))
    return 0.0


def test_a_request_drafts_only_once_its_shadow_drafts_come_true(tiny_models, monkeypatch):
    """A lookup drafter whose drafts are wrong for the first 30 tokens and right after: the request
    decodes plain, its shadow drafts (scored for free) find when drafts start to pay, and it drafts
    from then on; lossless throughout."""
    from specdecode.engine.controller import SpeculationController
    # shadows every step: how often they run follows measured times (tests/engine/test_controller.py), and
    # on the tiny model a step is so short that timing noise spaces them out
    monkeypatch.setattr(SpeculationController, "shadow_due", lambda self, seconds, young=False: True)
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False)
    prompt = llm.tokenizer.encode(TEXTS[2])
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    truth = llm.generate([prompt], params, num_speculative_tokens=0)[0].token_ids
    llm.drafter = Oracle({tuple(prompt): truth}, llm.target.model.vocab_size, good_after=30)
    state = build_state(llm, EngineConfig(max_batch_size=2, served_model_name="tiny"))
    with BackgroundServer(create_app(state)) as server:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 90, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "return_token_kinds": True}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        text = httpx.get(server.url + "/metrics", timeout=10).text
    choice = out["choices"][0]
    assert choice["token_ids"] == truth                                # lossless throughout
    assert metric(text, "specdecode:spec_decode_shadow_drafts_total") >= 2
    kinds = [k["kind"] for k in choice["token_kinds"]]
    # off early on (no drafts: every token is the target's own), accepted drafts after the switch back
    assert kinds[:30].count("accepted") == 0 and kinds[30:].count("accepted") >= 30
    spec = out["speculation"]
    assert spec["mode"] == "auto" and spec["on_at_end"] and spec["accepted_tokens"] >= 20


@pytest.mark.parametrize("method", ["eagle", "cascade"])
def test_eagle_head_in_the_server_stays_lossless_with_mixed_and_switching_rows(tiny_models, tmp_path, method):
    """An (untrained) EAGLE head keeps its own per-row state and reads the target's features:
    chunked prefill feeds it the prompt's features, rows that do not speculate still feed it,
    and rows switched off by the policy catch up on their probe steps. The cascade adds lookup
    rows (the repeated prompts) whose head state lags and catches up too."""
    import torch

    from specdecode.drafters.format import save_eagle
    from specdecode.drafters.head import EagleHead
    from specdecode.models.loader import load_model
    target = load_model(str(tiny_models["llama"]), "fp32", progress=False)
    torch.manual_seed(0)
    head = EagleHead.from_target(target.model, torch.arange(target.model.vocab_size))
    path = save_eagle(head, tmp_path / "eagle", target, {"note": "untrained"})
    llm = LLM(model=str(tiny_models["llama"]), method=method, drafter_path=str(path), dtype="fp32",
              progress=False)
    jobs, wants, outs, text, stats = mixed_rows_through_server(llm, TEXTS[:5])
    assert [o["choices"][0]["token_ids"] for o in outs] == wants
    assert sum(o["speculation"]["drafted_tokens"] for o in outs) > 0
    assert all(o["speculation"]["drafted_tokens"] == 0 for o, job in zip(outs, jobs) if job[1] == {"speculate": False})
    assert stats["memory"]["kv_bytes_capacity"]["draft"] > 0 and stats["memory"]["kv_bytes_used"]["draft"] == 0
    assert metric(text, "specdecode:spec_decode_num_drafts_total") > 0
