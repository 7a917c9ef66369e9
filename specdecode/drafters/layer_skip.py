"""Layer-skip self-speculation: the target drafts for itself with some of its layers left out
(Draft & Verify, Zhang et al. 2024, arXiv 2309.08168; SWIFT, Xia et al. 2024, arXiv 2410.06916).
No second model and no training: the draft is `SkipView`, the target's own weights run with a
set of layers skipped (their residual passes through), drafting like a separate draft model
(`ModelDrafter`: its own KV cache, catch-up of the tokens it has not seen, the shared logits
transform, the sequence's own generator, a confidence stop), so the target's cache is never
touched and the output stays exactly the target's.

Which layers: chosen on the fly from the context, as SWIFT does, with Draft & Verify's
criterion made cheap. On the first request (at its prefill) the drafter runs its prompt (up to
`calibration_tokens` tokens) through the full model once for the reference next-token argmaxes,
then scores every layer alone by the top-1 agreement of the model without it (teacher forced:
that is the depth-1 acceptance of a greedy draft), and finally adds layers in that order while
the agreement of the whole skipped set stays >= `min_agreement`, up to `skip_ratio` of the
layers. The set is kept for later requests (`skip_layers=` fixes it instead); `summary()`
reports it with its measured agreement.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..forward import ForwardBatch
from .base import ContiguousState, DrafterCapabilities, DrafterError, DrafterState
from .model import ModelDrafter
from .registry import register


class SkipView:
    """The target's model with layers `skip` left out, behind the model interface a draft needs
    (models/interface.py). Shares every weight with the target; has its own caches."""

    supports_trees = False
    has_features = False

    def __init__(self, model, skip: frozenset[int]) -> None:
        self.base, self.skip = model, frozenset(skip)
        self.vocab_size, self.max_len = model.vocab_size, model.max_len
        self.dtype, self.device = model.dtype, model.device

    def new_cache(self, batch_size: int, max_len: int):
        return self.base.new_cache(batch_size, max_len)

    def weight_bytes(self) -> int:
        layers = self.base.config.num_layers
        return int(self.base.weight_bytes() * (layers - len(self.skip)) / layers)

    def run(self, fb: ForwardBatch, cache) -> torch.Tensor:
        return self.base.run(fb, cache, skip=self.skip)

    def logits(self, hidden: torch.Tensor, logit_index: torch.Tensor | None = None,
               head_rows=None) -> torch.Tensor:
        return self.base.logits(hidden, logit_index, head_rows)

    def head_rows(self, ids):
        return self.base.head_rows(ids)

    def forward(self, tokens, cache, start, rows=None, logit_index=None, head_rows=None) -> torch.Tensor:
        return self.logits(self.run(ForwardBatch.chain(tokens, start, rows, logit_index), cache), logit_index,
                           head_rows)


@torch.inference_mode()
def top1_agreement(model, tokens: torch.Tensor,        # [1, T] int64
                   reference: torch.Tensor,            # [1, T] int64 the full model's argmax
                   skip: frozenset[int]) -> float:
    """Share of positions where the model without `skip` predicts the full model's next token."""
    cache = model.new_cache(1, tokens.shape[1])
    hidden = model.run(ForwardBatch.chain(tokens, 0), cache, skip=skip)
    return float((model.logits(hidden).argmax(-1) == reference).float().mean())


@torch.inference_mode()
def choose_skip_layers(model, token_ids: list[int], skip_ratio: float,
                       min_agreement: float) -> tuple[frozenset[int], float]:
    """(layers to skip, their measured top-1 agreement) on `token_ids` (module docstring)."""
    tokens = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    cache = model.new_cache(1, tokens.shape[1])
    no_layer = frozenset({-1})        # skips nothing, through the same path as the skipping passes
    reference = model.logits(model.run(ForwardBatch.chain(tokens, 0), cache, skip=no_layer)).argmax(-1)
    layers = model.config.num_layers
    alone = {i: top1_agreement(model, tokens, reference, frozenset({i})) for i in range(layers)}
    chosen: frozenset[int] = frozenset()
    agreement = 1.0
    for layer in sorted(alone, key=lambda i: (-alone[i], i)):
        if len(chosen) + 1 > int(skip_ratio * layers):
            break
        trial = top1_agreement(model, tokens, reference, chosen | {layer})
        if trial >= min_agreement:
            chosen, agreement = chosen | {layer}, trial
    return chosen, agreement


@register("layer-skip")
class LayerSkipDrafter(ModelDrafter):
    capabilities = DrafterCapabilities(has_state=True, relative_cost=0.5)   # refined once layers are chosen

    def __init__(self, target, skip_layers: list[int] | str | None = None, skip_ratio: float = 0.5,
                 min_agreement: float = 0.7, calibration_tokens: int = 128, draft_confidence: float = 0.4,
                 **_: object) -> None:
        if not getattr(target, "native", False) or not hasattr(target.model, "config"):
            raise DrafterError(f"method 'layer-skip' needs a natively loaded target; {target.name} runs through "
                               f"the transformers adapter")
        layers = target.model.config.num_layers
        for name, value, low, high in (("skip_ratio", skip_ratio, 0.0, 1.0), ("min_agreement", min_agreement, 0.0, 1.0),
                                       ("draft_confidence", draft_confidence, 0.0, 1.0)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value < high:
                raise DrafterError(f"{name} must be a number in [{low:g}, {high:g}), got {value!r}")
        if not isinstance(calibration_tokens, int) or not 8 <= calibration_tokens <= 4096:
            raise DrafterError(f"calibration_tokens must be an integer in [8, 4096], got {calibration_tokens!r}")
        if isinstance(skip_layers, str):        # --drafter-option skip_layers=3,5,7
            try:
                skip_layers = [int(x) for x in skip_layers.split(",") if x.strip()]
            except ValueError:
                raise DrafterError(f"skip_layers must be comma-separated layer indices, got {skip_layers!r}") from None
        if isinstance(skip_layers, int) and not isinstance(skip_layers, bool):
            skip_layers = [skip_layers]
        if skip_layers is not None:
            bad = [i for i in skip_layers if not isinstance(i, int) or not 0 <= i < layers]
            if bad or len(set(skip_layers)) >= layers:
                raise DrafterError(f"skip_layers must be distinct layer indices in [0, {layers}) leaving at least "
                                   f"one layer, got {skip_layers!r}")
        self.draft_confidence = float(draft_confidence)
        self.skip_ratio, self.min_agreement, self.calibration_tokens = skip_ratio, min_agreement, calibration_tokens
        self.target = target
        self.agreement: float | None = None          # measured top-1 agreement of the chosen set
        self.draft_vocab = self.target_vocab = target.model.vocab_size
        self.skip: frozenset[int] | None = None      # the skipped layers (None: chosen at the first request)
        self.model = self.draft = None                # the SkipView and its LoadedModel (set by _use)
        self._use(frozenset(skip_layers) if skip_layers is not None else None)

    def _use(self, skip: frozenset[int] | None) -> None:
        self.skip = skip
        self.model = SkipView(self.target.model, skip or frozenset())
        self.draft = replace(self.target, model=self.model, name=f"{self.target.name} (layer-skip)")
        if skip is not None:
            layers = self.target.model.config.num_layers
            self.capabilities = replace(LayerSkipDrafter.capabilities, relative_cost=(layers - len(skip)) / layers)

    def draft_model(self):
        return None           # its cache is per-row state from `prepare` (the view shares the target's weights)

    def prepare(self, batch_size: int, max_len: int) -> DrafterState:
        return ContiguousState(self.model.new_cache(batch_size, max_len))

    def summary(self) -> dict:
        return {"skip_layers": sorted(self.skip) if self.skip is not None else None,
                "num_layers": self.target.model.config.num_layers, "calibration_agreement": self.agreement}

    def prefill(self, seqs) -> None:
        """On the first request, choose the skipped layers from its prompt, so that the engine's
        draft budget starts from their cost (its prior: the share of layers kept). The prompt
        itself is read lazily: the first draft catches up on it (a budget that never drafts never
        pays for it)."""
        if self.skip is None and seqs:
            self._choose(seqs[0].token_ids)

    def _choose(self, token_ids: list[int]) -> None:
        skip, self.agreement = choose_skip_layers(self.target.model, token_ids[-self.calibration_tokens:],
                                                  self.skip_ratio, self.min_agreement)
        self._use(skip)

    def propose(self, seqs, sizes):
        if self.skip is None:           # not prefilled (a direct caller): choose from this context
            self._choose(seqs[0].token_ids)
        return super().propose(seqs, sizes)
