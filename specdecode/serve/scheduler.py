"""Continuous batching: one engine thread; requests join and leave between steps.

Each iteration of the engine thread:
1. aborts   -- requests whose client went away leave the queue or the batch; blocks are freed;
2. admit    -- waiting requests (FIFO) take a free row once the KV blocks their prompt +
               max_tokens can need are reserved in the target (and draft) cache;
3. prefill  -- up to `prefill_chunk` prompt tokens of admitted requests, in one ragged pass
               (fewer while requests decode: a pass stalls them about `prefill_stall_ms`, prefill.py);
4. step     -- one speculative step over all decoding rows (`BatchEngine.step`: every row's
               drafts verified in one batched target pass, ragged acceptance), with each row's
               draft length chosen by the speculation policy; tokens stream out as events;
5. finish   -- finished rows release their blocks and rows.

Requests talk to the thread through `Request.sink` (a callable taking an event; the app
passes one that hands events to its asyncio loop). An exception inside an iteration fails
the requests in the batch (500, sanitized), frees their blocks, and the thread goes on.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..engine.shadows import shadow_period
from ..engine.engine import MAX_CHAIN, SPAN
from ..drafters.prediction import prediction_usage
from ..engine.sequence import attach_prediction
from ..footprint import kv_bytes_per_token
from ..params import ParamError, SamplingParams
from ..tree import MAX_TREE_NODES
from .batch import BatchEngine, ServeSequence
from .metrics import ServeMetrics
from .policy import AUTO, OFF, ON, RowPolicy, SpeculationPolicy
from .prefill import PrefillBudget
from .protocol import STREAM_INTERVAL_MS

log = logging.getLogger("specdecode.serve")
_ids = itertools.count(1)


@dataclass
class ServeConfig:
    max_batch_size: int = 16
    max_queue: int = 64
    max_model_len: int | None = None     # None: the target's context
    block_size: int = 16
    num_blocks: int = 0                  # 0: max_batch_size rows of max_model_len tokens, at most kv_cache_gb
    kv_cache_gb: float = 4.0             # the default pool's bound (target + draft), as vLLM's CPU KV space
    prefill_chunk: int = 256
    prefill_stall_ms: float = 100.0      # 0: always prefill_chunk tokens per pass
    num_speculative_tokens: int = 5      # default k of a request
    spec_max_batch_size: int | None = None   # speculation off for the batch above this many rows
    health_timeout: float = 10.0
    served_model_name: str | None = None
    prefix_cache: bool = True            # reuse earlier requests' prompt blocks (block_pool.py)
    prefix_cache_blocks: int | None = None   # most idle cached blocks kept (None: what the pool has free)
    prefix_cache_dir: str | None = None      # hot prefixes kept on disk across restarts (prefix_disk.py)
    prefix_cache_dir_bytes: int = 4 * 2**30  # the directory's size bound
    max_tokens_default: int = 2048       # max_tokens of a request that gives none (at most the rest of the context)
    stream_interval_ms: float = STREAM_INTERVAL_MS   # a stream's chunks at most this often (its first at once)

    def __post_init__(self) -> None:
        for name, low, high in (("max_batch_size", 1, 1024), ("max_queue", 1, 1_000_000), ("block_size", 1, 1024),
                                ("prefill_chunk", 1, 1_000_000), ("num_speculative_tokens", 0, MAX_TREE_NODES),
                                ("num_blocks", 0, 100_000_000), ("max_tokens_default", 1, 100_000_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ParamError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ParamError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.spec_max_batch_size is not None and self.spec_max_batch_size < 1:
            raise ParamError(f"spec_max_batch_size must be >= 1, got {self.spec_max_batch_size}")
        if isinstance(self.prefill_stall_ms, bool) or not isinstance(self.prefill_stall_ms, (int, float)) \
                or not 0 <= self.prefill_stall_ms <= 60_000:
            raise ParamError(f"prefill_stall_ms must be a number of milliseconds in [0, 60000], got {self.prefill_stall_ms!r}")
        if self.prefix_cache_blocks is not None and (isinstance(self.prefix_cache_blocks, bool) or
                                                     not isinstance(self.prefix_cache_blocks, int) or
                                                     self.prefix_cache_blocks < 0):
            raise ParamError(f"prefix_cache_blocks must be an integer >= 0, got {self.prefix_cache_blocks!r}")
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise ParamError("prefix_cache_dir needs the prefix cache (prefix_cache=True)")
        if isinstance(self.prefix_cache_dir_bytes, bool) or not isinstance(self.prefix_cache_dir_bytes, int) \
                or self.prefix_cache_dir_bytes < 0:
            raise ParamError(f"prefix_cache_dir_bytes must be an integer >= 0, got {self.prefix_cache_dir_bytes!r}")
        if isinstance(self.stream_interval_ms, bool) or not isinstance(self.stream_interval_ms, (int, float)) \
                or not 0 <= self.stream_interval_ms <= 10_000:
            raise ParamError(f"stream_interval_ms must be a number of milliseconds in [0, 10000], "
                             f"got {self.stream_interval_ms!r}")
        if isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, (int, float)) \
                or not 0 < self.kv_cache_gb <= 1e6:
            raise ParamError(f"kv_cache_gb must be a number of GB in (0, 1e6], got {self.kv_cache_gb!r}")
        if not self.health_timeout > 0:
            raise ParamError(f"health_timeout must be > 0 seconds, got {self.health_timeout}")

    def blocks(self, context: int, token_bytes: int = 0) -> int:
        """KV blocks per cache: --num-blocks, or enough for a full batch at the full context, but
        no more than kv_cache_gb holds at `token_bytes` per token (target + draft), and at least one
        request of the whole context (plus the scratch block). Requests reserve their prompt and
        max_tokens, so a pool smaller than the full batch at the full context still runs the full
        batch of ordinary requests."""
        per_row = -(-(context + 1) // self.block_size)
        if self.num_blocks:
            return self.num_blocks
        full = self.max_batch_size * per_row
        if token_bytes:
            full = min(full, max(per_row, int(self.kv_cache_gb * 2**30 // (token_bytes * self.block_size))))
        return full + 1


@dataclass
class Tokens:
    ids: list[int]
    kinds: list[str]          # "accepted" | "recovered" | "bonus" | "forced", one per id
    logprobs: list | None = None   # per id (token, logprob, [(token, logprob)] top N) when asked

    def copy(self) -> "Tokens":
        return Tokens(list(self.ids), list(self.kinds), None if self.logprobs is None else list(self.logprobs))

    def extend(self, later: "Tokens") -> None:
        """Append a later event's tokens of the same choice (several steps as one)."""
        self.ids += later.ids
        self.kinds += later.kinds
        if self.logprobs is not None:
            self.logprobs += later.logprobs or []


@dataclass
class Finished:
    reason: str               # "stop" | "length"
    stop_text_index: int | None
    usage: dict
    speculation: dict
    sequence: object = field(default=None, repr=False, compare=False)   # the finished ServeSequence (offline.py)


@dataclass
class Failed:
    status: int
    message: str


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The server is stopping (`Scheduler.drain`): new requests are refused with 503."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], None]
    speculate: bool | None = None
    num_speculative_tokens: int | None = None
    internal: bool = False            # health checks: not counted in request metrics, never queued out
    after: str | None = None          # admitted once this request (the first choice of the same prompt)
                                      # has been prefilled, so that its prompt blocks are shared
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.perf_counter)
    prefix_memo: dict = field(default_factory=dict)   # the prompt's block hashes per cache (admission)


class Scheduler:
    def __init__(self, target, drafter, config: ServeConfig, method: str, weights_bytes: dict[str, int]) -> None:
        self.config = config
        self.target = target
        self.context = config.max_model_len or target.model.max_len
        rows = config.max_batch_size
        draft = drafter.draft_model() if drafter is not None else None
        num_blocks = config.blocks(self.context, kv_bytes_per_token(target.model)
                                   + kv_bytes_per_token(draft.model if draft is not None else None))
        # one row more than the batch: the engine then always passes explicit rows to the model
        # (its batch-1 fused path needs a contiguous cache)
        self.max_k = MAX_TREE_NODES if drafter is not None and drafter.capabilities.drafts_trees else MAX_CHAIN
        self.engine = BatchEngine(target, drafter, self.max_k, self.context, rows + 1, num_blocks, config.block_size)
        self.disks = []                               # serve --prefix-cache-dir (prefix_disk.py)
        if config.prefix_cache:
            self.engine.enable_prefix_caching(config.prefix_cache_blocks)
            if config.prefix_cache_dir:
                from .prefix_disk import DiskPrefixCache
                self.disks = [DiskPrefixCache(config.prefix_cache_dir, c, config.prefix_cache_dir_bytes)
                              for c in self.engine.runner.caches if c.prefix_caching]
                for disk in self.disks:
                    log.info("prefix cache: %d blocks loaded from %s", disk.load(), disk.dir)
        self.inner_drafter = drafter
        self.prefill_budget = PrefillBudget(config.prefill_chunk, config.prefill_stall_ms / 1000)
        caps = drafter.capabilities if drafter is not None else None
        # a drafter without per-request state (a lookup) can draft for switched-off rows for free
        self.policy = SpeculationPolicy(shadow=caps is not None and not caps.has_state,
                                        draft_cost=caps.relative_cost if caps is not None else 0.01,
                                        max_batch_size=config.spec_max_batch_size)
        # shadow drafts take at most SHADOW_SHARE of the steps' time (engine/shadows.py): their
        # seconds (drafts + scoring) and a step's, moving averages; shadows every `period` steps
        self.shadow_seconds = self.step_seconds = 0.0
        self.shadow_steps = 0
        self.shadowed_now = False             # this step drafted shadows (their cost is measured)
        self.metrics = ServeMetrics(config.served_model_name or target.name, method if drafter else "none",
                                    config.num_speculative_tokens if drafter else 0, weights_bytes,
                                    {"target": self.engine.cache, "draft": self.engine.draft_state})
        self.cond = threading.Condition()
        self.gate = threading.Lock()              # held by `hold()`: the engine thread waits
        self.inbox: deque[Request] = deque()
        self.aborts: set[str] = set()
        self.free_rows = list(range(rows - 1, -1, -1))
        self.prefilling: list[ServeSequence] = []
        self.running: list[ServeSequence] = []
        self._before: dict[int, tuple] = {}
        self._stop = False
        self.drain_deadline: float | None = None   # set by `drain`: no new requests; ends at this time
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------ any thread
    def submit(self, request: Request) -> None:
        with self.cond:
            if self.drain_deadline is not None or self._stop:
                raise ShuttingDown("the server is shutting down; retry on another server")
            if not request.internal and sum(not r.internal for r in self.inbox) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting, --max-queue); "
                                f"retry later")
            if request.internal:
                self.inbox.appendleft(request)      # a health check takes the next free row
            else:
                self.inbox.append(request)
            self.cond.notify()

    def abort(self, request_id: str) -> None:
        with self.cond:
            waiting = len(self.inbox)
            self.inbox = deque(r for r in self.inbox if r.id != request_id)
            if len(self.inbox) == waiting:          # not waiting: leaves the batch between two steps
                self.aborts.add(request_id)
                self.cond.notify()

    def start(self) -> None:
        """Run the engine loop in a thread of its own (tests, notebooks, Ray replicas). `specdecode
        serve` runs it on the process's main thread instead (`run`): the native kernels' OpenMP
        workers then keep spinning between passes; a second thread's parallel regions get a
        second worker pool, and with more pooled threads than cores libgomp puts its workers to
        sleep after every region (a 1.6 ms step of the embedded model took 6.5 ms)."""
        self._stop = False
        self.thread = threading.Thread(target=self.run, name="specdecode-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop now: what is queued or running ends with a 503 error."""
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        self._fail_all("the server is shutting down")

    def drain(self, timeout: float) -> None:
        """Graceful stop: new requests are refused (`ShuttingDown`); those queued or running go
        on for up to `timeout` seconds, then end with a 503 error; `run` then returns."""
        with self.cond:
            deadline = time.monotonic() + max(timeout, 0.0)
            self.drain_deadline = min(deadline, self.drain_deadline or deadline)
            self.cond.notify()

    def _fail_all(self, message: str) -> None:
        with self.cond:
            inbox, self.inbox = list(self.inbox), deque()
        for s in self.prefilling + self.running:
            self._end(s, "abort", Failed(503, message))
        self.prefilling, self.running = [], []
        for r in inbox:
            r.sink(Failed(503, message))

    def in_flight(self) -> int:
        """Requests queued or in the batch (health checks included)."""
        return len(self.inbox) + len(self.prefilling) + len(self.running)

    @contextlib.contextmanager
    def hold(self):
        """Keep the engine thread between iterations (queue and admission can be observed)."""
        with self.gate:
            yield

    # ------------------------------------------------------------ engine thread
    def run(self) -> None:
        """The engine loop, in the calling thread, until `stop`, or until a `drain` ends."""
        while True:
            with self.cond:
                busy = bool(self.inbox or self.aborts or self.prefilling or self.running)
                if self.drain_deadline is not None and (not busy or time.monotonic() >= self.drain_deadline):
                    break
                if not self._stop and not busy and not self._persist(limit=8):
                    self.cond.wait(timeout=1.0)
                if self._stop:
                    return
                aborts, self.aborts = self.aborts, set()
            try:
                with self.gate:
                    self._iteration(aborts)
                self.metrics.sample()
            except Exception:  # noqa: BLE001 -- the engine thread never dies
                log.exception("engine loop error")
                time.sleep(0.1)
        with self.gate:                              # a drain's time is up
            self._fail_all("the server is shutting down and this request did not finish in time "
                           "(--shutdown-timeout)")
            self._publish_counts()
            for disk in self.disks:                  # what the caches hold, for the next start
                disk.note_all()
            self._persist(limit=None)

    def run_until_idle(self) -> None:
        """Run iterations on the calling thread until nothing is queued or running (an offline
        batch: offline.py); the loop of `run` for a caller that submitted all its requests."""
        while self.in_flight():
            with self.gate:
                self._iteration(set())
            self.metrics.sample()

    def _persist(self, limit: int | None) -> bool:
        """Write up to `limit` blocks per disk cache (serve --prefix-cache-dir); True if more wait."""
        more = False
        for disk in self.disks:
            if disk.pending:
                more = disk.flush(limit) > 0 or more
        return more

    def _iteration(self, aborts: set[str]) -> None:
        try:
            self._apply_aborts(aborts)
            self._admit()
            self._prefill_some()
            self._step()
        except Exception as exc:  # noqa: BLE001 -- fail the batch, keep serving
            log.exception("engine step failed; failing %d request(s)", len(self.prefilling) + len(self.running))
            for s in self.prefilling + self.running:
                self._end(s, "error", Failed(500, f"internal error while generating ({type(exc).__name__}); "
                                                  f"the request was aborted"))
            self.prefilling, self.running = [], []
        self._publish_counts()

    def _publish_counts(self) -> None:
        active = self.prefilling + self.running
        on = sum(1 for s in active if s.drafts_ever and (s.policy.mode == ON or (s.policy.on and self.policy.batch_on)))
        self.metrics.set_counts(len(active), len(self.inbox), on, not self.policy.batch_on)

    def _apply_aborts(self, ids: set[str]) -> None:
        if not ids:
            return
        with self.cond:
            self.inbox = deque(r for r in self.inbox if r.id not in ids)
        for group in (self.prefilling, self.running):
            for s in [s for s in group if s.request.id in ids]:
                group.remove(s)
                self._end(s, "abort", None)

    def _speculates(self, request: Request) -> bool:
        return not (self.engine.drafter is None or request.speculate is False or request.num_speculative_tokens == 0)

    def _admit(self) -> None:
        while self.free_rows:
            with self.cond:
                if not self.inbox:
                    return
                request = self.inbox[0]
                if request.after is not None and (any(s.request.id == request.after for s in self.prefilling)
                                                  or any(r.id == request.after for r in self.inbox)):
                    return                      # a later choice waits for the first one's prompt blocks
                tokens = len(request.prompt_ids) + request.params.max_tokens
                hits = self.engine.match(request.prompt_ids, self._speculates(request), request.prefix_memo)
                if not self.engine.can_admit(tokens, hits):
                    return                      # FIFO: the head waits for blocks
                self.inbox.popleft()
            row = self.free_rows.pop()
            try:
                seq = self._new_sequence(request, row, tokens, hits)
            except Exception as exc:  # noqa: BLE001 -- this request fails, the row goes back
                self.engine.release(row)
                self.free_rows.append(row)
                if isinstance(exc, ParamError):        # a bad request the parser could not see
                    request.sink(Failed(400, str(exc)))
                else:
                    log.exception("admitting %s failed", request.id)
                    request.sink(Failed(500, f"internal error while admitting the request ({type(exc).__name__})"))
                continue
            (self.prefilling if seq.prefilled < seq.prefill_target else self.running).append(seq)
            if not request.internal:
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
                if self.engine.cache.prefix_caching:
                    self.metrics.record_prefix(len(request.prompt_ids), seq.cached_tokens)
            for disk in self.disks:                  # a hit: a hot prefix, worth keeping on disk
                disk.note(hits.get(id(disk.cache), ()))

    def _new_sequence(self, request: Request, row: int, tokens: int, hits: dict) -> ServeSequence:
        covered = self.engine.admit(row, tokens, hits)
        if not self._speculates(request):
            mode, k = OFF, 0
        else:
            mode = ON if request.speculate else AUTO
            k = min(request.num_speculative_tokens or self.config.num_speculative_tokens, self.max_k)
        copies = (self.inner_drafter is not None and self.inner_drafter.capabilities.copies
                  and request.num_speculative_tokens is None)          # a k of the request's own is its cap
        policy = RowPolicy(mode=mode, k=k, probe_wait=self.policy.probe_interval,
                           span=min(SPAN, self.max_k) if copies and mode != OFF else 0)
        seq = ServeSequence(request, request.prompt_ids, request.params, self.target.eos_token_ids, row,
                            policy, self.target.model.device)
        seq.prefilled = seq.cached_tokens = covered
        attach_prediction(seq, self.target.tokenizer)
        if request.params.structured is not None:         # the grammar's state (structured.py)
            from ..structured import grammar_tokenizer
            seq.constraint = grammar_tokenizer(self.target).constraint(request.params.structured)
        return seq

    def _prefill_some(self) -> None:
        budget, chunks = self.prefill_budget.tokens(decoding=bool(self.running)), []
        # shortest remaining prompt first: a short request is not queued behind a long prompt's
        # chunks (FIFO kept a chat 22 s behind a 4,000-token prefill); the long one gets the rest
        for s in sorted(self.prefilling, key=lambda s: s.prefill_target - s.prefilled):
            n = min(s.prefill_target - s.prefilled, budget)
            chunks.append((s, n))
            budget -= n
            if budget == 0:
                break
        if not chunks:
            return
        started = time.perf_counter()
        self.engine.prefill(chunks)
        self.prefill_budget.observe(sum(n for _, n in chunks), time.perf_counter() - started)
        done = [s for s in self.prefilling if s.prefilled == s.prefill_target]
        self.prefilling = [s for s in self.prefilling if s.prefilled < s.prefill_target]
        self.running += done

    def _step(self) -> None:
        seqs = self.running
        if not seqs:
            return
        ks, decisions = self.policy.plan([s.policy for s in seqs])
        for s, k in zip(seqs, ks):
            s.k_now = k
        shadow_started = time.perf_counter()
        self._shadow_drafts(seqs)
        shadow_spent = time.perf_counter() - shadow_started
        before = [(s.stats.drafted, s.stats.accepted, s.stats.emitted, s.stats.draft_seconds,
                   s.stats.verify_seconds) for s in seqs]
        self._before = {id(s): b for s, b in zip(seqs, before)}
        started = time.perf_counter()
        report = self.engine.step(seqs, self._on_tokens)
        seconds = time.perf_counter() - started
        drafted = [s.stats.drafted - b[0] for s, b in zip(seqs, before)]
        accepted = [s.stats.accepted - b[1] for s, b in zip(seqs, before)]
        emitted = [s.stats.emitted - b[2] for s, b in zip(seqs, before)]
        decisions += self.policy.observe([s.policy for s in seqs], ks, drafted, accepted, seconds)
        shadow_started = time.perf_counter()
        decisions += self._score_shadows(seqs)
        self._time_shadows(shadow_spent + time.perf_counter() - shadow_started, seconds)
        self.metrics.record_step(drafted, accepted, emitted, seqs[0].stats.draft_seconds - before[0][3],
                                 seqs[0].stats.verify_seconds - before[0][4], nodes=report.num_nodes)
        self._record_tree(seqs, report)
        self.metrics.record_decisions(decisions)
        if self.engine.loop.threads is not None:
            self.metrics.record_threads(self.engine.loop.threads)
        for s in seqs:
            if s.finished:
                self._end(s, s.finish_reason, None)
        self.running = [s for s in seqs if not s.finished]

    def _record_tree(self, seqs: list[ServeSequence], report) -> None:
        """The dashboard's last verified tree: the widest draft of this step, if any row drafted."""
        widest = max(range(len(seqs)), key=lambda b: report.num_nodes[b])
        if not report.num_nodes[widest]:
            return
        decode = self.target.tokenizer.decode
        tokens, emitted = report.node_tokens[widest], report.emitted[widest]
        self.metrics.record_tree(seqs[widest].request.id, tokens, [decode([t]) for t in tokens],
                                 report.node_parents[widest], report.accepted_nodes[widest],
                                 emitted, [decode([t]) for t in emitted])

    def _on_tokens(self, s: ServeSequence, tokens: list[int]) -> None:
        drafted0, accepted0 = self._before[id(s)][:2]
        drafted, accepted = s.stats.drafted - drafted0, s.stats.accepted - accepted0
        if s.forced_now:                 # a grammar's forced tokens (jump-forward, engine.py)
            kinds = ["forced"] * len(tokens)
        else:
            kinds = ["accepted"] * min(accepted, len(tokens))
            if len(tokens) > accepted:
                kinds.append("recovered" if accepted < drafted else "bonus")
        now = time.perf_counter()
        if s.first_token_at is None:
            s.first_token_at = now
        s.last_token_at = now
        lps = s.logprobs[len(s.logprobs) - len(tokens):] if s.params.logprobs is not None else None
        s.request.sink(Tokens(list(tokens), kinds, lps))

    # ------------------------------------------------------------ free scoring of lookup drafts
    def _shadow_drafts(self, seqs: list[ServeSequence]) -> None:
        """Shadow drafts for the switched-off rows with none pending, in one propose call, every
        `period` steps: a propose per row per step cost 24 rows of the embedded model ~1 ms of a
        ~20 ms step (24 requests in one call: 0.96x plain)."""
        self.shadowed_now = False
        if not self.policy.shadow:
            return
        fresh, rooms = [], []
        for s in seqs:
            r = s.policy
            if r.mode != AUTO or s.k_now > 0 or r.shadow is not None or (r.on and self.policy.batch_on):
                continue
            room = min(r.k, s.params.max_tokens - s.num_output - 1)
            if room > 0:
                fresh.append(s)
                rooms.append(room)
        if not fresh:
            return
        self.shadow_steps += 1
        if self.shadow_steps % shadow_period(self.shadow_seconds, self.step_seconds):
            return
        self.shadowed_now = True
        for s, (_, draft) in zip(fresh, self.inner_drafter.propose(fresh, rooms).main_paths()):
            if draft:
                s.policy.shadow = (s.num_output, draft)

    def _time_shadows(self, spent: float, step: float) -> None:
        """Moving averages of the shadow seconds (drafts and scoring) of a step that drafted shadows,
        and of a step's seconds."""
        if self.shadowed_now:
            past = 0.7 if self.shadow_seconds else 0.0
            self.shadow_seconds = past * self.shadow_seconds + (1 - past) * spent
        past = 0.7 if self.step_seconds else 0.0
        self.step_seconds = past * self.step_seconds + (1 - past) * step

    def _score_shadows(self, seqs: list[ServeSequence]) -> list:
        decisions = []
        for s in seqs:
            if s.policy.shadow is None:
                continue
            start, draft = s.policy.shadow
            out = s.output_ids[start:]
            matched = next((i for i, (a, b) in enumerate(zip(draft, out)) if a != b), min(len(draft), len(out)))
            if matched < len(out) or len(out) >= len(draft):
                drafted = len(draft)
            elif s.finished:
                drafted = len(out)
            else:
                continue                        # not decided yet
            s.policy.shadow = None
            self.metrics.shadow.inc()
            decisions += self.policy.observe_shadow(s.policy, len(seqs), drafted, matched)
        return decisions

    # ------------------------------------------------------------ the end of a request
    def _end(self, s: ServeSequence, reason: str, event) -> None:
        self.engine.release(s.row)
        self.free_rows.append(s.row)
        if event is None and reason in ("stop", "length"):
            st = s.stats
            event = Finished(reason, s.stop_text_index,
                             {"prompt_tokens": s.prompt_len, "completion_tokens": s.num_output,
                              "total_tokens": s.prompt_len + s.num_output,
                              "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
                              "completion_tokens_details": prediction_usage(
                                  s.prediction.ids if s.prediction is not None else [], s.output_ids)},
                             {"mode": s.policy.mode, "num_speculative_tokens": s.policy.k,
                              "on_at_end": s.policy.mode == ON or (s.policy.mode == AUTO and s.policy.on
                                                                    and self.policy.batch_on),
                              "steps": st.steps, "drafted_tokens": st.drafted, "accepted_tokens": st.accepted,
                              "acceptance_rate": round(st.acceptance_rate, 4),
                              "mean_accepted_length": round(st.mean_accepted_length, 4)}, s)
        if event is not None:
            s.request.sink(event)
        if not s.request.internal:
            self.metrics.request_done(s, reason, time.perf_counter())
