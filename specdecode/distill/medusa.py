"""Train Medusa heads (drafters/medusa.py) on the features the EAGLE pipeline extracts.

Same corpus, features, draft vocabulary, train/held-out split, time budget, epochs, learning-rate
schedule, checkpoints (--resume) and evaluation cadence as the EAGLE head: `MedusaTrainer` is a
`Trainer` (train.py) that trains another module with another loss and evaluation.

Loss: head i at position p is trained on the target's own token at p+2+i, i.e. `labels[p+1+i]`
(labels[q] is the target's greedy token after position q), for every such token of the answer;
cross-entropy over the draft vocabulary, head i weighted 0.8^i (the Medusa paper's decay),
tokens outside the draft vocabulary ignored.

Evaluation on held-out sequences simulates greedy drafting with a chain of the heads' argmaxes
from each answer position: depth d is accepted when heads 0..d-1 all agree with the target's
tokens. It reports acceptance per depth and the mean accepted length (bonus included) at
k = 1..8 (flat past K: the chain is K deep), plus each head's top-1 and top-`TOPK` accuracy
(a tree with `TOPK` children per node catches the latter).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..drafters.medusa import MAX_HEADS, MedusaConfig, MedusaHeads
from .train import IGNORE, TrainConfig, Trainer, batches

HEAD_DECAY = 0.8       # loss weight of head i: HEAD_DECAY ** i
TOPK = 4               # the drafter's default tree_topk: evaluation reports top-TOPK accuracy per head
EVAL_DEPTH = 8         # mean accepted length reported for k = 1..EVAL_DEPTH (as for EAGLE)


@dataclass
class MedusaTrainConfig(TrainConfig):
    heads: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.heads <= MAX_HEADS:
            raise ValueError(f"heads must be in [1, {MAX_HEADS}], got {self.heads}")


class MedusaTrainer(Trainer):
    config: MedusaTrainConfig

    def make_head(self, model, vocab: torch.Tensor) -> MedusaHeads:
        c = model.config
        return MedusaHeads(MedusaConfig(c.hidden_size, self.config.heads, int(vocab.numel()), c.vocab_size), vocab)

    # ------------------------------------------------------------------ data
    def _positions(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of every position of `ids` that some head has an answer token for, and each
        head's label there: ([N, D] float32, [N, K] draft-vocabulary index or IGNORE)."""
        d, heads = self.data, self.config.heads
        starts, ends, firsts = [], [], []
        for s in ids:
            a, n = int(d.offsets[s]), d.length(s)
            first = a + max(0, int(d.prompt_lens[s]) - 1)       # labels[first]: the first answer token
            starts.append(max(a, first - heads))                  # head K-1 at first-K predicts labels[first]
            ends.append(a + n)
            firsts.append(first)
        pos = torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)])                 # [N]
        end = torch.cat([torch.full((e - a,), e) for a, e in zip(starts, ends)])          # [N] sequence end
        first = torch.cat([torch.full((e - a,), f) for a, e, f in zip(starts, ends, firsts)])
        target = pos[:, None] + 1 + torch.arange(heads)[None, :]                            # [N, K] label index
        valid = (target < end[:, None]) & (target >= first[:, None])
        labels = d.labels[target.clamp(max=d.num_tokens - 1)].long()                       # [N, K] target ids
        valid &= labels >= 0
        labels = self._draft_index(torch.where(valid, labels, -1).to(self.device))
        return d.features[pos].to(self.device).float(), labels

    # ------------------------------------------------------------------ training
    def train_step(self, ids: list[int]) -> float:
        features, labels = self._positions(ids)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden = self.head(features).float()                                            # [N, K, D]
        loss = torch.zeros((), device=self.device)
        for i in range(self.config.heads):
            keep = labels[:, i] != IGNORE            # the LM head only where head i has a label
            if bool(keep.any()):
                ce = F.cross_entropy(self._draft_logits(hidden[keep, i]), labels[keep, i])
                loss = loss + HEAD_DECAY ** i * ce
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.optimizer.step()
        return loss.item()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, max_depth: int = EVAL_DEPTH) -> dict:
        self.head.eval()
        heads = self.config.heads
        reached = torch.zeros(max_depth)
        top1, topk, labelled = torch.zeros(heads), torch.zeros(heads), torch.zeros(heads)
        chains = 0
        for ids in batches(self.data, self.held_ids, self.config.batch_tokens, random.Random(1)):
            features, labels = self._positions(ids)
            hidden = self.head(features)                                                     # [N, K, D]
            right = torch.zeros_like(labels, dtype=torch.bool)                               # [N, K]
            for i in range(heads):
                logits = self._draft_logits(hidden[:, i])
                best = logits.topk(min(TOPK, logits.shape[-1]), dim=-1).indices              # [N, TOPK]
                known = labels[:, i] != IGNORE
                right[:, i] = (best[:, 0] == labels[:, i]) & known
                top1[i] += right[:, i].sum().item()
                topk[i] += ((best == labels[:, i:i + 1]).any(-1) & known).sum().item()
                labelled[i] += known.sum().item()
            starts = labels[:, 0] != IGNORE          # a chain from every position head 0 has a label for
            chains += int(starts.sum())
            ok = starts.clone()
            for depth in range(min(heads, max_depth)):
                ok &= right[:, depth]
                reached[depth] += ok.sum().item()
        self.head.train()
        depth_rate = (reached / max(chains, 1)).tolist()
        return {"chains": chains, "accept_depth": [round(x, 4) for x in depth_rate],
                "mean_accepted_length": [round(1 + sum(depth_rate[:k]), 3) for k in range(1, max_depth + 1)],
                "head_top1": [round(x, 4) for x in (top1 / labelled.clamp(min=1)).tolist()],
                f"head_top{TOPK}": [round(x, 4) for x in (topk / labelled.clamp(min=1)).tolist()]}

    # ------------------------------------------------------------------ checkpoints
    def load_checkpoint(self, path) -> None:
        from ..cli_common import CliError
        saved = torch.load(path, weights_only=False, map_location="cpu")["config"].get("heads")
        if saved is None:
            raise CliError(f"--resume: {path} is not a checkpoint of Medusa heads "
                           f"(train --kind medusa in another --out)")
        if saved != self.config.heads:
            raise CliError(f"--resume: the checkpoint in {path} has {saved} heads, --heads is {self.config.heads}")
        super().load_checkpoint(path)
