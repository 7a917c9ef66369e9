"""The logits transform shared by drafter and target, and token sampling.

Speculative decoding is lossless only if the drafter's and the target's logits go
through the *same* transform for the same row and position, so both call
`transform_logits` with the same `SamplingParams`, history and block tokens.

Pipeline per row (see `SamplingParams`):

1. ``logit_bias``            add the bias to the listed token ids
2. ``repetition_penalty``    CTRL / HF style on tokens seen in prompt + output + block prefix:
                             positive logit ``/= penalty``, negative logit ``*= penalty``
3. ``presence_penalty``      subtract once for every token seen among OUTPUT tokens (+ block prefix)
4. ``frequency_penalty``     subtract ``count * penalty`` (same counts as presence)
5. non-greedy rows only: ``/ temperature``, ``top_k``, ``top_p``, ``min_p``; filtered entries are -inf.

Greedy rows (temperature == 0) stop after step 4; `probs_from_logits` turns them into a
one-hot of the argmax.

"Block" = the T positions scored in one forward pass (T = 1 for plain decoding, k + 1 for
verification of k draft tokens). Position t of the block is predicted after
``history + block_tokens[:, :t]``, so penalties are counted per position.

Ties: top_k and top_p are applied as logit thresholds, so tokens tied with the last kept
token are kept too (the kept set can be slightly larger than k / the nucleus). This is
deterministic and identical for drafter and target, which is all losslessness needs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdecode.params import SamplingParams

__all__ = ["transform_logits", "probs_from_logits", "sample", "sample_drafts", "sample_at", "uniforms",
           "position_uniforms", "Generators"]

# None (torch default RNG) | one torch.Generator for the whole batch (vectorized draws) |
# a list of len batch with one torch.Generator (or None) per row (per-row draws).
Generators = torch.Generator | Sequence[torch.Generator | None] | None


def _uses_filters(p: SamplingParams, vocab: int) -> bool:
    return (not p.greedy) and ((0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0)


def transform_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    block_tokens: torch.Tensor | None = None,
    block_paths: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply a grammar's mask, bias, penalties, temperature and filters; returns float32 logits.

    logits:       [batch, T, vocab] raw logits, any float dtype (computed in float32).
    params:       len batch, one SamplingParams per row.
    history:      per row, all token ids before block position 0 (prompt + output), as a
                  list or 1-D tensor. Only needed when some row uses penalties.
    prompt_lens:  per row, how many leading history tokens are prompt. Presence/frequency
                  penalties count only output tokens; the repetition penalty counts both.
                  Required when some row uses presence/frequency penalties.
    block_tokens: [batch, T-1] tokens at block positions 0..T-2 (e.g. draft tokens); entries
                  < 0 (padding) are ignored. Only needed when T > 1 and penalties are used.
    block_paths:  [batch, T, T-1] bool, for a draft tree: entry [b, t, j] says block token j
                  precedes position t (is on its path; specdecode/tree.py `ancestors`). None =
                  a chain: every earlier block position precedes t.
    allowed:      [batch, T, vocab] bool, the tokens a grammar allows at each position
                  (structured.py); the others get -inf first. None = no constraint.

    Returns [batch, T, vocab] float32. When there is nothing to do and `logits` is already
    float32, the input tensor itself may be returned (do not modify it in place).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, T, vocab], got shape {tuple(logits.shape)}")
    batch, block_len, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for a batch of {batch}")
    device = logits.device
    if allowed is not None:
        logits = logits.float().masked_fill(~allowed.to(device), float("-inf"))

    bias_rows = [b for b, p in enumerate(params) if p.logit_bias]
    penalty_rows = [b for b, p in enumerate(params) if p.uses_penalties]
    filter_rows = [b for b, p in enumerate(params) if _uses_filters(p, vocab)]
    temperatures = [1.0 if p.greedy else float(p.temperature) for p in params]
    needs_temperature = any(t != 1.0 for t in temperatures)

    # Fast path: no bias, penalties or filters -> at most a temperature division.
    if not bias_rows and not penalty_rows and not filter_rows:
        out = logits.float()
        if needs_temperature:
            out = out / _row_tensor(temperatures, device)
        return out

    out = logits.to(torch.float32, copy=True)

    if bias_rows:
        rows, tokens, values = [], [], []
        for b in bias_rows:
            for token_id, bias in params[b].logit_bias.items():
                if token_id >= vocab:
                    raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary (size {vocab})")
                rows.append(b)
                tokens.append(token_id)
                values.append(bias)
        # (row, token) pairs are unique (logit_bias is a dict): a sparse in-place add over T.
        row_index = torch.tensor(rows, device=device)
        token_index = torch.tensor(tokens, device=device)
        out[row_index, :, token_index] += torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    if penalty_rows:
        _apply_penalties(out, params, penalty_rows, history, prompt_lens, block_tokens, block_paths)

    if needs_temperature:
        out /= _row_tensor(temperatures, device)

    if filter_rows:
        _apply_filters(out, params, filter_rows)
    return out


def _row_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """[n] python floats -> [n, 1, 1] float32 tensor for broadcasting over [n, T, vocab]."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1)


def _select(out: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of `out` to work on: the tensor itself when all rows are selected (no copy)."""
    if len(rows) == out.shape[0]:
        return out, None
    index = torch.tensor(rows, device=out.device)
    return out[index], index


def _apply_penalties(
    out: torch.Tensor,                      # [batch, T, vocab] float32, modified in place
    params: Sequence[SamplingParams],
    rows: list[int],
    history: Sequence[Sequence[int]] | None,
    prompt_lens: Sequence[int] | None,
    block_tokens: torch.Tensor | None,      # [batch, T-1]
    block_paths: torch.Tensor | None = None,  # [batch, T, T-1] bool; None = chain
) -> None:
    """Penalties touch only the tokens present in history + block, so each row works on the
    [T, n_unique] slice of those tokens (gather, penalize, scatter back) -- never on the full
    vocabulary. Per-position counts: history counts + cumulative counts of block tokens."""
    batch, block_len, vocab = out.shape
    device = out.device
    if history is None or len(history) != batch:
        raise ValueError("history (one token list per row) is required when a row uses penalties")
    uses_output_counts = any(params[b].presence_penalty != 0.0 or params[b].frequency_penalty != 0.0
                             for b in rows)
    if uses_output_counts and (prompt_lens is None or len(prompt_lens) != batch):
        raise ValueError("prompt_lens (one per row) is required with presence/frequency penalties")
    if block_len > 1 and (block_tokens is None or tuple(block_tokens.shape) != (batch, block_len - 1)):
        raise ValueError(f"block_tokens must be [batch, T-1] = [{batch}, {block_len - 1}] when T > 1")
    if block_len > 1:
        block_tokens = block_tokens.to(device=device, dtype=torch.long)

    for b in rows:
        p = params[b]
        past = torch.as_tensor(history[b], dtype=torch.long, device=device).reshape(-1)   # [H]
        block = block_tokens[b] if block_len > 1 else past[:0]                            # [T-1]
        if past.numel() and (int(past.min()) < 0 or int(past.max()) >= vocab):
            raise ValueError(f"history of row {b} has token ids outside [0, {vocab})")
        if block.numel() and int(block.max()) >= vocab:
            raise ValueError(f"block_tokens of row {b} has token ids >= {vocab}")
        token_ids, inverse = torch.unique(torch.cat([past, block.clamp(min=0)]), return_inverse=True)  # [U]
        n_unique = token_ids.numel()
        if n_unique == 0:
            continue
        past_inverse, block_inverse = inverse[:past.numel()], inverse[past.numel():]
        # Counts before block position 0, per unique token: [U].
        seen_counts = torch.bincount(past_inverse, minlength=n_unique).to(torch.float32)
        start = int(prompt_lens[b]) if uses_output_counts else 0
        output_counts = torch.bincount(past_inverse[start:], minlength=n_unique).to(torch.float32)
        # Block tokens before each position (on its path, for a tree): [T, U] (position 0 -> 0);
        # padding (< 0) ignored.
        prefix_counts = torch.zeros(block_len, n_unique, dtype=torch.float32, device=device)
        if block_len > 1:
            block_one_hot = torch.zeros(block_len - 1, n_unique, dtype=torch.float32, device=device)
            block_one_hot.scatter_(1, block_inverse.unsqueeze(1), (block >= 0).to(torch.float32).unsqueeze(1))
            if block_paths is None:
                prefix_counts[1:] = block_one_hot.cumsum(dim=0)
            else:
                prefix_counts = block_paths[b].to(device=device, dtype=torch.float32) @ block_one_hot

        row_logits = out[b]                                                          # [T, vocab] view
        values = row_logits[:, token_ids]                                            # [T, U]
        if p.repetition_penalty != 1.0:
            seen = (seen_counts + prefix_counts) > 0
            penalized = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            values = torch.where(seen, penalized, values)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = output_counts + prefix_counts
            values = values - p.presence_penalty * (counts > 0).to(torch.float32) - p.frequency_penalty * counts
        row_logits[:, token_ids] = values


def _apply_filters(out: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> None:
    """top_k, then top_p, then min_p on the (already temperature-scaled) rows, in place.

    Each filter is a per-(row, position) logit cutoff; rows where a filter is disabled get a
    cutoff of -inf. (Avoid exp() of -inf entries: on CPU it is far slower than softmax.)
    """
    vocab = out.shape[-1]
    device = out.device
    sub, index = _select(out, rows)
    neg_inf = float("-inf")

    top_k = [params[b].top_k if 0 < params[b].top_k < vocab else vocab for b in rows]
    top_p = [params[b].top_p for b in rows]
    window = None
    if any(k < vocab for k in top_k):
        max_k = max(k for k in top_k if k < vocab)
        top_values, top_indices = sub.topk(max_k, dim=-1)                          # [n, T, max_k]
        kth = torch.tensor([min(k, max_k) - 1 for k in top_k], device=device)
        cutoff = top_values.gather(-1, kth.view(-1, 1, 1).expand(-1, sub.shape[1], 1))  # [n, T, 1]
        disabled = torch.tensor([k >= vocab for k in top_k], device=device).view(-1, 1, 1)
        sub.masked_fill_(sub < cutoff.masked_fill(disabled, neg_inf), neg_inf)
        # The filtered logits at these indices are still in descending order (entries past a
        # row's k are -inf or tied with its k-th): the nucleus search can start from them.
        window = (sub.gather(-1, top_indices), top_indices)

    if any(p < 1.0 for p in top_p):
        # The nucleus is usually a few hundred tokens at most: look for its cutoff among the top
        # `candidates` logits and widen only if some row's nucleus does not end inside them --
        # a full sort of the whole vocabulary costs many times a topk(256).
        if not all(p >= 1.0 or k < vocab for p, k in zip(top_p, top_k)):
            window = None                      # some top_p row has no top_k: its own window
        cutoff = _nucleus_cutoff(sub, _row_tensor(top_p, device), window)
        disabled = torch.tensor([p >= 1.0 for p in top_p], device=device).view(-1, 1, 1)
        sub.masked_fill_(sub < cutoff.masked_fill(disabled, neg_inf), neg_inf)

    min_p = [params[b].min_p for b in rows]
    if any(p > 0.0 for p in min_p):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        log_min_p = _row_tensor([math.log(p) if p > 0.0 else neg_inf for p in min_p], device)
        sub.masked_fill_(sub < sub.amax(dim=-1, keepdim=True) + log_min_p, neg_inf)

    if index is not None:
        out[index] = sub


_TOP_P_CANDIDATES = 256


def _nucleus_cutoff(
    logits: torch.Tensor,                                   # [n, T, vocab] temperature-scaled, top_k-filtered
    top_p: torch.Tensor,                                    # [n, 1, 1]
    window: tuple[torch.Tensor, torch.Tensor] | None,       # ([n, T, c] descending logits, their indices) or None
) -> torch.Tensor:                                          # [n, T, 1] smallest logit kept by top_p
    """Keep the smallest set of tokens whose probability reaches top_p (always the top token):
    a sorted token is kept while the probability mass strictly before it is < top_p."""
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)                                              # [n, T, vocab]
    candidates = window[0].shape[-1] if window is not None else min(_TOP_P_CANDIDATES, vocab)
    while True:
        if window is not None:
            top_logits, top_indices = window
        elif candidates < vocab:
            top_logits, top_indices = logits.topk(candidates, dim=-1)           # [n, T, c] descending
        else:
            top_logits, top_indices = logits.sort(dim=-1, descending=True)      # [n, T, vocab]
        window = None
        cumulative = probs.gather(-1, top_indices).cumsum(dim=-1)
        mass_before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
        num_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)   # [n, T, 1]
        # num_keep < candidates: the first dropped token is among the candidates -> exact.
        if candidates >= vocab or bool((num_keep < candidates).all()):
            return top_logits.gather(-1, num_keep - 1)
        # Widen 8x, or go straight to the full sort once the window would be >= vocab / 4.
        candidates = candidates * 8 if candidates * 32 < vocab else vocab


def probs_from_logits(transformed: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Turn transformed logits into the distribution tokens are drawn from.

    transformed: [batch, T, vocab] from `transform_logits`.
    Returns [batch, T, vocab] float32: softmax for sampled rows, a one-hot of the argmax
    (ties -> lowest index, as torch.argmax) for greedy rows.
    """
    transformed = transformed.float()
    greedy = [p.greedy for p in params]
    if not any(greedy):
        return transformed.softmax(dim=-1)
    one_hot = torch.zeros_like(transformed).scatter_(-1, transformed.argmax(dim=-1, keepdim=True), 1.0)
    if all(greedy):
        return one_hot
    greedy_mask = torch.tensor(greedy, device=transformed.device).view(-1, 1, 1)
    return torch.where(greedy_mask, one_hot, transformed.softmax(dim=-1))


def uniforms(batch: int, counts: Sequence[int] | int, generators: Generators,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform [0, 1) float64 draws, [batch, max(counts)].

    generators: None (default RNG), a single torch.Generator (one vectorized draw for the
    whole batch), or a list of len batch of torch.Generator / None (row b draws exactly
    counts[b] numbers from its own generator, so its result depends only on that generator;
    the remaining entries of the row are 0 and must be ignored).
    """
    width = counts if isinstance(counts, int) else (max(counts) if len(counts) else 0)
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(batch, width, generator=generators, dtype=torch.float64, device=device)
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    out = torch.zeros(batch, width, dtype=torch.float64, device=device)
    for b, generator in enumerate(generators):
        n = counts if isinstance(counts, int) else int(counts[b])
        if n:
            out[b, :n] = torch.rand(n, generator=generator, dtype=torch.float64, device=device)
    return out


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """Draw one token per row by inverse CDF.

    probs:      [batch, vocab] non-negative weights (need not be exactly normalized).
    generators: None | torch.Generator | list of len batch (see `uniforms`); one uniform
                draw per row.
    Returns [batch] int64. Tokens with zero probability are never returned.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [batch, vocab], got shape {tuple(probs.shape)}")
    return sample_at(probs, uniforms(probs.shape[0], 1, generators, probs.device))


def sample_drafts(probs: torch.Tensor,         # [batch, vocab] a chain step's draft distributions
                  generators: list,             # one per row (see `uniforms`)
                  drafting: Sequence[bool],     # rows that keep a draft at this step
                  ) -> torch.Tensor:            # [batch] int64 (0 where not drafting)
    """A chain drafter's step: `sample` for the rows still drafting only. A row then takes one
    number from its generator per draft it keeps, however many the batch's other rows draft, so a
    seeded request's text does not depend on the requests beside it."""
    tokens = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    live = [b for b, on in enumerate(drafting) if on]
    if len(live) == probs.shape[0]:
        return sample(probs, generators)
    if live:
        index = torch.tensor(live, device=probs.device)
        tokens[index] = sample(probs.index_select(0, index), [generators[b] for b in live])
    return tokens


def sample_at(probs: torch.Tensor,       # [batch, vocab] non-negative weights
              u: torch.Tensor,           # [batch, 1] float64 uniforms in [0, 1)
              ) -> torch.Tensor:         # [batch] int64
    """Inverse CDF: the first token whose cumulative mass exceeds u * total (rows independent:
    a row's token depends on that row's weights and uniform only)."""
    vocab = probs.shape[-1]
    cdf = probs.to(torch.float64).cumsum(dim=-1)                                  # [batch, vocab]
    total = cdf[:, -1:]                                                           # [batch, 1]
    # Target strictly below the total (u * total can round up to it), so the first index whose
    # cumulative mass exceeds it exists. A float cumsum only increases where probs > 0
    # (x + 0 == x exactly), so zero-probability tokens are never that index.
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return tokens.clamp_(max=vocab - 1)                                            # all-zero rows -> vocab-1


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_uniforms(seed: int, start: int, count: int) -> list[float]:
    """The uniforms in [0, 1) of sequence positions start .. start+count-1 for a request seeded
    `seed`: a counter-based stream (SplitMix64 started from a hash of the seed, output t for
    position t), so the number for a position does not depend on how many were drawn before it.
    The sampler draws the token at position t with uniform t whether it decodes plainly or
    verifies point-mass drafts (verify_tree.verify_point_mass): same seed, same output."""
    state = _mix64((seed + _GOLDEN) & _MASK64)
    return [(_mix64((state + (t + 1) * _GOLDEN) & _MASK64) >> 11) * 2.0 ** -53 for t in range(start, start + count)]
