"""Self-distillation corpus: the target's own greedy answers to the prompts of `prompts.py`.

Stage 1 asks the target for short articles (passages for the summarization / RAG / translation
prompts); stage 2 answers every training prompt; stage 3 answers a follow-up turn for a quarter
of the chat prompts. All stages run batched on the native engine (plain decoding) and append to
`corpus.jsonl` as each batch finishes, so an interrupted build resumes where it stopped.

The target's features (last hidden states before the final norm) are captured while it
generates -- a `FeatureRecorder` sits in the drafter slot, drafts nothing and keeps what the
engine hands over after every target pass -- so training needs no second pass over the corpus.

corpus.jsonl: one JSON object per line: {"id", "task", "prompt_ids", "output_ids", "shard"};
features/shard-NNNNN.pt: {id: [L-1, hidden] bf16 features of positions 0..L-2} for one batch
(the last token is never fed to the target, so it has no feature).
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafters.base import Drafter, DrafterCapabilities, DraftProposal
from ..engine import offline
from ..params import SamplingParams
from . import prompts as P


class FeatureRecorder(Drafter):
    """Proposes nothing; records the target's features of each request by position."""

    name = "feature-recorder"
    capabilities = DrafterCapabilities(needs_target_hidden=True)

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        self.hidden_size, self.dtype = hidden_size, dtype
        self.features: dict[str, torch.Tensor] = {}     # request id -> [prompt + max_tokens, hidden]

    def observe(self, seqs, starts, hidden):
        width = hidden.shape[1]
        for b, s in enumerate(seqs):
            rows = self.features.get(s.request_id)
            if rows is None:
                rows = self.features[s.request_id] = torch.zeros(s.prompt_len + s.params.max_tokens,
                                                                 self.hidden_size, dtype=self.dtype)
            n = min(width, rows.shape[0] - starts[b])
            rows[starts[b]:starts[b] + n] = hidden[b, :n].to("cpu", self.dtype)

    def propose(self, seqs, sizes):
        return DraftProposal.empty(len(seqs))


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:      # a line cut short by an interruption
            break
    return rows


def _encode(target, messages: list[dict]) -> list[int]:
    tok = target.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special=False)


def _generate(target, jobs: list[tuple[str, list[int]]], max_tokens: int, batch_size: int, desc: str,
              on_batch) -> None:
    """Greedy plain decoding of (id, prompt_ids) jobs in batches of similar prompt length;
    on_batch gets [(id, prompt_ids, output_ids, features [len-1, hidden])] per batch."""
    recorder = FeatureRecorder(target.model.config.hidden_size, torch.bfloat16)
    core = offline.offline_core(target, recorder, 1)
    fits = [j for j in jobs if len(j[1]) + max_tokens <= target.model.max_len]
    if len(fits) < len(jobs):
        print(f"note: {len(jobs) - len(fits)} prompts skipped: longer than the target's context "
              f"({target.model.max_len}) minus {max_tokens} new tokens", file=sys.stderr)
    jobs = sorted(fits, key=lambda j: len(j[1]))
    params = SamplingParams(max_tokens=max_tokens)
    with tqdm(total=len(jobs), desc=desc, unit="prompt", dynamic_ncols=True) as bar:
        for i in range(0, len(jobs), batch_size):
            chunk = jobs[i:i + batch_size]
            seqs = offline.run(core, [ids for _, ids in chunk], [params] * len(chunk))
            on_batch([(job_id, ids, s.output_ids, recorder.features.pop(s.request_id)[:len(s.token_ids) - 1])
                      for (job_id, ids), s in zip(chunk, seqs)])
            bar.update(len(chunk))


def build_corpus(target, out_dir: Path, max_prompts: int | None = None, max_tokens: int = 256,
                 batch_size: int = 96, seed: int = 0) -> Path:
    """Build (or finish building) out_dir/corpus.jsonl for `target`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tok = target.tokenizer
    eos = set(target.eos_token_ids)
    strip = lambda ids: [t for t in ids if t not in eos]   # noqa: E731

    articles_path = out_dir / "articles.jsonl"
    done_articles = {r["id"]: r for r in _read_jsonl(articles_path)}
    todo = [(t, _encode(target, [{"role": "user", "content": req}])) for t, req in P.article_requests()
            if t not in done_articles]
    if todo:
        with articles_path.open("a") as f:
            def save_articles(batch):
                for topic, _, out, _ in batch:
                    row = {"id": topic, "text": tok.decode(strip(out)).strip()}
                    done_articles[topic] = row
                    f.write(json.dumps(row) + "\n")
                f.flush()
            _generate(target, todo, 160, batch_size, "stage 1/3 passages", save_articles)
    articles = {k: " ".join(v["text"].split()[:180]) for k, v in done_articles.items() if v["text"]}

    rows = P.training_prompts(articles, seed)
    random.Random(seed).shuffle(rows)          # any prefix (--max-prompts) mixes every task
    if max_prompts is not None:
        rows = rows[:max_prompts]
    corpus_path = out_dir / "corpus.jsonl"
    done = {r["id"]: r for r in _read_jsonl(corpus_path)}
    shard_dir = out_dir / "features"
    shard_dir.mkdir(exist_ok=True)
    with corpus_path.open("a") as f:
        def save(task_of):
            def on_batch(batch):
                shard = f"shard-{len(list(shard_dir.glob('shard-*.pt'))):05d}.pt"
                torch.save({job_id: feats for job_id, _, _, feats in batch}, shard_dir / shard)
                for job_id, ids, out, _ in batch:
                    row = {"id": job_id, "task": task_of[job_id], "prompt_ids": ids, "output_ids": out,
                           "shard": shard}
                    done[job_id] = row
                    f.write(json.dumps(row) + "\n")
                f.flush()
            return on_batch
        tasks = {r["id"]: r["task"] for r in rows}
        todo = [(r["id"], _encode(target, r["messages"])) for r in rows if r["id"] not in done]
        if todo:
            _generate(target, todo, max_tokens, batch_size, "stage 2/3 answers", save(tasks))
        follow = {r["id"] + "-turn2": r for r in rows if r.get("follow_up")}
        todo = []
        for job_id, r in follow.items():
            first = done.get(r["id"])
            if job_id in done or first is None:
                continue
            answer = tok.decode(strip(first["output_ids"])).strip()
            messages = r["messages"] + [{"role": "assistant", "content": answer},
                                        {"role": "user", "content": r["follow_up"]}]
            todo.append((job_id, _encode(target, messages)))
        if todo:
            _generate(target, todo, max_tokens, batch_size, "stage 3/3 follow-ups",
                      save({j: "multi_turn" for j in follow}))
    meta = {"target": target.name, "prompts": len(rows), "sequences": len(done),
            "output_tokens": sum(len(r["output_ids"]) for r in done.values()),
            "build_seconds_this_run": round(time.perf_counter() - started, 1)}
    (out_dir / "corpus_meta.json").write_text(json.dumps(meta, indent=1))
    return corpus_path


def load_corpus(path: Path) -> list[dict]:
    return _read_jsonl(path)
