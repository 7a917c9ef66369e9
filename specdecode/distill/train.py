"""Train an EAGLE-style head on target features (self-distillation), on CPU or CUDA.

Loss at every slot j (see drafters/head.py): cross-entropy of the head's draft-vocabulary logits against
the target's greedy token at j+1, plus smooth-L1 between the head's predicted feature and the
target's true feature at j+1 (both after the target's final norm). Training-time unrolling
(as in EAGLE-3 / HASS): depth s > 0 feeds slot j the feature the head predicted at depth s-1 for
slot j-1, so the head learns to draft from its own predictions; depth s is weighted 0.8^s.

Evaluation on held-out sequences simulates greedy chain drafting with the same unrolling:
a chain started at slot i is accepted up to depth d when the depth-1..d argmaxes all equal the
target's greedy tokens. It reports acceptance per depth and the mean accepted length (bonus
included) at k = 1..8; `specdecode distill` also measures the real thing with the engine.
"""
from __future__ import annotations

import json
import math
import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.head import EagleHead, rope_tables
from .features import FeatureSet

IGNORE = -100


@dataclass
class TrainConfig:
    draft_vocab_size: int = 8192
    unroll: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_tokens: int = 2048
    max_len: int = 768
    minutes: float = 60.0
    epochs: float = 20.0
    eval_every_minutes: float = 5.0
    checkpoint_every_minutes: float = 5.0
    holdout_share: float = 0.04
    feature_weight: float = 1.0
    seed: int = 0
    autocast: bool = True


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    tokens: int = 0
    curve: list = field(default_factory=list)


def bf16_autocast_pays(device: torch.device) -> bool:
    """bf16 autocast speeds training up on GPUs and on CPUs whose oneDNN has bf16 GEMMs (AVX-512 and
    up); elsewhere (AVX2-only CPUs) torch falls back to a scalar bf16 GEMM, far slower than fp32
    (docs/training.md, "What was tried")."""
    if device.type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def choose_draft_vocab(data: FeatureSet, size: int, eos_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often (EOS always in), sorted ascending."""
    known = data.labels[data.labels >= 0].long()
    counts = torch.bincount(known, minlength=vocab_size)
    for t in eos_ids:
        counts[t] = counts.max() + 1
    size = min(size, vocab_size)
    return counts.topk(size).indices.sort().values


def split(data: FeatureSet, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices. A sequence's side depends only on its own tokens (a
    CRC of its first 64), so it stays put when the corpus grows and training resumes."""
    train, held = [], []
    for s in range(data.num_sequences):
        a = int(data.offsets[s])
        head = data.tokens[a:a + min(64, data.length(s))].numpy().tobytes()
        (held if (zlib.crc32(head) ^ seed) % 10_000 < share * 10_000 else train).append(s)
    if not held and len(train) > 1:
        held.append(train.pop())
    return train, held


def batches(data: FeatureSet, ids: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    """Groups of similar-length sequences under a token budget, shuffled."""
    ids = sorted(ids, key=data.length)
    out, cur = [], []
    for s in ids:
        if cur and (len(cur) + 1) * max(data.length(s), data.length(cur[0])) > budget:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


class Trainer:
    def __init__(self, target, data: FeatureSet, config: TrainConfig, out_dir: Path, device: str = "cpu") -> None:
        self.target, self.data, self.config, self.out_dir = target, data, config, out_dir
        self.device = torch.device(device)
        self.autocast = config.autocast and bf16_autocast_pays(self.device)   # else fp32 throughout
        model = target.model
        self.train_ids, self.held_ids = split(data, config.holdout_share, config.seed)
        vocab = choose_draft_vocab(data, config.draft_vocab_size, target.eos_token_ids, model.vocab_size)
        self.head = self.make_head(model, vocab).to(self.device)
        self.to_draft = torch.full((model.vocab_size,), IGNORE, dtype=torch.long)
        self.to_draft[vocab] = torch.arange(vocab.numel())
        self.to_draft = self.to_draft.to(self.device)
        self.embed = model.embed.float().to(self.device)
        self.final_norm = model.final_norm.float().to(self.device)
        head = model.lm_head_weight
        self.lm_head = head.index_select(0, vocab.to(head.device)).float().to(self.device)
        self.eps = model.config.rms_norm_eps
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        self.state = TrainState()
        known = data.labels[data.labels >= 0].long().to(self.device)
        covered = (self.to_draft[known] != IGNORE).float().mean().item()
        self.vocab_coverage = covered

    def make_head(self, model, vocab: torch.Tensor) -> torch.nn.Module:
        """The module to train (a subclass trains another kind of drafter: distill/medusa.py)."""
        head = EagleHead.from_target(model, vocab)
        self.cos, self.sin = rope_tables(head.config, self.config.max_len + 8, torch.float32, self.device)
        return head

    # ------------------------------------------------------------------ data
    def _batch(self, ids: list[int]):
        d = self.data
        width = max(d.length(s) for s in ids)
        tokens = torch.zeros(len(ids), width, dtype=torch.long)
        feats = torch.zeros(len(ids), width, d.features.shape[1], dtype=torch.bfloat16)
        labels = torch.full((len(ids), width), IGNORE, dtype=torch.long)
        valid = torch.zeros(len(ids), width, dtype=torch.bool)
        response = torch.zeros(len(ids), width, dtype=torch.bool)
        for row, s in enumerate(ids):
            a, n = int(d.offsets[s]), d.length(s)
            tokens[row, :n] = d.tokens[a:a + n].long()
            feats[row, :n] = d.features[a:a + n]
            labels[row, :n] = d.labels[a:a + n].long()
            valid[row, :n] = True
            response[row, max(0, int(d.prompt_lens[s]) - 1):n] = True
        dev = self.device
        # slot j: feature j, token j+1 -> feature j+1, label (target's greedy token) at j+1
        return (tokens[:, 1:].to(dev), feats[:, :-1].to(dev).float(), feats[:, 1:].to(dev).float(),
                self._draft_index(labels[:, 1:].to(dev)), valid[:, 1:].to(dev), response[:, 1:].to(dev),
                labels[:, 1:].to(dev), tokens[:, 2:].to(dev))

    def _draft_index(self, labels: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft-vocabulary indices; unknown (-1 / padding) -> IGNORE."""
        index = self.to_draft[labels.clamp(min=0)]
        return torch.where(labels >= 0, index, torch.full_like(index, IGNORE))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.final_norm, self.eps)

    def _unroll(self, token_ids, feats_in, depth: int):
        """Yields (depth, predicted features [B, T, D]); depth s > 0 reads depth s-1's predictions."""
        emb = F.embedding(token_ids, self.embed)
        width = token_ids.shape[1]
        cos, sin = self.cos[:width][None, None], self.sin[:width][None, None]
        inputs = feats_in
        for s in range(depth):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                predicted = self.head(emb, inputs, cos, sin).float()
            yield s, predicted
            inputs = torch.cat([feats_in[:, :1], predicted[:, :-1]], dim=1)

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:   # [N, D] -> [N, V_draft]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return F.linear(self._norm(predicted), self.lm_head).float()

    # ------------------------------------------------------------------ training
    def train_step(self, ids: list[int]) -> float:
        tokens, feats_in, feats_out, labels, valid, _, _, _ = self._batch(ids)
        labelled = valid & (labels != IGNORE)         # answer positions: the only ones drafting sees
        target = self._norm(feats_out)
        loss = torch.zeros((), device=self.device)
        for s, predicted in self._unroll(tokens, feats_in, self.config.unroll):
            mask = labelled.clone()
            mask[:, :s] = False
            picked = predicted[mask]                  # LM head only where there is a label
            ce = F.cross_entropy(self._draft_logits(picked), labels[mask])
            reg = F.smooth_l1_loss(self._norm(picked), target[mask])
            loss = loss + 0.8 ** s * (ce + self.config.feature_weight * reg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        return loss.item()

    def set_lr(self, progress: float) -> None:
        warm = min(1.0, (self.state.step + 1) / 20)
        lr = self.config.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, max_depth: int = 8) -> dict:
        """Simulated greedy chain acceptance on held-out response positions."""
        self.head.eval()
        reached = torch.zeros(max_depth)
        chains = 0
        rng = random.Random(1)
        for ids in batches(self.data, self.held_ids, self.config.batch_tokens, rng):
            tokens, feats_in, _, _, valid, response, greedy, _ = self._batch(ids)
            width = tokens.shape[1]
            # depth d of the chain started at slot i is drafted at slot i+d by unroll depth d; it is
            # right when it equals the target's greedy token there (greedy[:, i+d])
            ok = valid & response                                               # [B, T] chain starts
            chains += int(ok.sum())
            for d, predicted in self._unroll(tokens, feats_in, max_depth):
                draft = self.head.draft_vocab[self._draft_logits(predicted).argmax(-1)]
                right = (draft == greedy) & valid                                # [B, T]
                shifted = torch.zeros_like(ok)
                shifted[:, :width - d] = right[:, d:]
                ok = ok & shifted
                reached[d] += ok.sum().item()
        self.head.train()
        depth_rate = (reached / max(chains, 1)).tolist()
        mal = [1 + sum(depth_rate[:k]) for k in range(1, max_depth + 1)]
        return {"chains": chains, "accept_depth": [round(x, 4) for x in depth_rate],
                "mean_accepted_length": [round(x, 3) for x in mal]}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: Path) -> None:
        torch.save({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "state": asdict(self.state), "config": asdict(self.config)}, path)

    def load_checkpoint(self, path: Path) -> None:
        ckpt = torch.load(path, weights_only=False, map_location=self.device)
        self.head.load_state_dict(ckpt["head"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.state = TrainState(**ckpt["state"])
        vocab = self.head.draft_vocab
        self.to_draft.fill_(IGNORE)
        self.to_draft[vocab] = torch.arange(vocab.numel(), device=self.device)
        self.lm_head = self.target.model.lm_head_weight.index_select(0, vocab.to("cpu")).float().to(self.device)

    def _record(self, loss: float, on_eval) -> None:
        total_tokens = sum(self.data.length(s) for s in self.train_ids)
        point = {"seconds": round(self.state.seconds, 1), "step": self.state.step,
                 "epoch": round(self.state.tokens / total_tokens, 3), "loss": round(loss, 4), **self.evaluate()}
        self.state.curve.append(point)
        (self.out_dir / "curve.json").write_text(json.dumps(self.state.curve, indent=1))
        if on_eval is not None:
            on_eval(point)

    def run(self, on_eval=None, progress: bool = True) -> dict:
        from tqdm import tqdm
        cfg = self.config
        rng = random.Random(cfg.seed + self.state.step)
        budget_s = cfg.minutes * 60
        total_tokens = sum(self.data.length(s) for s in self.train_ids)
        last_eval = last_ckpt = self.state.seconds
        bar = tqdm(total=int(budget_s), initial=int(self.state.seconds), desc="train", unit="s",
                   disable=not progress, dynamic_ncols=True)
        if self.state.step == 0:           # the curve starts at the untrained head
            self._record(0.0, on_eval)
        done = False
        losses: list[float] = []
        while not done:
            for ids in batches(self.data, self.train_ids, cfg.batch_tokens, rng):
                t0 = time.perf_counter()
                progress_share = max(self.state.seconds / budget_s, self.state.tokens / (cfg.epochs * total_tokens))
                self.set_lr(progress_share)
                loss = self.train_step(ids)
                losses.append(loss)
                dt = time.perf_counter() - t0
                self.state.step += 1
                self.state.seconds += dt
                self.state.tokens += sum(self.data.length(s) for s in ids)
                bar.update(int(self.state.seconds) - bar.n)
                bar.set_postfix(loss=f"{loss:.3f}", epoch=f"{self.state.tokens / total_tokens:.2f}")
                done = self.state.seconds >= budget_s or self.state.tokens >= cfg.epochs * total_tokens
                if done or self.state.seconds - last_eval >= cfg.eval_every_minutes * 60:
                    last_eval = self.state.seconds
                    self._record(sum(losses) / len(losses), on_eval)
                    losses = []
                if done or self.state.seconds - last_ckpt >= cfg.checkpoint_every_minutes * 60:
                    last_ckpt = self.state.seconds
                    self.save_checkpoint(self.out_dir / "checkpoint.pt")
                if done:
                    break
        bar.close()
        return self.state.curve[-1] if self.state.curve else {}
