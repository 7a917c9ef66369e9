"""The model runner: owns the KV caches and runs the target's passes.

Caches. A native target's keys and values live in a paged cache (cache/paged.py: blocks shared by
all rows, reserved at admission, prefix blocks shared between requests); a draft model's too,
with its own block table per row, reserved and freed with the row. The transformers adapter's
caches cannot be paged: one slot per row. A drafter without a draft model keeps its per-row state
from `prepare` (an EAGLE head's features, a layer-skip view's cache), re-made when the engine grows.

Passes. `prefill` writes the next tokens of some rows' prompts, from each row's cache length, in
one ragged pass (the draft model's cache too, for rows that may draft). `score` is the one target
pass of a step: each row's pending tokens + drafts (a chain or a tree), returning what verification
reads. Cache rule: a row of the target cache holds `token_ids[:length]`; the tokens after that
("pending": normally the last emitted token) go into the next pass with the drafts.
"""
from __future__ import annotations

import hashlib

import torch

from ..cache.blocks import chain_hashes
from ..cache.paged import PagedKVCache
from ..drafters.base import Drafter, DraftProposal, TargetCacheView
from ..fast import argmax_last, top_k_indices
from ..forward import ForwardBatch
from ..sampling import probs_from_logits, transform_logits
from ..structured import allowed_masks, lazy_rows, mask_greedy
from ..tree import ancestors
from ..verify_tree import verify_drafts
from .config import SLACK
from .costs import ExpertCosts, ExpertCounter, curve_rows, measure_cost_curve, measure_pass_costs
from .sequence import Sequence


def kv_salt(loaded) -> bytes:
    """What a model's keys and values depend on besides the tokens: its weights (fingerprint),
    how they are held (dtype, native formats) and the kernel build that computes them."""
    from ..fast.linear import kernel_id
    model = loaded.model
    fused = "fused" if getattr(model, "fused", None) is not None else "eager"
    text = f"{loaded.fingerprint}|{loaded.weights_kind}|{getattr(model, 'dtype', '')}|{fused}|{kernel_id()}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class ModelRunner:
    def __init__(self, target, drafter: Drafter | None, rows: int, context: int, num_blocks: int,
                 block_size: int, state_len: int) -> None:
        self.target = target                      # LoadedModel
        self.model = target.model
        self.drafter = drafter
        self.wants_hidden = drafter is not None and drafter.capabilities.needs_target_hidden
        self.draft = drafter.draft_model() if drafter is not None else None   # a draft model's LoadedModel
        self.rows, self.context = rows, context
        self.paged = target.native                # the adapter's caches are transformers' own
        self.cache = self._new_cache(self.model, num_blocks, block_size)
        self._show_target_cache()
        self.draft_cache = None
        if self.draft is not None:
            paged = self.paged and self.draft.native
            self.draft_cache = self._new_cache(self.draft.model, num_blocks if paged else 0, block_size)
        self.drafter_state = None                 # the drafter's per-row state (DrafterState)
        self.state_len = 0                        # positions per row it was prepared for
        self.reprepare(state_len)
        self.prefix_note = ""                     # why prefix caching is off, where it is
        self.experts = ExpertCounter.of(self.model)   # a MoE target's distinct experts per pass (else None)

    def _new_cache(self, model, num_blocks: int, block_size: int):
        if num_blocks and hasattr(model, "new_paged_cache"):     # a model with more than keys and values
            return model.new_paged_cache(self.rows, self.context + SLACK, num_blocks, block_size)
        if num_blocks:
            layers, heads, dims = model.config.kv_geometry()
            return PagedKVCache(layers, self.rows, heads, dims, self.context + SLACK,
                                num_blocks, block_size, model.dtype, model.device)
        return model.new_cache(self.rows, self.context + SLACK)

    def _show_target_cache(self) -> None:
        """Hand a drafter that reads the target's keys and values (capabilities.reads_target_cache,
        Gemma 4's assistant) a read-only view of the target cache, again whenever it is re-made: the
        one way a drafter sees it (the view cannot write, drafters/base.TargetCacheView)."""
        if self.drafter is not None and self.drafter.capabilities.reads_target_cache:
            self.drafter.use_target_cache(TargetCacheView(self.cache))

    @property
    def caches(self) -> list:
        """The KV caches made here (target, then a draft model's)."""
        return [c for c in (self.cache, self.draft_cache) if c is not None]

    def reprepare(self, max_len: int) -> None:
        """(Re)make the drafter's per-row state for every row, `max_len` positions each (rows idle;
        0: not yet, the first `grow` makes it)."""
        self.state_len = max_len
        if self.drafter is None or (max_len == 0 and self.draft_cache is None):
            self.drafter_state = None
        elif self.draft_cache is not None:
            self.drafter_state = self.drafter.use_draft_cache(self.draft_cache)
        else:
            self.drafter_state = self.drafter.prepare(self.rows, max_len)

    def grow(self, rows: int, num_blocks: int, state_len: int) -> None:
        """More rows, blocks or drafter positions per row (between calls: every row idle)."""
        if rows > self.rows or (self.paged and num_blocks > self.cache.num_blocks):
            self.rows = max(rows, self.rows)
            for c in self.caches:
                if isinstance(c, PagedKVCache):
                    c.grow(self.rows, num_blocks)
            if not self.paged:
                self.cache = self._new_cache(self.model, 0, 0)
                self._show_target_cache()
                if self.draft_cache is not None:
                    self.draft_cache = self._new_cache(self.draft.model, 0, 0)
            self.reprepare(max(state_len, self.state_len))
        elif state_len > self.state_len and self.draft_cache is None:
            self.reprepare(state_len)

    # ------------------------------------------------------------------ admission (paged caches)
    def enable_prefix_caching(self, max_cached_blocks: int | None = None) -> None:
        """Reuse the keys and values of earlier requests' blocks. Off for the target when the drafter
        reads the target's hidden states of every token (a matched prefix is never run through it)."""
        if not self.paged:
            self.prefix_note = "the transformers adapter's caches are not paged"
        elif self.wants_hidden:
            self.prefix_note = "the drafter reads the target's hidden states of every prompt token"
        elif any(getattr(c, "recurrent", False) for c in self.caches):
            self.prefix_note = "the model's recurrent layers keep a state per row, not per block"
        else:
            self.cache.enable_prefix_caching(kv_salt(self.target), max_cached_blocks)
            if isinstance(self.draft_cache, PagedKVCache):
                self.draft_cache.enable_prefix_caching(kv_salt(self.draft), max_cached_blocks)

    def match(self, prompt_ids: list[int], drafting: bool, memo: dict) -> dict:
        """Per cache, the registered blocks the prompt starts with (the same count in each cache the
        row writes: its draft cache too when it may draft). `memo` keeps the prompt's hashes."""
        caches = [self.cache] + ([self.draft_cache] if drafting and self.draft_cache is not None else [])
        if not all(getattr(c, "prefix_caching", False) for c in caches):
            return {}
        limit = len(prompt_ids) - 1                 # the last prompt token is the first step's
        hits = {}
        for c in caches:
            if id(c) not in memo:
                memo[id(c)] = chain_hashes(prompt_ids, c.block_size, c.salt, limit // c.block_size)
            hits[id(c)] = c.pool.match(memo[id(c)])
        shortest = min(len(h) for h in hits.values())
        return {key: h[:shortest] for key, h in hits.items()} if shortest else {}

    def fits(self, tokens: int) -> bool:
        """Whether a request of `tokens` (prompt + max_tokens) can ever be admitted."""
        return all(c.blocks_for(tokens) <= c.usable_blocks for c in self.caches if isinstance(c, PagedKVCache))

    def can_admit(self, tokens: int, hits: dict) -> bool:
        return all(c.can_reserve(tokens, hits.get(id(c), ())) for c in self.caches if isinstance(c, PagedKVCache))

    def admit(self, row: int, tokens: int, hits: dict) -> int:
        """Reserve the row in every cache, taking the matched blocks; returns the prompt positions they
        cover (prefill starts there)."""
        covered = 0
        for c in self.caches:
            if isinstance(c, PagedKVCache):
                blocks = hits.get(id(c), ())
                c.reserve(row, tokens, blocks)
                covered = len(blocks) * c.block_size if blocks else covered
            else:
                c.reset(row)
        return covered

    def release(self, row: int) -> None:
        for c in self.caches:
            c.release(row) if isinstance(c, PagedKVCache) else c.reset(row)
        if self.drafter_state is not None and self.draft_cache is None:
            self.drafter_state.reset(row)           # the drafter's per-row state: the row starts anew

    def register(self, seqs: list[Sequence]) -> None:
        """Register the rows' newly committed full blocks (every cache that caches prefixes)."""
        for c in self.caches:
            if getattr(c, "prefix_caching", False):
                for s in seqs:
                    c.commit(s.row, s.token_ids)

    # ------------------------------------------------------------------ passes
    def prefill(self, chunks: list[tuple[Sequence, int]], draft: bool = False) -> None:
        """Write the next `n` prompt tokens of each (sequence, n) into the target cache (or, with
        `draft`, the draft model's), all rows in one ragged pass without logits."""
        model, cache = (self.draft.model, self.draft_cache) if draft else (self.model, self.cache)
        starts = [cache.lengths[s.row] for s, _ in chunks]
        width = max(n for _, n in chunks)
        tokens = torch.zeros(len(chunks), width, dtype=torch.long)                  # [B, width]
        for b, ((s, n), start) in enumerate(zip(chunks, starts)):
            tokens[b, :n] = torch.tensor(s.prompt_ids[start:start + n])
        tokens = tokens.clamp(max=model.vocab_size - 1)     # a draft may embed fewer (padding) ids
        device = model.device
        rows = torch.tensor([s.row for s, _ in chunks], device=device)
        hidden = model.run(ForwardBatch.chain(tokens.to(device), torch.tensor(starts, device=device), rows,
                                              lengths=[n for _, n in chunks]), cache)   # [B, width, D]
        if not draft and self.wants_hidden:   # an EAGLE head reads the target's features of the prompt
            self._observe([s for s, _ in chunks], starts, hidden)
        if not draft:
            for b, ((s, n), start) in enumerate(zip(chunks, starts)):
                if s.params.prompt_logprobs is not None:
                    s.prompt_logprobs += self._prompt_logprobs(s, start, hidden[b:b + 1, :n])
        for (s, n), start in zip(chunks, starts):
            cache.truncate(s.row, start + n)

    def _observe(self, seqs: list[Sequence], starts: list[int],
                 hidden: torch.Tensor,      # [B, width, D]: a pass's outputs, row b from position starts[b]
                 ) -> None:
        """Hand the drafter the target's features of the rows it hears of (`RowSpec.listening`):
        none of a row whose speculation is kept off."""
        keep = [b for b, s in enumerate(seqs) if s.spec.listening]
        if len(keep) == len(seqs):
            self.drafter.observe(seqs, starts, hidden)
        elif keep:
            self.drafter.observe([seqs[b] for b in keep], [starts[b] for b in keep],
                                 hidden[torch.tensor(keep, device=hidden.device)])

    def _prompt_logprobs(self, s: Sequence, start: int,
                         hidden: torch.Tensor,      # [1, n, D]: prompt positions start .. start+n-1
                         ) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """The log-probability of each next prompt token (positions start+1 .. start+n) under the
        model's raw logits, with the top `prompt_logprobs` alternatives; 64 positions of logits at a time."""
        out, top = [], s.params.prompt_logprobs
        for at in range(0, hidden.shape[1], 64):
            index = torch.arange(at, min(at + 64, hidden.shape[1]), device=hidden.device)[None]   # [1, m]
            logps = self.model.logits(hidden, index)[0].float().log_softmax(dim=-1)           # [m, vocab]
            nxt = s.prompt_ids[start + at + 1:start + at + 1 + logps.shape[0]]
            chosen = logps.gather(1, torch.tensor(nxt, device=logps.device)[:, None])[:, 0].tolist()
            values, ids = logps.topk(top, dim=-1) if top else (logps[:, :0], logps[:, :0].long())
            out += [(t, v, list(zip(i, w))) for t, v, i, w in zip(nxt, chosen, ids.tolist(), values.tolist())]
        return out

    def cost_curve(self, row: int, max_rows: int) -> dict[int, float]:
        """The target pass's seconds against its rows (costs.measure_cost_curve), on an idle row."""
        if self.paged:
            self.cache.reserve(row, max_rows + 1)
        try:
            return measure_cost_curve(self.model, self.cache, row, curve_rows(max_rows))
        finally:
            self.release(row)

    def pass_costs(self, row: int, max_rows: int) -> tuple[dict[int, float], ExpertCosts | None]:
        """`cost_curve`, and on a MoE target what the distinct experts of a pass add (costs.measure_pass_costs)."""
        if self.experts is None:
            return self.cost_curve(row, max_rows), None
        if self.paged:
            self.cache.reserve(row, max_rows + 1)
        try:
            return measure_pass_costs(self.model, self.cache, row, curve_rows(max_rows), counter=self.experts)
        finally:
            self.release(row)

    def pass_experts(self) -> float | None:
        """The distinct experts per MoE layer the last pass read (None: not a MoE target)."""
        return self.experts.read() if self.experts is not None else None

    def score(self, seqs: list[Sequence], proposal: DraftProposal
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """One target pass over each row's pending tokens + drafts; returns, at the n+1 positions
        verification reads (position 0 after the last pending token, i+1 after draft node i), the
        transformed target probabilities [B, n+1, vocab], or, when every row is greedy, only their
        argmax [B, n+1]; and the log-probabilities [B, n+1, vocab] when some row reports them."""
        k = proposal.k
        starts = [self.cache.lengths[s.row] for s in seqs]
        pending = [s.token_ids[start:] for s, start in zip(seqs, starts)]
        drafts, num_drafted = proposal.tokens.tolist(), proposal.num_tokens.tolist()
        widths = [len(p) + n for p, n in zip(pending, num_drafted)]
        width = max(len(p) for p in pending) + k
        device = self.model.device
        tokens = torch.tensor([p + d[:n] + [0] * (width - len(p) - n) for p, d, n in zip(pending, drafts, num_drafted)],
                              dtype=torch.long, device=device)                      # [B, width]
        # logits at the last pending token and after each draft (rows with fewer drafts repeat their
        # last real position; verification ignores those)
        logit_index = torch.tensor([[min(len(p) - 1 + i, w - 1) for i in range(k + 1)]
                                    for p, w in zip(pending, widths)], device=device)  # [B, k+1]
        rows = torch.tensor([s.row for s in seqs], device=device)
        start = torch.tensor(starts, device=device)
        fb = (ForwardBatch.tree(tokens, start, rows, [len(p) for p in pending], proposal.parents, logit_index, widths)
              if proposal.is_tree and k > 0 else ForwardBatch.chain(tokens, start, rows, logit_index, widths))
        hidden = self.model.run(fb, self.cache)                                      # [B, width, D]
        logits = self.model.logits(hidden, fb.logit_index)                           # [B, k+1, vocab]
        if self.wants_hidden:
            self._observe(seqs, starts, hidden)
        history = any(s.params.uses_penalties for s in seqs)
        lazy = lazy_rows(seqs)           # greedy constrained rows: masks only where the argmax is forbidden
        transformed = transform_logits(
            logits, [s.params for s in seqs], [s.token_ids for s in seqs] if history else None,
            [s.prompt_len for s in seqs] if history else None, proposal.tokens.to(device) if k > 0 else None,
            ancestors(proposal.parents, proposal.num_tokens) if history and proposal.is_tree else None,
            allowed_masks(seqs, proposal, logits.shape[-1], skip=lazy))
        all_greedy = all(s.params.greedy for s in seqs)
        target_tokens = argmax_last(transformed) if all_greedy else None              # [B, k+1]
        if any(lazy):
            if transformed is logits:     # an inference tensor: not writable here
                transformed = transformed.clone()
            mask_greedy(seqs, proposal, lazy, transformed, target_tokens)
        wanted = self.drafter.capabilities.needs_target_topk if self.drafter is not None else 0
        if wanted:                        # the top-1 of greedy rows is their argmax, already taken
            top = target_tokens[..., None] if wanted == 1 and target_tokens is not None \
                else top_k_indices(transformed, wanted)                               # [B, k+1, wanted]
            self.drafter.observe_topk(seqs, proposal, top)
        probs = None if all_greedy else probs_from_logits(transformed, [s.params for s in seqs])   # [B, k+1, vocab]
        # log-probabilities as reported: log-softmax of the transformed logits (greedy rows at temperature 1)
        wants = any(s.params.logprobs is not None for s in seqs)
        return probs, target_tokens, (transformed.float().log_softmax(dim=-1) if wants else None)

    def verify(self, seqs: list[Sequence], proposal: DraftProposal, target_probs: torch.Tensor | None,
               target_tokens: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
        """Per row the accepted path (node indices by depth) and the emitted tokens (the accepted
        drafts, then the recovered or bonus token): the one verifier, `verify_tree.verify_drafts`."""
        return verify_drafts(proposal.tokens, proposal.parents, proposal.num_tokens, proposal.probs, target_probs,
                             target_tokens, [s.params.greedy for s in seqs], [s.generator for s in seqs],
                             [s.seed for s in seqs], [len(s.token_ids) for s in seqs])

    def commit_row(self, row: int, first_node: int, path: list[int], is_tree: bool) -> None:
        """A row's cache after its step: a tree's accepted path moved to consecutive slots from the
        first node's (where a chain would have written it), then the row rolled back to the tokens
        it committed (the pending ones and the accepted drafts)."""
        if is_tree and path:
            src = [first_node + node for node in path]
            dst = [first_node + depth for depth in range(len(path))]
            if src != dst:
                self.cache.move(row, src, dst)
        self.cache.truncate(row, first_node + len(path))
