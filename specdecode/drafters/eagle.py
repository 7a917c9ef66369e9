"""EAGLE-style drafter: a one-layer head that reads the target's features (see head.py).
`HeadDrafter` is the machinery below, whatever the head; `EagleDrafter` loads a trained EAGLE
head, drafters/mtp.py the multi-token-prediction head of a Qwen3.5 checkpoint.

State per batch row (`HeadState`, kept by the engine with its rows; both position-addressed, so
rollback is a length change):
  * `features[row, p]`: the target's feature at position p, written by `observe` after every
    target pass (prefill and verification). Valid for p < the target cache length.
  * the head's one-layer KV cache: slot j holds keys/values computed from feature j and token j+1.

propose: first catch up the slots the head has not computed from TRUE features (the accepted
drafts and the recovered/bonus token of the last step: about one mean accepted length of slots,
one batched pass), whose last output drafts token 1; then chain k-1 single-slot passes, each
reading the feature the previous slot predicted. commit: cut the head cache back to the slots
computed from true features; the next propose redoes the rest with the target's real features.

Early stop (`min_confidence`): a row stops drafting before a draft (after the first) whose
probability under the head is below the threshold; the chain ends when every row has stopped.
Drafts past the first rarely survive when the head is unsure, and each costs a head pass. The
number of drafts depends only on the head's own state, so verification stays exact.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.contiguous import KVCache
from ..footprint import weights_bytes
from ..forward import ForwardBatch
from ..sampling import probs_from_logits, sample_drafts, transform_logits
from ..tree import walk_path
from .base import ContiguousState, Drafter, DrafterCapabilities, DrafterError, DraftProposal, row_state
from .dynamic_tree import Candidates, expand, select_nodes
from .features import PendingFeatures
from .head import Head, HeadConfig, head_block, rope_tables
from .registry import register

MAX_TREE_TOPK = 16     # children per expanded node (and frontier width) of a dynamic tree
MAX_TREE_DEPTH = 16    # head passes per tree (its depth); the head-cache tree mask also needs (depth-1)*topk < 64
CATCH_UP_WINDOW = 64   # a catch-up of more slots computes only the last this many (see `catch_up_window`)


class HeadState(ContiguousState):
    """A head's per-row state, kept by the engine with its rows (`Sequence.drafter_state`): the
    head's KV cache, the target's features, the first slot each row's catch-up computed, the
    features not yet written, and each row's [first, end) of features observed without a gap."""

    def __init__(self, cache: KVCache, features: torch.Tensor, keep: int) -> None:   # features: [rows, max_len, D]
        super().__init__(cache, features)
        rows = features.shape[0]
        self.features = features
        self.head_from = torch.zeros(rows, dtype=torch.long)     # [rows]
        self.pending = PendingFeatures(features, keep)
        self.seen = [[0, 0] for _ in range(rows)]


class HeadDrafter(Drafter):
    """A one-layer head on the target's features, with its own per-row KV cache: the machinery
    this module's docstring describes. A subclass loads the head (`_load_head`): EAGLE's trained
    head (`EagleDrafter`), or the MTP head of the target's own checkpoint (drafters/mtp.py)."""

    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True)
    tree_topk, tree_depth = 1, 1          # a chain, unless a subclass drafts trees

    def __init__(self, target, fast: bool = True, min_confidence: float = 0.0,
                 catch_up_window: int = CATCH_UP_WINDOW) -> None:
        if not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence < 1.0:
            raise DrafterError(f"min_confidence must be in [0, 1), got {min_confidence!r}")
        self.min_confidence = float(min_confidence)
        if not isinstance(catch_up_window, int) or isinstance(catch_up_window, bool) or catch_up_window < 1:
            raise DrafterError(f"catch_up_window must be an integer >= 1, got {catch_up_window!r}")
        self.catch_up_window = catch_up_window
        model = target.model
        self.dtype, self.device = model.dtype, model.device
        make_linear = None
        if fast and self.device.type == "cpu":
            from ..fast import make_linear
        self.embed = model.embed                                                           # [V, D] (shared)
        self.vocab = model.vocab_size
        head = self._load_head(target, make_linear or (lambda w, b=None: (lambda x: F.linear(x, w, b))))
        self.config, self.block, self.params = head.config, head.block, head.params
        self.draft_vocab, self.lm_head, self.final_norm = head.draft_vocab, head.lm_head, head.final_norm
        self.cos, self.sin = head.cos, head.sin
        self.capabilities = replace(self.capabilities, relative_cost=head.relative_cost,
                                    prior_acceptance=head.prior_acceptance)

    def _load_head(self, target, link) -> Head:
        """The head; `link(weight, bias)` makes a projection (the fast kernels' where they run)."""
        raise NotImplementedError

    def _head_input(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input from true target features [B, T, D] (EAGLE reads them as they are)."""
        return features

    # ------------------------------------------------------------------ state
    def prepare(self, batch_size: int, max_len: int) -> HeadState:
        c = self.config
        room = 64 if self.tree_topk > 1 else 0       # a tree's head slots past the row's end (< 64 bits)
        # keys and values in float32: on a CPU attention over bfloat16 keys is several times slower and a
        # large share of a head pass at a long context (docs/drafters.md, "Trained drafters"); the cache
        # is one layer, so the bytes are few
        cache = KVCache(1, batch_size, c.num_kv_heads, c.head_dim, max_len + room, torch.float32, self.device)
        features = torch.zeros(batch_size, max_len, c.hidden_size, dtype=self.dtype, device=self.device)
        return HeadState(cache, features, self.catch_up_window + MAX_TREE_DEPTH + 2)

    def observe(self, seqs, starts, hidden):
        st = row_state(seqs)
        width, max_len = hidden.shape[1], st.features.shape[1]
        for b, s in enumerate(seqs):
            n = min(width, max_len - starts[b])
            if n > 0:
                st.pending.add(s.row, starts[b], hidden[b, :n])
                seen = st.seen[s.row]     # the engine skips a row while its speculation is kept off:
                if not seen[0] <= starts[b] <= seen[1]:     # the features before such a gap are stale
                    seen[0] = starts[b]
                seen[1] = starts[b] + n

    # ------------------------------------------------------------------ one head pass
    def _pass(self, st: HeadState, rows: torch.Tensor, starts: list[int],
              tokens: torch.Tensor,        # [B, T] token j+1 of each slot j
              features: torch.Tensor,      # [B, T, D]
              fb: ForwardBatch | None = None,   # the pass's positions / visibility; None = a chain
              ) -> torch.Tensor:           # -> [B, T, D] predicted features
        if fb is None:
            if len(starts) == 1:
                return self._pass_one(st, int(rows[0]), starts[0], tokens, features)
            fb = ForwardBatch.chain(tokens, torch.tensor(starts), rows)      # the pass, described once
        positions = fb.rope_positions().to(self.device)                   # [B, T]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        key_len = max(starts) + tokens.shape[1]
        computed = torch.arange(key_len)[None] >= st.head_from[rows.cpu()][:, None]   # [B, L] slots a catch-up filled
        mask = (fb.visible(key_len) & computed[:, None]).to(self.device)[:, None]        # [B, 1, T, L]
        start_t = torch.tensor(starts, device=self.device)
        c = self.config

        def attend(q, k, v):
            keys, values = st.cache.write(0, rows, start_t, k.float(), v.float())
            out = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask, enable_gqa=True)
            return out.to(q.dtype)
        return self.block(self.params, c, F.embedding(tokens, self.embed), features, cos, sin, attend)

    def _pass_one(self, st: HeadState, row: int, start: int,
                  tokens: torch.Tensor,        # [1, T]
                  features: torch.Tensor,      # [1, T, D]
                  ) -> torch.Tensor:           # -> [1, T, D]
        """`_pass` of one row's chain (the single-request case): it writes the cache row in place
        and attends to a view of the slots it computed (head_from .. start+T-1), with no mask at one
        slot and a causal one (T x slots) at a catch-up, where the general pass copies the row's
        cache and masks every slot before it (at a long context, a good share of a head pass)."""
        num = tokens.shape[1]
        end, first = start + num, int(st.head_from[row])
        cos, sin = self.cos[start:end][None, None], self.sin[start:end][None, None]
        mask = (None if num == 1
                else torch.ones(num, end - first, dtype=torch.bool, device=self.device).tril(start - first))

        def attend(q, k, v):
            cache_k, cache_v = st.cache.keys[0], st.cache.values[0]
            cache_k[row, :, start:end] = k[0]
            cache_v[row, :, start:end] = v[0]
            out = F.scaled_dot_product_attention(q.float(), cache_k[row:row + 1, :, first:end],
                                                 cache_v[row:row + 1, :, first:end], attn_mask=mask, enable_gqa=True)
            return out.to(q.dtype)
        return self.block(self.params, self.config, F.embedding(tokens, self.embed), features, cos, sin, attend)

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:   # [B, D] -> [B, V_draft] float32
        if self.final_norm is not None:
            predicted = F.rms_norm(predicted, (self.config.hidden_size,), self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(predicted).float()

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:   # [B, D] -> [B, 1, vocab] float32
        """Draft logits scattered into the target's vocabulary (-inf outside the draft vocabulary)."""
        draft_logits = self._draft_logits(predicted)                                       # [B, V_draft]
        logits = torch.full((predicted.shape[0], 1, self.vocab), float("-inf"), device=self.device)
        logits[:, 0].index_copy_(1, self.draft_vocab, draft_logits)
        return logits

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, seqs, sizes):
        st = row_state(seqs)
        k = max(sizes)
        batch = len(seqs)
        params = [s.params for s in seqs]
        needs_history = any(p.uses_penalties for p in params)
        generators = [s.generator for s in seqs]
        rows = torch.tensor([s.row for s in seqs], device=self.device)
        draft_tokens = torch.zeros(batch, k, dtype=torch.long)
        draft_probs = None
        # 1. catch up: slots head_len .. n-1 from true features (n = positions the target has seen)
        st.pending.flush()
        ends = [len(s.token_ids) - 1 for s in seqs]
        starts = [self._catch_up_start(st, s.row, e) for s, e in zip(seqs, ends)]
        width = max(e - st for st, e in zip(starts, ends))
        if min(ends) == 0:       # a one-token prompt: no target feature yet, so nothing to draft from
            sizes = [0 if e == 0 else m for e, m in zip(ends, sizes)]
            if width == 0:
                return DraftProposal.empty(batch)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        features = torch.zeros(batch, width, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for b, s in enumerate(seqs):
            n = ends[b] - starts[b]
            tokens[b, :n] = torch.tensor(s.token_ids[starts[b] + 1:ends[b] + 1])
            features[b, :n] = st.features[s.row, starts[b]:ends[b]]
        predicted = self._pass(st, rows, starts, tokens.to(self.device), self._head_input(features))
        last = torch.tensor([max(0, e - st - 1) for st, e in zip(starts, ends)], device=self.device)
        feature = predicted[torch.arange(batch, device=self.device), last]               # [B, D]
        for b, s in enumerate(seqs):
            st.cache.truncate(s.row, ends[b])
        if self.tree_topk > 1:
            return self._propose_tree(st, rows, ends, feature, sizes)
        # 2. chain: each draft comes from the feature the previous slot predicted. Greedy rows with
        # no logit bias or penalties only need the argmax (a point-mass proposal: verify then
        # accepts a draft iff it is the target's argmax), so the full-vocabulary work is skipped.
        argmax_only = all(p.greedy and not p.logit_bias and not p.uses_penalties for p in params)
        num_drafts = list(sizes)
        for step in range(k):
            confidence = None
            if argmax_only:
                draft_logits = self._draft_logits(feature)                                 # [B, V_draft]
                best = draft_logits.argmax(-1)
                draft_tokens[:, step] = self.draft_vocab[best].cpu()
                if self.min_confidence and step:
                    confidence = torch.softmax(draft_logits, -1).gather(1, best[:, None])[:, 0]
            else:
                logits = self._logits(feature)
                history = [s.token_ids + draft_tokens[b, :step].tolist() for b, s in enumerate(seqs)] \
                    if needs_history else None
                transformed = transform_logits(logits, params, history,
                                               [s.prompt_len for s in seqs] if needs_history else None, None)
                probs = probs_from_logits(transformed, params)[:, 0]                        # [B, vocab]
                if draft_probs is None:
                    draft_probs = torch.zeros(batch, k, self.vocab, dtype=torch.float32, device=self.device)
                draft_probs[:, step] = probs
                draft_tokens[:, step] = sample_drafts(probs, generators, [n > step for n in num_drafts]).cpu()
                if self.min_confidence and step:
                    confidence = probs.gather(1, draft_tokens[:, step:step + 1].to(probs.device))[:, 0]
            if confidence is not None:      # rows stop before an unsure draft
                for b, c in enumerate(confidence.tolist()):
                    if c < self.min_confidence and num_drafts[b] > step:
                        num_drafts[b] = step
            if step + 1 == k or max(num_drafts) <= step + 1:
                break
            slot = [e + step for e in ends]
            predicted = self._pass(st, rows, slot, draft_tokens[:, step:step + 1].to(self.device), feature[:, None])
            feature = predicted[:, 0]
            for b, s in enumerate(seqs):
                st.cache.truncate(s.row, slot[b] + 1)
        # step state: head slots computed from true features, per row (what commit keeps)
        return DraftProposal(draft_tokens, torch.tensor(num_drafts, dtype=torch.long),
                             None if argmax_only else draft_probs, step_state=ends)

    def _catch_up_start(self, st: HeadState, row: int, end: int) -> int:
        """The first head slot the catch-up to `end` computes: where the head's cache ends, but
        no more than `catch_up_window` slots back. Slots skipped stay out of every later pass's
        attention (`head_from`): a head that has not drafted for a whole prompt (the prefill, or
        plain steps while the budget did not draft) would otherwise run over all of it, costing
        several plain steps for a probe of a few drafts (docs/drafters.md, "Trained drafters");
        the head reads mostly the feature before it, little of the context far back."""
        start = st.cache.lengths[row]
        if start < int(st.head_from[row]):     # cut back below what it had computed (a new sequence)
            start = 0
        if end - start > self.catch_up_window:
            start = end - self.catch_up_window
        first = st.seen[row][0]                  # no slot from a feature the engine did not observe
        if start < first <= end:
            start = first
        if start != st.cache.lengths[row] or start == 0:
            st.head_from[row] = start
            st.cache.truncate(row, start)
        return start

    def _propose_tree(self, st: HeadState, rows: torch.Tensor, ends: list[int],
                      root_feature: torch.Tensor,      # [B, D] predicted feature of each row's root
                      budgets: list[int]) -> DraftProposal:
        """2'. an EAGLE-2 dynamic tree (dynamic_tree.py): one head pass per depth over the K best
        candidates of that depth (the frontier), then the best `budgets[b]` candidates overall.

        Head slots of the tree: frontier f of depth d (tokens at position root + d) is written at
        slot end + (d-1)*K + f, RoPE position end + d - 1 (it reads its parent's predicted feature),
        and sees the true slots (< end) and the slots of its own ancestors (tree_mask bits)."""
        batch, topk, dim = len(ends), self.tree_topk, self.config.hidden_size
        depth = min(self.tree_depth, max(budgets), 63 // topk + 1)
        if depth <= 0:
            return DraftProposal.empty(batch)
        ends_t = torch.tensor(ends, dtype=torch.long)
        candidates = Candidates()
        root_log_probs = F.log_softmax(self._draft_logits(root_feature), dim=-1)          # [B, V_draft]
        scores, tokens = root_log_probs.topk(min(topk, root_log_probs.shape[-1]), dim=-1)  # [B, K]
        first = candidates.add(tokens, scores, torch.full_like(tokens, -1))
        features = root_feature[:, None].expand(batch, tokens.shape[1], dim)             # [B, K, D] parents'
        parent_masks = torch.zeros(batch, tokens.shape[1], dtype=torch.long)              # [B, K] ancestors' bits
        for d in range(1, depth):
            # frontier: the K best candidates of depth d
            frontier_scores, pick = scores.topk(min(topk, scores.shape[1]), dim=1)         # [B, F]
            width = pick.shape[1]
            frontier_tokens = tokens.gather(1, pick)
            own_bits = torch.ones(width, dtype=torch.long) << ((d - 1) * topk + torch.arange(width))
            frontier_masks = parent_masks.gather(1, pick) | own_bits                         # [B, F]
            frontier_features = features.gather(1, pick.to(self.device)[:, :, None].expand(-1, -1, dim))
            starts = [e + (d - 1) * topk for e in ends]
            head_tokens = self.draft_vocab[frontier_tokens.to(self.device)]                 # [B, F] target ids
            fb = ForwardBatch(head_tokens, torch.tensor(starts), rows,
                              positions=(ends_t + d - 1)[:, None].expand(batch, width),
                              tree_base=ends_t[:, None].expand(batch, width), tree_mask=frontier_masks)
            predicted = self._pass(st, rows, starts, head_tokens, frontier_features, fb)        # [B, F, D]
            log_probs = F.log_softmax(self._draft_logits(predicted.reshape(batch * width, dim)), dim=-1)
            tokens, scores = expand(log_probs.reshape(batch, width, -1).cpu(), frontier_scores.cpu(), topk)
            children = tokens.shape[1] // width
            parent_slot = torch.arange(width).repeat_interleave(children)                    # [F*K] frontier index
            parents = (first + pick.gather(1, parent_slot.expand(batch, -1)))                 # global candidate ids
            first = candidates.add(tokens, scores, parents)
            features = predicted[:, parent_slot.to(self.device)]                              # [B, F*K, D]
            parent_masks = frontier_masks[:, parent_slot]
        for b, row in enumerate(rows.tolist()):
            st.cache.truncate(row, ends[b])
        node_tokens, node_parents, num_nodes = select_nodes(candidates, budgets)
        return DraftProposal(self.draft_vocab.cpu()[node_tokens], num_nodes, None, step_state=ends,
                             parents=node_parents)

    def commit(self, seqs, proposal, num_accepted):
        if proposal.step_state is None:
            return
        st = row_state(seqs)
        if proposal.is_tree:      # the verify pass wrote node i's feature at slot root+1+i: move the
            parents, tokens = proposal.tree_parents().tolist(), proposal.tokens.tolist()   # accepted path's
            st.pending.flush()                                                           # to root+depth
            for b, (s, root) in enumerate(zip(seqs, proposal.step_state)):
                accepted = num_accepted[b]
                path = s.token_ids[root + 1:root + 1 + accepted]
                nodes = walk_path(parents[b][:int(proposal.num_tokens[b])], tokens[b], path) if accepted else []
                for depth, node in enumerate(nodes or [], start=1):
                    if node != depth - 1 and root + 1 + node < st.features.shape[1]:
                        st.features[s.row, root + depth] = st.features[s.row, root + 1 + node]
        for s, true_len in zip(seqs, proposal.step_state):    # keep only slots computed from true features
            st.cache.truncate(s.row, min(st.cache.lengths[s.row], true_len))


@register("eagle")
class EagleDrafter(HeadDrafter):
    def __init__(self, target, drafter_path: str | Path | None = None, fast: bool = True,
                 min_confidence: float = 0.0, tree_topk: int = 1, tree_depth: int = 6,
                 catch_up_window: int = CATCH_UP_WINDOW, **_: object) -> None:
        from .format import check_target, read_meta, shipped_drafter
        if not getattr(target, "native", False):
            raise DrafterError(f"method 'eagle' needs a natively loaded target (Llama/Qwen2/Qwen3); {target.name} runs "
                               f"through the transformers adapter")
        path = Path(drafter_path).expanduser() if drafter_path is not None else shipped_drafter(target, "eagle")
        for name, value, limit in (("tree_topk", tree_topk, MAX_TREE_TOPK), ("tree_depth", tree_depth, MAX_TREE_DEPTH)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise DrafterError(f"{name} must be an integer in [1, {limit}], got {value!r}")
        self.tree_topk, self.tree_depth = tree_topk, tree_depth
        if tree_topk > 1:       # EAGLE-2 dynamic trees (dynamic_tree.py); 1: a chain
            self.capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True, drafts_trees=True)
        if path is None:
            raise DrafterError(f"no EAGLE drafter for {target.name}: train one with `specdecode distill --target "
                               f"{target.name} --out DIR` and pass --drafter DIR")
        self.path, self.meta = path, read_meta(path, "eagle")
        self.matches_target = check_target(self.meta, target, path)
        super().__init__(target, fast, min_confidence, catch_up_window)

    def _load_head(self, target, link) -> Head:
        from safetensors.torch import load_file

        from .format import prior_acceptance
        config, model = HeadConfig(**self.meta["config"]), target.model
        try:
            weights = load_file(str(self.path / "model.safetensors"))
        except (OSError, RuntimeError) as exc:
            raise DrafterError(f"cannot read {self.path / 'model.safetensors'}: {exc}") from None
        cast = lambda t: t.to(self.dtype).to(self.device)          # noqa: E731
        params = {"fc": link(cast(weights["fc.weight"]), cast(weights["fc.bias"]))}
        for name in ("qkv", "o", "gate_up", "down"):
            params[name] = link(cast(weights[f"{name}.weight"]), None)
        for name in ("in_norm", "attn_norm", "mlp_norm"):
            params[name] = cast(weights[name])
        draft_vocab = weights["draft_vocab"].long().to(self.device)                    # [V_draft]
        # priors of the draft budget: a head pass reads its layer and LM-head rows, so its cost is their share of
        # the target's weight bytes (a pass is bound by the bytes it reads); and the held-out acceptance
        head_bytes = (sum(weights[f"{name}.weight"].numel() for name in ("fc", "qkv", "o", "gate_up", "down"))
                      + draft_vocab.numel() * model.config.hidden_size) * self.embed.element_size()
        return Head(config, head_block, params, draft_vocab,
                    link(model.lm_head_weight.index_select(0, draft_vocab).contiguous(), None), model.final_norm,
                    *rope_tables(config, model.max_len + 64, self.dtype, self.device),
                    head_bytes / max(weights_bytes(model), 1), prior_acceptance(self.meta))


@register("eagle2")
class Eagle2Drafter(EagleDrafter):
    """The same head drafting EAGLE-2 dynamic trees (dynamic_tree.py): `tree_topk` children per
    expanded node, `tree_depth` head passes; the node budget is the step's draft size."""

    capabilities = DrafterCapabilities(needs_target_hidden=True, has_state=True, drafts_trees=True)

    def __init__(self, target, tree_topk: int = 8, tree_depth: int = 6, **options) -> None:
        if tree_topk == 1:
            raise DrafterError("method 'eagle2' drafts trees: tree_topk must be >= 2 (use method 'eagle' for a chain)")
        super().__init__(target, tree_topk=tree_topk, tree_depth=tree_depth, **options)
