"""Server metrics: Prometheus series (named after vLLM's where they exist, prefix `specdecode:`)
and the `/api/stats` JSON of the dashboard, both fed by the engine thread.

Counters are exposed with the `_total` suffix, as prometheus-client does (and vLLM):
`specdecode:spec_decode_num_drafts_total` is vLLM's `vllm:spec_decode_num_drafts_total`.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..engine.sequence import SpecStats

P = "specdecode:"
disable_created_metrics()          # no `_created` series next to every counter (as vLLM)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
NODE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
EXPERT_BUCKETS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
HISTORY_LEN = 120          # one sample per second
RATE_WINDOW_S = 10.0


class ServeMetrics:
    def __init__(self, model: str, method: str, k: int, weights_bytes: dict[str, int], caches: dict) -> None:
        self.model, self.method, self.k = model, method, k
        self.weights_bytes = weights_bytes            # {"target": int, "draft": int}
        self.caches = caches                          # {"target": PagedKVCache, "draft": PagedKVCache | None}
        self.started = time.time()
        self.started_mono = time.monotonic()
        self.lock = threading.Lock()
        r = self.registry = CollectorRegistry()
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Verification steps of a request that had drafts",
                                  registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.drafted_per_pos = Counter(P + "spec_decode_num_draft_tokens_per_pos",
                                       "Draft tokens proposed at each draft position", ["position"], registry=r)
        self.tree_nodes = Histogram(P + "spec_decode_tree_nodes_per_step",
                                    "Draft tokens / tree nodes verified per request and step (the chosen draft "
                                    "size; 0 = a plain step)", buckets=NODE_BUCKETS, registry=r)
        self.mean_accepted_length = Gauge(P + "spec_decode_mean_accepted_length",
                                          "Emitted tokens per verification step of a request (bonus included)",
                                          registry=r)
        self.acceptance_rate = Gauge(P + "spec_decode_acceptance_rate", "Accepted / drafted tokens", registry=r)
        self.draft_time = Counter(P + "spec_decode_draft_time_seconds", "Time spent drafting", registry=r)
        self.verify_time = Counter(P + "spec_decode_verify_time_seconds",
                                   "Time spent scoring and verifying (target pass)", registry=r)
        self.shadow = Counter(P + "spec_decode_shadow_drafts",
                              "Lookup drafts scored for free for requests the last steps did not draft for",
                              registry=r)
        self.speculating = Gauge(P + "num_requests_speculating", "Running requests the last step drafted for",
                                 registry=r)
        self.batch_disabled = Gauge(P + "spec_decode_batch_disabled",
                                    "1 while the controller drafts for none of the requests that may draft",
                                    registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency", buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in the batch (prefilling or decoding)",
                             registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests queued", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)",
                                   registry=r)
        self.tokens_per_s = Gauge(P + "generation_tokens_per_second",
                                  f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s", registry=r)
        self.success = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.failed = Counter(P + "request_failed", "Requests ended by an internal error", registry=r)
        self.aborted = Counter(P + "request_aborted", "Requests aborted (client gone)", registry=r)
        self.steps = Counter(P + "engine_steps", "Batched verification steps", registry=r)
        self.threads = Gauge(P + "engine_threads", "Threads the engine's passes run on (the thread tuner's choice)",
                             registry=r)
        self.thread_switches = Counter(P + "engine_thread_switches",
                                       "Thread count changes after a trial measured the other count faster",
                                       registry=r)
        self.moe_passes = Counter(P + "moe_passes", "Target passes of a mixture-of-experts model", registry=r)
        self.moe_pass_rows = Counter(P + "moe_pass_rows", "Rows of those passes (pending tokens and drafts)",
                                     registry=r)
        self.moe_experts = Counter(P + "moe_experts", "Distinct experts those passes read, per MoE layer on average "
                                   "(a pass of r rows reads the union of the experts they route to)", registry=r)
        self.moe_experts_per_pass = Histogram(P + "moe_experts_per_pass", "Distinct experts one target pass read, "
                                              "per MoE layer on average", buckets=EXPERT_BUCKETS, registry=r)
        self.weights = Gauge(P + "memory_weights_bytes", "Bytes of model weights", ["model"], registry=r)
        self.kv_used = Gauge(P + "kv_cache_used_bytes", "KV cache bytes in allocated blocks", ["model"], registry=r)
        self.kv_capacity = Gauge(P + "kv_cache_capacity_bytes", "KV cache pool bytes", ["model"], registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of the target's KV blocks in use", registry=r)
        for name, value in weights_bytes.items():
            self.weights.labels(name).set(value)
        # aggregates for /api/stats (under self.lock): the rows' steps as one request's, and the rest
        self.row_stats = SpecStats()
        self.totals = dict(steps=0, finished=0, failed=0, aborted=0, prefix_queries=0, prefix_hits=0)
        self.node_counts = [0] * (len(NODE_BUCKETS) + 1)     # row-steps per node-count bucket (last: more)
        self._per_pos: list[tuple] = []
        self.last_tree: dict | None = None
        self.counts = dict(running=0, waiting=0, speculating=0, batch_off=False)
        self.rate_points: deque[tuple[float, int]] = deque()
        self.history: deque[dict] = deque(maxlen=HISTORY_LEN)
        self._last_sample = (time.monotonic(), replace(self.row_stats))
        self._thread_switches = 0

    # ------------------------------------------------------------ engine thread
    def record_step(self, drafted: list[int], accepted: list[int], emitted: list[int],
                    draft_s: float, verify_s: float, nodes: list[int] | None = None) -> None:
        """One batched step: per row the draft depth (a chain's length, a tree's deepest node: the
        per-position series count by depth), accepted drafts, emitted tokens and tree nodes."""
        nodes = drafted if nodes is None else nodes
        with self.lock:
            for n in nodes:
                self.node_counts[next((i for i, b in enumerate(NODE_BUCKETS) if n <= b), len(NODE_BUCKETS))] += 1
            self.totals["steps"] += 1
            for row in zip(drafted, accepted, emitted, nodes):
                self.row_stats.record_step(*row)
            self.row_stats.draft_seconds += draft_s
            self.row_stats.verify_seconds += verify_s
            self.rate_points.append((time.monotonic(), sum(emitted)))
        self.steps.inc()
        self.generation_tokens.inc(sum(emitted))
        self.draft_time.inc(draft_s)
        self.verify_time.inc(verify_s)
        for n in nodes:
            self.tree_nodes.observe(n)
        if not any(drafted):                        # a plain step: nothing per position
            return
        self.num_drafts.inc(sum(1 for n in drafted if n))
        self.num_draft_tokens.inc(sum(drafted))
        self.num_accepted.inc(sum(accepted))
        for n, a in zip(drafted, accepted):
            for i in range(n):
                self._position(i)[0].inc()
                if i < a:
                    self._position(i)[1].inc()

    def _position(self, i: int) -> tuple:
        """The (drafted, accepted) counters of draft position i (label lookups once per position)."""
        while len(self._per_pos) <= i:
            label = str(len(self._per_pos))
            self._per_pos.append((self.drafted_per_pos.labels(label), self.accepted_per_pos.labels(label)))
        return self._per_pos[i]

    def record_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """An admitted request's prompt looked up in the prefix cache (vLLM's counters, in tokens)."""
        with self.lock:
            self.totals["prefix_queries"] += prompt_tokens
            self.totals["prefix_hits"] += cached_tokens
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def record_tree_of(self, seqs, proposal, paths: list[list[int]], emitted: list[list[int]], decode) -> None:
        """The last verified draft (the dashboard draws it): of a step's widest draft, if any row
        drafted, the node tokens and parents (-1 = the root, the last committed token), the accepted
        path's node indices by depth, and the tokens the step emitted (the accepted ones, then the
        recovered or bonus token)."""
        counts = proposal.num_tokens.tolist()
        widest = max(range(len(seqs)), key=lambda b: counts[b])
        n = counts[widest]
        if not n:
            return
        tokens, accepted, out = proposal.tokens[widest, :n].tolist(), paths[widest], emitted[widest]
        tree = {"request_id": seqs[widest].request.id, "tokens": tokens, "texts": [decode([t]) for t in tokens],
                "parents": proposal.tree_parents()[widest, :n].tolist(), "accepted": accepted, "emitted": out,
                "emitted_texts": [decode([t]) for t in out],
                "extra_token": out[len(accepted)] if len(out) > len(accepted) else None, "t": round(time.time(), 3)}
        with self.lock:
            self.last_tree = tree

    def record_experts(self, rows: int, experts: float) -> None:
        """A MoE target's pass of `rows` rows read `experts` distinct experts per MoE layer."""
        self.moe_passes.inc()
        self.moe_pass_rows.inc(rows)
        self.moe_experts.inc(experts)
        self.moe_experts_per_pass.observe(experts)

    def record_threads(self, tuner) -> None:
        """The thread tuner's choice and its switches so far (engine/threads.py)."""
        self.threads.set(tuner.current)
        new = tuner.switches - self._thread_switches
        if new > 0:
            self.thread_switches.inc(new)
            self._thread_switches = tuner.switches


    def request_done(self, seq, reason: str, now: float) -> None:
        """A request ended: reason stop/length (success), abort or error."""
        with self.lock:
            key = {"abort": "aborted", "error": "failed"}.get(reason, "finished")
            self.totals[key] += 1
        if reason == "abort":
            self.aborted.inc()
            return
        if reason == "error":
            self.failed.inc()
            return
        self.success.labels(reason).inc()
        arrival = seq.request.arrival
        if seq.first_token_at is not None:
            self.ttft.observe(seq.first_token_at - arrival)
            if seq.num_output > 1:
                self.tpot.observe((seq.last_token_at - seq.first_token_at) / (seq.num_output - 1))
        self.e2e.observe(now - arrival)

    def set_counts(self, running: int, waiting: int, speculating: int, batch_off: bool) -> None:
        with self.lock:
            self.counts = dict(running=running, waiting=waiting, speculating=speculating, batch_off=batch_off)
        self.running.set(running)
        self.waiting.set(waiting)
        self.speculating.set(speculating)
        self.batch_disabled.set(int(batch_off))

    def sample(self) -> None:
        """One history point per second (called by the engine thread, busy or idle)."""
        now = time.monotonic()
        last_t, last = self._last_sample
        if now - last_t < 1.0:
            return
        with self.lock:
            r = self.row_stats
            drafted, accepted, emitted = r.drafted - last.drafted, r.accepted - last.accepted, r.emitted - last.emitted
            row_steps = r.steps - last.steps
            self.history.append({
                "t": round(time.time(), 3),
                "tokens_per_s": round(emitted / (now - last_t), 3),
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_accepted_length": round(emitted / row_steps, 4) if row_steps else 0.0,
                "running": self.counts["running"], "waiting": self.counts["waiting"]})
            self._last_sample = (now, replace(r))

    # ------------------------------------------------------------ readers
    def _rate(self) -> float:
        """Tokens emitted by the steps of the last RATE_WINDOW_S seconds, per second."""
        now = time.monotonic()
        points = self.rate_points
        while points and now - points[0][0] > RATE_WINDOW_S:
            points.popleft()
        window = min(RATE_WINDOW_S, max(now - self.started_mono, 1e-3))
        return sum(n for _, n in points) / window

    def kv_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        used = {name: (c.used_bytes() if c is not None else 0) for name, c in self.caches.items()}
        capacity = {name: (c.nbytes() if c is not None else 0) for name, c in self.caches.items()}
        return used, capacity

    def stats(self) -> dict:
        used, capacity = self.kv_bytes()
        with self.lock:
            t, r = self.totals, self.row_stats
            rate = self._rate()
            return {
                "model": self.model, "method": self.method, "uptime_s": round(time.time() - self.started, 3),
                "requests": {"running": self.counts["running"], "waiting": self.counts["waiting"],
                             "finished": t["finished"], "failed": t["failed"], "aborted": t["aborted"]},
                "speculation": {
                    "requests_on": self.counts["speculating"], "batch_auto_off": self.counts["batch_off"],
                    "k": self.k,
                    "acceptance_rate": round(r.acceptance_rate, 4),
                    "mean_accepted_length": round(r.mean_accepted_length, 4),
                    "tokens_per_step": round(r.emitted / t["steps"], 4) if t["steps"] else 0.0,
                    "acceptance_per_position": [round(x, 4) for x in r.acceptance_per_position],
                    "tree_nodes_mean": round(r.nodes / r.steps, 4) if r.steps else 0.0,
                    "tree_nodes_histogram": {(f"<={b}" if i < len(NODE_BUCKETS) else f">{NODE_BUCKETS[-1]}"): c
                                             for i, (b, c) in enumerate(zip(NODE_BUCKETS + (NODE_BUCKETS[-1],),
                                                                            self.node_counts))},
                    "last_tree": self.last_tree,
                    "draft_s": round(r.draft_seconds, 4), "verify_s": round(r.verify_seconds, 4),
                    "drafted_tokens": r.drafted, "accepted_tokens": r.accepted, "steps": t["steps"]},
                "throughput_tokens_per_s": round(rate, 3),
                "generated_tokens": r.emitted,
                "memory": {"weights_bytes": dict(self.weights_bytes), "kv_bytes_used": used,
                           "kv_bytes_capacity": capacity},
                "prefix_cache": self._prefix_stats(t),
                "history": list(self.history),
            }

    def _prefix_stats(self, totals: dict) -> dict:
        target = self.caches.get("target")
        on = target is not None and target.prefix_caching
        queries, hits = totals["prefix_queries"], totals["prefix_hits"]
        return {"enabled": on, "queried_tokens": queries, "hit_tokens": hits,
                "hit_rate": round(hits / queries, 4) if queries else 0.0,
                "cached_blocks": target.cached_blocks if on else 0,
                "cached_bytes": target.cached_blocks * target.block_bytes if on else 0}

    def render(self) -> bytes:
        used, capacity = self.kv_bytes()
        for name in used:
            self.kv_used.labels(name).set(used[name])
            self.kv_capacity.labels(name).set(capacity[name])
        target = self.caches.get("target")
        if target is not None and target.usable_blocks:
            self.kv_usage.set(target.used_blocks / target.usable_blocks)
        with self.lock:
            self.tokens_per_s.set(self._rate())
            self.acceptance_rate.set(self.row_stats.acceptance_rate)
            self.mean_accepted_length.set(self.row_stats.mean_accepted_length)
        return generate_latest(self.registry)
