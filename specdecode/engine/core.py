"""The engine core: continuous batching of speculative steps over paged KV caches, under every
front (`LLM.generate` runs it on the calling thread, `specdecode serve` on its engine thread).

Requests are submitted from any thread (`submit`, `abort`); events come back through each
request's sink: `Tokens` as they are committed, then `Finished` or `Failed`. Each iteration
(`iterate`) is:

1. schedule -- aborted requests leave; queued requests take a free row once their blocks are
   reserved; the next prompt chunks are prefilled (scheduler.py);
2. plan     -- each decoding row's draft size (controller.py);
3. draft    -- every source's drafts in one record (drafting.py: a grammar's forced tokens, the
   drafter's proposal, a cascade's free lookups, shadow drafts);
4. score, verify -- one target pass over every row's pending tokens and drafts, then verification
   (runner.py; the verifier is a pure function, verify.py / verify_tree.py);
5. commit   -- tokens appended (stops applied), caches rolled back to what was accepted, the
   drafter told (`Drafting.commit`), full blocks registered for prefix caching;
6. report   -- stats, the controller's measurements, events; finished rows release their blocks.

An exception inside an iteration fails the requests in the batch (500, sanitized), frees their
rows, and the engine goes on.
"""
from __future__ import annotations

import logging
import time

from ..drafters.base import DrafterError
from ..footprint import kv_bytes_per_token
from ..params import ParamError
from ..structured import grammar_tokenizer
from ..tree import MAX_TREE_NODES
from .config import MAX_CHAIN, SLACK, SPAN, EngineConfig
from .controller import AUTO, OFF, ON, SpeculationController
from .costs import StepCosts
from .drafting import Drafting, StepDrafts
from .loop import EngineLoop
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Failed, Request, Sequence, Tokens
from .threads import ThreadTuner

log = logging.getLogger("specdecode.engine")
MAX_CURVE_ROWS = 16     # the start-up cost curve's largest pass (beyond, its last segment; the steps correct it)
REMEASURE_STEPS = 512   # steps between two measurements of a stale cost curve (costs.StepCosts.stale)


class EngineCore(EngineLoop):
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
        self.full = rows == config.max_batch_size   # a server's engine: every row may hold the whole context
        self.runner = ModelRunner(target, self.drafter, rows, self.context, num_blocks if target.native else 0,
                                  config.block_size, self.context + SLACK if self.full else 0)
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
        self.curve_age = 0                            # steps since it was measured
        self.controller = SpeculationController(caps, self.costs, config.adaptive, config.spec_max_batch_size)
        self.drafting = Drafting(self.drafter, self.controller, self.context, self.max_k)
        self.threads = ThreadTuner() if target.model.device.type == "cpu" else None
        self.metrics = metrics
        super().__init__()

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
        s.drafter_state = self.runner.drafter_state   # this core's, whoever else shares the drafter
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
        """2. plan, 3. draft, 4. score and verify, 5. commit, 6. report, for the decoding rows `seqs`."""
        if self.threads is not None:
            self.threads.before()
        t0 = time.perf_counter()
        pending = [len(s.token_ids) - self.runner.cache.lengths[s.row] for s in seqs]
        sizes = self._plan(seqs, pending)
        drafts = self.drafting.draft(seqs, sizes, pending)
        t1 = time.perf_counter()
        target_probs, target_tokens, logprobs = self.runner.score(seqs, drafts.proposal)
        experts = self.runner.pass_experts()
        paths, emitted = self.runner.verify(seqs, drafts.proposal, target_probs, target_tokens)
        t2 = time.perf_counter()
        pass_rows = sum(len(s.token_ids) - self.runner.cache.lengths[s.row] for s in seqs) \
            + int(drafts.proposal.num_tokens.sum())
        if self.threads is not None:
            self.threads.after(t2 - t0, pass_rows)
        appended = self._commit(seqs, drafts, paths, emitted, logprobs)
        self._report(seqs, sizes, drafts, paths, appended, pass_rows, t1 - t0, t2 - t1, experts)

    def _plan(self, seqs: list[Sequence], pending: list[int]) -> list[int]:
        """Each row's drafts this step: the controller's size within the row's room."""
        if self.drafter is None:
            return [0] * len(seqs)
        self.measure_costs(len(seqs))
        sizes = self.controller.plan([s.spec for s in seqs], pending)
        return [s.draft_room(k, self.context) for s, k in zip(seqs, sizes)]

    def measure_costs(self, batch: int) -> None:
        """The start-up cost curve, up to the rows this batch may verify (measured once per doubling,
        on a free row), and again when the steps show it was measured under load (`StepCosts.stale`)."""
        need = min(MAX_CURVE_ROWS, batch * (self.config.num_speculative_tokens + 1))
        self.curve_age += 1
        if not self.scheduler.free_rows or not self.config.adaptive:
            return
        if self.curve_rows and self.costs.stale and self.curve_age >= REMEASURE_STEPS \
                and self.runner.can_admit(self.curve_rows + 1, {}):      # its blocks never taken from a request
            curve, experts = self.runner.pass_costs(self.scheduler.free_rows[-1], self.curve_rows)
            self.costs.remeasured(curve)
            self.costs.price_experts(experts)
            self.curve_age = 0
            return
        if need <= self.curve_rows:
            return
        if self.curve_rows and need < 2 * self.curve_rows:
            return
        row = self.scheduler.free_rows[-1]
        curve, experts = self.runner.pass_costs(row, need)
        self.costs.extend(curve)
        self.costs.price_experts(experts)
        self.curve_rows, self.curve_age = need, 0

    def _commit(self, seqs, drafts: StepDrafts, paths: list[list[int]], emitted: list[list[int]],
                logprobs) -> list[list[int]]:
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
            self.runner.commit_row(s.row, old_len, paths[b], drafts.proposal.is_tree)
        self.drafting.commit(seqs, drafts, [len(p) for p in paths])
        self.runner.register(seqs)
        return out

    def _report(self, seqs, sizes, drafts: StepDrafts, paths, appended, pass_rows, draft_s, verify_s,
                experts: float | None = None) -> None:
        """Stats, the controller's measurements, the shadows' scores, events; `experts`: on MoE, the
        distinct experts per layer the step's pass read."""
        num = drafts.proposal.num_tokens.tolist()
        depth = drafts.depths()
        now = time.perf_counter()
        for b, s in enumerate(seqs):
            a, n, step, forced = len(paths[b]), num[b], appended[b], drafts.forced[b]
            s.stats.record_step(depth[b], min(a, len(step)), len(step), nodes=n)
            s.stats.draft_seconds += draft_s
            s.stats.verify_seconds += verify_s
            ids = forced + step
            kinds = ["forced"] * len(forced) + ["accepted"] * min(a, len(step))
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
            self.controller.observe([s.spec for s in seqs], sizes, drafts.priced(num), paths, pass_rows, verify_s,
                                    draft_s, drafts.priced(depth), experts)
        if self.metrics is not None:
            self.metrics.record_step(depth, [min(len(p), len(x)) for p, x in zip(paths, appended)],
                                     [len(x) + len(f) for x, f in zip(appended, drafts.forced)], draft_s, verify_s,
                                     nodes=num)
            if experts is not None:
                self.metrics.record_experts(pass_rows, experts)
            self.metrics.record_tree_of(seqs, drafts.proposal, paths, appended, self.target.tokenizer.decode)
            if self.threads is not None:
                self.metrics.record_threads(self.threads)

    # ------------------------------------------------------------------ the end of a request
    def _end(self, s: Sequence, reason: str, event) -> None:
        self.runner.release(s.row)
        self.scheduler.release(s.row)
        self.controller.finish_row(s.spec)
        if event is None and reason in ("stop", "length"):
            event = s.finished_event()
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
        idle cached prefix blocks the config allows. A server's engine is built at its full size
        and does not grow (a call waits for its rows)."""
        if self.full:
            return
        runner = self.runner
        blocks = 0
        if runner.paged:
            per_row = -(-(tokens + SLACK) // self.config.block_size)
            blocks = rows * per_row + 1 + (self.config.prefix_cache_blocks or 0)
        if rows > runner.rows:
            self.scheduler.add_rows(rows)
        runner.grow(rows, blocks, tokens + SLACK)
