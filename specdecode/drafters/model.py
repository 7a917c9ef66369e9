"""A separate, smaller draft model that shares the target's tokenizer.

The draft runs k autoregressive steps with its own KV cache (never the target's),
applying the very same logits transform and the sequence's own random generator, and
returns the distributions it sampled from so the verifier can do rejection sampling.

Cache rule: after verification its cache keeps the entries of the tokens the target
accepted; tokens it has not yet seen (the recovered/bonus token, or the last draft when
all were accepted) are fed at the start of the next proposal (catch-up).

With `draft_context` N (DRAFT_CONTEXT, 256, by default; 0: all) the draft reads only the last N
tokens of a long prompt (and restarts
from the last N when it would otherwise catch up more than N): its cache row starts at the
sequence's token `offset` (slot 0 holds token `offset`; RoPE is relative, so the
draft sees the window as the start of a text). Its prompt prefill then costs N tokens, not the
prompt's length; drafts may be a little worse, the output is the target's all the same. The
server prefills draft caches itself and ignores it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..footprint import weights_bytes
from ..forward import ForwardBatch
from ..models.config import ModelError
from ..sampling import probs_from_logits, sample, transform_logits
from .base import ContiguousState, DraftProposal, Drafter, DrafterCapabilities, DrafterError, DrafterState
from .registry import register
from .vocab_rank import frequent_ids

DRAFT_CONTEXT = 256     # tokens of a long prompt the draft reads by default (0: all). The 1.5B / 0.5B pair on
                        # four 670-770-token prompts (AMD Zen 5): reading all, 1.00x plain (summarization 1.04x,
                        # rag 0.95x); the last 256, 1.06x (1.11x, 0.99x). Lookups still read the whole text


def check_same_tokenizer(target, draft) -> None:
    """Refuse a pair whose vocabularies differ, naming both models and the first difference."""
    target_vocab = target.tokenizer.vocab_fingerprint()
    draft_vocab = draft.tokenizer.vocab_fingerprint()
    if target_vocab == draft_vocab:
        return
    for i, (a, b) in enumerate(zip(target_vocab, draft_vocab)):
        if a != b:
            raise DrafterError(f"draft {draft.name} does not share the tokenizer of target {target.name}: "
                               f"token {i} is {b!r} in the draft but {a!r} in the target")
    raise DrafterError(f"draft {draft.name} does not share the tokenizer of target {target.name}: "
                       f"vocabulary sizes differ ({len(draft_vocab)} vs {len(target_vocab)} tokens)")


@register("model")
class ModelDrafter(Drafter):
    capabilities = DrafterCapabilities(has_state=True, relative_cost=1.0,    # refined per instance
                                       prefill_when_drafting=True)
    draft_context = 0                         # 0: the draft reads the whole context (subclasses too)
    head_rows = None                          # None: the draft's whole LM head (subclasses too)

    def __init__(self, target, draft=None, draft_confidence: float = 0.4, draft_context: int = DRAFT_CONTEXT,
                 head_vocab: int = 0, head_rank: str = "freq", **_: object) -> None:
        if not isinstance(draft_confidence, (int, float)) or not 0.0 <= draft_confidence < 1.0:
            raise DrafterError(f"draft_confidence must be a number in [0, 1), got {draft_confidence!r}")
        # stop drafting a row once the draft's probability of its own token falls below this (HF's
        # dynamic schedule; 0 = always draft k): saves draft passes the target would likely reject. Its
        # probability under the softmax, for greedy rows too (whose sampling distribution is one-hot:
        # before 2026-11-27 greedy rows always drafted k). The 1.5B / 0.5B pair's first draft tokens
        # (greedy, 21 Spec-Bench / HumanEval prompts) were accepted 11-33% of the time below a draft
        # probability of 0.4, 35-67% at 0.4-0.8, 94% above 0.9
        self.draft_confidence = float(draft_confidence)
        if isinstance(draft_context, bool) or not isinstance(draft_context, int) or not 0 <= draft_context <= 1 << 20:
            raise DrafterError(f"draft_context must be 0 (the whole context) or a number of tokens in [1, {1 << 20}], "
                               f"got {draft_context!r}")
        self.draft_context = draft_context
        self.offset: dict[int, int] = {}      # cache row -> sequence index of the token in its slot 0
        if draft is None:
            raise DrafterError("method 'model' needs a draft model (--draft PATH / LLM(draft=...))")
        check_same_tokenizer(target, draft)
        if (Path(draft.path) / "drafter.json").is_file():     # trained by `specdecode distill --kind draft-lm`
            from .format import check_target, read_meta
            check_target(read_meta(Path(draft.path), "draft-lm"), target, Path(draft.path))
        self.draft = draft                    # LoadedModel
        self.model = draft.model
        self.cache = None
        # what the last call's draft cache holds, for the next call's prompts (`prepare` / `prefill`):
        # (its cache, {row: (text, offset, length)}); a chat's next turn starts with the same tokens
        self._kept: tuple | None = None
        self._reuse: dict[int, tuple[list[int], int, int]] = {}
        self._texts: dict[int, list[int]] = {}     # row -> its sequence's token list (grows in place)
        self._own_cache = False
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
        if (isinstance(head_vocab, bool) or not isinstance(head_vocab, int)
                or not (head_vocab == 0 or (32 <= head_vocab <= shared_vocab and head_vocab % 32 == 0))):
            raise DrafterError(f"head_vocab must be 0 (the whole vocabulary) or a multiple of 32 in "
                               f"[32, {shared_vocab}], got {head_vocab!r}")
        if not isinstance(head_rank, str) or not head_rank:
            raise DrafterError(f"head_rank must be 'freq', 'id' or a text file / folder, got {head_rank!r}")
        self.head_vocab = head_vocab if 0 < head_vocab < self.draft_vocab else 0
        if self.head_vocab:
            ids = frequent_ids(draft.tokenizer, shared_vocab, self.head_vocab,
                               head_rank, keep=tuple(draft.eos_token_ids) + tuple(target.eos_token_ids))
            self.head_rows = draft.model.head_rows(ids)
        if draft.native and target.native:     # relative cost: one draft pass reads all its weights
            head = draft.model.lm_head
            head_bytes = getattr(head, "nbytes", 0) * (1 - self.head_vocab / self.draft_vocab) if self.head_vocab else 0
            cost = (weights_bytes(draft.model) - head_bytes) / max(weights_bytes(target.model), 1)
            self.capabilities = replace(ModelDrafter.capabilities, relative_cost=cost)

    def draft_model(self):
        return self.draft

    def prepare(self, batch_size: int, max_len: int) -> DrafterState:
        if max_len > self.model.max_len + 64:
            raise ModelError(f"draft {self.draft.name} has a context of {self.model.max_len} tokens, "
                             f"fewer than the {max_len} this batch needs")
        kept, self._kept = self._kept, None
        if kept is not None and kept[0].batch_size == batch_size:   # the last call's entries, matched
            old, self._reuse = kept                                  # in `prefill`
            if old.max_len >= max_len:
                self.cache = old
            else:                                                    # a longer call: a larger cache
                self.cache = self.model.new_cache(batch_size, max_len)
                upto = max((length for _, _, length in self._reuse.values()), default=0)
                for src, dst in zip(old.keys + old.values, self.cache.keys + self.cache.values):
                    dst[:, :, :upto] = src[:, :, :upto]
            for row in range(batch_size):
                self.cache.truncate(row, 0)
        else:
            self.cache, self._reuse = self.model.new_cache(batch_size, max_len), {}
        self.offset, self._texts, self._own_cache = {}, {}, True
        return ContiguousState(self.cache)

    def use_draft_cache(self, cache) -> DrafterState:
        self.cache = cache            # e.g. the server's paged cache: the same interface as KVCache
        self.offset, self.draft_context = {}, 0     # the server prefills the whole prompt into it
        self._own_cache, self._kept, self._reuse = False, None, {}
        return cache

    def close(self) -> None:
        # kept for the next call (LLM.generate's turns), for one sequence only: a batch's rows would keep
        # their whole KV alive between calls for little (its next prompts rarely share their rows' text)
        if self._own_cache and self.cache is not None and self.cache.batch_size == 1:
            entries = dict(self._reuse)      # a row this call never read (it never drafted) holds what it held
            entries.update({row: (text, self.offset.get(row, 0), self.cache.lengths[row])
                            for row, text in self._texts.items()})
            self._kept = (self.cache, entries)
        self.cache, self._texts, self._reuse = None, {}, {}

    def _reuse_prefix(self, s) -> None:
        """Keep the entries of row s.row that the last call left for the same tokens at the same
        positions, so that only the rest of the prompt is prefilled. With draft_context the row
        keeps the last call's window start while the prompt is within twice the window from it
        (a chat's turns then reuse their history; the draft then reads up to twice the window of a
        prompt)."""
        self._texts[s.row] = s.token_ids
        old = self._reuse.pop(s.row, None)
        n = len(s.token_ids)
        if old is None or (self.draft_context and not n - 2 * self.draft_context <= old[1] < n):
            return
        text, offset, length = old
        same = 0
        for a, b in zip(text[offset:offset + length], s.token_ids[offset:n - 1]):
            if a != b:
                break
            same += 1
        if same:
            self.offset[s.row] = offset
            self.cache.truncate(s.row, same)

    def _offsets(self, seqs) -> list[int]:
        """Per sequence, the index of the token in its draft cache row's slot 0 (draft_context)."""
        if not self.draft_context:
            return [0] * len(seqs)
        for s in seqs:
            length, n = self.cache.lengths[s.row], len(s.token_ids)
            if length == 0 or n - self.offset.get(s.row, 0) - length > self.draft_context:
                self.cache.truncate(s.row, 0)        # a new sequence, or a catch-up longer than the window
                self.offset[s.row] = max(0, n - self.draft_context)
        return [self.offset[s.row] for s in seqs]

    def _padded(self, feed: list[list[int]]) -> torch.Tensor:     # -> [B, longest] int64
        """Each row's tokens, zero-padded to the longest; an id the draft cannot embed (the target's
        padding rows) becomes any valid one (drafts only: still lossless)."""
        width = max(len(f) for f in feed)
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feed], dtype=torch.long, device=self.model.device)
        return tokens.clamp(max=self.draft_vocab - 1) if self.target_vocab > self.draft_vocab else tokens

    @torch.inference_mode()
    def prefill(self, seqs) -> None:
        """The prompts (all but their last token) into the draft cache in one ragged pass, no logits:
        what the last call left for the same first tokens is kept (`_reuse_prefix`)."""
        for s in seqs:
            self._reuse_prefix(s)
        offsets = self._offsets(seqs)
        feed = [s.token_ids[off + self.cache.lengths[s.row]:len(s.token_ids) - 1] for s, off in zip(seqs, offsets)]
        if not any(feed):
            return
        device = self.model.device
        starts = [self.cache.lengths[s.row] for s in seqs]
        tokens = self._padded(feed)
        rows = torch.tensor([s.row for s in seqs], device=device)
        self.model.run(ForwardBatch.chain(tokens, torch.tensor(starts, device=device), rows), self.cache)
        for b, s in enumerate(seqs):                 # padding is not text
            self.cache.truncate(s.row, starts[b] + len(feed[b]))

    @torch.inference_mode()
    def propose(self, seqs, max_tokens):
        k = max(max_tokens)
        batch = len(seqs)
        device = self.model.device
        draft_tokens = torch.zeros(batch, k, dtype=torch.long)
        draft_probs = None
        params = [s.params for s in seqs]
        needs_history = any(p.uses_penalties for p in params)
        generators = [s.generator for s in seqs]
        rows = torch.tensor([s.row for s in seqs], device=device)
        # feed: tokens this row's draft cache has not seen yet (catch-up), then one draft at a time
        offsets = self._offsets(seqs)
        feed = [s.token_ids[off + self.cache.lengths[s.row]:] for s, off in zip(seqs, offsets)]
        base_len = [len(s.token_ids) - off for s, off in zip(seqs, offsets)]   # step state: the text before
                                                                                # the drafts, in cache slots
        limit = list(max_tokens)                             # per row: drafts kept (early stop lowers it)
        for step in range(k):
            if all(step >= n for n in limit):
                break
            starts = [self.cache.lengths[s.row] for s in seqs]
            tokens = self._padded(feed)
            last = torch.tensor([[len(f) - 1] for f in feed], device=device)
            logits = self.model.forward(tokens, self.cache, torch.tensor(starts, device=device), rows=rows,
                                        logit_index=last, head_rows=self.head_rows)
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
            draft_tokens[:, step] = sample(probs, generators).cpu()
            if self.draft_confidence > 0:
                softmax = transformed[:, 0].float().softmax(-1) if any(p.greedy for p in params) else probs
                confidence = softmax.gather(1, draft_tokens[:, step:step + 1].to(probs.device))[:, 0].tolist()
                limit = [min(n, step + 1) if c < self.draft_confidence else n for n, c in zip(limit, confidence)]
            for b, s in enumerate(seqs):
                self.cache.truncate(s.row, starts[b] + len(feed[b]))
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
        for s, base_len, accepted in zip(seqs, proposal.step_state, num_accepted):
            keep = min(self.cache.lengths[s.row], base_len + accepted)
            self.cache.truncate(s.row, keep)
