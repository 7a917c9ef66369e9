"""The engine core: continuous batching of speculative steps over paged KV caches, under every
front (`LLM.generate` runs it on the calling thread, `specdecode serve` on its engine thread).

Requests are submitted from any thread (`submit`, `abort`); events come back through each
request's sink: `Tokens` as they are committed, then `Finished` or `Failed`. Each iteration
(`iterate`) is:

1. schedule -- aborted requests leave; queued requests take a free row once their blocks are
   reserved; the next prompt chunks are prefilled (scheduler.py);
2. plan     -- each decoding row's draft size (controller.py);
3. draft    -- a grammar's forced tokens first (jump-forward), then the drafter's proposal for the
   rows that draft; for rows that do not, shadow drafts (a stateless drafter's free measurements)
   or drafts that cost nothing to make (a cascade's lookups) where verifying them pays;
4. verify   -- one target pass over every row's pending tokens and drafts, then verification
   (runner.py; the verifier is a pure function, verify.py / verify_tree.py);
5. commit   -- tokens appended (stops applied), caches rolled back to what was accepted, the
   drafter told, full blocks registered for prefix caching;
6. report   -- stats, the controller's measurements, events; finished rows release their blocks.

An exception inside an iteration fails the requests in the batch (500, sanitized), frees their
rows, and the engine goes on.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from ..drafters.base import DrafterError, DraftProposal
from ..drafters.prediction import prediction_usage
from ..footprint import kv_bytes_per_token
from ..params import ParamError
from ..structured import FORCED_MAX, grammar_tokenizer, trim_drafts
from ..tree import MAX_TREE_NODES, depths
from .config import MAX_CHAIN, SPAN, EngineConfig
from .controller import AUTO, OFF, ON, YOUNG, SpeculationController
from .costs import StepCosts
from .runner import SLACK, ModelRunner
from .scheduler import Scheduler
from .sequence import Failed, Finished, Request, Sequence, Tokens
from .threads import ThreadTuner

log = logging.getLogger("specdecode.engine")
MAX_CURVE_ROWS = 16     # the start-up cost curve's largest pass (beyond, its last segment; the steps correct it)


def tree_depths(proposal: DraftProposal) -> list[int]:
    """Each row's draft depth (a chain's length): the draft positions acceptance is counted at."""
    if not proposal.is_tree or proposal.k == 0:
        return proposal.num_tokens.tolist()
    live = torch.arange(proposal.k)[None, :] < proposal.num_tokens.cpu()[:, None]
    return torch.where(live, depths(proposal.parents), 0).max(dim=1).values.tolist()


class EngineCore:
    def __init__(self, target, drafter, config: EngineConfig, metrics=None, rows: int | None = None,
                 num_blocks: int | None = None) -> None:
        """`rows` / `num_blocks`: the engine's rows and KV blocks per cache when not the config's
        (the Python front starts small and grows: `grow`); `metrics`: an observer with the methods
        of serve/metrics.ServeMetrics, or None."""
        self.config = config
        self.target = target
        self.drafter = drafter if config.num_speculative_tokens > 0 else None
        caps = self.drafter.capabilities if self.drafter is not None else None
        if caps is not None and caps.drafts_trees and not target.model.supports_trees:
            raise DrafterError(f"method {self.drafter.name!r} drafts trees, and {target.name} verifies chains only "
                               f"(recurrent layers, or the transformers adapter): use a chain drafter such as "
                               f"ngram or model")
        self.context = config.max_model_len or target.model.max_len
        self.max_k = MAX_TREE_NODES if caps is not None and caps.drafts_trees else MAX_CHAIN
        rows = rows or config.max_batch_size
        draft = self.drafter.draft_model() if self.drafter is not None else None
        if num_blocks is None:
            num_blocks = config.blocks(self.context, kv_bytes_per_token(target.model)
                                       + kv_bytes_per_token(draft.model if draft is not None else None))
        full = rows == config.max_batch_size      # the server's engine: every row may hold the whole context
        self.runner = ModelRunner(target, self.drafter, rows, self.context, num_blocks if target.native else 0,
                                  config.block_size, self.context + SLACK if full else 0)
        self.scheduler = Scheduler(config, rows)
        # a model whose passes run fastest up to some length (Qwen3.5's one-call stack) prefills in such chunks
        best = getattr(target.model, "prefill_tokens", None)
        if best:
            self.scheduler.budget.chunk = min(self.scheduler.budget.chunk, best)
        self.disks = []                               # prefix blocks on disk (cache/disk.py)
        if config.prefix_cache:
            self.runner.enable_prefix_caching(config.prefix_cache_blocks)
            if config.prefix_cache_dir:
                from ..cache.disk import DiskPrefixCache
                self.disks = [DiskPrefixCache(config.prefix_cache_dir, c, config.prefix_cache_dir_bytes)
                              for c in self.runner.caches if getattr(c, "prefix_caching", False)]
                for disk in self.disks:
                    log.info("prefix cache: %d blocks loaded from %s", disk.load(), disk.dir)
        self.costs = StepCosts({1: 1.0}, draft_cost=caps.relative_cost if caps is not None else None,
                               passes=caps is not None and caps.has_state)
        self.curve_rows = 0                           # the cost curve is measured up to this many rows
        self.controller = SpeculationController(caps, self.costs, config.adaptive)
        self.threads = ThreadTuner() if target.model.device.type == "cpu" else None
        self.metrics = metrics
        self.gate = threading.Lock()                  # held by an iteration (a test holds it to look between two)
        self.stopping = False
        self.drain_deadline: float | None = None      # set by `drain`: no new requests; ends at this time
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ any thread
    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def in_flight(self) -> int:
        return self.scheduler.in_flight()

    def start(self) -> None:
        """Run the engine loop in a thread of its own (tests, notebooks, Ray replicas). `specdecode
        serve` runs it on the process's main thread instead (`run`): the native kernels' OpenMP
        workers then keep spinning between passes (a second thread's parallel regions get a second
        worker pool, whose workers sleep after every region)."""
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="specdecode-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop now: what is queued or running ends with a 503 error."""
        with self.scheduler.cond:
            self.stopping = self.scheduler.closed = True
            self.scheduler.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        self._fail_all("the server is shutting down")

    def drain(self, timeout: float) -> None:
        """Graceful stop: new requests are refused; those queued or running go on for up to `timeout`
        seconds, then end with a 503 error; `run` then returns."""
        with self.scheduler.cond:
            deadline = time.monotonic() + max(timeout, 0.0)
            self.drain_deadline = min(deadline, self.drain_deadline or deadline)
            self.scheduler.closed = True
            self.scheduler.cond.notify()

    def _fail_all(self, message: str) -> None:
        inbox, rows = self.scheduler.take_all()
        for s in rows:
            self._end(s, "abort", Failed(503, message))
        for r in inbox:
            r.sink(Failed(503, message))

    # ------------------------------------------------------------------ the engine thread
    def run(self) -> None:
        """The engine loop, in the calling thread, until `stop`, or until a `drain` ends."""
        sched = self.scheduler
        while True:
            with sched.cond:
                busy = sched.busy()
                if self.drain_deadline is not None and (not busy or time.monotonic() >= self.drain_deadline):
                    break
                if not self.stopping and not busy:
                    sched.cond.wait(timeout=1.0)
                if self.stopping:
                    return
            with self.gate:
                self.iterate()
            if self.metrics is not None:
                self.metrics.sample()
        with self.gate:                              # a drain's time is up
            self._fail_all("the server is shutting down and this request did not finish in time "
                           "(--shutdown-timeout)")
            self._publish_counts([])
            if self.disks:                           # what the caches hold, for the next start
                from ..cache.disk import write_all
                write_all(self.disks)

    def run_until_idle(self) -> None:
        """Iterate on the calling thread until nothing is queued or running (`LLM.generate`)."""
        while self.scheduler.busy():
            with self.gate:
                self.iterate()

    def iterate(self) -> None:
        """One iteration (module docstring); a failure fails the batch, not the engine."""
        sched = self.scheduler
        try:
            for s in sched.take_aborts():
                self._end(s, "abort", None)
            self._admit()
            self._prefill()
            if sched.running:
                self.step(sched.running)
                finished = [s for s in sched.running if s.finished]
                sched.running = [s for s in sched.running if not s.finished]
                for s in finished:
                    self._end(s, s.finish_reason, None)
        except Exception as exc:  # noqa: BLE001 -- fail the batch, keep serving
            log.exception("engine step failed; failing %d request(s)", len(sched.prefilling) + len(sched.running))
            rows, sched.prefilling, sched.running = sched.prefilling + sched.running, [], []
            why = (str(exc) if isinstance(exc, DrafterError)
                   else f"internal error while generating ({type(exc).__name__})")
            for s in rows:                # a drafter's own error names what is wrong; anything else is sanitized
                self._end(s, "error", Failed(500, f"{why}; the request was aborted"))
        self._publish_counts(sched.running)

    # ------------------------------------------------------------------ 1. schedule
    def _admit(self) -> None:
        runner, sched = self.runner, self.scheduler
        while (request := sched.head()) is not None:
            hits = ({} if request.params.prompt_logprobs is not None     # every prompt position computed
                    else runner.match(request.prompt_ids, self._drafts(request), request.prefix_memo))
            if not runner.can_admit(len(request.prompt_ids) + request.params.max_tokens, hits):
                return                                 # FIFO: the head waits for blocks
            row = sched.take(request)
            if row is None:
                continue
            try:
                s = self._new_sequence(request, row, hits)
            except Exception as exc:  # noqa: BLE001 -- this request fails, the row goes back
                runner.release(row)
                sched.release(row)
                if isinstance(exc, ParamError):       # a bad request the parser could not see
                    request.sink(Failed(400, str(exc)))
                else:
                    log.exception("admitting %s failed", request.id)
                    request.sink(Failed(500, f"internal error while admitting the request ({type(exc).__name__})"))
                continue
            sched.place(s)
            if self.metrics is not None and not request.internal:
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
                if getattr(runner.cache, "prefix_caching", False):
                    self.metrics.record_prefix(len(request.prompt_ids), s.stats.cached_tokens)
            for disk in self.disks:                   # a hit no longer on disk (dropped, trimmed): again
                disk.note(hits.get(id(disk.cache), ()))

    def _drafts(self, request: Request) -> bool:
        """May this request's row draft at all?"""
        return not (self.drafter is None or request.speculate is False or request.num_speculative_tokens == 0)

    def _new_sequence(self, request: Request, row: int, hits: dict) -> Sequence:
        covered = self.runner.admit(row, len(request.prompt_ids) + request.params.max_tokens, hits)
        params = request.params
        if not self._drafts(request):
            spec = self.controller.new_row(0, OFF)
        else:
            k = min(request.num_speculative_tokens or self.config.num_speculative_tokens, self.max_k)
            copies = self.drafter.capabilities.copies and request.num_speculative_tokens is None
            pinned = params.seed is not None and not params.greedy and self.drafter.capabilities.has_state
            spec = self.controller.new_row(k, ON if request.speculate else AUTO,
                                           span=min(SPAN, self.max_k) if copies else 0, pinned=pinned,
                                           predicted=params.prediction is not None, sampled=not params.greedy)
        s = Sequence(request, self.target.eos_token_ids, row, spec, self.target.model.device)
        s.prefilled = s.stats.cached_tokens = covered
        if params.prediction is not None:
            from ..drafters.prediction import PredictionIndex
            s.prediction = PredictionIndex(self.target.tokenizer.encode(params.prediction, add_special=False))
        if params.structured is not None:             # the grammar's state (structured.py)
            s.constraint = grammar_tokenizer(self.target).constraint(params.structured)
        return s

    def _prefill(self) -> None:
        sched = self.scheduler
        chunks = sched.prefill_chunks()
        if not chunks:
            return
        started = time.perf_counter()
        self.runner.prefill(chunks)
        drafting = [(s, n) for s, n in chunks if s.spec.mode != OFF]
        if self.runner.draft_cache is not None and drafting:
            self.runner.prefill(drafting, draft=True)
        for s, n in chunks:
            s.prefilled += n
        self.runner.register([s for s, _ in chunks])
        seconds = time.perf_counter() - started
        sched.budget.observe(sum(n for _, n in chunks), seconds)
        for s, _ in chunks:
            s.stats.prefill_seconds += seconds
        done = [s for s in sched.prefilled() if s.spec.mode != OFF]
        if done and self.drafter is not None:
            self.drafter.prefill(done)

    # ------------------------------------------------------------------ one step
    def step(self, seqs: list[Sequence]) -> None:
        """2. plan, 3. draft, 4. verify, 5. commit, 6. report, for the decoding rows `seqs`."""
        if self.threads is not None:
            self.threads.before()
        t0 = time.perf_counter()
        sizes = self._plan(seqs)
        forced = self._jump_forward(seqs, sizes)
        proposal, drafted = self._draft(seqs, sizes)
        t1 = time.perf_counter()
        target_probs, target_tokens, logprobs = self.runner.score(seqs, proposal)
        paths, emitted = self.runner.verify(seqs, proposal, target_probs, target_tokens)
        t2 = time.perf_counter()
        pass_rows = sum(len(s.token_ids) - self.runner.cache.lengths[s.row] for s in seqs) + proposal.num_tokens.sum()
        if self.threads is not None:
            self.threads.after(t2 - t0, int(pass_rows))
        appended = self._commit(seqs, proposal, drafted, paths, emitted, logprobs)
        self._report(seqs, sizes, proposal, paths, forced, appended, int(pass_rows), t1 - t0, t2 - t1, drafted[2])

    def _plan(self, seqs: list[Sequence]) -> list[int]:
        """Each row's drafts this step: the controller's size within the row's room."""
        if self.drafter is None:
            return [0] * len(seqs)
        self.measure_costs(len(seqs))
        pending = [len(s.token_ids) - self.runner.cache.lengths[s.row] for s in seqs]
        sizes = self.controller.plan([s.spec for s in seqs], pending)
        limit = self.config.spec_max_batch_size
        if limit is not None and len(seqs) > limit:
            sizes = [k if s.spec.mode == ON else 0 for s, k in zip(seqs, sizes)]
        return [s.draft_room(k, self.context) for s, k in zip(seqs, sizes)]

    def measure_costs(self, batch: int) -> None:
        """The start-up cost curve, up to the rows this batch may verify (measured once per doubling,
        on a free row)."""
        need = min(MAX_CURVE_ROWS, batch * (self.config.num_speculative_tokens + 1))
        if need <= self.curve_rows or not self.scheduler.free_rows or not self.config.adaptive:
            return
        if self.curve_rows and need < 2 * self.curve_rows:
            return
        row = self.scheduler.free_rows[-1]
        self.costs.extend(self.runner.cost_curve(row, need))
        self.curve_rows = need

    def _jump_forward(self, seqs: list[Sequence], sizes: list[int]) -> list[list[int]]:
        """Structured output: the tokens a row's grammar allows alone have probability 1 under the
        masked target distribution, whatever the logits: committed now, written by this step's pass
        as pending tokens (not for rows with stop strings: a stop string may cut them; never an end
        of sequence, never past max_tokens - 1). Returns each row's tokens; lowers its draft room."""
        counts: list[list[int]] = [[] for _ in seqs]
        if self.drafter is None:
            return counts
        for b, s in enumerate(seqs):
            if s.constraint is None or s.params.stop:
                continue
            forced = s.constraint.forced(s.draft_room(FORCED_MAX, self.context))   # no end of sequence
            if not forced:
                continue
            appended = s.append(forced)
            s.constraint.consume(forced[:appended])
            if s.params.logprobs is not None:     # probability 1 under the masked distribution
                s.logprobs += [(t, 0.0, [(t, 0.0)][:s.params.logprobs]) for t in forced[:appended]]
            s.stats.emitted += appended
            counts[b] = forced[:appended]
            sizes[b] = s.draft_room(sizes[b], self.context)
        return counts

    def _draft(self, seqs: list[Sequence], sizes: list[int]) -> tuple[DraftProposal, tuple]:
        """The proposal over every row (rows at size 0 have none), and what the drafter's commit
        gets: (drafting row indices, their own proposal). Shadow drafts for the other rows."""
        active = [i for i, k in enumerate(sizes) if k > 0]
        self._shadow(seqs, sizes)
        free = self._free_drafts(seqs, sizes)
        if not active:
            if free:
                return DraftProposal.from_lists([free.get(b, []) for b in range(len(seqs))]), ([], None, free)
            return DraftProposal.empty(len(seqs)), ([], None, free)
        rows = [seqs[i] for i in active]
        sub = self.drafter.propose(rows, [sizes[i] for i in active])
        if not isinstance(sub, DraftProposal) or sub.tokens.shape[0] != len(rows):
            raise DrafterError(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r}: propose "
                               f"must return a DraftProposal of {len(rows)} rows (one per sequence), got "
                               f"{type(sub).__name__}" + (f" of {sub.tokens.shape[0]} rows"
                                                          if isinstance(sub, DraftProposal) else ""))
        sub = sub.simplified()
        caps = self.drafter.capabilities
        if sub.probs is None and not caps.has_state and not caps.commit_reads_nodes \
                and any(s.constraint is not None for s in rows):
            sub = trim_drafts(rows, sub)          # a grammar trims point-mass drafts the target could never accept
        if sub.parents is not None:
            free = {}                             # (free chains join chain proposals only)
        if len(active) == len(seqs):
            return sub, (active, sub, free)
        full = sub.scatter(active, len(seqs), max([sub.k] + [len(d) for d in free.values()])).put_chains(free)
        full.step_state = sub.step_state          # observe_topk reads the drafter's own step state
        return full, (active, sub, free)

    def _free_drafts(self, seqs: list[Sequence], sizes: list[int]) -> dict[int, list[int]]:
        """Drafts that cost nothing to make (a cascade's lookups) for the rows planned plain, where
        the controller predicts that verifying them pays: {row index: chain}."""
        if self.drafter is None or not self.drafter.capabilities.free_drafts:
            return {}
        idle = [i for i, (s, k) in enumerate(zip(seqs, sizes)) if k == 0 and s.spec.mode == AUTO
                and not s.spec.pinned and s.constraint is None]
        if not idle:
            return {}
        rows = sum(len(s.token_ids) - self.runner.cache.lengths[s.row] for s in seqs) + sum(sizes)
        rooms = [seqs[i].draft_room(min(max(SPAN, seqs[i].spec.k), self.max_k), self.context) for i in idle]
        chains = self.drafter.free_drafts([seqs[i] for i in idle], rooms,
                                          lambda n, a: self.controller.free_draft_pays(rows, len(seqs), n, a))
        return {i: list(c[:room]) for i, c, room in zip(idle, chains, rooms) if c and room}

    def _shadow(self, seqs: list[Sequence], sizes: list[int]) -> None:
        """Shadow drafts for a stateless drafter's rows at size 0 with none pending (a free measurement
        of every size, scored after the step), as often as their cost allows."""
        idle = [i for i, (s, k) in enumerate(zip(seqs, sizes)) if k == 0 and s.spec.mode == AUTO
                and s.spec.shadow is None and not s.spec.pinned and s.draft_room(s.spec.k, self.context) > 0]
        # a young greedy row shadows every step (a short answer that copies is found early); a sampled
        # row's shadows are rationed from the start: their hidden cost (the passes after them ran
        # slower) outweighed what a sampled row's drafts win
        young = any(seqs[i].spec.steps < YOUNG and seqs[i].params.greedy for i in idle)
        if not idle or not self.controller.shadow_due(self.costs.pass_seconds(len(seqs)), young):
            return
        started = time.perf_counter()
        rows = [seqs[i] for i in idle]
        proposal = self.drafter.propose(rows, [s.draft_room(s.spec.k, self.context) for s in rows])
        drafted = time.perf_counter()
        counts = proposal.num_tokens.tolist()
        for s, (nodes, path), count in zip(rows, proposal.main_paths(), counts):
            if nodes:
                s.spec.shadow = (len(s.token_ids), path, None if proposal.parents is None else nodes, count)
        self.controller.observe_shadows(time.perf_counter() - started, drafted - started, len(rows), sum(counts))

    def _commit(self, seqs, proposal: DraftProposal, drafted: tuple, paths: list[list[int]],
                emitted: list[list[int]], logprobs) -> list[list[int]]:
        """Append each row's accepted drafts and its recovered or bonus token (stops applied), roll
        the caches back to them, tell the drafter; returns the tokens each row appended."""
        decode = self.target.tokenizer.decode
        out = []
        for b, s in enumerate(seqs):
            tokens = emitted[b][:len(paths[b]) + 1]
            old_len = len(s.token_ids)            # the slot of the first draft node
            appended = s.append(tokens, decode if s.params.stop else None)
            out.append(tokens[:appended])
            if s.params.logprobs is not None:     # emitted token j sits after the root, then after node j-1
                s.record_logprobs(tokens[:appended], logprobs[b, [0] + [n + 1 for n in paths[b]]])
            if s.constraint is not None:
                s.constraint.consume(tokens[:appended])
            self.runner.commit_row(s.row, old_len, paths[b], proposal.is_tree)
        if self.drafter is not None:
            active, sub, free = drafted
            accepted = [len(p) for p in paths]
            if active:
                self.drafter.commit([seqs[i] for i in active], sub, [accepted[i] for i in active])
            if free:                      # free chains: committed with their own proposal
                rows = list(free)
                self.drafter.commit([seqs[i] for i in rows], DraftProposal.from_lists([free[i] for i in rows]),
                                    [accepted[i] for i in rows])
            drafting = set(active) | set(free)   # rows that never draft (speculation off) never reach the drafter
            idle = [i for i, s in enumerate(seqs) if i not in drafting and s.spec.mode != OFF]
            if idle:
                self.drafter.commit([seqs[i] for i in idle], DraftProposal.empty(len(idle)), [0] * len(idle))
        self.runner.register(seqs)
        return out

    def _report(self, seqs, sizes, proposal, paths, forced, appended, pass_rows, draft_s, verify_s, free) -> None:
        """Stats, the controller's measurements, the shadows' scores, events (free chains: the controller
        prices their pass's rows, not their drafting, and their rows' gains stay plain ones)."""
        num = proposal.num_tokens.tolist()
        depth = tree_depths(proposal)
        now = time.perf_counter()
        for b, s in enumerate(seqs):
            a, n, step = len(paths[b]), num[b], appended[b]
            s.stats.record_step(depth[b], min(a, len(step)), len(step), nodes=n)
            s.stats.draft_seconds += draft_s
            s.stats.verify_seconds += verify_s
            ids = forced[b] + step
            kinds = ["forced"] * len(forced[b]) + ["accepted"] * min(a, len(step))
            if len(step) > a:
                kinds.append("recovered" if a < n else "bonus")
            if s.first_token_at is None:
                s.first_token_at = now
            s.last_token_at = now
            lps = s.logprobs[len(s.logprobs) - len(ids):] if s.params.logprobs is not None else None
            s.request.sink(Tokens(ids, kinds, lps, s))
            if s.spec.shadow is not None and s.spec.score_shadow(s.token_ids, s.finished) and self.metrics is not None:
                self.metrics.shadow.inc()
        if self.drafter is not None:
            planned = [0 if b in free else n for b, n in enumerate(num)]
            self.controller.observe([s.spec for s in seqs], sizes, planned, paths, pass_rows, verify_s, draft_s,
                                    [0 if b in free else d for b, d in enumerate(depth)])
        if self.metrics is not None:
            self.metrics.record_step(depth, [min(len(p), len(x)) for p, x in zip(paths, appended)],
                                     [len(x) + len(f) for x, f in zip(appended, forced)], draft_s, verify_s, nodes=num)
            self.metrics.record_tree_of(seqs, proposal, paths, appended, self.target.tokenizer.decode)
            if self.threads is not None:
                self.metrics.record_threads(self.threads)

    # ------------------------------------------------------------------ the end of a request
    def _end(self, s: Sequence, reason: str, event) -> None:
        self.runner.release(s.row)
        self.scheduler.release(s.row)
        self.controller.finish_row(s.spec)
        if event is None and reason in ("stop", "length"):
            st = s.stats
            event = Finished(reason, s.stop_text_index,
                             {"prompt_tokens": s.prompt_len, "completion_tokens": s.num_output,
                              "total_tokens": s.prompt_len + s.num_output,
                              "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
                              "completion_tokens_details": prediction_usage(
                                  s.prediction.ids if s.prediction is not None else [], s.output_ids)},
                             {"mode": s.spec.mode, "num_speculative_tokens": s.spec.k,
                              "on_at_end": s.spec.mode == ON or (s.spec.mode == AUTO and s.spec.size > 0),
                              "steps": st.steps, "drafted_tokens": st.drafted, "accepted_tokens": st.accepted,
                              "acceptance_rate": round(st.acceptance_rate, 4),
                              "mean_accepted_length": round(st.mean_accepted_length, 4)}, s)
        if event is not None:
            s.request.sink(event)
        if self.metrics is not None and not s.request.internal:
            self.metrics.request_done(s, reason, time.perf_counter())

    def _publish_counts(self, running: list[Sequence]) -> None:
        if self.metrics is None:
            return
        sched = self.scheduler
        on = sum(1 for s in running if s.spec.mode != OFF and s.spec.size > 0)
        could = sum(1 for s in running if s.spec.mode == AUTO)
        self.metrics.set_counts(len(sched.prefilling) + len(running), len(sched.inbox), on, could > 0 and on == 0)

    # ------------------------------------------------------------------ growth (the Python front)
    def grow(self, rows: int, tokens: int) -> None:
        """Room for `rows` requests of up to `tokens` positions each (between calls), plus the
        idle cached prefix blocks the config allows."""
        runner = self.runner
        blocks = 0
        if runner.paged:
            per_row = -(-(tokens + SLACK) // self.config.block_size)
            blocks = rows * per_row + 1 + (self.config.prefix_cache_blocks or 0)
        if rows > runner.rows:
            self.scheduler.add_rows(rows)
        runner.grow(rows, blocks, tokens + SLACK)
