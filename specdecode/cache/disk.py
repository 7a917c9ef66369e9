"""Cached prefixes on disk (`serve --prefix-cache-dir DIR`): a restarted server, or one started again
after a crash, takes the keys and values of hot prompts (a long system prompt, a document asked
about again) from disk instead of prefilling them again.

One file per block, `DIR/<salt>/<block hash>.kv`: a JSON header line (format, the cache's salt,
the block's hash, geometry, dtype, payload size and checksum), then the block's keys and values
of every layer. The salt names the model, its weights, dtype and kernel build
(batch.kv_salt), so another model's files are never read, and a file whose header, size or
checksum does not match is skipped (and removed when it is ours but damaged).

Which blocks are written, and when (write-behind): every block the cache registers (a prompt's
full blocks after their prefill, the answer's as they fill) and every block a later request
matches that is not on disk (it was skipped or trimmed) is staged at once, and written by one
writer thread. The engine thread only copies the block's keys and values into a bounded staging
queue (the pool may hand the block out again right after, so the writer never reads the pool); a
block that finds the queue full is skipped rather than waited for. The writer serializes,
checksums, writes a temporary file and renames it over the block's name (a reader never sees half
a file; a temporary file a kill leaves is removed at the next start), then trims the directory to
`max_bytes`, least recently used files (by mtime) first; loading a file touches it. A `kill -9`
thus loses only the blocks still staged (those of the last moments); a graceful
stop (`write_all`) stages what the cache still holds, the most recently used last, within the size
bound, and waits a bounded time for the writer to finish. At start-up the newest files are loaded
into free blocks of the pool, as idle cached blocks (at most the pool's free blocks and the
cache's own bound).

Threads: `note`, `note_all` and `load` run on the engine thread; `_write` and `_trim` only on the
writer. `on_disk`, `pending` and `writing` are shared, under `lock`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

log = logging.getLogger("specdecode.serve")
FORMAT = "specdecode-kv-block/1"
STAGING_BYTES = 256 * 2**20     # bound on the staged copies (at least one block)
STOP_TIMEOUT = 30.0             # seconds a graceful stop waits for the writer
LINGER = 5.0                    # seconds an idle writer thread waits for more before it ends
TRIM_EVERY = 64                 # writes between two trims while the queue stays busy


class DiskPrefixCache:
    def __init__(self, root: Path, cache, max_bytes: int, staging_bytes: int = STAGING_BYTES) -> None:
        self.cache, self.max_bytes = cache, max_bytes
        self.dir = Path(root) / cache.salt.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob("*.tmp"):          # a write cut short by a kill
            tmp.unlink(missing_ok=True)
        k = cache.keys[0]
        heads, dims = [t.shape[2] for t in cache.keys], [t.shape[3] for t in cache.keys]
        self.geometry = {"layers": len(cache.keys), "block_size": cache.block_size,     # one shape, or one a layer
                         "kv_heads": heads[0] if len(set(heads)) == 1 else heads,
                         "head_dim": dims[0] if len(set(dims)) == 1 else dims,
                         "dtype": str(k.dtype).replace("torch.", "")}
        self.payload_bytes = 2 * sum(t[0].numel() for t in cache.keys) * k.element_size()
        self.file_bytes = len(self._header(bytes(16), "0" * 32)) + self.payload_bytes
        self.capacity = max(1, staging_bytes // self.payload_bytes)     # staged copies at most
        self.lock = threading.Condition()
        self.on_disk = {p.stem for p in self.dir.glob("*.kv")}          # hex hashes of our files
        self.pending: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # staged copies, oldest first
        self.writing: bytes | None = None            # the hash the writer is writing now
        self.writer: threading.Thread | None = None  # started when a block is staged, ends when idle
        self.written = self.loaded = self.skipped = 0
        cache.pool.on_register = self._registered

    # ------------------------------------------------------------ reading (engine thread, at start)
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
            pool.register(block, key)          # on disk already: not staged again
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
                with self.lock:
                    self.on_disk.discard(path.stem)
            return None, None
        return bytes.fromhex(path.stem), torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # ------------------------------------------------------------ staging (engine thread)
    def _registered(self, block: int, key: bytes) -> None:
        """The pool registered `block` (full and committed: its contents are final)."""
        self.note([block])

    def note(self, blocks: list[int], wait_until: float | None = None) -> None:
        """Stage a copy of each block not on disk nor staged yet. A block that finds the queue full is
        skipped, not the oldest staged dropped: a prompt's first blocks are worth more than its last
        (a match stops at the first missing block). `wait_until`: first wait for room until this
        time.monotonic() (a graceful stop)."""
        if self.max_bytes < self.file_bytes:
            return                                    # not even one file would stay
        pool = self.cache.pool
        for block in blocks:
            key = pool.hash_of[block]
            if key is None:
                continue
            with self.lock:
                if key.hex() in self.on_disk or key in self.pending or key == self.writing:
                    continue
                while len(self.pending) >= self.capacity and wait_until is not None \
                        and (left := wait_until - time.monotonic()) > 0:
                    self.lock.wait(left)
                if len(self.pending) >= self.capacity:
                    self.skipped += 1
                    continue
            copy = self._copy(block)                  # outside the lock: only this thread stages
            with self.lock:
                self.pending[key] = copy
                if self.writer is None:
                    self.writer = threading.Thread(target=self._run, name="specdecode-prefix-writer", daemon=True)
                    self.writer.start()
                self.lock.notify_all()

    def _copy(self, block: int) -> torch.Tensor:
        """The block's keys then values of every layer, flat (layers may differ in shape), in memory
        of its own (on the CPU)."""
        tensors = [t[block] for t in self.cache.keys] + [t[block] for t in self.cache.values]
        return torch.cat([t.reshape(-1) for t in tensors]).cpu()

    def note_all(self, wait_until: float | None = None) -> None:
        """Every block the cache holds for a prefix, at most as many as the size bound keeps, the
        least recently used first (written first, so the most recent end up newest on disk)."""
        pool = self.cache.pool
        held = [b for b in range(len(pool.refs)) if pool.refs[b] and pool.hash_of[b] is not None]
        keep = self.max_bytes // self.file_bytes
        self.note((list(pool.idle) + held)[-keep:] if keep else [], wait_until)

    def wait(self, deadline: float) -> bool:
        """Wait until the writer has written every staged block, or until `deadline`
        (time.monotonic()); True if nothing is left."""
        with self.lock:
            while (self.pending or self.writing is not None) and (left := deadline - time.monotonic()) > 0:
                self.lock.wait(left)
            return not self.pending and self.writing is None

    # ------------------------------------------------------------ writing (the writer thread)
    def _run(self) -> None:
        since_trim = 0
        while True:
            with self.lock:
                if not self.pending:
                    self.lock.wait(LINGER)
                if not self.pending:
                    self.writer = None
                    self.lock.notify_all()
                    return
                key, copy = self.pending.popitem(last=False)
                self.writing = key
                self.lock.notify_all()                # room in the queue
            try:
                if self._write(key, copy):
                    since_trim += 1
                    with self.lock:
                        self.on_disk.add(key.hex())
                        self.written += 1
                        idle = not self.pending
                    if idle or since_trim >= TRIM_EVERY:
                        self._trim()
                        since_trim = 0
            except Exception:  # noqa: BLE001 -- the writer outlives one bad block
                log.exception("prefix cache: writing a block to %s failed", self.dir)
            finally:
                with self.lock:
                    self.writing = None
                    self.lock.notify_all()

    def _write(self, key: bytes, copy: torch.Tensor) -> bool:
        payload = memoryview(copy.contiguous().view(torch.uint8).numpy()).cast("B")
        header = self._header(key, hashlib.blake2b(payload, digest_size=16).hexdigest())
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.dir / f"{key.hex()}.kv")
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            log.warning("prefix cache: could not write to %s (%s)", self.dir, exc)
            return False
        return True

    def _header(self, key: bytes, checksum: str) -> bytes:
        header = {"format": FORMAT, "salt": self.cache.salt.hex(), "hash": key.hex(), "geometry": self.geometry,
                  "bytes": self.payload_bytes, "checksum": checksum}
        return json.dumps(header).encode() + b"\n"

    def _trim(self) -> None:
        """Remove the least recently used files until the directory fits `max_bytes`."""
        sizes = {}
        for path in self.dir.glob("*.kv"):
            try:
                stat = path.stat()
            except OSError:                           # removed meanwhile
                continue
            sizes[path] = (stat.st_mtime, stat.st_size)
        total = sum(size for _, size in sizes.values())
        for path in sorted(sizes, key=lambda p: sizes[p][0]):
            if total <= self.max_bytes:
                break
            total -= sizes[path][1]
            path.unlink(missing_ok=True)
            with self.lock:
                self.on_disk.discard(path.stem)


def write_all(disks: list[DiskPrefixCache], timeout: float = STOP_TIMEOUT) -> None:
    """A graceful stop: stage what the caches hold and wait up to `timeout` seconds for the writer."""
    deadline = time.monotonic() + timeout
    for disk in disks:
        disk.note_all(wait_until=deadline)
    for disk in disks:
        if not disk.wait(deadline):
            log.warning("prefix cache: %d blocks not written to %s within %g s", len(disk.pending), disk.dir,
                        timeout)
