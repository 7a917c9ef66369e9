"""Target features for training, gathered into flat tensors.

For each token position p: the target's feature (last hidden state before the final norm, bf16)
and its greedy next token `labels[p]` (-1 where unknown). Features come from the shards the
corpus build captured while generating (`corpus.py`); labels of answer positions are the
generated tokens themselves (greedy decoding: the target's argmax). Prompt positions keep their
features (the head attends to them) but have no label. Sequences without a shard (an older
corpus) get one batched target pass instead (`extract`), which also labels their prompts.
The assembled set is cached as `features.pt` and reused by every training run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..forward import ForwardBatch


@dataclass
class FeatureSet:
    tokens: torch.Tensor     # [N] int32, all sequences concatenated
    features: torch.Tensor   # [N, D] bf16
    labels: torch.Tensor     # [N] int32, target argmax at each position
    offsets: torch.Tensor    # [S+1] int64, sequence s is [offsets[s], offsets[s+1])
    prompt_lens: torch.Tensor  # [S] int64
    fingerprint: str

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_sequences(self) -> int:
        return self.offsets.numel() - 1

    def length(self, s: int) -> int:
        return int(self.offsets[s + 1] - self.offsets[s])

    def save(self, path: Path) -> None:
        torch.save(self.__dict__, path)

    @staticmethod
    def load(path: Path) -> FeatureSet:
        return FeatureSet(**torch.load(path, weights_only=True))


@torch.inference_mode()
def extract(target, sequences: list[list[int]], prompt_lens: list[int], token_budget: int = 4096,
            progress: bool = True) -> FeatureSet:
    model = target.model
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    lengths = [len(s) for s in sequences]
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    total = int(offsets[-1])
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    features = torch.empty(total, model.config.hidden_size, dtype=torch.bfloat16)
    labels = torch.empty(total, dtype=torch.int32)
    started = time.perf_counter()
    with tqdm(total=total, desc="target features", unit="tok", disable=not progress, dynamic_ncols=True) as bar:
        i = 0
        while i < len(order):
            width = lengths[order[i]]
            batch = [order[i]]
            while i + len(batch) < len(order) and (len(batch) + 1) * lengths[order[i + len(batch)]] <= token_budget:
                batch.append(order[i + len(batch)])
            width = max(lengths[s] for s in batch)
            padded = torch.zeros(len(batch), width, dtype=torch.long)
            for row, s in enumerate(batch):
                padded[row, :lengths[s]] = torch.tensor(sequences[s])
            cache = model.new_cache(len(batch), width)
            hidden = model.run(ForwardBatch.chain(padded.to(model.device), 0), cache)     # [B, T, D]
            logits = model.logits(hidden)
            argmax = logits.argmax(-1).cpu()
            for row, s in enumerate(batch):
                a, n = int(offsets[s]), lengths[s]
                features[a:a + n] = hidden[row, :n].to("cpu", torch.bfloat16)
                labels[a:a + n] = argmax[row, :n].to(torch.int32)
            bar.update(sum(lengths[s] for s in batch))
            i += len(batch)
    del started
    return FeatureSet(tokens, features, labels, offsets, torch.tensor(prompt_lens, dtype=torch.long),
                      target.fingerprint)


def _sequences(corpus: list[dict], max_len: int, shards: bool) -> list[list[int]]:
    """Token sequences to train on. With shards the last generated token is dropped: it was never
    fed to the target, so it has no feature (it is still the label of the position before)."""
    full = [r["prompt_ids"] + r["output_ids"] for r in corpus]
    return [s[:min(max_len, len(s) - 1)] for s in full] if shards else [s[:max_len] for s in full]


def from_shards(target, corpus: list[dict], corpus_dir: Path, max_len: int) -> FeatureSet:
    sequences = _sequences(corpus, max_len, shards=True)
    lengths = [len(s) for s in sequences]
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    features = torch.zeros(int(offsets[-1]), target.model.config.hidden_size, dtype=torch.bfloat16)
    labels = torch.full((int(offsets[-1]),), -1, dtype=torch.int32)
    by_shard: dict[str, list[int]] = {}
    for i, r in enumerate(corpus):
        by_shard.setdefault(r["shard"], []).append(i)
    for shard, members in tqdm(sorted(by_shard.items()), desc="load features", unit="shard", leave=False):
        stored = torch.load(corpus_dir / "features" / shard, weights_only=True)
        for i in members:
            a, n, prompt = int(offsets[i]), lengths[i], len(corpus[i]["prompt_ids"])
            features[a:a + n] = stored[corpus[i]["id"]][:n]
            full = torch.tensor(corpus[i]["prompt_ids"] + corpus[i]["output_ids"], dtype=torch.int32)
            start = max(prompt - 1, 0)           # position p is labelled by answer token p+1
            if n > start:
                labels[a + start:a + n] = full[start + 1:n + 1]
    return FeatureSet(torch.tensor([t for s in sequences for t in s], dtype=torch.int32), features, labels,
                      offsets, torch.tensor([min(len(r["prompt_ids"]), n) for r, n in zip(corpus, lengths)]),
                      target.fingerprint)


def corpus_features(target, corpus: list[dict], corpus_dir: Path, path: Path, max_len: int = 768,
                    progress: bool = True) -> FeatureSet:
    """Features of the corpus, from `path` when it was made for this target and corpus."""
    shards = all(r.get("shard") for r in corpus)
    sequences = _sequences(corpus, max_len, shards)
    if path.exists():
        cached = FeatureSet.load(path)
        if cached.fingerprint == target.fingerprint and cached.num_sequences == len(sequences) \
                and cached.num_tokens == sum(len(s) for s in sequences):
            return cached
    if shards:
        features = from_shards(target, corpus, corpus_dir, max_len)
    else:
        features = extract(target, sequences, [min(len(r["prompt_ids"]), max_len) for r in corpus],
                           progress=progress)
    features.save(path)
    return features
