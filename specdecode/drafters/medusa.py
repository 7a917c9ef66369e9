"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv 2401.10774; Medusa-1: heads trained on a frozen target).

K residual heads read the target's *feature* (its last hidden state before the final norm, as
EAGLE reads it) at one position and each predicts one token further ahead:

    head i:  h_i = x + SiLU(W_i x + b_i)      (one ResBlock, W_i initialised to zero)
             logits_i = lm_head[draft_vocab](final_norm(h_i))

with the target's own final norm and LM head restricted to a reduced draft vocabulary (chosen by
corpus frequency as for EAGLE, distill/train.py). The heads never see the drafted tokens: one
pass of all K heads drafts a whole tree.

Offsets. The feature at position p predicts (through the target's own LM head) token p+1; head
i at position p predicts token p+2+i (head 0: the token after the target's own next token).
When drafting, the newest feature the target has computed is at p = L-2, L = len(token_ids):
the token at L-1 (the last committed one: the bonus / recovered token of the last step) was
predicted from it but has not been run through the target yet. The tree's root is that token
L-1; a draft node at depth d (1-based: depth 1 is token L) is token L-1+d = p+1+d, so it comes
from head d-1. So with K heads the tree is at most K deep.

Tree (the EAGLE-2 rerank of dynamic_tree.py): depth 1's candidates are head 0's top-`topk`
tokens; at each further depth d the `topk` best candidates of depth d-1 (by path score, the sum of
the heads' log-probabilities along the path) each get head d-1's top-`topk` tokens as children --
every node of one depth shares its head's distribution -- and the tree is the `sizes[b]`
best candidates overall. It is proposed as point masses (probs None): the tree verifier keeps
the target's distribution exactly, greedy or sampled.

State per cache row, position-addressed: `features[row, p]`, written by `observe` after every
target pass; `known[row]`: positions below it hold the target's feature at that position. A tree
pass writes draft node i's feature at slot L + i, not at its path position, so `commit` moves
the last accepted node's feature to where a chain would have put it (it is the next step's p).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import walk_path
from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal, row_state
from .dynamic_tree import Candidates, select_nodes
from .features import PendingFeatures
from .registry import register

MEDUSA_VERSION = 1     # layout of a saved kind "medusa" drafter (config["version"])
MAX_HEADS = 16
MAX_TREE_TOPK = 16


@dataclass
class MedusaConfig:
    hidden_size: int
    num_heads: int
    draft_vocab_size: int
    target_vocab_size: int
    version: int = MEDUSA_VERSION

    def as_dict(self) -> dict:
        return asdict(self)


def medusa_block(x: torch.Tensor,            # [N, D] features
                 stacked,                    # callable [N, D] -> [N, K*D]: W_1..W_K stacked, with biases
                 num_heads: int) -> torch.Tensor:   # -> [N, K, D] head i's hidden state
    """All K heads' residual blocks in one projection."""
    return x[:, None] + F.silu(stacked(x).reshape(x.shape[0], num_heads, x.shape[-1]))


class MedusaHeads(nn.Module):
    """Trainable parameters: `weight` [K, D, D] and `bias` [K, D] (zero at start: every head
    starts as the identity, i.e. predicting what the target's LM head predicts from x), plus the
    draft vocabulary. The target's final norm and LM head are not saved (read at load)."""

    def __init__(self, config: MedusaConfig, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.weight = nn.Parameter(torch.zeros(c.num_heads, c.hidden_size, c.hidden_size))
        self.bias = nn.Parameter(torch.zeros(c.num_heads, c.hidden_size))
        vocab = torch.arange(c.draft_vocab_size) if draft_vocab is None else draft_vocab.long()
        self.register_buffer("draft_vocab", vocab.clone(), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # [N, D] -> [N, K, D]
        k, d = self.config.num_heads, self.config.hidden_size
        stacked = lambda t: F.linear(t, self.weight.reshape(k * d, d), self.bias.reshape(k * d))  # noqa: E731
        return medusa_block(x, stacked, k)


class FeatureState:
    """`DrafterState` of the per-row features ([rows, max_len, D]), their `known` lengths and the
    features not yet written into them, kept by the engine with its rows (`Sequence.drafter_state`)."""

    def __init__(self, features: torch.Tensor) -> None:
        self.features = features
        self.known = [0] * features.shape[0]
        self.pending = PendingFeatures(features, MAX_HEADS + 2)     # the newest feature, and a tree's slots

    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()

    def used_bytes(self) -> int:
        rows, max_len = self.features.shape[:2]
        return int(self.nbytes() * sum(self.known) / (rows * max_len))

    def reset(self, row: int) -> None:
        self.known[row] = 0

    def truncate(self, row: int, length: int) -> None:
        self.known[row] = min(self.known[row], length)


@register("medusa")
class MedusaDrafter(Drafter):
    capabilities = DrafterCapabilities(needs_target_hidden=True, drafts_trees=True, has_state=True,
                                       relative_cost=0.005)

    def __init__(self, target, drafter_path: str | Path | None = None, tree_topk: int = 4,
                 tree_depth: int | None = None, fast: bool = True, **_: object) -> None:
        from .format import check_target, prior_acceptance, read_meta, shipped_drafter
        if not getattr(target, "native", False):
            raise DrafterError(f"method 'medusa' needs a natively loaded target (Llama/Qwen2/Qwen3); {target.name} "
                               f"runs through the transformers adapter")
        path = Path(drafter_path).expanduser() if drafter_path is not None else shipped_drafter(target, "medusa")
        if path is None:
            raise DrafterError(f"no Medusa heads for {target.name}: train them with `specdecode distill --kind medusa "
                               f"--target {target.name} --out DIR` and pass --drafter DIR/drafter")
        meta = read_meta(path, "medusa")
        self.matches_target = check_target(meta, target, path)
        self.capabilities = replace(self.capabilities, prior_acceptance=prior_acceptance(meta))
        self.path = path
        try:
            self.config = MedusaConfig(**meta["config"])
        except (KeyError, TypeError) as exc:
            raise DrafterError(f"{path / 'drafter.json'}: bad Medusa config: {exc}") from None
        if self.config.version > MEDUSA_VERSION:
            raise DrafterError(f"{path}: Medusa layout version {self.config.version} is newer than this specdecode "
                               f"reads (<= {MEDUSA_VERSION}); upgrade specdecode")
        heads = self.config.num_heads
        if not isinstance(tree_topk, int) or isinstance(tree_topk, bool) or not 1 <= tree_topk <= MAX_TREE_TOPK:
            raise DrafterError(f"tree_topk must be an integer in [1, {MAX_TREE_TOPK}], got {tree_topk!r}")
        tree_depth = heads if tree_depth is None else tree_depth
        if not isinstance(tree_depth, int) or isinstance(tree_depth, bool) or not 1 <= tree_depth <= heads:
            raise DrafterError(f"tree_depth must be an integer in [1, {heads}] (the heads in {path}), "
                               f"got {tree_depth!r}")
        self.tree_topk, self.tree_depth = tree_topk, tree_depth
        model = target.model
        self.dtype, self.device = model.dtype, model.device
        from safetensors.torch import load_file
        try:
            weights = load_file(str(path / "model.safetensors"))
        except (OSError, RuntimeError) as exc:
            raise DrafterError(f"cannot read {path / 'model.safetensors'}: {exc}") from None
        d = self.config.hidden_size
        make_linear = None
        if fast and self.device.type == "cpu":
            from ..fast import make_linear
        link = make_linear or (lambda w, b=None: (lambda x: F.linear(x, w, b)))
        cast = lambda t: t.to(self.dtype).to(self.device).contiguous()          # noqa: E731
        used = slice(0, tree_depth)                        # heads deeper than the tree are never run
        self.stacked = link(cast(weights["weight"][used].reshape(tree_depth * d, d)),
                            cast(weights["bias"][used].reshape(tree_depth * d)))
        self.draft_vocab = weights["draft_vocab"].long().to(self.device)              # [V_draft]
        self.final_norm, self.eps = model.final_norm, model.config.rms_norm_eps
        self.lm_head = link(model.lm_head_weight.index_select(0, self.draft_vocab).contiguous(), None)

    # ------------------------------------------------------------------ state
    def prepare(self, batch_size: int, max_len: int) -> FeatureState:
        features = torch.zeros(batch_size, max_len, self.config.hidden_size, dtype=self.dtype, device=self.device)
        return FeatureState(features)

    def observe(self, seqs, starts, hidden):
        """Positions below len(token_ids) of the pass are true features (the pending tokens; the
        drafts after them wait for commit). A prefill pass stops one short of that, but its last
        claimed position is rewritten by the row's first step before any propose reads it."""
        st = row_state(seqs)
        width, max_len = hidden.shape[1], st.features.shape[1]
        for b, s in enumerate(seqs):
            n = max(0, min(width, max_len - starts[b]))
            if n:
                st.pending.add(s.row, starts[b], hidden[b, :n])
            st.known[s.row] = min(starts[b] + n, len(s.token_ids))

    # ------------------------------------------------------------------ drafting
    def head_log_probs(self, features: torch.Tensor) -> torch.Tensor:   # [B, D] -> [B, depth, V_draft] float32
        hidden = medusa_block(features, self.stacked, self.tree_depth)                   # [B, depth, D]
        normed = F.rms_norm(hidden, (self.config.hidden_size,), self.final_norm, self.eps)
        return F.log_softmax(self.lm_head(normed).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, seqs, sizes):
        st = row_state(seqs)
        batch = len(seqs)
        positions = [len(s.token_ids) - 2 for s in seqs]          # p: the newest target feature
        budgets = [m if 0 <= p < st.known[s.row] else 0 for s, p, m in zip(seqs, positions, sizes)]
        depth = min(self.tree_depth, max(budgets))
        if depth <= 0:
            return DraftProposal.empty(batch)
        rows = torch.tensor([s.row for s in seqs], device=self.device)
        st.pending.flush()
        features = st.features[rows, torch.tensor(positions, device=self.device).clamp(min=0)]   # [B, D]
        log_probs = self.head_log_probs(features)[:, :depth].cpu()                           # [B, depth, V_draft]
        topk = min(self.tree_topk, log_probs.shape[-1])
        head_scores, head_tokens = log_probs.topk(topk, dim=-1)                              # [B, depth, topk]
        candidates = Candidates()
        scores, tokens = head_scores[:, 0], head_tokens[:, 0]                                # [B, topk] depth 1
        first = candidates.add(tokens, scores, torch.full_like(tokens, -1))
        for d in range(1, depth):
            frontier_scores, pick = scores.topk(min(topk, scores.shape[1]), dim=1)           # [B, F]
            width = pick.shape[1]
            scores = (frontier_scores[:, :, None] + head_scores[:, d, None, :]).reshape(batch, -1)   # [B, F*topk]
            tokens = head_tokens[:, d, None, :].expand(batch, width, topk).reshape(batch, -1)
            parents = (first + pick)[:, :, None].expand(batch, width, topk).reshape(batch, -1)
            first = candidates.add(tokens, scores, parents)
        node_tokens, node_parents, num_nodes = select_nodes(candidates, budgets)
        return DraftProposal(self.draft_vocab.cpu()[node_tokens], num_nodes, None,
                             step_state=[len(s.token_ids) for s in seqs], parents=node_parents)

    def commit(self, seqs, proposal, num_accepted):
        """Move each row's last accepted node's feature from its tree slot to its path position."""
        if proposal.step_state is None:
            return
        st = row_state(seqs)
        features, known = st.features, st.known
        st.pending.flush()
        parents = proposal.tree_parents().tolist()
        tokens = proposal.tokens.tolist()
        for b, (s, old_len) in enumerate(zip(seqs, proposal.step_state)):
            accepted = num_accepted[b]
            if accepted == 0:
                continue
            path = s.token_ids[old_len:old_len + accepted]
            nodes = walk_path(parents[b][:int(proposal.num_tokens[b])], tokens[b], path)
            node = nodes[-1] if nodes else None
            if node is None or old_len + node >= features.shape[1]:    # cut short (a stop string) / no room
                known[s.row] = min(known[s.row], old_len)
                continue
            if node != accepted - 1:
                features[s.row, old_len + accepted - 1] = features[s.row, old_len + node]
            known[s.row] = old_len + accepted

