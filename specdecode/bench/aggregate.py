"""From per-prompt measurements to the `rows` of results.json (schema in specdecode/bench/README.md).

One row per system x method x k x task, plus the pseudo-tasks "all" (every prompt) and,
when both Spec-Bench and other tasks were measured, "spec_bench" (the six Spec-Bench tasks).
Ratios are Spec-Bench style: the mean of per-prompt tokens/s of the cell over the mean of
the reference cell, on the prompts both measured.
"""
from __future__ import annotations

from statistics import mean, median

from ..datasets import SPEC_BENCH_TASKS

PLAIN = "plain"


def _key(r: dict) -> tuple:
    return (r["system"], r["method"], int(r["k"]))


def _ratio(records: list[dict], reference: dict[str, dict]) -> float | None:
    common = [r for r in records if r["prompt_id"] in reference]
    if not common:
        return None
    ref = mean(reference[r["prompt_id"]]["tokens_per_s"] for r in common)
    return mean(r["tokens_per_s"] for r in common) / ref if ref > 0 else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _identical(records: list[dict], reference: dict[str, dict], gaps: dict) -> tuple[float | None, dict | None, int]:
    common = [r for r in records if r["prompt_id"] in reference]
    if not common:
        return None, None, 0
    first, count = None, 0
    for r in common:
        ref_ids = reference[r["prompt_id"]]["token_ids"]
        pos = first_difference(ref_ids, r["token_ids"])
        if pos is None:
            continue
        count += 1
        if first is None:
            first = {"task": r["task"], "prompt_id": r["prompt_id"].split("/", 1)[1], "position": pos,
                     "plain_token": ref_ids[pos] if pos < len(ref_ids) else None,
                     "token": r["token_ids"][pos] if pos < len(r["token_ids"]) else None}
            gap = gaps.get((_key(r), r["task"], r["prompt_id"].split("/", 1)[1]))
            if gap:
                first.update({k: gap[k] for k in ("gap", "top1_top2_gap") if k in gap})
    return (len(common) - count) / len(common), first, count


def _spec_stats(records: list[dict]) -> dict:
    """Speculation counters, only where every record carries them."""
    out: dict = {"mean_accepted_length": None, "acceptance_rate": None, "acceptance_per_position": None,
                 "time_share": None, "tree_nodes_mean": None}
    if all(r.get("steps") for r in records):
        emitted = sum(r.get("emitted", r["tokens"]) for r in records)
        out["mean_accepted_length"] = emitted / sum(r["steps"] for r in records)
        if all("nodes" in r for r in records):     # draft nodes verified per step (a chain's tokens)
            out["tree_nodes_mean"] = sum(r["nodes"] for r in records) / sum(r["steps"] for r in records)
    if all("drafted_per_position" in r for r in records):
        drafted = sum(r["drafted"] for r in records)
        out["acceptance_rate"] = sum(r["accepted"] for r in records) / drafted if drafted else None
        width = max((len(r["drafted_per_position"]) for r in records), default=0)
        rates = []
        for i in range(width):
            d = sum(r["drafted_per_position"][i] for r in records if i < len(r["drafted_per_position"]))
            a = sum(r["accepted_per_position"][i] for r in records if i < len(r["accepted_per_position"]))
            rates.append(a / d if d else None)
        out["acceptance_per_position"] = rates
        total = sum(r["total_s"] for r in records)
        if total > 0:
            share = {name: sum(r[f"{name}_s"] for r in records) / total for name in ("draft", "verify", "prefill")}
            share["other"] = max(0.0, 1.0 - sum(share.values()))
            out["time_share"] = share
    return out


def _mean_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def build_rows(records: list[dict], tasks: list[str], greedy: bool) -> list[dict]:
    """Aggregate measurement records into rows (see the module docstring)."""
    gaps = {(_key(r), r["task"], str(r["prompt_id"])): r for r in records if r.get("type") == "divergence"}
    measured = [r for r in records if r.get("type", "measurement") == "measurement"]
    groups: dict[str, list[str]] = {t: [t] for t in tasks if any(r["task"] == t for r in measured)}
    present = list(groups)
    groups["all"] = present
    bench_tasks = [t for t in present if t in SPEC_BENCH_TASKS]
    if bench_tasks and len(bench_tasks) < len(present):
        groups["spec_bench"] = bench_tasks
    cells = list(dict.fromkeys(_key(r) for r in measured))
    rows = []
    for task, members in groups.items():
        in_task = [r for r in measured if r["task"] in members]
        # prompt ids are unique within a task; qualify them so that "all" never mixes two prompts
        by_cell: dict[tuple, dict[str, dict]] = {}
        for r in in_task:
            by_cell.setdefault(_key(r), {})[f"{r['task']}/{r['prompt_id']}"] = r
        for cell in cells:
            if cell not in by_cell:
                continue
            system, method, k = cell
            own = [dict(r, prompt_id=pid) for pid, r in by_cell[cell].items()]
            plain = by_cell.get((system, PLAIN, 0), {})
            hf_plain = by_cell.get(("transformers", PLAIN, 0), {})
            row = {"system": system, "method": method, "k": k, "task": task, "prompts": len(own),
                   "tokens": sum(r["tokens"] for r in own),
                   "tokens_per_s": mean(r["tokens_per_s"] for r in own),
                   "tokens_per_s_total": (sum(r["tokens"] for r in own) / sum(r["seconds"] for r in own))
                   if sum(r["seconds"] for r in own) > 0 else None,
                   "speedup": 1.0 if method == PLAIN else _ratio(own, plain),
                   "speedup_vs_transformers_plain": _ratio(own, hf_plain),
                   "ttft_s": _mean_or_none([r.get("ttft_s") for r in own]),
                   "decode_ms_per_token": _mean_or_none([r.get("decode_ms_per_token") for r in own])}
            row.update(_spec_stats(own))
            chosen = [r["drafter"] for r in own if r.get("drafter")]
            if chosen:                   # what the drafter chose (e.g. layers skipped), as of its last prompt
                row["drafter"] = chosen[-1]
            if greedy:
                share, first, count = _identical(own, plain, gaps)
                row.update(identical_share=share, divergences=count, first_divergence=first)
                row["identical_share_vs_transformers_plain"] = _identical(own, hf_plain, {})[0]
            else:   # sampling: outputs differ by design; the distribution is what is preserved
                row.update(identical_share=None, divergences=None, first_divergence=None,
                           identical_share_vs_transformers_plain=None)
            rows.append(row)
    return rows


def roofline(run: dict, rows: list[dict], records: list[dict]) -> dict:
    """The bandwidth floor and each system's plain-decoding fraction of it (floor ms/token over
    measured decode ms/token, all tasks). The read bandwidth is probed at the start of the run
    (of each part of a resumed run) and after every prompt; it drifts with other tenants, so the
    floor is taken from the highest probe (the lowest floor: fractions are not overstated)."""
    roof = dict(run.get("roofline") or {})
    samples = start_probes(roof) + [r["read_bandwidth_gbs"] for r in records if r.get("type") == "bandwidth"]
    roof.pop("read_bandwidth_samples", None)
    floor = None
    if samples and roof.get("weight_mb"):
        roof.update(read_bandwidth_gbs=max(samples), read_bandwidth_lowest_gbs=min(samples),
                    read_bandwidth_probes=len(samples))
        floor = roof["floor_ms_per_token"] = roof["weight_mb"] / roof["read_bandwidth_gbs"]   # MB / (GB/s) = ms
    systems = {}
    own_mb = {"transformers": roof.get("transformers_mb"), "llama.cpp": roof.get("gguf_mb")}   # what each reads
    for row in rows:
        if row["task"] == "all" and row["method"] == PLAIN and row.get("decode_ms_per_token"):
            ms, name = row["decode_ms_per_token"], row["system"]
            own = floor * own_mb[name] / roof["weight_mb"] if floor and own_mb.get(name) else floor
            systems[name] = {"decode_ms_per_token": ms, "fraction_of_floor": own / ms if own else None,
                             "fraction_of_floor_paired": None}
    for system, fractions in _paired_fractions(records, roof.get("weight_mb"), own_mb).items():
        if system in systems:
            systems[system]["fraction_of_floor_paired"] = median(fractions)
    roof["systems"] = systems
    return roof


def start_probes(roof: dict) -> list[float]:
    """The bandwidth probes run.json's roofline holds (one per part of a resumed run); a run.json
    written before probes were kept as a list holds its single start probe."""
    if roof.get("read_bandwidth_samples"):
        return list(roof["read_bandwidth_samples"])
    return [roof["read_bandwidth_gbs"]] if roof.get("read_bandwidth_gbs") else []


def _paired_fractions(records: list[dict], weight_mb: float | None,
                      own_mb: dict | None = None) -> dict[str, list[float]]:
    """Per prompt, the floor from the bandwidth probe taken right after it over that prompt's
    plain decode ms/token: each generation against the bandwidth of its own minute."""
    out: dict[str, list[float]] = {}
    pending: list[dict] = []
    prompt = None
    for r in records:
        if r.get("type", "measurement") == "measurement":
            if (r["task"], r["prompt_id"]) != prompt:    # a prompt with no probe after it (a run before probes)
                pending, prompt = [], (r["task"], r["prompt_id"])
            if r["method"] == PLAIN and r.get("decode_ms_per_token"):
                pending.append(r)
        elif r.get("type") == "bandwidth" and weight_mb:
            for m in pending:
                mb = (own_mb or {}).get(m["system"]) or weight_mb
                out.setdefault(m["system"], []).append(mb / r["read_bandwidth_gbs"] / m["decode_ms_per_token"])
            pending = []
    return out


def summary(rows: list[dict]) -> dict:
    """The figures the project's goals are stated in (see benchmarks/README.md), over the
    Spec-Bench tasks when measured, else over all prompts."""
    scope = "spec_bench" if any(r["task"] == "spec_bench" for r in rows) else "all"
    top = [r for r in rows if r["task"] == scope]

    def get(system, method=None):
        return [r for r in top if r["system"] == system and (method is None or r["method"] == method)]

    out: dict = {"scope": scope}
    sd_plain, hf_plain = get("specdecode", PLAIN), get("transformers", PLAIN)
    if sd_plain and hf_plain:
        out["specdecode_plain_over_transformers_plain"] = sd_plain[0]["tokens_per_s"] / hf_plain[0]["tokens_per_s"]
    for system in ("specdecode", "transformers", "llama.cpp"):
        spec = [r for r in get(system) if r["method"] != PLAIN and r["speedup"] is not None]
        if spec:
            best = max(spec, key=lambda r: r["speedup"])
            out[f"{system}_best"] = {"method": best["method"], "k": best["k"], "speedup": best["speedup"],
                                     "tokens_per_s": best["tokens_per_s"]}
    if "specdecode_best" in out and "transformers_best" in out and out["transformers_best"]["speedup"]:
        out["specdecode_best_over_transformers_best_speedup"] = (out["specdecode_best"]["speedup"] /
                                                                 out["transformers_best"]["speedup"])
    sd_ngram, lc_ngram = get("specdecode", "ngram"), get("llama.cpp", "ngram")
    if sd_ngram and lc_ngram:
        out["specdecode_ngram_over_llamacpp_ngram_tokens_per_s"] = (max(r["tokens_per_s"] for r in sd_ngram) /
                                                                   max(r["tokens_per_s"] for r in lc_ngram))
    shares = [r["identical_share"] for r in get("specdecode") if r["method"] != PLAIN
              and r["identical_share"] is not None]
    if shares:
        out["specdecode_min_identical_share"] = min(shares)
    return out
