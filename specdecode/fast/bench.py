"""Interleaved benchmark: every method runs one full model's matmuls (30 layers + LM head,
all distinct weights) in round-robin, so host memory-bandwidth noise hits all methods alike.
Usage (from the repo root):  STAT=min|median python -m specdecode.fast.bench [methods...]
Methods: read F.linear-bf16 F.linear-fp32 mkldnn-bf16 mkl-fp32 PackedLinear-bf16 PackedLinear-fp32
         C-amx C-avx512bf16 C-fp32   (default: all).  Needs ~2.5 GB RAM."""
import sys, time, statistics, ctypes, torch, torch.nn.functional as F
torch.set_num_threads(2); torch.manual_seed(0)
from specdecode.fast import linear as _fl
_fl._load(); so = _fl._compile(); want = sys.argv[1:]
lib = ctypes.CDLL(so); print("amx_init", lib.sd_amx_init())
P, I = ctypes.c_void_p, ctypes.c_int
lib.sd_pack_bf16.argtypes = [P, P, I, I, I, I]; lib.sd_pack_fp32.argtypes = [P, P, I, I, I]
for f in (lib.sd_linear_bf16_amx, lib.sd_linear_bf16_avx512): f.argtypes = [P, I, P, P, P, I, I, I, I, I, I]
lib.sd_linear_fp32.argtypes = [P, I, P, P, P, I, I, I, I, I]
lib.sd_read_bw.argtypes = [P, ctypes.c_size_t, I]; lib.sd_read_bw.restype = ctypes.c_float
H, IM, V, L = 576, 1536, 49152, 30
shapes = [(960, H), (H, H), (2 * IM, H), (H, IM)] * L + [(V, H)]
NB16 = sum(n * k for n, k in shapes) * 2
W32 = [torch.randn(n, k) * 0.02 for n, k in shapes]
def packb(w):
    n, k = w.shape; wp = torch.empty(n * k, dtype=torch.bfloat16); lib.sd_pack_bf16(w.data_ptr(), wp.data_ptr(), n, k, n, k); return wp
def packf(w):
    n, k = w.shape; wp = torch.empty(n * k); lib.sd_pack_fp32(w.data_ptr(), wp.data_ptr(), n, k, n); return wp
methods = {}  # name -> (bytes, factory(M) -> step())
def add(name, nbytes, make):
    if not want or name in want: methods[name] = (nbytes, make)
if not want or "read" in want:
    buf = torch.ones(NB16 // 4)
add("read", NB16, lambda M: (lambda: lib.sd_read_bw(buf.data_ptr(), buf.numel(), 2)))
def torch_method(ws, dt, call):
    def make(M):
        xs = {k: torch.randn(M, k, dtype=dt) for k in (H, IM)}
        pairs = [(w, xs[k]) for w, (n, k) in zip(ws, shapes)]
        return lambda: [call(x, w) for w, x in pairs]
    return make
if not want or "F.linear-bf16" in want:
    Wb = [w.bfloat16() for w in W32]; add("F.linear-bf16", NB16, torch_method(Wb, torch.bfloat16, F.linear))
if not want or "F.linear-fp32" in want:
    add("F.linear-fp32", 2 * NB16, torch_method(W32, torch.float32, F.linear))
if not want or "mkldnn-bf16" in want:
    Wd = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in W32]
    add("mkldnn-bf16", NB16, torch_method(Wd, torch.bfloat16, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")))
if not want or "mkl-fp32" in want:
    Wm = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in W32]
    add("mkl-fp32", 2 * NB16, torch_method(Wm, torch.float32, lambda x, w: torch.ops.mkl._mkl_linear(x, w[0], w[1], None, x.shape[0])))
def custom(kind):
    if kind == "fp32": ws = [packf(w) for w in W32]; dt = torch.float32
    else: ws = [packb(w.bfloat16()) for w in W32]; dt = torch.bfloat16
    fn = {"amx": lib.sd_linear_bf16_amx, "avx512bf16": lib.sd_linear_bf16_avx512, "fp32": lib.sd_linear_fp32}[kind]
    def make(M):
        xs = {k: torch.randn(M, k, dtype=dt) for k in (H, IM)}
        ys = {n: torch.empty(M, n, dtype=dt) for n, _ in shapes}
        if kind == "fp32":
            args = [(xs[k].data_ptr(), k, w.data_ptr(), None, ys[n].data_ptr(), n, M, n, k, 2) for w, (n, k) in zip(ws, shapes)]
        else:
            args = [(xs[k].data_ptr(), k, w.data_ptr(), None, ys[n].data_ptr(), n, M, n, k, 1, 2) for w, (n, k) in zip(ws, shapes)]
        return lambda keep=(xs, ys): [fn(*a) for a in args]
    return make
from specdecode.fast.linear import PackedLinear
for dtn, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    if not want or "PackedLinear-" + dtn in want:
        pl = [PackedLinear(w.to(dt), None) for w in W32]
        add("PackedLinear-" + dtn, NB16 * (2 if dt == torch.float32 else 1), torch_method(pl, dt, lambda x, w: w(x)))
for kind in ("amx", "avx512bf16", "fp32"):
    if not want or "C-" + kind in want: add("C-" + kind, 2 * NB16 if kind == "fp32" else NB16, custom(kind))
del W32
REPS = 11
import os
MIN = os.environ.get('STAT') == 'min'
def idle_frac(dt=0.3):
    a = [int(v) for v in open("/proc/stat").readline().split()[1:]]; time.sleep(dt)
    b = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    d = [y - x for x, y in zip(a, b)]; return (d[3] + d[4]) / max(1, sum(d))
def wait_quiet(limit=120):
    t0 = time.time()
    while idle_frac() < 0.9 and time.time() - t0 < limit: pass
    return time.time() - t0
print(f"{'method':14s} " + " ".join(f"{'M=%d' % m:>15s}" for m in [1, 2, 4, 8, 9, 16]))
res = {n: [] for n in methods}
for M in [1, 2, 4, 8, 9, 16]:
    steps = {n: mk(M) for n, (b, mk) in methods.items()}
    waited = wait_quiet()
    if waited > 1: print(f"(waited {waited:.0f}s for an idle machine)", flush=True)
    for s in steps.values(): s(); s()
    ts = {n: [] for n in steps}
    for _ in range(REPS):
        for n, s in steps.items():
            t = time.perf_counter(); s(); ts[n].append(time.perf_counter() - t)
    q = idle_frac(0.05)
    for n in steps: res[n].append(min(ts[n]) if MIN else statistics.median(ts[n]))
for n, (b, _) in methods.items():
    print(f"{n:14s} " + " ".join(f"{t*1e3:6.1f}ms {b/t/1e9:4.1f}GB/s" for t in res[n]), flush=True)
