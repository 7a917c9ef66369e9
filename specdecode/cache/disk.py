"""Cached prefixes on disk (`serve --prefix-cache-dir DIR`): a restarted server takes the keys and
values of hot prompts (a long system prompt, a document asked about again) from disk instead of
prefilling them again.

One file per block, `DIR/<salt>/<block hash>.kv`: a JSON header line (format, the cache's salt,
the block's hash, geometry, dtype, payload size and checksum), then the block's keys and values
of every layer. The salt names the model, its weights, dtype and kernel build
(batch.kv_salt), so another model's files are never read, and a file whose header, size or
checksum does not match is skipped (and removed when it is ours but damaged). Which blocks are
written: a block the moment a later request matches it (so hot prefixes survive a crash), and at
a graceful stop every block the cache still holds, the most recently used first, within the size
bound. The directory is trimmed to `max_bytes`, least recently used files (by mtime) first;
loading a file touches it. At start-up the newest files are loaded into free blocks of the pool,
as idle cached blocks (at most the pool's free blocks and the cache's own bound).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("specdecode.serve")
FORMAT = "specdecode-kv-block/1"


class DiskPrefixCache:
    def __init__(self, root: Path, cache, max_bytes: int) -> None:
        self.cache, self.max_bytes = cache, max_bytes
        self.dir = Path(root) / cache.salt.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.on_disk = {p.stem for p in self.dir.glob("*.kv")}
        self.pending: OrderedDict[bytes, None] = OrderedDict()     # hashes to write, oldest first
        k = cache.keys[0]
        heads, dims = [t.shape[2] for t in cache.keys], [t.shape[3] for t in cache.keys]
        self.geometry = {"layers": len(cache.keys), "block_size": cache.block_size,     # one shape, or one a layer
                         "kv_heads": heads[0] if len(set(heads)) == 1 else heads,
                         "head_dim": dims[0] if len(set(dims)) == 1 else dims,
                         "dtype": str(k.dtype).replace("torch.", "")}
        self.payload_bytes = 2 * sum(t[0].numel() for t in cache.keys) * k.element_size()
        self.written = self.loaded = 0

    # ------------------------------------------------------------ reading
    def load(self) -> int:
        """Load the newest valid files into free blocks as idle cached blocks; returns how many."""
        pool = self.cache.pool
        room = len(pool.free) if pool.max_idle is None else min(len(pool.free), pool.max_idle - len(pool.idle))
        files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime, reverse=True)
        for path in files:
            if room <= 0:
                break
            key, data = self._read(path)
            if data is None or key in pool.cached:
                continue
            block = pool.take()
            targets = [t[block] for t in self.cache.keys + self.cache.values]    # keys of every layer, then values
            parts = data.view(self.cache.keys[0].dtype).split([t.numel() for t in targets])
            for target, part in zip(targets, parts):
                target.copy_(part.view(target.shape))
            pool.register(block, key)
            pool.drop(block)                   # unheld: an idle cached block
            os.utime(path)
            room -= 1
            self.loaded += 1
        return self.loaded

    def _read(self, path: Path) -> tuple[bytes | None, torch.Tensor | None]:
        """(hash, payload as uint8) of a valid file of this cache; (None, None) otherwise."""
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline(4096).decode("utf-8"))
                payload = f.read(self.payload_bytes + 1)
        except (OSError, ValueError, UnicodeDecodeError):
            header, payload = None, b""
        ok = (isinstance(header, dict) and header.get("format") == FORMAT
              and header.get("salt") == self.cache.salt.hex() and header.get("geometry") == self.geometry
              and header.get("hash") == path.stem
              and len(payload) == self.payload_bytes == header.get("bytes")
              and hashlib.blake2b(payload, digest_size=16).hexdigest() == header.get("checksum"))
        if not ok:
            log.warning("prefix cache: skipping %s (truncated, damaged or not this model's)", path)
            if isinstance(header, dict) and header.get("salt") == self.cache.salt.hex():
                path.unlink(missing_ok=True)        # ours but damaged
                self.on_disk.discard(path.stem)
            return None, None
        return bytes.fromhex(path.stem), torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # ------------------------------------------------------------ writing
    def note(self, blocks: list[int]) -> None:
        """Blocks to keep on disk (hits: hot prefixes)."""
        for block in blocks:
            key = self.cache.pool.hash_of[block]
            if key is not None and key.hex() not in self.on_disk:
                self.pending[key] = None

    def note_all(self) -> None:
        """Every block the cache holds for a prefix, the least recently used first (written first,
        so the most recent end up newest on disk)."""
        pool = self.cache.pool
        held = [b for b in range(len(pool.refs)) if pool.refs[b] and pool.hash_of[b] is not None]
        self.note(list(pool.idle) + held)

    def flush(self, limit: int | None = None) -> int:
        """Write up to `limit` pending blocks still cached (None: all); returns how many remain."""
        pool, count = self.cache.pool, 0
        while self.pending and (limit is None or count < limit):
            key, _ = self.pending.popitem(last=False)
            block = pool.cached.get(key)
            if block is not None and key.hex() not in self.on_disk:
                self._write(key, block)
                count += 1
        if count:
            self._trim()
        return len(self.pending)

    def _write(self, key: bytes, block: int) -> None:
        tensors = [t[block] for t in self.cache.keys] + [t[block] for t in self.cache.values]
        payload = torch.cat([t.reshape(-1) for t in tensors]).view(torch.uint8).numpy().tobytes()
        header = {"format": FORMAT, "salt": self.cache.salt.hex(), "hash": key.hex(), "geometry": self.geometry,
                  "bytes": len(payload), "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(header).encode() + b"\n")
                f.write(payload)
            os.replace(tmp, self.dir / f"{key.hex()}.kv")
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            log.warning("prefix cache: could not write to %s (%s)", self.dir, exc)
            return
        self.on_disk.add(key.hex())
        self.written += 1

    def _trim(self) -> None:
        files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            self.on_disk.discard(path.stem)
