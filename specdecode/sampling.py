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
from typing import Optional, Sequence, Union

import torch

from specdecode.params import SamplingParams

__all__ = ["transform_logits", "probs_from_logits", "sample", "uniforms", "Generators"]

# None (torch default RNG) | one torch.Generator for the whole batch (vectorized draws) |
# a list of len batch with one torch.Generator (or None) per row (per-row draws).
Generators = Union[torch.Generator, Sequence[Optional[torch.Generator]], None]


def _uses_filters(p: SamplingParams, vocab: int) -> bool:
    return (not p.greedy) and ((0 < p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0)


def transform_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    block_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply bias, penalties, temperature and filters; returns float32 logits.

    logits:       [batch, T, vocab] raw logits, any float dtype (computed in float32).
    params:       len batch, one SamplingParams per row.
    history:      per row, all token ids before block position 0 (prompt + output), as a
                  list or 1-D tensor. Only needed when some row uses penalties.
    prompt_lens:  per row, how many leading history tokens are prompt. Presence/frequency
                  penalties count only output tokens; the repetition penalty counts both.
                  Required when some row uses presence/frequency penalties.
    block_tokens: [batch, T-1] tokens at block positions 0..T-2 (e.g. draft tokens); entries
                  < 0 (padding) are ignored. Only needed when T > 1 and penalties are used.

    Returns [batch, T, vocab] float32. When there is nothing to do and `logits` is already
    float32, the input tensor itself may be returned (do not modify it in place).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, T, vocab], got shape {tuple(logits.shape)}")
    batch, block_len, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for a batch of {batch}")
    device = logits.device

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
        bias_table = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        bias_table[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = torch.tensor(
            values, dtype=torch.float32, device=device)
        out += bias_table[:, None, :]

    if penalty_rows:
        _apply_penalties(out, params, penalty_rows, history, prompt_lens, block_tokens)

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
) -> None:
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

    n = len(rows)
    # Per-row counts of tokens before block position 0.
    all_counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)     # prompt + output
    output_counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)  # output only
    for i, b in enumerate(rows):
        tokens = torch.as_tensor(history[b], dtype=torch.long, device=device).reshape(-1)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(f"history of row {b} has token ids outside [0, {vocab})")
        ones = torch.ones(tokens.numel(), dtype=torch.float32, device=device)
        all_counts[i].index_add_(0, tokens, ones)
        if uses_output_counts:
            start = int(prompt_lens[b])
            output_counts[i].index_add_(0, tokens[start:], ones[start:])

    # Counts of block tokens strictly before each position: [n, T, vocab] (position 0 -> 0).
    block_counts = None
    if block_len > 1:
        index = torch.tensor(rows, device=device)
        block = block_tokens.to(device=device, dtype=torch.long)[index]          # [n, T-1]
        valid = (block >= 0).to(torch.float32)
        one_hot = torch.zeros(n, block_len - 1, vocab, dtype=torch.float32, device=device)
        one_hot.scatter_(2, block.clamp(0, vocab - 1).unsqueeze(-1), valid.unsqueeze(-1))
        block_counts = torch.cat([torch.zeros(n, 1, vocab, dtype=torch.float32, device=device),
                                  one_hot.cumsum(dim=1)], dim=1)

    sub, index = _select(out, rows)
    repetition = [params[b].repetition_penalty for b in rows]
    if any(r != 1.0 for r in repetition):
        seen = all_counts.unsqueeze(1) if block_counts is None else all_counts.unsqueeze(1) + block_counts
        penalty = _row_tensor(repetition, device)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        sub = torch.where(seen > 0, penalized, sub)
    if uses_output_counts:
        counts = output_counts.unsqueeze(1) if block_counts is None else output_counts.unsqueeze(1) + block_counts
        presence = _row_tensor([params[b].presence_penalty for b in rows], device)
        frequency = _row_tensor([params[b].frequency_penalty for b in rows], device)
        sub = sub - presence * (counts > 0).to(torch.float32) - frequency * counts
    if index is None:
        out.copy_(sub)
    else:
        out[index] = sub


def _apply_filters(out: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> None:
    """top_k, then top_p, then min_p on the (already temperature-scaled) rows, in place."""
    vocab = out.shape[-1]
    device = out.device
    sub, index = _select(out, rows)
    neg_inf = float("-inf")

    top_k = [params[b].top_k if 0 < params[b].top_k < vocab else vocab for b in rows]
    if any(k < vocab for k in top_k):
        max_k = max(k for k in top_k if k < vocab)
        top_values = sub.topk(max_k, dim=-1).values                              # [n, T, max_k]
        kth = torch.tensor([min(k, max_k) - 1 for k in top_k], device=device)
        cutoff = top_values.gather(-1, kth.view(-1, 1, 1).expand(-1, sub.shape[1], 1))  # [n, T, 1]
        enabled = torch.tensor([k < vocab for k in top_k], device=device).view(-1, 1, 1)
        sub = sub.masked_fill(enabled & (sub < cutoff), neg_inf)

    top_p = [params[b].top_p for b in rows]
    if any(p < 1.0 for p in top_p):
        sorted_logits = sub.sort(dim=-1, descending=True).values                  # [n, T, vocab]
        sorted_probs = sorted_logits.softmax(dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Probability mass strictly before each sorted token; a token is kept while the mass
        # before it is < top_p -> the smallest set reaching top_p, always incl. the top token.
        mass_before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
        keep = mass_before < _row_tensor(top_p, device)
        num_keep = keep.sum(dim=-1, keepdim=True).clamp(min=1)                     # [n, T, 1]
        cutoff = sorted_logits.gather(-1, num_keep - 1)
        enabled = torch.tensor([p < 1.0 for p in top_p], device=device).view(-1, 1, 1)
        sub = sub.masked_fill(enabled & (sub < cutoff), neg_inf)

    min_p = [params[b].min_p for b in rows]
    if any(p > 0.0 for p in min_p):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        log_min_p = _row_tensor([math.log(p) if p > 0.0 else neg_inf for p in min_p], device)
        max_logit = sub.amax(dim=-1, keepdim=True)
        sub = sub.masked_fill(sub < max_logit + log_min_p, neg_inf)

    if index is None:
        out.copy_(sub)
    else:
        out[index] = sub


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


def uniforms(batch: int, counts: Sequence[int] | int, generators: Generators, device: torch.device | str = "cpu") -> torch.Tensor:
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
    batch, vocab = probs.shape
    u = uniforms(batch, 1, generators, probs.device)                              # [batch, 1]
    cdf = probs.to(torch.float64).cumsum(dim=-1)                                  # [batch, vocab]
    total = cdf[:, -1:]                                                           # [batch, 1]
    # Target strictly below the total (u * total can round up to it), so the first index whose
    # cumulative mass exceeds it exists. A float cumsum only increases where probs > 0
    # (x + 0 == x exactly), so zero-probability tokens are never that index.
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return tokens.clamp_(max=vocab - 1)                                            # all-zero rows -> vocab-1
