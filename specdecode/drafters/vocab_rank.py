"""Which token ids a draft's reduced LM head keeps (FR-Spec, arXiv 2502.14856).

A small draft spends a large share of its bytes on its LM head (Qwen2.5-0.5B: 136 of 392 MB per
token), yet most of the text it drafts uses a small part of the vocabulary. `frequent_ids` returns
the `count` ids a draft head keeps:

- ``rank="freq"`` (default): the ids ranked by how often they occur when the draft's tokenizer
  encodes a text corpus; ids never seen follow in id order (BPE ids come in merge order, roughly
  by frequency in the tokenizer's own training text). The corpus is the running Python's standard
  library (code, docstrings, and pydoc's English topics: text every Python install has, read
  here for counts only), or a file / folder the user names (``rank=PATH``: their own domain's
  text). The counts are cached per vocabulary and corpus under ``$SPECDECODE_CACHE/vocab_rank``.
- ``rank="id"``: the first `count` ids (the tokenizer's own order).

The end-of-generation ids are always kept, so a reduced draft can still propose the end. Whatever
is kept, drafting stays lossless: a token outside the head gets draft probability 0, which the
verifier's rejection sampling handles like any other draft distribution.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

from ..footprint import weights_bytes
from ..models.gguf import cache_root
from .base import DrafterError

CORPUS_BYTES = 8 << 20           # text read for the counts (the stdlib, many times larger, is sampled down to this)
CORPUS_VERSION = 1               # bump when the default corpus or its sampling changes
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "encodings"}


def default_corpus() -> list[Path]:
    """The Python standard library's .py files (no tests, no installed packages), pydoc's topics
    first, sampled evenly across the sorted list to about CORPUS_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))
    topics = [p for p in files if p.parts[-2:] == ("pydoc_data", "topics.py")]
    rest = [p for p in files if p not in topics]
    total = sum(p.stat().st_size for p in rest) or 1
    stride = max(1, round(total / CORPUS_BYTES))
    return topics + rest[::stride]


def _corpus_files(source: str | Path | None) -> list[Path]:
    if source is None:
        return default_corpus()
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if files:
            return files
    raise DrafterError(f"head_rank must be 'freq', 'id' or a text file / folder to count tokens in; "
                       f"{str(source)!r} is neither a file nor a folder with files")


def token_counts(tokenizer, vocab_size: int, source: str | Path | None = None) -> torch.Tensor:   # [vocab] int64
    """How often each id occurs when `tokenizer` encodes the corpus (cached per vocabulary + corpus)."""
    files = _corpus_files(source)
    key = hashlib.sha256()
    key.update("\n".join(tokenizer.vocab_fingerprint()).encode())
    key.update(f"{CORPUS_VERSION} {vocab_size}".encode())
    for p in files:
        st = p.stat()
        key.update(f"{p} {st.st_size} {int(st.st_mtime)}".encode())
    cached = cache_root() / "vocab_rank" / f"{key.hexdigest()[:24]}.pt"
    if cached.is_file():
        try:
            counts = torch.load(cached)
            if counts.shape == (vocab_size,):
                return counts
        except Exception:        # a torn or foreign file: count again
            pass
    texts, budget = [], CORPUS_BYTES if source is None else 64 * CORPUS_BYTES
    for p in files:
        if budget <= 0:
            break
        text = p.read_bytes()[:budget].decode("utf-8", errors="ignore")
        budget -= len(text)
        texts.append(text)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        ids = ids[ids < vocab_size]
        counts += torch.bincount(ids, minlength=vocab_size)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    torch.save(counts, tmp)
    tmp.replace(cached)
    return counts


def frequent_ids(tokenizer, vocab_size: int, count: int, rank: str = "freq",
                 keep: tuple[int, ...] = ()) -> torch.Tensor:   # [count] int64, ascending
    """The `count` token ids a reduced draft head keeps (module docstring); `keep` (the
    end-of-generation ids) are always among them."""
    if rank == "id":
        order = torch.arange(vocab_size)
    else:
        counts = token_counts(tokenizer, vocab_size, None if rank == "freq" else rank)
        # most frequent first; ties (unseen ids above all) in id order: a stable sort of -counts
        order = torch.sort(-counts, stable=True).indices
    forced = [i for i in dict.fromkeys(keep) if 0 <= i < vocab_size]
    if forced:
        is_forced = torch.zeros(vocab_size, dtype=torch.bool)
        is_forced[forced] = True
        order = torch.cat([torch.tensor(forced, dtype=torch.int64), order[~is_forced[order]]])
    return torch.sort(order[:count]).values


def reduced_head(draft, head_vocab: int, head_rank: str, ids: int, keep: tuple[int, ...] = (),
                 whole: int | None = None):
    """A draft model's LM head over its `head_vocab` most used token ids among the first `ids`
    (`head_rank`: frequent_ids), or None for the whole head (head_vocab 0, or as many rows as
    `whole`, the head's own; default `ids`). A bad option is a DrafterError naming it."""
    if (isinstance(head_vocab, bool) or not isinstance(head_vocab, int)
            or not (head_vocab == 0 or (32 <= head_vocab <= ids and head_vocab % 32 == 0))):
        raise DrafterError(f"head_vocab must be 0 (the whole vocabulary) or a multiple of 32 in "
                           f"[32, {ids}], got {head_vocab!r}")
    if not isinstance(head_rank, str) or not head_rank:
        raise DrafterError(f"head_rank must be 'freq', 'id' or a text file / folder, got {head_rank!r}")
    if not 0 < head_vocab < (ids if whole is None else whole):
        return None
    return draft.model.head_rows(frequent_ids(draft.tokenizer, ids, head_vocab, head_rank, keep))


def draft_cost(draft_model, target_model, head_rows=None, whole: int = 1) -> float:
    """One draft token's cost against a target step: the draft's weight bytes (less the rows of its
    `whole`-row LM head that a reduced head leaves unread) over the target's."""
    cut = 0.0 if head_rows is None else getattr(draft_model.lm_head, "nbytes", 0) * (1 - len(head_rows.ids) / whole)
    return (weights_bytes(draft_model) - cut) / max(weights_bytes(target_model), 1)
