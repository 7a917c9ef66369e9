"""The native linear kernels against torch's, on one full model's matmuls, interleaved.

    python scripts/measure/linear_kernels.py [--stat min|median] [METHOD ...]

Every method runs the matmuls of one whole model (SmolLM2-135M's shapes: 30 layers of qkv, o,
gate|up and down projections, then the LM head, all distinct random weights) for M = 1, 2, 4, 8,
9 and 16 rows, the methods in round-robin so that the host's memory-bandwidth noise hits them
alike; before each M it waits (up to 2 minutes) for a CPU more than 90% idle. Prints per method
and M the median (or --stat min) time of one pass and the weight bytes it read per second.
Methods (default: all): read (the bandwidth probe), F.linear-bf16, F.linear-fp32, mkldnn-bf16,
mkl-fp32, PackedLinear-bf16, PackedLinear-fp32, C-amx, C-avx512bf16, C-fp32 (the kernels of
specdecode/fast/kernels.c called directly; C-amx only where the CPU has AMX and the kernel allows
it). Needs ~2.5 GB of RAM; 2 threads.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # this checkout's specdecode

H, IM, V, L = 576, 1536, 49152, 30                 # SmolLM2-135M: hidden, intermediate, vocab, layers
SHAPES = [(960, H), (H, H), (2 * IM, H), (H, IM)] * L + [(V, H)]
NB16 = sum(n * k for n, k in SHAPES) * 2           # the model's weight bytes in bf16
ROWS = (1, 2, 4, 8, 9, 16)
REPS = 11
THREADS = 2
METHODS = ("read", "F.linear-bf16", "F.linear-fp32", "mkldnn-bf16", "mkl-fp32", "PackedLinear-bf16",
           "PackedLinear-fp32", "C-amx", "C-avx512bf16", "C-fp32")


def kernels():
    """The native kernel library (compiled as specdecode loads it), its entry points typed, and
    whether the AMX kernels may run here."""
    from specdecode.fast import linear
    linear._load()
    lib = ctypes.CDLL(str(linear._compile()))
    amx = linear.kernel_plan()["amx_bf16"] and lib.sd_amx_init() == 0
    P, N = ctypes.c_void_p, ctypes.c_int
    lib.sd_pack_bf16.argtypes = [P, P, N, N, N, N]
    lib.sd_pack_fp32.argtypes = [P, P, N, N, N]
    for f in (lib.sd_linear_bf16_amx, lib.sd_linear_bf16_avx512):
        f.argtypes, f.restype = [P, N, P, P, P, N, N, N, N, N, N], None
    lib.sd_linear_fp32.argtypes, lib.sd_linear_fp32.restype = [P, N, P, P, P, N, N, N, N, N], None
    lib.sd_read_bw.argtypes, lib.sd_read_bw.restype = [P, ctypes.c_size_t, N], ctypes.c_float
    return lib, amx


def torch_method(weights, dtype, call):
    """factory(M) -> one pass of `call(x, w)` over every weight, on random inputs of M rows."""
    def make(m: int):
        xs = {k: torch.randn(m, k, dtype=dtype) for k in (H, IM)}
        pairs = [(w, xs[k]) for w, (n, k) in zip(weights, SHAPES)]
        return lambda: [call(x, w) for w, x in pairs]
    return make


def native_method(lib, kind: str, w32: list[torch.Tensor]):
    """factory(M) -> one pass of a kernels.c entry point over every weight, packed once."""
    packed = []
    for w in w32:
        n, k = w.shape
        if kind == "fp32":
            wp = torch.empty(n * k)
            lib.sd_pack_fp32(w.data_ptr(), wp.data_ptr(), n, k, n)
        else:
            wb = w.bfloat16()
            wp = torch.empty(n * k, dtype=torch.bfloat16)
            lib.sd_pack_bf16(wb.data_ptr(), wp.data_ptr(), n, k, n, k)
        packed.append(wp)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    fn = {"amx": lib.sd_linear_bf16_amx, "avx512bf16": lib.sd_linear_bf16_avx512, "fp32": lib.sd_linear_fp32}[kind]

    def make(m: int):
        xs = {k: torch.randn(m, k, dtype=dtype) for k in (H, IM)}
        ys = {n: torch.empty(m, n, dtype=dtype) for n, _ in SHAPES}
        tail = (THREADS,) if kind == "fp32" else (1, THREADS)          # bf16: out_bf16, then threads
        calls = [(xs[k].data_ptr(), k, wp.data_ptr(), None, ys[n].data_ptr(), n, m, n, k, *tail)
                 for wp, (n, k) in zip(packed, SHAPES)]
        return lambda keep=(xs, ys): [fn(*a) for a in calls]
    return make


def methods(lib, want: set[str]) -> dict:
    """name -> (weight bytes read per pass, factory(M) -> one pass), for the methods wanted."""
    from specdecode.fast.linear import PackedLinear
    out: dict = {}
    w32 = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    if "read" in want:
        buf = torch.ones(NB16 // 4)
        out["read"] = (NB16, lambda m: (lambda: lib.sd_read_bw(buf.data_ptr(), buf.numel(), THREADS)))
    if "F.linear-bf16" in want:
        out["F.linear-bf16"] = (NB16, torch_method([w.bfloat16() for w in w32], torch.bfloat16, F.linear))
    if "F.linear-fp32" in want:
        out["F.linear-fp32"] = (2 * NB16, torch_method(w32, torch.float32, F.linear))
    if "mkldnn-bf16" in want:
        wd = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in w32]
        out["mkldnn-bf16"] = (NB16, torch_method(
            wd, torch.bfloat16, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")))
    if "mkl-fp32" in want:
        wm = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in w32]
        out["mkl-fp32"] = (2 * NB16, torch_method(
            wm, torch.float32, lambda x, w: torch.ops.mkl._mkl_linear(x, w[0], w[1], None, x.shape[0])))
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if f"PackedLinear-{name}" in want:
            packed = [PackedLinear(w.to(dtype), None) for w in w32]
            nbytes = NB16 * (2 if dtype == torch.float32 else 1)
            out[f"PackedLinear-{name}"] = (nbytes, torch_method(packed, dtype, lambda x, w: w(x)))
    for kind in ("amx", "avx512bf16", "fp32"):
        if f"C-{kind}" in want:
            out[f"C-{kind}"] = (2 * NB16 if kind == "fp32" else NB16, native_method(lib, kind, w32))
    return out


def idle_fraction(seconds: float = 0.3) -> float:
    """The share of CPU time spent idle over the next `seconds` (/proc/stat)."""
    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    a = sample()
    time.sleep(seconds)
    d = [y - x for x, y in zip(a, sample())]
    return (d[3] + d[4]) / max(1, sum(d))


def wait_quiet(limit: float = 120.0) -> float:
    """Wait (up to `limit` seconds) for a CPU more than 90% idle; returns the seconds waited."""
    started = time.time()
    while idle_fraction() < 0.9 and time.time() - started < limit:
        pass
    return time.time() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("methods", nargs="*", metavar="METHOD", help=f"any of {', '.join(METHODS)} (default: all)")
    p.add_argument("--stat", choices=("median", "min"), default="median", help="of the repetitions (default median)")
    args = p.parse_args()
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown method(s) {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    lib, amx = kernels()
    want = set(args.methods or METHODS)
    if not amx and "C-amx" in want:               # its instructions would kill the process
        if args.methods:
            p.error("C-amx needs AMX, which this CPU (or its kernel) does not allow")
        want.discard("C-amx")
    print(f"AMX: {'yes' if amx else 'no (C-amx skipped)'}")
    chosen = methods(lib, want)
    stat = min if args.stat == "min" else statistics.median
    print(f"{'method':14s} " + " ".join(f"{f'M={m}':>15s}" for m in ROWS))
    results: dict[str, list[float]] = {name: [] for name in chosen}
    for m in ROWS:
        steps = {name: make(m) for name, (_, make) in chosen.items()}
        waited = wait_quiet()
        if waited > 1:
            print(f"(waited {waited:.0f}s for an idle machine)", flush=True)
        for step in steps.values():               # warm-up
            step()
            step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(REPS):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        for name in steps:
            results[name].append(stat(times[name]))
    for name, (nbytes, _) in chosen.items():
        print(f"{name:14s} " + " ".join(f"{t * 1e3:6.1f}ms {nbytes / t / 1e9:4.1f}GB/s" for t in results[name]),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
