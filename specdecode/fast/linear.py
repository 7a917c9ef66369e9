"""Fast small-batch linear layers for CPU decoding (batch 1, 1..16 token rows).

PyTorch's CPU GEMV for a handful of rows reaches well below the memory bandwidth (bf16 worse than
fp32; specdecode/fast/README.md, "Results").  ``PackedLinear`` repacks a weight once into a blocked
layout and calls a tiny native kernel (``kernels.c`` beside this file) through ctypes:

    bf16 weights:  AMX tiles (any row count), else AVX512-BF16; fp32 accumulation
    fp32 weights:  AVX512F FMA

The C file is compiled lazily on first use with the system C compiler into
``~/.cache/specdecode/kernels/<hash>.so`` (hash of source + flags + compiler).  If anything is
missing -- x86 CPU flags, a compiler, a supported dtype -- ``PackedLinear`` falls back to
``F.linear`` and ``reason()`` says why.  Set ``SPECDECODE_FAST=0`` to force the fallback.

Numerics: bf16*bf16 products are exact in fp32 and accumulated in fp32, so outputs equal an
fp32-accumulated matmul up to summation order; bf16 outputs are rounded to nearest-even.

    lin = PackedLinear(weight, bias)      # weight[out, in], bias[out] or None
    y = lin(x)                            # x[..., in] -> y[..., out], dtype of the weight
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PackedLinear", "available", "reason", "self_check", "isa", "kernel_plan", "cpu_flags",
           "cpu_field", "kernel_cache", "features"]

_SRC = Path(__file__).with_name("kernels.c")
_SOURCES = (_SRC, *(_SRC.with_name(n) for n in ("decoder.c", "decoder_moe.c", "decoder_ops.c", "decoder_attn.c",
                                                  "quant.c", "quant16.c", "quant16_amx.c", "quant_dequant.c",
                                                  "avx512_compat.h", "quant16_avx2.c", "deltanet.c",
                                                  "rowops.c", "hybrid.c")))  # #included
# -mamx-*: the AMX kernels compile on any x86 CPU; they only run where the CPU has AMX (checked at load)
_CFLAGS = ["-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-fopenmp", "-shared", "-fPIC",
           "-std=gnu11", "-ffp-contract=off", "-Wno-psabi"]
# CPUs without (all of) AVX512 compile the same kernels through SIMDe (avx512_compat.h): its headers
# come from Debian's libsimde-dev (/usr/include/simde) or SPECDECODE_SIMDE_INCLUDE=DIR
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_CACHE = Path(os.environ.get("SPECDECODE_KERNEL_CACHE", "~/.cache/specdecode/kernels")).expanduser()
# bf16 uses AMX for every row count when available: each output row is then bitwise identical
# whether computed alone or in a block (AVX512-BF16 at M=1 sums in another order than AMX), which
# keeps greedy speculative decoding identical to plain decoding.  AVX512-BF16 (also row invariant,
# but not equal to AMX) is only the fallback for CPUs without AMX.
AMX_MIN_ROWS = 1

_state: dict = {}  # lazily filled by _load(): lib, amx, bf16, fp32, reason


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def cpu_field(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo, e.g. "model name" ("" where there is none)."""
    return _cpuinfo(field)


def cpu_label() -> str:
    """The CPU as figures should name it: model name, with the family and model numbers that tell
    its generation (e.g. "AMD EPYC (family 26, model 2)"); the platform's name off Linux."""
    import platform
    name = cpu_field("model name") or platform.processor() or platform.machine()
    family, model = cpu_field("cpu family"), cpu_field("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo names them (avx512f, avx512_vnni, amx_int8, ...)."""
    return _cpu_flags()


def kernel_cache() -> Path:
    """Where the compiled kernel libraries are kept (SPECDECODE_KERNEL_CACHE)."""
    return _CACHE


def kernel_plan(flags: set[str] | None = None) -> dict:
    """Which kernel build a CPU with `flags` (/proc/cpuinfo names; default this CPU's) gets, decided
    as _load() decides it, without compiling or loading anything: {"isa": "avx512" (every AVX512
    feature native) | "avx2" (the missing ones emulated through SIMDe) | "none" (eager torch),
    "emulated": [flags], "amx_bf16": bool, "amx_int8": bool (AMX tiles for quantized passes of
    several rows; SPECDECODE_QAMX=0 turns them off), "reason": why "none", else "ok"}. AMX also
    needs the OS's permission, which only loading the kernels asks for (reason() then says)."""
    flags = _cpu_flags() if flags is None else set(flags)
    plan = {"isa": "none", "emulated": [f for f in _AVX512_FLAGS if f not in flags], "amx_bf16": False,
            "amx_int8": False, "reason": "ok"}
    missing = [f for f in _AVX2_FLAGS if f not in flags]
    if os.environ.get("SPECDECODE_FAST", "1") == "0":
        plan["reason"] = "disabled by SPECDECODE_FAST=0"
    elif missing:
        plan["reason"] = f"CPU lacks {', '.join(missing)} (the kernels need AVX512, or AVX2 + FMA + F16C)"
    elif plan["emulated"] and not _simde_available():
        plan["reason"] = (f"CPU lacks {', '.join(plan['emulated'])}: the kernels then compile through SIMDe, whose "
                          f"headers are missing (apt install libsimde-dev, or SPECDECODE_SIMDE_INCLUDE=DIR)")
    else:
        plan["isa"] = "avx2" if plan["emulated"] else "avx512"
        plan["amx_bf16"] = "avx512_bf16" in flags and {"amx_tile", "amx_bf16"} <= flags
        plan["amx_int8"] = (plan["amx_bf16"] and "amx_int8" in flags
                            and os.environ.get("SPECDECODE_QAMX", "1") != "0")
    return plan


# Software prefetch (PREFETCHT2, this many bytes ahead of each weight block) in the quantized kernels,
# on Intel CPUs and AMD Zen 5 (family 26) and later: there it shortens passes whose weights stream from
# memory (weights that sit in cache gain nothing). On older AMD cores the hardware prefetcher alone beat
# a PREFETCHT0 build and PREFETCHT2 is untried, so they keep 0 (docs/models.md, "What was tried";
# specdecode/fast/README.md, "Prefetch and unrolled rows").
QPREFETCH_BYTES = 2048


def _qprefetch_bytes() -> int:
    """How far ahead the quantized kernels prefetch weights (0 = not at all): SPECDECODE_QPREFETCH,
    by default QPREFETCH_BYTES on Intel CPUs and AMD family 26 (Zen 5) or later, 0 elsewhere."""
    value = os.environ.get("SPECDECODE_QPREFETCH")
    if value is None:
        vendor, family = _cpuinfo("vendor_id"), _cpuinfo("cpu family")
        if vendor == "GenuineIntel" or (vendor == "AuthenticAMD" and family.isdigit() and int(family) >= 26):
            return QPREFETCH_BYTES
        return 0
    return int(value) if value.isdigit() else 0


def _compile() -> Path:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = _CFLAGS + [f"-DSD_QPREFETCH={_qprefetch_bytes()}"]
    sources = b"".join(p.read_bytes() for p in _SOURCES)
    key = hashlib.sha256(sources + " ".join(flags + [cc, version]).encode()).hexdigest()[:16]
    so = _CACHE / f"kernels-{key}.so"
    if so.exists():
        return so
    _CACHE.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_CACHE)  # build then rename: safe vs. races
    os.close(fd)
    include = os.environ.get("SPECDECODE_SIMDE_INCLUDE")
    r = subprocess.run([cc, *flags, *([f"-I{include}"] if include else []), str(_SRC), "-o", tmp],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compile failed: {r.stderr.strip()[:500]}")
    os.replace(tmp, so)
    return so


def kernel_id() -> str:
    """Which native kernel build computes here ('' when none is loaded): results are bitwise
    reproducible for one build, so caches of computed keys and values name it."""
    lib = _state.get("lib")
    return Path(lib._name).stem if lib is not None else ""


def _load() -> dict:
    if _state:
        return _state
    st = {"lib": None, "amx": False, "bf16": False, "fp32": False, "reason": "ok"}
    _state.update(st)
    flags = _cpu_flags()
    plan = kernel_plan(flags)
    if plan["isa"] == "none":
        _state["reason"] = plan["reason"]
        return _state
    emulated = plan["emulated"]
    try:
        lib = ctypes.CDLL(str(_compile()))  # torch is imported first, so libgomp is shared
    except (RuntimeError, OSError) as e:
        _state["reason"] = str(e)
        return _state
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.sd_pack_bf16.argtypes = [P, P, I, I, I, I]
    lib.sd_pack_fp32.argtypes = [P, P, I, I, I]
    for f in (lib.sd_linear_bf16_amx, lib.sd_linear_bf16_avx512):
        f.argtypes = [P, I, P, P, P, I, I, I, I, I, I]
        f.restype = None
    lib.sd_linear_fp32.argtypes = [P, I, P, P, P, I, I, I, I, I]
    lib.sd_linear_fp32.restype = None
    lib.sd_isa.restype = I
    _state["lib"] = lib
    _state["fp32"] = True
    _state["bf16"] = True      # AVX512-BF16, or its emulation through SIMDe (the same lane semantics)
    _state["isa"] = "avx512" if lib.sd_isa() == 2 else "avx2"
    _state["emulated"] = emulated
    # AMX needs the CPU flags (kernel_plan) *and* the kernel's permission (arch_prctl XCOMP_PERM).
    _state["amx"] = plan["amx_bf16"] and lib.sd_amx_init() == 0
    # Quantized weights on AMX int8 tiles for passes of several rows (bitwise equal to the VNNI kernels;
    # SPECDECODE_QAMX=0 keeps VNNI, e.g. to compare the two)
    lib.sd_q_amx.argtypes = [I]
    lib.sd_q_amx.restype = I
    _state["qamx"] = bool(lib.sd_q_amx(int(_state["amx"] and plan["amx_int8"])))
    return _state


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def weight_empty(numel: int, dtype: torch.dtype) -> Tensor:
    """torch.empty(numel) for packed weights, asked to live on 2 MB transparent huge pages (Linux
    madvise(MADV_HUGEPAGE), before the first write): a decode step streams every weight byte once, and
    with 4 KB pages each page ends the hardware prefetcher's run and costs a TLB miss, which lowers the
    bandwidth a step reaches (specdecode/fast/README.md, "Huge pages"). Where the kernel says no (THP
    "never", not Linux) it is a plain torch.empty. SPECDECODE_HUGEPAGES=0 turns it off."""
    size = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * size
    libc = _libc()
    if nbytes < 4 * _HUGE_PAGE or libc is None or os.environ.get("SPECDECODE_HUGEPAGES", "1") == "0":
        return torch.empty(numel, dtype=dtype)
    buf = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)      # untouched: malloc maps it lazily
    off = -buf.data_ptr() % _HUGE_PAGE
    libc.madvise(buf.data_ptr() + off, (nbytes + _HUGE_PAGE - off) // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf[off:off + nbytes].view(dtype)                        # the view keeps buf alive


def zeroed_empty(numel: int, dtype: torch.dtype) -> Tensor:
    """torch.zeros(numel) whose pages become resident only when first written: a fresh anonymous mapping
    (the kernel maps a zero page on first touch), on 2 MB pages as weight_empty asks. A KV pool sized for
    a whole context then holds memory for the blocks in use, not its capacity. Small sizes (and with
    SPECDECODE_HUGEPAGES=0 too) a plain torch.zeros."""
    import mmap
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    libc = _libc()
    if nbytes < 4 * _HUGE_PAGE or libc is None or os.environ.get("SPECDECODE_HUGEPAGES", "1") == "0":
        return torch.zeros(numel, dtype=dtype)
    buf = torch.frombuffer(mmap.mmap(-1, nbytes + _HUGE_PAGE), dtype=torch.uint8)   # keeps the mapping alive
    off = -buf.data_ptr() % _HUGE_PAGE
    libc.madvise(buf.data_ptr() + off, (nbytes + _HUGE_PAGE - off) // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return buf[off:off + nbytes].view(dtype)


def _simde_available() -> bool:
    include = os.environ.get("SPECDECODE_SIMDE_INCLUDE")
    roots = [Path(include)] if include else [Path("/usr/include"), Path("/usr/local/include")]
    return any((root / "simde" / "x86" / "avx512.h").is_file() for root in roots)


def isa() -> str:
    """Which kernels run: 'avx512' (native), 'avx2' (the AVX512 kernels through SIMDe) or 'none'."""
    st = _load()
    return st.get("isa", "none") if st["lib"] is not None else "none"


def features() -> dict:
    """What loaded (compiling the kernels on first use): {"isa": as isa(), "amx": AMX bf16 tiles usable
    (flags and the OS's permission), "qamx": quantized passes of several rows on AMX int8 tiles,
    "reason": as reason()}."""
    st = _load()
    return {"isa": isa(), "amx": bool(st["amx"]), "qamx": bool(st.get("qamx", False)), "reason": reason()}


def available() -> bool:
    """True if the native kernel loaded (at least the fp32 path)."""
    return _load()["lib"] is not None


def reason() -> str:
    """Why the fast path is (partly) unavailable, or 'ok'."""
    st = _load()
    if st["reason"] != "ok":
        return st["reason"]
    if st.get("emulated"):
        return f"ok (AVX2: {', '.join(st['emulated'])} emulated through SIMDe)"
    return "ok" + ("" if st["amx"] else " (no AMX)")


class PackedLinear:
    """y = x @ weight.T + bias with the weight pre-packed for the native small-M kernel.

    weight: [out, in] bf16 or fp32 (kept only if the fallback is used); bias: [out] or None.
    Inputs of another dtype are cast to the weight dtype; the output has the weight dtype.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        assert weight.dim() == 2
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        st = _load()
        self.fast = weight.device.type == "cpu" and (
            (self.dtype == torch.bfloat16 and st["bf16"]) or (self.dtype == torch.float32 and st["fp32"])
        )
        if not self.fast:
            self.weight = weight
            self.bias = None if bias is None else bias.to(self.dtype)
            return
        N, K = weight.shape
        self.Np = (N + 31) // 32 * 32  # 32 output columns per packed group
        self.Kp = (K + 31) // 32 * 32 if self.dtype == torch.bfloat16 else K
        w = weight.detach().contiguous()
        self.wp = weight_empty(self.Np * self.Kp, self.dtype)  # blocked, see kernels.c
        if self.dtype == torch.bfloat16:
            st["lib"].sd_pack_bf16(w.data_ptr(), self.wp.data_ptr(), N, K, self.Np, self.Kp)
        else:
            st["lib"].sd_pack_fp32(w.data_ptr(), self.wp.data_ptr(), N, K, self.Np)
        self.bias32 = None if bias is None else bias.detach().float().contiguous()  # [out] fp32
        self._lib, self._amx = st["lib"], st["amx"]

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:  # x[..., in] -> [..., out]
        if not self.fast:
            return F.linear(x.to(self.dtype), self.weight, self.bias)
        K, N = self.in_features, self.out_features
        lead = x.shape[:-1]
        # cheap checks first: the common decode case (2-D, contiguous, right dtype) does no copies
        x2 = x if x.dtype is self.dtype else x.to(self.dtype)
        if x2.dim() != 2:
            x2 = x2.reshape(-1, K)  # [M, K]
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.Kp != K:  # bf16 kernels consume k in blocks of 32: zero-pad the activations
            x2 = F.pad(x2, (0, self.Kp - K))
        M = x2.shape[0]
        y = torch.empty(M, N, dtype=self.dtype) if out is None else out  # [M, N] contiguous
        if M == 0:
            return y.view(*lead, N)
        b = self.bias32.data_ptr() if self.bias32 is not None else None
        nt = torch.get_num_threads()
        if self.dtype is torch.float32:
            self._lib.sd_linear_fp32(x2.data_ptr(), self.Kp, self.wp.data_ptr(), b, y.data_ptr(),
                                     N, M, N, self.Kp, nt)
        else:
            fn = self._lib.sd_linear_bf16_amx if (self._amx and M >= AMX_MIN_ROWS) \
                else self._lib.sd_linear_bf16_avx512
            fn(x2.data_ptr(), self.Kp, self.wp.data_ptr(), b, y.data_ptr(), N, M, N, self.Kp, 1, nt)
        return y if x.dim() == 2 else y.view(*lead, N)


def self_check(verbose: bool = False) -> bool:
    """Compare every kernel path against an fp64 reference on awkward shapes. Returns True/False."""
    g = torch.Generator().manual_seed(0)
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for N, K in [(960, 576), (576, 1536), (40, 70), (17, 32), (1, 5)]:
            w = torch.randn(N, K, generator=g).to(dtype)
            b = torch.randn(N, generator=g).to(dtype).float()  # exact in the weight dtype
            lin = PackedLinear(w, b)
            for M in (1, 2, 3, 9, 16, 17, 33):
                x = torch.randn(2, M, K, generator=g).to(dtype)  # leading dims are flattened
                ref = x.double() @ w.double().t() + b.double()
                y = lin(x)
                # fp32 sum-order slack: K * eps * sum|x*w|; bf16 output adds one rounding
                slack = K * 2**-23 * (x.double().abs() @ w.double().abs().t() + b.abs().double())
                if dtype == torch.bfloat16:
                    slack = slack + ref.abs() * 2**-8
                err = (y.double() - ref).abs()
                good = y.shape == ref.shape and y.dtype == dtype and bool((err <= slack + 1e-6).all())
                ok &= good
                if verbose or not good:
                    print(f"{str(dtype):15s} N={N:4d} K={K:4d} M={M:2d} fast={lin.fast} "
                          f"maxerr={err.max().item():.2e} {'ok' if good else 'FAIL'}")
    return ok


if __name__ == "__main__":
    print("available:", available(), "| reason:", reason())
    print("self_check:", "PASS" if self_check() else "FAIL")
