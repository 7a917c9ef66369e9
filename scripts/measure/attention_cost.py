"""Cost of one decode step at long contexts (attention), old kernels vs new, alternating.

One decode step (1 token per row; --tokens N: a verify pass of N) of the embedded model through
FusedDecoder.forward_rows on a PagedKVCache (block 16) + the LM head, for several contexts and batch
sizes.  With --base REF the kernels of git revision REF are compiled too (same flags) and the two
builds alternate round by round in the same process, so machine noise hits both alike; the table
gives the median and the minimum of the single steps of each build.

Usage: python scripts/measure/attention_cost.py [--base main] [--ctx 300 1500] [--batch 1 8 32]
                                        [--rounds 5] [--steps 10] [--scatter] [--threads 1 --cputime]
--scatter: the rows take their blocks one at a time in a random order, so a row's blocks lie
scattered in the pool as when many requests grow at once (default: each row's blocks in order).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's specdecode, not an installed one


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def build_rev(rev: str) -> Path:
    """The kernels of git revision `rev`, compiled like specdecode/fast/linear.py does."""
    from specdecode.fast import linear as lin
    root = Path(lin.__file__).resolve().parents[2]
    src = {p.name: subprocess.run(["git", "-C", str(root), "show", f"{rev}:specdecode/fast/{p.name}"],
                                  capture_output=True, check=True).stdout for p in lin._SOURCES}
    flags = lin._CFLAGS + [f"-DSD_QPREFETCH={lin._qprefetch_bytes()}"]
    key = hashlib.sha256(b"".join(src.values()) + " ".join(flags).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"sd-kernels-{rev.replace('/', '_')}-{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as d:
            for name, text in src.items():
                (Path(d) / name).write_bytes(text)
            subprocess.run(["gcc", *flags, str(Path(d) / lin._SRC.name), "-o", str(out)], check=True)
    return out


def use_lib(fused, lib) -> None:
    """Point a FusedDecoder's native entry points at `lib` (same struct layouts)."""
    P, N = ctypes.c_void_p, ctypes.c_int
    rows_fn, head_fn = lib.sd_decoder_rows, lib.sd_decoder_head
    rows_fn.argtypes, rows_fn.restype = [P, P, P, P, P, P, N, P, N, P, N], N
    head_fn.argtypes, head_fn.restype = [P, P, N, P, N], N
    fused._rows_fn, fused._head_fn = rows_fn, head_fn


def prefill(fused, cache, ids: list[int]) -> None:
    """Cache row 0 <- the keys and values of `ids` (chunks of 64 tokens through the fused decoder)."""
    from specdecode.forward import ForwardBatch
    for s in range(0, len(ids), 64):
        chunk = torch.tensor(ids[s:s + 64])[None]
        fused.forward_rows(ForwardBatch.chain(chunk, torch.tensor([s]), torch.tensor([0])), cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="git revision whose kernels to compare against")
    ap.add_argument("--ctx", type=int, nargs="+", default=[300, 1500])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--scatter", action="store_true")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per row and pass (> 1: a verify pass)")
    ap.add_argument("--threads", type=int, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--cputime", action="store_true",
                    help="time the CPU time of this thread, not the wall clock (with --threads 1: robust "
                         "to other processes on a busy host)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cputime else time.perf_counter

    from specdecode import LLM
    from specdecode.cache.paged import PagedKVCache
    from specdecode.fast import linear as lin
    from specdecode.forward import ForwardBatch

    llm = LLM(method="none")
    m = llm.target.model
    c, fused = m.config, m.fused
    libs = {"new": lin._load()["lib"]}
    if args.base:
        libs = {"base": ctypes.CDLL(str(build_rev(args.base))), **libs}
    print(f"specdecode from {Path(lin.__file__).resolve().parents[1]}")
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; model {c.num_layers} layers, "
          f"{c.num_heads} q / {c.num_kv_heads} kv heads, head_dim {c.head_dim}, {m.dtype}; "
          f"paged block 16{', scattered blocks' if args.scatter else ''}")
    unit = "decode step" if args.tokens == 1 else f"pass of {args.tokens} tokens per row"
    clock_name = "CPU" if args.cputime else "wall"
    print(f"{clock_name} ms per {unit}: median (min) of {args.rounds} rounds x {args.steps} steps"
          + (f" (builds alternate: {' / '.join(libs)})" if len(libs) > 1 else ""))
    rng = random.Random(0)
    text = llm.tokenizer.encode(Path(__file__).resolve().parents[2].joinpath("README.md").read_text())
    text = (text * (max(args.ctx) // len(text) + 1))[:max(args.ctx)]
    for ctx in args.ctx:
        for B in args.batch:
            pc = PagedKVCache(c.num_layers, B + 1, c.num_kv_heads, c.head_dim, ctx + 64 + args.tokens,
                              (B + 1) * ((ctx + args.tokens) // 16 + 6) + 2, 16, m.dtype, m.device)
            for r in range(B):
                pc.reserve(r, ctx + 40 + args.tokens)
            n = pc.blocks_for(ctx + args.tokens)
            if args.scatter:                           # rows take their blocks one at a time in random turns
                turns = [r for r in range(B) for _ in range(n)]
                rng.shuffle(turns)
                for r in turns:
                    pc._grow(r, (len(pc.tables[r]) + 1) * pc.block_size)
            prefill(fused, pc, text[:ctx])             # row 0: real keys / values, copied to the others
            for r in range(1, B):
                pc._grow(r, ctx + args.tokens)
                k = pc.blocks_for(ctx)
                src, dst = torch.tensor(pc.tables[0][:k]), torch.tensor(pc.tables[r][:k])
                for pool in pc.keys + pc.values:
                    pool[dst] = pool[src]
            x = torch.full((B, args.tokens), 100)
            fb = ForwardBatch.chain(x, torch.tensor([ctx] * B), torch.arange(B))
            none = torch.arange(args.tokens).repeat(B, 1)
            times = {name: [] for name in libs}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    use_lib(fused, lib)
                    for _ in range(2):
                        fused.head(fused.forward_rows(fb, pc), none)
                    for _ in range(args.steps):
                        t = clock()
                        fused.head(fused.forward_rows(fb, pc), none)
                        times[name].append((clock() - t) * 1e3)
            med = {n: statistics.median(v) for n, v in times.items()}
            low = {n: min(v) for n, v in times.items()}
            line = f"ctx {ctx:5d} B {B:3d}: " + "  ".join(f"{n} {med[n]:7.2f} ({low[n]:7.2f}) ms" for n in med)
            if len(med) > 1:
                line += f"  new/base {med['new'] / med['base']:.2f}"
            line += f"   ({B / med['new'] * 1e3:.0f} tok/s new)"
            print(line, flush=True)
            del pc
    use_lib(fused, libs["new"])


if __name__ == "__main__":
    main()
