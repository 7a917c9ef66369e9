"""A separate, smaller draft model that shares the target's tokenizer.

The draft runs k autoregressive steps with its own KV cache (never the target's; the engine
pages it beside the target's and prefills it with the prompt), applying the very same logits
transform and the sequence's own random generator, and returns the distributions it sampled
from so the verifier can do rejection sampling.

Cache rule: after verification its cache keeps the entries of the tokens the target accepted;
tokens it has not yet seen (the recovered/bonus token, or the last draft when all were
accepted, or a prompt it was never given) are fed at the start of the next proposal (catch-up).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..engine.config import SLACK
from ..forward import ForwardBatch
from ..models.config import ModelError
from ..sampling import probs_from_logits, sample_drafts, transform_logits
from .base import ContiguousState, Drafter, DrafterCapabilities, DrafterError, DrafterState, DraftProposal, row_state
from .registry import register
from .vocab_rank import draft_cost, reduced_head


def same_tokenizer(target, draft) -> bool:
    """Whether two models share one vocabulary (token ids mean the same text)."""
    return target.tokenizer.vocab_fingerprint() == draft.tokenizer.vocab_fingerprint()


def check_same_tokenizer(target, draft) -> None:
    """Refuse a pair whose vocabularies differ, naming both models and the first difference, and
    the method that drafts across vocabularies (text-model, cross_tokenizer.py)."""
    target_vocab = target.tokenizer.vocab_fingerprint()
    draft_vocab = draft.tokenizer.vocab_fingerprint()
    if target_vocab == draft_vocab:
        return
    hint = " (method 'text-model', the default's choice for such a pair, drafts through text)"
    for i, (a, b) in enumerate(zip(target_vocab, draft_vocab)):
        if a != b:
            raise DrafterError(f"draft {draft.name} does not share the tokenizer of target {target.name}: "
                               f"token {i} is {b!r} in the draft but {a!r} in the target{hint}")
    raise DrafterError(f"draft {draft.name} does not share the tokenizer of target {target.name}: "
                       f"vocabulary sizes differ ({len(draft_vocab)} vs {len(target_vocab)} tokens){hint}")


@register("model")
class ModelDrafter(Drafter):
    capabilities = DrafterCapabilities(has_state=True, relative_cost=1.0)    # refined per instance
    head_rows = None                          # None: the draft's whole LM head (subclasses too)

    def __init__(self, target, draft=None, draft_confidence: float = 0.4, head_vocab: int = 0,
                 head_rank: str = "freq", **_: object) -> None:
        if not isinstance(draft_confidence, (int, float)) or not 0.0 <= draft_confidence < 1.0:
            raise DrafterError(f"draft_confidence must be a number in [0, 1), got {draft_confidence!r}")
        # stop drafting a row once the draft's probability of its own token falls below this (HF's
        # dynamic schedule; 0 = always draft k): saves draft passes the target would likely reject. Its
        # probability under the softmax, for greedy rows too (whose sampling distribution is one-hot,
        # and says nothing of the draft's confidence). Below the default the target rarely agrees
        # (docs/drafters.md, "The methods")
        self.draft_confidence = float(draft_confidence)
        if draft is None:
            raise DrafterError("method 'model' needs a draft model (--draft PATH / LLM(draft=...))")
        check_same_tokenizer(target, draft)
        if (Path(draft.path) / "drafter.json").is_file():     # trained by `specdecode distill --kind draft-lm`
            from .format import check_target, read_meta
            check_target(read_meta(Path(draft.path), "draft-lm"), target, Path(draft.path))
        self.draft = draft                    # LoadedModel
        self.model = draft.model
        # Same tokenizer, but the embedding tables may be padded to different sizes (e.g.
        # Qwen2.5-0.5B: 151936 rows, Qwen2.5-7B: 152064): draft logits are cut / padded with
        # -inf to the target's size so draft and target distributions share one vocabulary.
        self.draft_vocab = draft.model.vocab_size
        self.target_vocab = target.model.vocab_size
        # head_vocab: the draft's LM head over that many token ids only (0 = all), the ones its
        # tokenizer uses most (head_rank, drafters/vocab_rank.py; FR-Spec): a small draft spends a
        # large share of its bytes on its head (Qwen2.5-0.5B: 136 of 392 MB). Lossless whatever it
        # keeps: the other tokens get draft probability 0, handled by rejection sampling like any
        # other draft distribution.
        shared_vocab = min(self.draft_vocab, self.target_vocab)       # ids both models have
        self.head_rows = reduced_head(draft, head_vocab, head_rank, shared_vocab, whole=self.draft_vocab,
                                      keep=tuple(draft.eos_token_ids) + tuple(target.eos_token_ids))
        if draft.native and target.native:     # relative cost: one draft pass reads all its weights
            cost = draft_cost(draft.model, target.model, self.head_rows, self.draft_vocab)
            self.capabilities = replace(ModelDrafter.capabilities, relative_cost=cost)

    def draft_model(self):
        return self.draft

    def prepare(self, batch_size: int, max_len: int) -> DrafterState:
        """A contiguous cache of its own (a subclass whose model the engine does not page)."""
        if max_len > self.model.max_len + SLACK:
            raise ModelError(f"draft {self.draft.name} has a context of {self.model.max_len} tokens, "
                             f"fewer than the {max_len} this batch needs")
        return ContiguousState(self.model.new_cache(batch_size, max_len))

    def use_draft_cache(self, cache) -> DrafterState:
        return cache                  # the engine's paged cache: the same interface as KVCache

    @staticmethod
    def draft_cache(seqs):
        """The draft KV cache of the engine these rows run in (their `drafter_state`: the engine's
        paged cache, or the contiguous one `prepare` made)."""
        state = row_state(seqs)
        return state.cache if isinstance(state, ContiguousState) else state

    def _padded(self, feed: list[list[int]]) -> torch.Tensor:     # -> [B, longest] int64
        """Each row's tokens, zero-padded to the longest; an id the draft cannot embed (the target's
        padding rows) becomes any valid one (drafts only: still lossless)."""
        width = max(len(f) for f in feed)
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feed], dtype=torch.long, device=self.model.device)
        return tokens.clamp(max=self.draft_vocab - 1) if self.target_vocab > self.draft_vocab else tokens

    @torch.inference_mode()
    def propose(self, seqs, sizes):
        cache = self.draft_cache(seqs)
        k = max(sizes)
        batch = len(seqs)
        device = self.model.device
        draft_tokens = torch.zeros(batch, k, dtype=torch.long)
        draft_probs = None
        params = [s.params for s in seqs]
        needs_history = any(p.uses_penalties for p in params)
        generators = [s.generator for s in seqs]
        rows = torch.tensor([s.row for s in seqs], device=device)
        # feed: tokens this row's draft cache has not seen yet (catch-up), then one draft at a time
        feed = [s.token_ids[cache.lengths[s.row]:] for s in seqs]
        base_len = [len(s.token_ids) for s in seqs]          # step state: the text before the drafts
        limit = list(sizes)                             # per row: drafts kept (early stop lowers it)
        for step in range(k):
            if all(step >= n for n in limit):
                break
            starts = [cache.lengths[s.row] for s in seqs]
            tokens = self._padded(feed)
            last = torch.tensor([[len(f) - 1] for f in feed], device=device)
            fb = ForwardBatch.chain(tokens, torch.tensor(starts, device=device), rows, last)
            logits = self.model.logits(self.model.run(fb, cache), last, self.head_rows)   # [B, 1, head / vocab]
            if self.head_rows is not None:                     # [B, 1, head rows] -> the whole vocabulary
                full = torch.full((batch, 1, self.target_vocab), float("-inf"), device=device)
                logits = full.index_copy_(2, self.head_rows.ids.to(device), logits)
            elif logits.shape[-1] != self.target_vocab:                            # [B, 1, draft vocab]
                logits = torch.nn.functional.pad(logits[..., :self.target_vocab],
                                                 (0, max(0, self.target_vocab - logits.shape[-1])),
                                                 value=float("-inf"))
            history = [s.token_ids + draft_tokens[b, :step].tolist() for b, s in enumerate(seqs)] \
                if needs_history else None
            transformed = transform_logits(logits, params, history,
                                           [s.prompt_len for s in seqs] if needs_history else None, None)
            probs = probs_from_logits(transformed, params)[:, 0]                    # [B, vocab]
            if draft_probs is None:
                draft_probs = torch.zeros(batch, k, probs.shape[-1], dtype=torch.float32, device=device)
            draft_probs[:, step] = probs
            draft_tokens[:, step] = sample_drafts(probs, generators, [n > step for n in limit]).cpu()
            if self.draft_confidence > 0:
                softmax = transformed[:, 0].float().softmax(-1) if any(p.greedy for p in params) else probs
                confidence = softmax.gather(1, draft_tokens[:, step:step + 1].to(probs.device))[:, 0].tolist()
                limit = [min(n, step + 1) if c < self.draft_confidence else n for n, c in zip(limit, confidence)]
            for b, s in enumerate(seqs):
                cache.truncate(s.row, starts[b] + len(feed[b]))
            feed = [[t] for t in draft_tokens[:, step].tolist()]
        used = max(1, min(k, max(limit)))
        num_tokens = torch.tensor([min(n, used) for n in limit], dtype=torch.long)
        probs_out = None if draft_probs is None else draft_probs[:, :used]
        return DraftProposal(draft_tokens[:, :used], num_tokens, probs_out, step_state=base_len)

    def commit(self, seqs, proposal, num_accepted):
        # Keep entries for tokens that are now part of the sequence: the old tokens plus the
        # accepted drafts, bounded by what was actually written (the last draft never is).
        if proposal.step_state is None:     # the engine skipped propose (no room for drafts): nothing to keep
            return
        cache = self.draft_cache(seqs)
        for s, base_len, accepted in zip(seqs, proposal.step_state, num_accepted):
            cache.truncate(s.row, min(cache.lengths[s.row], base_len + accepted))
