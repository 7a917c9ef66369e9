"""Qwen3.5's multi-token-prediction head as a drafter (`method="mtp"`; vLLM's `method: mtp`,
llama.cpp's `--spec-type draft-mtp`).

A Qwen3.5 checkpoint ships one extra layer beside the model (`mtp.*` tensors, `mtp_num_hidden_layers`
in its config) trained to predict the token after next from the target's last hidden state and the
next token: head slot j reads the target's hidden state at position j (after its final norm) and the
embedding of token j+1, and its output gives token j+2 through the target's LM head (head.py,
`mtp_block`). Drafting k tokens chains the head k times, each slot reading the previous slot's output.

That is the EAGLE head's slot (eagle.py), so the drafter is `HeadDrafter` with this head: the same
per-row head cache, catch-up from the verification pass's hidden states, rollback by length and
early stop (`min_confidence`). Chains only, as Qwen3.5's recurrent layers verify chains only. The
head's weights are loaded with the target (models/qwen3_5.py keeps them as `model.mtp`).

The drafts go through the target's own LM head, most of a drafted token's cost at Qwen3.5's
248,320 rows; `head_vocab=N` drafts over the N most used token ids only (vocab_rank.py, as a draft
model's reduced head; `head_rank` says how they are ranked). Lossless either way: a token outside
the head gets draft probability 0.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..footprint import weights_bytes
from ..models.gemma import fp32_rms_norm
from .base import DrafterError
from .eagle import CATCH_UP_WINDOW, HeadDrafter
from .head import Head, HeadConfig, mtp_block
from .registry import register
from .vocab_rank import reduced_head


def has_mtp_head(target) -> bool:
    """Whether `target` (a loaded model, a model directory or a GGUF file) carries an MTP head to draft
    with: a loaded native model that kept one, a directory whose safetensors hold `mtp.fc.weight`, or a
    GGUF file whose tensors hold it (llama.cpp's blk.N.nextn.eh_proj; models/qwen3_5_gguf.py)."""
    if not isinstance(target, (str, Path)):
        return getattr(getattr(target, "model", None), "mtp", None) is not None
    folder = Path(target).expanduser()
    index = folder / "model.safetensors.index.json"
    try:
        if folder.is_file() and folder.suffix.lower() == ".gguf":
            from ..models.gguf import tensor_table
            arch, tensors = tensor_table(folder)           # the header alone
            return arch == "qwen35" and any(name.endswith(".nextn.eh_proj.weight") for _, name, _, _ in tensors)
        if index.is_file():
            return "mtp.fc.weight" in json.loads(index.read_text()).get("weight_map", {})
        from safetensors import safe_open
        for file in folder.glob("*.safetensors") if folder.is_dir() else ():
            with safe_open(str(file), framework="pt") as handle:
                if "mtp.fc.weight" in handle.keys():
                    return True
    except Exception:  # noqa: BLE001 -- an unreadable directory has no head to draft with; loading it says why
        return False
    return False


@register("mtp")
class MtpDrafter(HeadDrafter):
    def __init__(self, target, fast: bool = True, min_confidence: float = 0.0,
                 catch_up_window: int = CATCH_UP_WINDOW, head_vocab: int = 0, head_rank: str = "freq",
                 **_: object) -> None:
        model = getattr(target, "model", None)
        if getattr(model, "mtp", None) is None:
            problem = getattr(model, "mtp_problem", "")
            if problem:
                why = f"its MTP head (mtp.* tensors) {problem}"
            elif getattr(model, "config", None) is not None and getattr(model.config, "arch", "") == "qwen3_5":
                why = ("its weights hold no MTP head (mtp.* tensors; a checkpoint re-saved by transformers drops "
                       "them, a GGUF file converted without them has no blk.N.nextn.* tensors)")
            else:
                why = ("only a natively loaded Qwen3.5 checkpoint with its MTP head (mtp.* tensors in its "
                       "safetensors) has one")
            raise DrafterError(f"method 'mtp' drafts with the target's multi-token-prediction head, but {target.name} "
                               f"has none: {why}; use another --method (e.g. ngram)")
        self.target_norm = model.final_norm          # the target's final norm ((1 + w), float32)
        self.head_rows = reduced_head(target, head_vocab, head_rank, model.vocab_size,
                                      keep=tuple(target.eos_token_ids))      # None: the whole LM head
        super().__init__(target, fast, min_confidence, catch_up_window)

    def _load_head(self, target, link) -> Head:
        model = target.model
        c = model.config
        config = HeadConfig(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                            c.rms_norm_eps, c.rope_theta, c.vocab_size, c.vocab_size)
        rows = self.head_rows
        vocab = torch.arange(c.vocab_size, device=self.device) if rows is None else rows.ids.to(self.device)
        # a head pass reads its own weights and the LM head's rows: their share of the target's weight bytes
        head_bytes = model.mtp_bytes + len(vocab) * c.hidden_size * self.embed.element_size()
        # the target's own LM head (or its rows); the block's output is normed already; the target's
        # (partial) RoPE tables
        return Head(config, mtp_block, model.mtp, vocab, model.lm_head if rows is None else rows.linear,
                    None, model.rope_cos, model.rope_sin, head_bytes / max(weights_bytes(model), 1))

    def _head_input(self, features: torch.Tensor) -> torch.Tensor:
        """The head reads the target's hidden states after its final norm (the features observed are before it)."""
        return fp32_rms_norm(features, self.target_norm, self.config.rms_norm_eps)

    def _logits(self, predicted: torch.Tensor) -> torch.Tensor:         # [B, D] -> [B, 1, V] float32
        if self.head_rows is not None:
            return super()._logits(predicted)                           # -inf outside the head's rows
        return self._draft_logits(predicted)[:, None]                    # the whole vocabulary: no scatter
