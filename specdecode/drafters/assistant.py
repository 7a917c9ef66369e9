"""Gemma 4's assistant as a drafter (method "assistant"; the default when --draft / LLM(draft=...) names
a directory whose config.json has model_type gemma4_assistant): the model of models/gemma4_assistant.py,
fed as transformers' Gemma4AssistantCandidateGenerator feeds it.

What it reads of the target, writing nothing of it:
  * the target's hidden state at the position before each row's last token, after the target's final
    norm (`observe`, as EAGLE gets its features: capabilities.needs_target_hidden);
  * the target's keys and values of the last layer of each type (windowed, global), through the
    read-only view of the target's cache the engine hands it (capabilities.reads_target_cache,
    `use_target_cache`; drafters/base.TargetCacheView).

propose: for each row whose one pending token t sits at position p (the target holds positions < p),
k steps of the assistant, all with the query at position p and the same keys (read once per
proposal): step 1 reads the target's embedding of t and the target's feature at p-1, step i+1 the
embedding of draft i and step i's `post_projection` output. The drafts are the assistant's argmax,
point masses, as transformers drafts: the point-mass verifier (verify_tree.verify_point_mass) keeps
the target's distribution, and a seeded sampled row gives the text of plain decoding. A row with
more than one pending token (a grammar's forced tokens) or a one-token prompt gets no drafts.

State: per row, the target's last pass over it (a view of that pass's output), replaced by the next
pass; nothing to roll back, so propose is pure (`has_state` False: the engine may draft shadows).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..footprint import weights_bytes
from ..models.errors import ModelError
from ..models.gemma import fp32_rms_norm
from ..models.gemma4_assistant import MODEL_TYPE, AssistantConfig, Gemma4Assistant, assistant_dir
from ..models.transformer import eager_linear
from .base import Drafter, DrafterCapabilities, DrafterError, DraftProposal, TargetCacheView
from .registry import register


class LastPasses:
    """`DrafterState` of the assistant drafter: per row, (first position, the target's hidden states of
    its last pass [T, D]); a row's request ends -> its entry goes."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[int, torch.Tensor]] = {}

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self.rows.values())

    def used_bytes(self) -> int:
        return self.nbytes()

    def reset(self, row: int) -> None:
        self.rows.pop(row, None)

    def truncate(self, row: int, length: int) -> None:
        entry = self.rows.get(row)
        if entry is not None and entry[0] >= length:
            del self.rows[row]

    def keep(self, row: int, start: int, hidden: torch.Tensor) -> None:    # hidden: [T, D] from position start
        self.rows[row] = start, hidden

    def feature_at(self, row: int, position: int) -> torch.Tensor | None:
        """The row's hidden state at `position` if its last pass computed it."""
        entry = self.rows.get(row)
        if entry is None or not entry[0] <= position < entry[0] + entry[1].shape[0]:
            return None
        return entry[1][position - entry[0]]


@register("assistant")
class AssistantDrafter(Drafter):
    capabilities = DrafterCapabilities(needs_target_hidden=True, reads_target_cache=True)   # cost: per instance

    def __init__(self, target, draft=None, fast: bool = True, **_: object) -> None:
        from ..models.gemma4 import Gemma4Transformer
        from ..models.loader import read_weights
        if draft is None:
            raise DrafterError(f"method 'assistant' needs Gemma 4's assistant: --draft DIR / LLM(draft=DIR), a "
                               f"directory whose config.json has model_type {MODEL_TYPE}")
        folder = Path(draft) if isinstance(draft, (str, Path)) else None
        if folder is None or assistant_dir(folder) is None:
            raise DrafterError(f"method 'assistant' needs Gemma 4's assistant, and draft "
                               f"{getattr(draft, 'name', draft)} is not one (its config.json model_type is not "
                               f"{MODEL_TYPE})")
        if not (getattr(target, "native", False) and isinstance(target.model, Gemma4Transformer)):
            raise DrafterError(f"method 'assistant' drafts for a natively loaded Gemma 4 target; {target.name} "
                               f"is not one")
        try:
            config = AssistantConfig.from_hf(json.loads((folder / "config.json").read_text()))
        except (ModelError, KeyError, TypeError, ValueError) as exc:
            raise DrafterError(f"{folder / 'config.json'}: {exc}") from None
        model = self.backbone = target.model
        c = model.config
        if config.backbone_hidden_size != c.hidden_size:
            raise DrafterError(f"assistant {folder} was made for a target of hidden size {config.backbone_hidden_size} "
                               f"(backbone_hidden_size), and {target.name}'s is {c.hidden_size}")
        if config.text.vocab_size > model.vocab_size:
            raise DrafterError(f"assistant {folder} has {config.text.vocab_size} tokens, more than target "
                               f"{target.name}'s {model.vocab_size}")
        self.kv_layers = model.stored_kv_layers()         # windowed? -> the target's cache layer it reads
        make_linear = eager_linear
        if fast and model.device.type == "cpu":
            from ..fast import make_linear
        try:
            weights = read_weights(folder, model.dtype, model.device, progress=False)
            self.model = Gemma4Assistant(config, weights, make_linear)
        except KeyError as exc:
            raise DrafterError(f"assistant {folder} has no weight {exc.args[0]!r}") from None
        for sliding, dim in self.model.key_shapes().items():     # its queries against the target's keys
            kind, layer = "windowed" if sliding else "global", self.kv_layers.get(sliding)
            if layer is None or c.layer_head_dim(layer) != dim or config.text.num_heads % c.layer_kv_heads(layer):
                theirs = "none" if layer is None else (f"{c.layer_kv_heads(layer)} kv heads of "
                                                       f"{c.layer_head_dim(layer)}")
                raise DrafterError(f"assistant {folder}'s {kind} layers have {config.text.num_heads} query heads of "
                                   f"{dim}, and target {target.name}'s {kind} keys are {theirs}: it was made for "
                                   f"another target")
        element = model.embed.element_size()
        self.capabilities = replace(self.capabilities, relative_cost=self.model.step_elements * element
                                    / max(weights_bytes(model), 1))
        self.view: TargetCacheView | None = None
        self.passes = LastPasses()

    def use_target_cache(self, view: TargetCacheView) -> None:
        self.view = view

    def prepare(self, batch_size: int, max_len: int) -> LastPasses:
        self.passes = LastPasses()
        return self.passes

    def close(self) -> None:
        self.passes = LastPasses()

    def observe(self, seqs, starts, hidden):
        for b, s in enumerate(seqs):
            self.passes.keep(s.row, starts[b], hidden[b])

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:        # [B] -> [B, backbone], the target's
        return F.embedding(tokens.to(self.backbone.device), self.backbone.embed) * self.backbone.embed_scale

    @torch.inference_mode()
    def propose(self, seqs, sizes):
        batch = len(seqs)
        live, features = [], []
        for b, s in enumerate(seqs):
            end = len(s.token_ids) - 1             # the pending token's position
            feature = self.passes.feature_at(s.row, end - 1) if sizes[b] and end >= 1 else None
            if feature is not None and self.view is not None and self.view.length(s.row) == end:
                live.append(b)
                features.append(feature)
        if not live:
            return DraftProposal.empty(batch)
        k = max(sizes[b] for b in live)
        rows = [seqs[b].row for b in live]
        lengths = torch.tensor([len(seqs[b].token_ids) - 1 for b in live])
        c = self.backbone.config
        feature = fp32_rms_norm(torch.stack(features), self.backbone.final_norm_fp32, c.rms_norm_eps)    # [B', D]
        embeds = self._embed(torch.tensor([seqs[b].token_ids[-1] for b in live]))
        keys = {}
        for sliding, (positions, visible) in self.model.key_positions(lengths).items():
            k_, v_ = self.view.read(self.kv_layers[sliding], rows, positions)
            keys[sliding] = k_, v_, visible.to(self.model.device)
        drafts = torch.zeros(len(live), k, dtype=torch.long)
        for step in range(k):
            logits, feature = self.model.step(embeds, feature, keys, lengths)
            best = logits.argmax(dim=-1)
            drafts[:, step] = best.cpu()
            if step + 1 < k:
                embeds = self._embed(best)
        tokens = torch.zeros(batch, k, dtype=torch.long)
        tokens[live] = drafts
        num = torch.zeros(batch, dtype=torch.long)
        num[live] = torch.tensor([sizes[b] for b in live])
        return DraftProposal(tokens, num, None)

