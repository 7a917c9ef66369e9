"""Numbers and tables of `specdecode bench serve`: per (load level, speculation arm) summaries
(TTFT, TPOT, ITL and end-to-end latency at p50/p99, request and token throughput, goodput,
failures), speculation on/off ratios, memory over time; written as results.json,
requests.jsonl (one line per request) and report.md."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from .serve_load import KINDS, Record


def percentiles(values: list[float], scale: float = 1000.0) -> dict | None:
    """mean, p50, p90, p99 (linear interpolation) of `values` times `scale`, or None when empty."""
    if not values:
        return None
    arr = np.asarray(values, dtype=float) * scale
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": round(float(arr.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3), "n": int(arr.size)}


def meets_slo(record: Record, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not record.ok:
        return False
    if slo_ttft_ms is not None and (record.ttft is None or record.ttft * 1000 > slo_ttft_ms):
        return False
    return slo_tpot_ms is None or record.tpot is None or record.tpot * 1000 <= slo_tpot_ms


def summarize(records: list[Record], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """Summary of the requests of one arm of one level; duration_s is the wall time of its rounds."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    kinds = {k: sum(r.kinds.get(k, 0) for r in ok) for k in KINDS}
    steps = kinds["recovered"] + kinds["bonus"]     # every verify step ends with exactly one of these
    duration = max(duration_s, 1e-9)
    return {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "failures": dict(Counter(r.error or "unknown" for r in failed).most_common(10)),
        "failures_by_status": dict(Counter(str(r.status) if r.status is not None else "no response" for r in failed)),
        "duration_s": round(duration_s, 6),
        "request_throughput": round(len(ok) / duration, 4),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration, 3),
        "goodput_requests": good,
        "goodput": round(good / duration, 4),
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "token_kinds": kinds,
        "tokens_per_step": round((kinds["accepted"] + steps) / steps, 4) if steps else None,
    }


def compare(off: dict, on: dict) -> dict:
    """Speculation on vs off at one load level: TPOT ratio off/on (> 1: speculation is faster)."""
    def ratio(a, b):
        return round(a / b, 4) if a is not None and b else None
    get = lambda s, key, stat: (s.get(key) or {}).get(stat)   # noqa: E731
    return {"tpot_p50_ratio_off_over_on": ratio(get(off, "tpot_ms", "p50"), get(on, "tpot_ms", "p50")),
            "tpot_mean_ratio_off_over_on": ratio(get(off, "tpot_ms", "mean"), get(on, "tpot_ms", "mean")),
            "ttft_p50_ratio_off_over_on": ratio(get(off, "ttft_ms", "p50"), get(on, "ttft_ms", "p50")),
            "output_tokens_per_s_ratio_on_over_off": ratio(on["output_tokens_per_s"], off["output_tokens_per_s"])}


def _ms(stats: dict | None) -> str:
    if not stats:
        return "–"
    return f"{stats['p50']:.1f} / {stats['p99']:.1f}"


def _bytes(value) -> str:
    if value is None:
        return "–"
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    return "–"


def _comparison_table(levels: list[dict], key: str, arm: str, label: str, title: str) -> list[str]:
    """Markdown rows of one arm against `off` at every level that has the comparison `key`."""
    compared = [lv for lv in levels if lv.get(key)]
    if not compared:
        return []
    fmt = lambda v, spec=".2f": "–" if v is None else format(v, spec)   # noqa: E731
    lines = ["", f"## {title}", "",
             f"| load | TPOT p50 off ms | TPOT p50 {label} ms | TPOT ratio off/{label} "
             f"| output tok/s ratio {label}/off |",
             "|---|---|---|---|---|"]
    for lv in compared:
        c, off, other = lv[key], lv["arms"]["off"], lv["arms"][arm]
        lines.append(f"| {lv['load']} | {fmt((off['tpot_ms'] or {}).get('p50'), '.1f')} "
                     f"| {fmt((other['tpot_ms'] or {}).get('p50'), '.1f')} | {fmt(c['tpot_p50_ratio_off_over_on'])}x "
                     f"| {fmt(c['output_tokens_per_s_ratio_on_over_off'])}x |")
    return lines


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = ["# specdecode bench serve", "",
             f"Server: {results['server']['url']} ({'started by the run' if results['server']['local'] else 'given'}), "
             f"model `{results['server']['model']}`. Prompts: {', '.join(cfg['tasks'])}; max tokens "
             f"{cfg['max_tokens']}, temperature {cfg['temperature']:g}"
             + ("; ignore_eos" if cfg["ignore_eos"] else "") + ".",
             f"SLOs for goodput: TTFT {cfg['slo_ttft_ms'] or '–'} ms, TPOT {cfg['slo_tpot_ms'] or '–'} ms. "
             "Times in ms as p50 / p99; TPOT = (latency - TTFT) / (tokens - 1); ITL = gap between streamed chunks."
             + (f" Server arguments: `{' '.join(results['server']['args'])}`."
                if results["server"].get("args") else ""),
             "", "| load | speculation | requests | failed | req/s | output tok/s | goodput req/s | TTFT ms | TPOT ms "
             "| ITL ms | tokens/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in results["levels"]:
        for arm, s in level["arms"].items():
            tps = f"{s['tokens_per_step']:.2f}" if s["tokens_per_step"] else "–"
            lines.append(f"| {level['load']} | {arm} | {s['requests']} | {s['failed']} | {s['request_throughput']:.2f} "
                         f"| {s['output_tokens_per_s']:.1f} | {s['goodput']:.2f} | {_ms(s['ttft_ms'])} "
                         f"| {_ms(s['tpot_ms'])} | {_ms(s['itl_ms'])} | {tps} |")
    lines += _comparison_table(results["levels"], "comparison", "on", "on",
                               "Speculation on vs off (interleaved rounds)")
    lines += _comparison_table(results["levels"], "comparison_auto", "server", "auto",
                               "Automatic policy (arm `server`: no speculate field) vs off")
    if any(lv["memory"]["samples"] for lv in results["levels"]):
        lines += ["", "## Memory during each level", "",
                  "| load | RSS start | RSS after warm-up | RSS end | RSS peak | RSS growth | KV in use at end |",
                  "|---|---|---|---|---|---|---|"]
        for lv in results["levels"]:
            rss, kv = lv["memory"].get("rss_bytes") or {}, lv["memory"].get("kv_bytes_used") or {}
            lines.append(f"| {lv['load']} | {_bytes(rss.get('start'))} | {_bytes(rss.get('after_warmup'))} "
                         f"| {_bytes(rss.get('end'))} | {_bytes(rss.get('peak'))} | {_bytes(rss.get('growth'))} "
                         f"| {_bytes(kv.get('end'))} |")
    failures = Counter()
    for lv in results["levels"]:
        for s in lv["arms"].values():
            failures.update(s["failures"])
    if failures:
        lines += ["", "## Failures", ""] + [f"- {count} x {reason}" for reason, count in failures.most_common(10)]
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict, records: list[Record]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record.as_dict()) + "\n")
    (out / "report.md").write_text(markdown(results))
