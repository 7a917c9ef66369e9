"""The verifier: lossless speculative rejection sampling, a pure function of tensors.

Terms (used with these meanings throughout the project):

* **draft tokens** -- the k tokens per row proposed by a drafter (a small model, an n-gram /
  prompt-lookup table, ...) for the positions right after the current context. Rows may be
  ragged: row b has ``num_draft[b] <= k`` drafts, the rest of its k slots is padding.
* **accepted** token -- a draft token the verifier keeps. Drafts are checked left to right and
  checking stops at the first rejection, so the accepted tokens are always a prefix of the drafts.
* **recovered** token -- the token emitted at the first rejected position i: sampled from the
  normalized residual ``max(0, target[i] - draft[i])`` (or, for a greedy row, the target's
  argmax at i).
* **bonus** token -- the token emitted when all ``num_draft[b]`` drafts of the row are accepted:
  sampled from the target's distribution at position ``num_draft[b]`` (argmax when greedy).
  The target scored that position in the same forward pass, so it comes for free.
* **emitted** tokens -- ``accepted + 1``: every step emits the accepted drafts plus exactly one
  recovered or bonus token.
* **mean accepted length** -- the mean number of *emitted* tokens per verification step, i.e. it
  INCLUDES the bonus / recovered token (plain decoding has mean accepted length 1).

Trees (`specdecode.verify_tree`; shapes in `specdecode.tree`): when the drafts of a row form a
tree, the **accepted** tokens are a path from the root instead of a prefix: at each node its
children are tried in node order and the first one accepted becomes the current node. The
**recovered** token is emitted when every child of the last accepted node is rejected (sampled
from the residual left after all of them); the **bonus** token when that node has no children.
Emitted tokens and mean accepted length are unchanged. A chain is the tree with one child per
node, and then both readings coincide.

Algorithm (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): with target
distribution p_i and draft distribution q_i at position i and draft token d_i ~ q_i, accept d_i
with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection emit a sample from
``normalize(max(0, p_i - q_i))``; if every draft is accepted emit a bonus sample from p_{n}.
Each emitted token is then distributed exactly as p at its position: speculation changes the
speed, never the output distribution. Drafts without a distribution (n-gram / lookup drafts)
are point masses ``q_i = one_hot(d_i)``. Greedy rows (one-hot targets) reduce to: accept iff
``d_i == argmax p_i``, then emit ``argmax p`` at the stopping position.

If the residual at the rejected position is numerically zero (total mass <= RESIDUAL_EPS, only
possible when q_i ~= p_i up to float rounding) we sample from p_i instead. The probability of
rejecting at such a position is exactly that residual mass, so the fallback moves the output
distribution by at most RESIDUAL_EPS in total variation.

Random draws: all acceptance uniforms are drawn up front (one per draft), then one uniform per
sampled row for the recovered / bonus token; greedy rows need no randomness. ``generators``
follows `specdecode.sampling`: None (torch default RNG), one torch.Generator (vectorized draws
for the batch), or a list with one torch.Generator per row -- then a sampled row b draws exactly
``num_draft[b] + 1`` numbers from its own generator (a greedy row draws none), so its result
depends only on its own generator and inputs, never on the rest of the batch. (The engine verifies
point-mass drafts with `verify_tree.verify_point_mass` instead: one uniform per sequence position,
so each emitted token is the one plain decoding samples there.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import Generators, sample, uniforms

__all__ = ["PAD_TOKEN", "RESIDUAL_EPS", "VerifyResult", "verify"]

PAD_TOKEN = -1
RESIDUAL_EPS = 1e-6


@dataclass
class VerifyResult:
    tokens: torch.Tensor        # [batch, k+1] int64; row b valid in [:num_emitted[b]], rest PAD_TOKEN (-1)
    num_accepted: torch.Tensor  # [batch] int64, 0..num_draft[b]
    num_emitted: torch.Tensor   # [batch] int64 = num_accepted + 1


def _residual_probs(target_probs: torch.Tensor,   # [batch, vocab] target distribution at the rejected position
                    draft_probs: torch.Tensor,    # [batch, vocab] draft distribution at that position
                    ) -> torch.Tensor:            # [batch, vocab] normalize(max(0, target - draft))
    residual_probs = (target_probs - draft_probs).clamp_(min=0.0)
    residual_mass = residual_probs.sum(dim=-1, keepdim=True)                      # [batch, 1]
    residual_probs.div_(residual_mass.clamp(min=RESIDUAL_EPS))
    degenerate = residual_mass <= RESIDUAL_EPS                                    # [batch, 1]
    if bool(degenerate.any()):
        residual_probs = torch.where(degenerate, target_probs, residual_probs)
    return residual_probs


def verify(
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    generators: Generators = None,
) -> VerifyResult:
    """Accept a prefix of each row's drafts and emit one recovered or bonus token.

    draft_tokens: [batch, k] int64 (k may be 0); positions >= num_draft[b] are padding (any value).
    num_draft:    [batch] int64 in [0, k], drafts per row.
    draft_probs:  [batch, k, vocab] distributions the drafts were sampled from (after the same
                  `transform_logits` + `probs_from_logits` as the target), or None for point-mass
                  drafts (n-gram / lookup).
    target_probs: [batch, k+1, vocab] target distributions from `probs_from_logits`; position i
                  is the distribution of the token after the context + drafts[:i].
    greedy:       [batch] bool; greedy rows accept iff draft == argmax(target) and emit argmax.
    generators:   None | torch.Generator | list of len batch (see module docstring).
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    device = target_probs.device
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [batch, k+1, vocab] = [{batch}, {k + 1}, vocab], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [batch, k, vocab] = [{batch}, {k}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    num_draft = num_draft.to(device=device, dtype=torch.long).reshape(batch)
    if batch and (int(num_draft.min()) < 0 or int(num_draft.max()) > k):
        raise ValueError(f"num_draft must be in [0, k={k}], got {num_draft.tolist()}")
    greedy = greedy.to(device=device, dtype=torch.bool).reshape(batch)
    draft_tokens = draft_tokens.to(device=device, dtype=torch.long)

    rows = torch.arange(batch, device=device)
    positions = torch.arange(k, device=device)
    is_draft = positions.unsqueeze(0) < num_draft.unsqueeze(1)                   # [batch, k]
    if k and bool((is_draft & ((draft_tokens < 0) | (draft_tokens >= vocab))).any()):
        raise ValueError(f"draft tokens (within num_draft) must be in [0, {vocab})")
    draft_index = draft_tokens.clamp(0, vocab - 1)                               # [batch, k] padding-safe

    sampled = ~greedy
    greedy_rows = greedy.nonzero().squeeze(1)                                    # [n_greedy]
    sampled_rows = sampled.nonzero().squeeze(1)                                  # [n_sampled]
    all_sampled = sampled_rows.numel() == batch
    per_row = generators is not None and not isinstance(generators, torch.Generator)

    # --- acceptance of each draft position --------------------------------------------------
    accepted = torch.zeros(batch, k, dtype=torch.bool, device=device)            # [batch, k]
    if k and sampled_rows.numel():
        # Greedy rows draw nothing from per-row generators; vectorized draws cover the batch.
        counts = torch.where(sampled, num_draft, 0).tolist() if per_row else k
        accept_uniforms = uniforms(batch, counts, generators, device)             # [batch, <=k]
        accept_uniforms = torch.nn.functional.pad(accept_uniforms, (0, k - accept_uniforms.shape[1]))  # [batch, k]
        target_at_draft = target_probs[:, :k].gather(-1, draft_index.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
        if draft_probs is None:
            draft_at_draft = torch.ones_like(target_at_draft)
        else:
            draft_at_draft = draft_probs.gather(-1, draft_index.unsqueeze(-1)).squeeze(-1).double()    # [batch, k]
        # u < p/q  <=>  u * q < p  (no division: q == 0 accepts iff p > 0; p == q > 0 always accepts).
        accepted = accept_uniforms * draft_at_draft < target_at_draft
    if k and greedy_rows.numel():
        greedy_target = target_probs[:, :k] if greedy_rows.numel() == batch else target_probs[greedy_rows, :k]
        accepted[greedy_rows] = draft_tokens[greedy_rows] == greedy_target.argmax(dim=-1)   # [n_greedy, k]
    accepted &= is_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)                      # [batch]

    # --- recovered (first rejection) or bonus (all accepted) token --------------------------
    target_next = target_probs[rows, num_accepted]                                # [batch, vocab] (a copy)
    next_tokens = torch.empty(batch, dtype=torch.long, device=device)             # [batch]
    if greedy_rows.numel():
        next_tokens[greedy_rows] = target_next[greedy_rows].argmax(dim=-1)
    if sampled_rows.numel():
        rejected_rows = (sampled & (num_accepted < num_draft)).nonzero().squeeze(1)   # [n_rejected]
        next_probs = target_next                                                  # bonus rows: target
        if rejected_rows.numel():
            reject_pos = num_accepted[rejected_rows]                               # < num_draft <= k
            if draft_probs is None:
                draft_rejected = torch.zeros(rejected_rows.numel(), vocab, dtype=target_next.dtype, device=device)
                draft_rejected.scatter_(-1, draft_index[rejected_rows, reject_pos].unsqueeze(-1), 1.0)  # point mass
            else:
                draft_rejected = draft_probs[rejected_rows, reject_pos].to(target_next.dtype)  # [n_rejected, vocab]
            next_probs = target_next.clone()
            next_probs[rejected_rows] = _residual_probs(target_next[rejected_rows], draft_rejected)
        if all_sampled:
            next_tokens = sample(next_probs, generators)
        else:
            row_generators = [generators[b] for b in sampled_rows.tolist()] if per_row else generators
            next_tokens[sampled_rows] = sample(next_probs[sampled_rows], row_generators)

    tokens = torch.full((batch, k + 1), PAD_TOKEN, dtype=torch.long, device=device)
    if k:
        keep = positions.unsqueeze(0) < num_accepted.unsqueeze(1)
        tokens[:, :k] = torch.where(keep, draft_tokens, PAD_TOKEN)
    tokens.scatter_(1, num_accepted.unsqueeze(1), next_tokens.unsqueeze(1))
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)
