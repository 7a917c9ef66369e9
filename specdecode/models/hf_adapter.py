"""Adapter that runs any causal LM transformers can load behind the native forward contract.

Slower than the native engine (one row at a time, transformers' own cache), but lossless:
rollback is `DynamicCache.crop`, so speculative and plain decoding see the same model. A model with
recurrent layers (Qwen3.5's linear attention: `layer_types`) gets a cache built from its config, and
its rollback replays the row's kept tokens into a new one (a recurrent state cannot be cropped).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelError
from .interface import HeadRows


class AdapterCache:
    """Per-row transformers caches with the same length bookkeeping as `KVCache`."""

    def __init__(self, batch_size: int, max_len: int) -> None:
        self.rows: list = [None] * batch_size
        self.tokens: list[torch.Tensor | None] = [None] * batch_size   # [1, length] each row's tokens so far
        self.lengths = [0] * batch_size
        self.batch_size = batch_size
        self.max_len = max_len

    def truncate(self, row: int, length: int) -> None:
        self.lengths[row] = length

    def reset(self, row: int | None = None) -> None:
        for r in (range(self.batch_size) if row is None else [row]):
            self.lengths[r] = 0
            self.rows[r] = self.tokens[r] = None

    def nbytes(self) -> int:
        return 0


class HFAdapter:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        import transformers
        from transformers import AutoModelForCausalLM
        dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        try:
            self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), **{dtype_arg: dtype}).to(device).eval()
        except Exception as exc:  # transformers raises many kinds for unsupported models
            raise ModelError(f"transformers cannot load {model_dir}: {exc}") from None
        cfg = self.hf.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
        self.dtype, self.device = dtype, device
        layer_types = getattr(cfg.get_text_config(), "layer_types", None) or ()
        self.recurrent = "linear_attention" in layer_types     # a cache of its own layer kinds, replayed to roll back
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    def new_cache(self, batch_size: int, max_len: int) -> AdapterCache:
        return AdapterCache(batch_size, max_len)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.hf.parameters())

    supports_trees = False    # transformers' caches are cropped, not position-addressed: chains only
    has_features = False      # `run` returns transformers' output logits (see `run`)

    def run(self, fb, cache: AdapterCache) -> torch.Tensor:
        """A chain pass described by a `ForwardBatch` (specdecode/forward.py). The states it returns
        are transformers' own output logits [B, T, vocab] (its head may do more than a matmul, e.g.
        soft-capping), which `logits` selects from: no features for drafters that read them."""
        if not fb.is_chain:
            raise ModelError("the transformers adapter verifies chains only: use a drafter that proposes "
                             "chains (ngram, model, eagle) with this model")
        return self._pass(fb.tokens, cache, fb.start, fb.rows)

    def logits(self, states: torch.Tensor,              # [B, T, vocab] from `run`
               logit_index: torch.Tensor | None = None,  # [B, n]
               head_rows: HeadRows | None = None,       # those token ids only (selected here)
               ) -> torch.Tensor:                       # [B, n, vocab] float32
        if logit_index is not None:
            states = torch.gather(states, 1, logit_index.to(states.device)[:, :, None].expand(-1, -1, states.shape[-1]))
        return states if head_rows is None else states[..., head_rows.ids.to(states.device)]

    def head_rows(self, ids) -> HeadRows:
        """Logits of token ids `ids` only: selected from transformers' whole output here."""
        return HeadRows(self, HeadRows.checked_ids(ids, self.vocab_size))

    def forward(self, tokens: torch.Tensor,            # [B, T]
                cache: AdapterCache, start, rows: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None,  # [B, n]
                head_rows: HeadRows | None = None,
                ) -> torch.Tensor:                     # [B, n, vocab] float32
        return self.logits(self._pass(tokens, cache, start, rows), logit_index, head_rows)

    @torch.inference_mode()
    def _pass(self, tokens: torch.Tensor, cache: AdapterCache, start, rows: torch.Tensor | None) -> torch.Tensor:
        batch, num_tokens = tokens.shape
        starts = [start] * batch if isinstance(start, int) else [int(s) for s in torch.as_tensor(start).reshape(-1)]
        row_ids = list(range(batch)) if rows is None else [int(r) for r in rows]
        outputs = []
        for b, (row, pos) in enumerate(zip(row_ids, starts)):
            past, kept = cache.rows[row], cache.tokens[row]
            if past is None or pos == 0:
                past, kept = self._new_cache(), None
            elif past.get_seq_length() > pos and self.recurrent:       # replay the tokens kept
                past, kept = self._new_cache(), kept[:, :pos]
                self.hf(input_ids=kept.to(self.device), past_key_values=past, use_cache=True)
            elif past.get_seq_length() > pos:
                past.crop(pos - past.get_seq_length())     # a negative count removes that many tokens
            positions = torch.arange(pos, pos + num_tokens, device=self.device)[None]
            out = self.hf(input_ids=tokens[b:b + 1].to(self.device), past_key_values=past,
                          position_ids=positions, use_cache=True)
            cache.rows[row] = out.past_key_values
            if self.recurrent:
                new = tokens[b:b + 1].cpu()
                cache.tokens[row] = new if kept is None else torch.cat([kept[:, :pos], new], dim=1)
            outputs.append(out.logits[0].float())                       # [T, vocab]
        return torch.stack(outputs)

    def _new_cache(self):
        """An empty transformers cache for one row: built from the model's config where it has recurrent
        layers (which a bare DynamicCache does not know of: their state has no slot there)."""
        from transformers import DynamicCache
        return DynamicCache(config=self.hf.config) if self.recurrent else DynamicCache()
