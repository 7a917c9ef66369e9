"""Quantized weights kept as stored (GGUF block formats, int8 per channel) and their native matmul.

``QuantWeight`` is a weight matrix [out, in] held as the file's own bytes, possibly in several
row segments of different formats (a fused q|k|v projection whose v rows use another type).
``QuantLinear(weight, bias)`` computes ``x @ W.T + b`` for bf16 activations with ``quant.c``:
it never expands the weights in memory, and every output row is computed exactly as in a
one-row call (batch invariant, like ``PackedLinear``).

    qw = QuantWeight.from_blocks(ggml_type, raw_uint8_rows, (out, in))
    lin = QuantLinear(QuantWeight.cat([q, k, v]), bias)
    y = lin(x)            # x [..., in] bf16 -> y [..., out] bf16
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import linear as _lin

__all__ = ["QuantWeight", "QuantLinear", "NATIVE_TYPES", "quantize_int8", "type_name", "repacks16", "qamx_min_rows"]

# ggml type ids (gguf.GGMLQuantizationType) the native kernel reads; I8 is our int8 per channel
I8 = 1000
NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
                14: "Q6_K", 39: "MXFP4", I8: "I8"}
_BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
          13: (256, 176), 14: (256, 210), 39: (32, 17)}
MAX_SEGMENTS = 4  # SD_QSEG in quant.c
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
DEQUANT_ROWS = 4096   # rows QuantWeight.dequantize expands to fp32 at a time (scratch: this x in_features x 4 B)
# type -> (its 16-column interleaved type, bytes per 16 columns x 256 k)
INTERLEAVED = {12: (1012, 2368), 14: (1014, 3360), 2: (1002, 288 * 8), 3: (1003, 320 * 8), 6: (1006, 352 * 8),
               7: (1007, 384 * 8), 8: (1008, 544 * 8)}


def type_name(qtype: int) -> str:
    if qtype in NATIVE_TYPES:
        return NATIVE_TYPES[qtype]
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(qtype).name
    except Exception:
        return f"type {qtype}"


def row_bytes(qtype: int, in_features: int) -> int:
    if qtype == I8:
        return 4 + in_features
    block, size = _BLOCK[qtype]
    if in_features % block:
        raise ValueError(f"{type_name(qtype)} rows need in_features % {block} == 0, got {in_features}")
    return in_features // block * size


@dataclass
class QuantWeight:
    """A [out, in] weight as raw quantized rows: segments[i] = (ggml type, uint8 [rows_i, row_bytes]).
    `mapped`: the segments are views of a memory-mapped model file (read in place, not copied);
    QuantLinear gives their pages back once it has repacked them (`release_pages`)."""
    segments: list[tuple[int, Tensor]]
    in_features: int
    mapped: bool = False

    @classmethod
    def from_blocks(cls, qtype: int, data, shape: tuple[int, int], mapped: bool = False) -> QuantWeight:
        out, inp = int(shape[0]), int(shape[1])
        if qtype not in NATIVE_TYPES:
            raise ValueError(f"{type_name(qtype)} has no native kernel (native: {', '.join(NATIVE_TYPES.values())})")
        raw = torch.as_tensor(np.ascontiguousarray(data)).view(torch.uint8).reshape(out, row_bytes(qtype, inp))
        return cls([(qtype, raw)], inp, mapped)

    @classmethod
    def cat(cls, weights: list[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (q|k|v, gate|up), without copying: each part stays a segment of its
        own (`runs` groups those of one type, as the kernel reads them)."""
        if len({w.in_features for w in weights}) != 1:
            raise ValueError("QuantWeight.cat: different in_features")
        return cls([seg for w in weights for seg in w.segments], weights[0].in_features,
                   all(w.mapped for w in weights))

    def runs(self) -> list[tuple[int, list[Tensor]]]:
        """Consecutive segments of one type grouped: (ggml type, [uint8 [rows_i, row_bytes]]), one
        kernel segment each."""
        runs: list[tuple[int, list[Tensor]]] = []
        for qtype, data in self.segments:
            if runs and runs[-1][0] == qtype:
                runs[-1][1].append(data)
            else:
                runs.append((qtype, [data]))
        return runs

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(d.shape[0] for _, d in self.segments), self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.segments)

    def type_names(self) -> str:
        return "+".join(type_name(t) for t, _ in self.runs())

    def permute_rows(self, order: Tensor) -> QuantWeight:
        """Rows reordered (one segment only): llama.cpp's q/k row permutation undone."""
        if len(self.segments) != 1:
            raise ValueError("permute_rows needs a single segment")
        qtype, data = self.segments[0]
        return QuantWeight([(qtype, data[order].contiguous())], self.in_features)

    def select_rows(self, ids: Tensor) -> QuantWeight:     # ids [n] int64, ascending
        """The rows `ids` (ascending) as stored, each segment's kept in order (a reduced LM head)."""
        segs, first = [], 0
        for qtype, data in self.segments:
            mine = ids[(ids >= first) & (ids < first + data.shape[0])] - first
            if mine.numel():
                segs.append((qtype, data[mine].contiguous()))
            first += data.shape[0]
        return QuantWeight(segs, self.in_features)

    def flat_sample(self, stride: int, count: int) -> Tensor:
        """Elements 0, stride, 2*stride, ... (at most count) of the flattened exact weights, fp32,
        dequantizing only the rows they lie in."""
        K = self.in_features
        idx = torch.arange(0, self.shape[0] * K, stride)[:count]
        rows, inverse = torch.unique(idx // K, return_inverse=True)
        starts = torch.tensor([0] + [d.shape[0] for _, d in self.segments]).cumsum(0)
        picked = []
        for i, (qtype, data) in enumerate(self.segments):
            mine = rows[(rows >= starts[i]) & (rows < starts[i + 1])]
            picked.append(QuantWeight([(qtype, data[mine - starts[i]])], K).dequantize())
        dense = torch.cat(picked)                                   # [len(rows), K]
        return dense[inverse, idx % K]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The exact weights [out, in] (reference / fallback), in `dtype`. Rows are dequantized to
        fp32 DEQUANT_ROWS at a time, so that a vocabulary-sized embedding read into bf16 never holds
        its whole fp32 expansion."""
        out = torch.empty(self.shape[0], self.in_features, dtype=dtype)             # [out, in]
        row = 0
        for qtype, data in self.segments:
            for first in range(0, data.shape[0], DEQUANT_ROWS):
                chunk = data[first:first + DEQUANT_ROWS]
                out[row + first:row + first + chunk.shape[0]] = self._dequantize_rows(qtype, chunk)
            row += data.shape[0]
        return out

    def _dequantize_rows(self, qtype: int, data: Tensor) -> Tensor:      # uint8 [rows, row_bytes] -> fp32 [rows, in]
        lib = _quant_lib() if native_reason() is None else None
        if lib is not None:       # the same float operations as gguf's numpy dequantize, in C
            out = torch.empty(data.shape[0], self.in_features, dtype=torch.float32)
            if lib.sd_qdequant(data.data_ptr(), qtype, data.shape[1], self.in_features, data.shape[0],
                               out.data_ptr(), torch.get_num_threads()) == 0:
                return out
        if qtype == I8:
            scale = data[:, :4].contiguous().view(torch.float32)            # [rows, 1]
            return data[:, 4:].contiguous().view(torch.int8).float() * scale
        from gguf.quants import dequantize
        arr = dequantize(data.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(data.shape[0], -1)


def release_pages(data: Tensor) -> None:
    """Drop the whole pages inside a tensor that views a memory-mapped file from this process's
    resident memory (madvise MADV_DONTNEED): the page cache keeps them, and a later read maps them
    again from the file. Only for file views (QuantWeight.mapped): on anonymous memory it would zero them."""
    libc = _lin._libc()
    if libc is None or data.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = -(-data.data_ptr() // page) * page
    end = (data.data_ptr() + data.numel() * data.element_size()) // page * page
    if end > start:
        libc.madvise(start, end - start, MADV_DONTNEED)


def quantize_int8(weight: Tensor) -> QuantWeight:
    """Symmetric int8 per output channel (row): scale = max|row| / 127, round to nearest."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)   # [out, 1]
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    raw = torch.cat([scale.contiguous().view(torch.uint8).reshape(w.shape[0], 4), q.view(torch.uint8)], dim=1)
    return QuantWeight([(I8, raw.contiguous())], w.shape[1])


class _QMat(ctypes.Structure):  # must match sd_qmat in quant.c
    _fields_ = [("N", ctypes.c_int), ("K", ctypes.c_int), ("nseg", ctypes.c_int),
                ("type", ctypes.c_int * MAX_SEGMENTS), ("n_end", ctypes.c_int * MAX_SEGMENTS),
                ("data", ctypes.c_void_p * MAX_SEGMENTS), ("row_bytes", ctypes.c_long * MAX_SEGMENTS)]


@functools.cache
def _quant_lib():
    """The kernel library with the quantized entry points' signatures set (once)."""
    lib = _lin._load()["lib"]
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.sd_qlinear.argtypes = [P, P, I, P, P, I, I, I, I]
    lib.sd_qlinear.restype = I
    lib.sd_repack16.argtypes = [I, P, L, I, L, P]
    lib.sd_repack16.restype = None
    lib.sd_qdequant.argtypes = [P, I, L, I, L, P, I]
    lib.sd_qdequant.restype = I
    return lib


def repacks16(qtype: int, start: int, end: int, in_features: int) -> bool:
    """Whether rows start..end of a weight in format `qtype` are repacked 16 columns at a time at load
    (quant16.c; the layout the AMX int8 tiles also read): a 16-aligned row range, in_features % 256 == 0
    for the K formats, and not SPECDECODE_Q16=0."""
    return (qtype in INTERLEAVED and not start % 16 and not end % 16
            and not (qtype in (12, 14) and in_features % 256) and os.environ.get("SPECDECODE_Q16", "1") != "0")


@functools.cache
def qamx_min_rows() -> int:
    """The row count from which a pass runs the 16-column layouts on AMX int8 tiles (QAMX_MIN_ROWS in quant.c)."""
    match = re.search(r"#define QAMX_MIN_ROWS (\d+)", Path(__file__).with_name("quant.c").read_text())
    return int(match.group(1)) if match else 0


def native_reason() -> str | None:
    """None if the quantized kernels can run here, else why not."""
    st = _lin._load()
    if st["lib"] is None:
        return f"native kernels unavailable: {st['reason']}"
    return None          # AVX512 BF16 / VNNI / BW / VL natively, or emulated through SIMDe (linear._load)


class QuantLinear:
    """y = x @ W.T + bias with W a QuantWeight, computed natively from the quantized blocks
    (bf16 activations and output, fp32 accumulation). Without the native kernel it dequantizes
    once to bf16 and uses F.linear."""

    dtype = torch.bfloat16

    def __init__(self, weight: QuantWeight, bias: Tensor | None = None):
        self.weight_q = weight
        self.out_features, self.in_features = weight.shape
        self.Kp = self.in_features
        self.bias32 = None if bias is None else bias.detach().float().contiguous()  # [out] fp32
        runs = weight.runs()
        # the parts of a run in a format never repacked (MXFP4, Q5_K, I8) stay apart, each a kernel segment
        # read where it lies (an expert's gate|up: two views of the file) rather than one concatenated copy
        apart = [run for qtype, parts in runs
                 for run in ([(qtype, parts)] if qtype in INTERLEAVED else [(qtype, [part]) for part in parts])]
        runs = apart if len(apart) <= MAX_SEGMENTS else runs
        self.fast = native_reason() is None and len(runs) <= MAX_SEGMENTS
        if not self.fast:
            self.weight = weight.dequantize(torch.bfloat16)
            self.bias = None if bias is None else bias.to(torch.bfloat16)
            return
        self._lib = _quant_lib()
        m = _QMat(N=self.out_features, K=self.in_features, nseg=len(runs))
        end = 0
        self._packed = []     # the kernel's copies of the runs: 16-column interleaved or concatenated
        for i, (qtype, parts) in enumerate(runs):
            start, end = end, end + sum(part.shape[0] for part in parts)
            qtype, data = self._interleave(qtype, parts, start, end)
            m.type[i], m.n_end[i], m.data[i], m.row_bytes[i] = qtype, end, data.data_ptr(), data.shape[-1]
        if weight.mapped:       # what the kernel reads from the file is read there; the repacked rest not again
            for _, data in weight.segments:
                if not any(data.data_ptr() == m.data[i] for i in range(len(runs))):
                    release_pages(data)
        self.qmat = m
        self.qmat_ref = ctypes.byref(m)

    def _interleave(self, qtype: int, parts: list[Tensor], start: int, end: int) -> tuple[int, Tensor]:
        """A run's rows repacked 16 columns at a time (lossless, same size; see quant16.c) where
        repacks16 says so, part by part into one buffer (16 rows of a part are 16 rows of the run:
        every part of a run starts on a 16-row boundary or the run is not repacked); else one part
        as stored (a file's rows read in place), several concatenated."""
        K = self.in_features
        bounds = np.cumsum([start] + [part.shape[0] for part in parts])     # each part's first row, and the end
        if not (repacks16(qtype, start, end, K) and not (bounds % 16).any()):
            if len(parts) == 1:
                return qtype, parts[0]
            self._packed.append(torch.cat(parts))
            return qtype, self._packed[-1]
        row_bytes = K * INTERLEAVED[qtype][1] // 256
        packed = _lin.weight_empty((end - start) // 16 * row_bytes, torch.uint8).view((end - start) // 16, row_bytes)
        row = 0
        for part in parts:       # a mapped file's rows in chunks, each chunk's pages given back once repacked
            step = DEQUANT_ROWS if self.weight_q.mapped else part.shape[0]
            for first in range(0, part.shape[0], step):
                chunk = part[first:first + step]
                self._lib.sd_repack16(qtype, chunk.data_ptr(), part.shape[1], K, chunk.shape[0],
                                      packed[row // 16].data_ptr())
                if self.weight_q.mapped:
                    release_pages(chunk)
                row += chunk.shape[0]
        self._packed.append(packed)
        return INTERLEAVED[qtype][0], packed

    @property
    def nbytes(self) -> int:
        return self.weight_q.nbytes

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:  # x[..., in] -> [..., out] bf16
        if not self.fast:
            return F.linear(x.to(torch.bfloat16), self.weight, self.bias)
        lead, K, N = x.shape[:-1], self.in_features, self.out_features
        x2 = x.to(torch.bfloat16).reshape(-1, K).contiguous()   # [M, K]
        M = x2.shape[0]
        y = torch.empty(M, N, dtype=torch.bfloat16) if out is None else out  # [M, N]
        if M:
            b = self.bias32.data_ptr() if self.bias32 is not None else None
            if self._lib.sd_qlinear(self.qmat_ref, x2.data_ptr(), K, b, y.data_ptr(), N, M, 1, torch.get_num_threads()):
                raise ValueError("sd_qlinear rejected its arguments")
        return y.view(*lead, N)
