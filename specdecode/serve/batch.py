"""The engine side of serving: the engine's loop and model runner over a changing set of rows
in paged caches (composed, not subclassed).

* `ServeSequence` -- a `Sequence` plus what serving needs (its request, speculation state,
  prefill progress, timings).
* `RowDrafter` -- wraps the drafter so only rows that speculate this step draft (rows with
  speculation off never touch the draft model; their draft cache lags and catches up by the
  drafter's own catch-up rule when they speculate again).
* `BatchEngine` -- a `ModelRunner` on paged target/draft caches and a `SpecEngine` stepping it
  with a per-row k (`step`), admission by reservation, and chunked prefill of new rows
  (`prefill`), so the running rows are stalled by at most one chunk between two steps.
"""
from __future__ import annotations

import dataclasses
import time

from ..drafters.base import DraftProposal, Drafter, DrafterState
from ..engine.engine import SpecEngine
from ..engine.runner import ModelRunner
from ..engine.scheduler import draft_room
from ..engine.threads import ThreadTuner
from ..engine.sequence import Sequence
from ..params import SamplingParams
from .block_pool import chain_hashes
from .paged_cache import PagedKVCache
from .policy import OFF, RowPolicy


class ServeSequence(Sequence):
    def __init__(self, request, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...],
                 row: int, policy: RowPolicy, device) -> None:
        super().__init__(request.id, prompt_ids, params, eos_token_ids, row, device)
        self.request = request
        self.policy = policy
        self.k_now = 0                     # drafts allowed in the coming step (set by the scheduler)
        self.prefilled = 0                 # prompt tokens already in the target cache
        self.cached_tokens = 0             # of which taken from earlier requests' cached blocks
        self.admitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def prefill_target(self) -> int:
        """Tokens prefill writes: the prompt but its last token (which is pending, see engine.py)."""
        return len(self.prompt_ids) - 1

    @property
    def drafts_ever(self) -> bool:
        return self.policy.mode != OFF and self.policy.k > 0


class RowDrafter(Drafter):
    """Drafts only for rows with room > 0 and scatters the proposal back to the full batch.
    Declarations and state are the wrapped drafter's."""

    name = "rows"

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities

    def draft_model(self):
        return self.inner.draft_model()

    def prepare(self, batch_size: int, max_len: int) -> DrafterState | None:
        return self.inner.prepare(batch_size, max_len)

    def use_draft_cache(self, cache) -> DrafterState:
        return self.inner.use_draft_cache(cache)

    def observe(self, seqs, starts, hidden):
        """Target hidden states reach the drafter for every row (speculating or not), so a row
        whose speculation comes back on can catch up from them."""
        self.inner.observe(seqs, starts, hidden)

    def propose(self, seqs, max_tokens):
        active = [i for i, n in enumerate(max_tokens) if n > 0]
        sub = self.inner.propose([seqs[i] for i in active], [max_tokens[i] for i in active])
        out = sub if len(active) == len(seqs) else sub.scatter(active, len(seqs))
        return DraftProposal(out.tokens, out.num_tokens, out.probs, step_state=(active, sub), parents=out.parents)

    def observe_topk(self, seqs, proposal, topk_ids):
        """Every row's target top-k reaches the drafter (speculating or not): a table-driven
        drafter learns from all of them. The proposal carries the inner drafter's own step state."""
        if proposal.step_state is not None:
            proposal = dataclasses.replace(proposal, step_state=proposal.step_state[1].step_state)
        self.inner.observe_topk(seqs, proposal, topk_ids)

    def commit(self, seqs, proposal, num_accepted):
        if proposal.step_state is None:      # the engine did not call propose this step
            return
        active, sub = proposal.step_state
        self.inner.commit([seqs[i] for i in active], sub, [num_accepted[i] for i in active])

    def close(self) -> None:
        self.inner.close()


class BatchEngine:
    """The engine loop over paged caches: a `ModelRunner` whose target cache (and a draft
    model's, for a drafter that declares one) are paged, a `SpecEngine` driving its steps with
    a per-row k chosen by the server's scheduler, admission by block reservation, and chunked
    prefill of new rows."""

    def __init__(self, target, drafter: Drafter | None, max_k: int, context: int, num_rows: int,
                 num_blocks: int, block_size: int) -> None:
        self.drafter = RowDrafter(drafter) if drafter is not None else None
        self.capabilities = drafter.capabilities if drafter is not None else None
        self.context = context
        self.runner = ModelRunner(target, self.drafter)

        def paged(model, rows: int, max_len: int) -> PagedKVCache:
            c = model.config
            return PagedKVCache(c.num_layers, rows, c.num_kv_heads, c.head_dim, max_len, num_blocks, block_size,
                                model.dtype, model.device)
        self.runner.allocate(num_rows, context + max_k + 2, new_cache=paged)
        self.loop = SpecEngine(target, self.drafter, max_k if drafter is not None else 0, runner=self.runner,
                               threads=ThreadTuner() if target.model.device.type == "cpu" else None)
        self.prefix_note = ""               # why prefix caching is off for a cache that has it off

    # ------------------------------------------------------------ prefix caching
    def enable_prefix_caching(self, max_cached_blocks: int | None = None) -> None:
        """Reuse the keys and values of earlier requests' prompts (paged_cache.py). Off for the
        target when the drafter reads the target's hidden states of every prompt token (an EAGLE
        head): a matched prefix would be skipped by the target pass the head reads them from."""
        draft = self.runner.drafter.draft_model() if self.drafter is not None else None
        if self.capabilities is not None and self.capabilities.needs_target_hidden:
            self.prefix_note = "the drafter reads the target's hidden states of every prompt token"
            return
        self.cache.enable_prefix_caching(kv_salt(self.runner.target), max_cached_blocks)
        if self.draft_cache is not None and draft is not None:
            self.draft_cache.enable_prefix_caching(kv_salt(draft), max_cached_blocks)

    def match(self, prompt_ids: list[int], drafting: bool, memo: dict) -> dict:
        """Per cache, the registered blocks the prompt starts with (the same count in each cache
        the row writes: its draft cache too when it drafts). `memo`: the request's, keeps the
        prompt's block hashes between admission attempts."""
        caches = [self.cache] + ([self.draft_cache] if drafting and self.draft_cache is not None else [])
        if not all(c.prefix_caching for c in caches):
            return {}
        limit = len(prompt_ids) - 1                 # the last prompt token is the first step's
        hits = {}
        for c in caches:
            key = id(c)
            if key not in memo:
                memo[key] = chain_hashes(prompt_ids, c.block_size, c.salt, limit // c.block_size)
            hits[key] = c.pool.match(memo[key])
        shortest = min(len(h) for h in hits.values())
        return {key: h[:shortest] for key, h in hits.items()} if shortest else {}

    def commit(self, seqs) -> None:
        """Register the rows' newly committed full blocks (every cache that has them)."""
        for c in self.runner.caches:
            if c.prefix_caching:
                for s in seqs:
                    c.commit(s.row, s.token_ids)

    @property
    def cache(self) -> PagedKVCache:
        return self.runner.cache

    @property
    def draft_cache(self) -> PagedKVCache | None:
        return self.runner.draft_cache

    @property
    def draft_state(self) -> DrafterState | None:
        """The drafter's per-request state (the paged draft cache of a draft model), for accounting."""
        return self.runner.drafter_state

    def step(self, seqs: list[ServeSequence], on_tokens=None):
        """One speculative step; row b drafts up to its k_now (set by the scheduler). Returns the
        engine's StepReport (each row's draft tree and accepted path)."""
        room = [draft_room(s, s.k_now, self.context) if self.drafter is not None else 0 for s in seqs]
        report = self.loop.step(seqs, room, on_tokens)
        self.commit(seqs)
        return report

    # ------------------------------------------------------------ rows
    def fits(self, tokens: int) -> bool:
        """Whether a request of `tokens` (prompt + max_tokens) can ever be admitted."""
        return all(c.blocks_for(tokens) <= c.usable_blocks for c in self.runner.caches)

    def can_admit(self, tokens: int, hits: dict | None = None) -> bool:
        return all(c.can_reserve(tokens, (hits or {}).get(id(c), ())) for c in self.runner.caches)

    def admit(self, row: int, tokens: int, hits: dict | None = None) -> int:
        """Reserve the row in every cache, taking the matched blocks; returns the prompt positions
        they cover (prefill starts there)."""
        covered = 0
        for c in self.runner.caches:
            blocks = (hits or {}).get(id(c), ())
            c.reserve(row, tokens, blocks)
            covered = len(blocks) * c.block_size if blocks else covered
        return covered

    def release(self, row: int) -> None:
        for c in self.runner.caches:
            c.release(row)
        if self.draft_state is not None:
            self.draft_state.reset(row)         # the drafter's per-row state: the row starts anew

    # ------------------------------------------------------------ chunked prefill
    def prefill(self, chunks: list[tuple[ServeSequence, int]]) -> None:
        """Write the next `n` prompt tokens of each sequence into the target cache (and the
        draft cache of rows that may speculate), all rows in one ragged forward pass."""
        self.runner.prefill_chunks(chunks)
        drafting = [(s, n) for s, n in chunks if s.drafts_ever]
        if self.draft_cache is not None and drafting:
            self.runner.prefill_chunks(drafting, draft=True)
        for s, n in chunks:
            s.prefilled += n
        self.commit([s for s, _ in chunks])


def kv_salt(loaded) -> bytes:
    """What a model's keys and values depend on besides the tokens: its weights (fingerprint),
    how they are held (dtype, native formats) and the kernel build that computes them."""
    import hashlib

    from ..fast.linear import kernel_id
    model = loaded.model
    fused = "fused" if getattr(model, "fused", None) is not None else "eager"
    text = f"{loaded.fingerprint}|{loaded.weights_kind}|{getattr(model, 'dtype', '')}|{fused}|{kernel_id()}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
