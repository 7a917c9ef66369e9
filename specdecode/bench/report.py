"""Writes results.json, report.md and the PNG plots of a bench run, and the console summary."""
from __future__ import annotations

import json
from pathlib import Path

PLOTS = {"speedup": "speedup_by_task.png", "acceptance": "acceptance_by_position.png",
         "k": "tokens_per_s_vs_k.png"}


def _f(value, spec: str = "{:.2f}") -> str:
    return "n/a" if value is None else spec.format(value)


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _table(rows: list[dict], with_task: bool) -> list[str]:
    head = (["task"] if with_task else []) + ["system", "method", "k", "tok/s", "speed-up", "vs HF plain",
                                              "mean acc. len", "identical", "TTFT s", "prompts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["task"]] if with_task else []) + [
            r["system"], r["method"], str(r["k"]), _f(r["tokens_per_s"], "{:.1f}"), _f(r["speedup"]) + "x",
            _f(r["speedup_vs_transformers_plain"]) + ("x" if r["speedup_vs_transformers_plain"] else ""),
            _f(r["mean_accepted_length"]), _pct(r["identical_share"]), _f(r["ttft_s"], "{:.3f}"), str(r["prompts"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _summary_lines(summary: dict) -> list[str]:
    out = [f"Scope: {summary['scope']} prompts."]
    if "specdecode_plain_over_transformers_plain" in summary:
        out.append(f"- specdecode plain / transformers plain tokens/s: "
                   f"{summary['specdecode_plain_over_transformers_plain']:.2f}x")
    for system in ("specdecode", "transformers", "llama.cpp"):
        best = summary.get(f"{system}_best")
        if best:
            out.append(f"- {system} best speculative mode: {best['method']} k={best['k']}, "
                       f"{best['speedup']:.2f}x its own plain decoding ({best['tokens_per_s']:.1f} tok/s)")
    if "specdecode_best_over_transformers_best_speedup" in summary:
        out.append(f"- specdecode best speed-up / transformers best speed-up: "
                   f"{summary['specdecode_best_over_transformers_best_speedup']:.2f}x")
    if "specdecode_ngram_over_llamacpp_ngram_tokens_per_s" in summary:
        out.append(f"- specdecode ngram / llama.cpp prompt lookup tokens/s: "
                   f"{summary['specdecode_ngram_over_llamacpp_ngram_tokens_per_s']:.2f}x")
    if "specdecode_min_identical_share" in summary:
        out.append(f"- specdecode greedy outputs identical to plain decoding: "
                   f"{summary['specdecode_min_identical_share']:.0%} of prompts (worst cell)")
    return out


def _roofline_lines(roof: dict) -> list[str]:
    if not roof.get("floor_ms_per_token"):
        return []
    probes = roof.get("read_bandwidth_probes", 1)
    where = ("measured at the start of the run" if probes == 1 else
             f"the highest of {probes} probes during the run (lowest {roof['read_bandwidth_lowest_gbs']:.1f} GB/s)")
    line = (f"Read bandwidth {roof['read_bandwidth_gbs']:.1f} GB/s, {where}; "
            f"{roof['weight_mb']:.3g} MB of target weights per token -> floor {roof['floor_ms_per_token']:.2f} ms/token"
            + (f" (transformers reads {roof['transformers_mb']:.3g} MB: its own floor)" if roof.get("transformers_mb")
               else "") + ".")
    parts = [f"{name} plain {s['decode_ms_per_token']:.2f} ms/token = {_pct(s['fraction_of_floor'])} of its floor"
             + (f" ({_pct(s['fraction_of_floor_paired'])} against the probe after each prompt, median)"
                if s.get("fraction_of_floor_paired") else "")
             for name, s in roof.get("systems", {}).items()]
    out = [line] + ([" " + "; ".join(parts) + "."] if parts else [])
    if roof.get("gguf_mb"):
        own = roof["gguf_mb"] / roof["read_bandwidth_gbs"]              # MB / (GB/s) = ms
        llama = roof.get("systems", {}).get("llama.cpp", {}).get("decode_ms_per_token")
        share = f"; it runs at {_pct(own / llama)} of that" if llama else ""
        out.append(f" (llama.cpp reads the {roof['gguf_mb']:.0f} MB quantized GGUF weights, so its own floor is "
                   f"{own:.2f} ms/token{share}.)")
    return ["".join(out)]


REGRESSION = 0.97      # a speculative cell below this speed-up over its system's plain decoding is flagged


def regressions(rows: list[dict]) -> list[dict]:
    """Cells (system x method x k x task, and all tasks) where speculation was slower than
    REGRESSION x plain decoding: a change that makes a case lose shows up in the report."""
    return [r for r in rows if r["method"] != "plain" and r.get("speedup") is not None
            and r["speedup"] < REGRESSION]


def _regression_lines(rows: list[dict]) -> list[str]:
    slow = regressions(rows)
    if not slow:
        return [f"No speculative cell is below {REGRESSION:.2f}x its system's plain decoding."]
    lines = [f"{len(slow)} cell(s) below {REGRESSION:.2f}x plain decoding (speculation loses there):", "",
             "| system | method | k | task | speed-up |", "|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['method']} | {r['k']} | {r['task']} | {r['speedup']:.2f}x |"
              for r in sorted(slow, key=lambda r: r["speedup"])]
    return lines


def console_summary(results: dict) -> str:
    rows = [r for r in results["rows"] if r["task"] == "all"]
    lines = _table(rows, with_task=False) + [""] + _summary_lines(results["summary"])
    slow = regressions(results["rows"])
    if slow:
        lines += ["", f"warning: {len(slow)} cell(s) below {REGRESSION:.2f}x plain decoding: " + ", ".join(
            f"{r['system']} {r['method']} k={r['k']} {r['task']} {r['speedup']:.2f}x" for r in slow[:8])
            + (" ..." if len(slow) > 8 else "") + " (report.md, 'Regressions')"]
    lines += [""] + _roofline_lines(results["roofline"])
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    cfg, m = results["config"], results["machine"]
    rows = results["rows"]
    out = ["# specdecode bench", "", f"Command: `{cfg['command']}`", "",
           f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('threads')} threads; torch {m.get('torch')}, "
           f"transformers {m.get('transformers')}, llama-cpp-python {m.get('llama_cpp') or 'not installed'}.",
           f"Model: {cfg['model'] or 'embedded SmolLM2-135M-Instruct'}"
           + (f", draft {cfg['draft']}" if cfg["draft"] else "") +
           f"; dtype {cfg['dtype']}; max {cfg['max_tokens']} new tokens (EOS stops); temperature {cfg['temperature']}.",
           "", "## Summary", ""] + _summary_lines(results["summary"])
    out += ["", "## All prompts", ""] + _table([r for r in rows if r["task"] == "all"], with_task=False)
    out += ["", "## Per task", ""] + _table([r for r in rows if r["task"] != "all"], with_task=True)
    out += ["", "## Regressions", ""] + _regression_lines(rows)
    spec = [r for r in rows if r["task"] == "all" and r["acceptance_per_position"]]
    if spec:
        width = max(len(r["acceptance_per_position"]) for r in spec)
        out += ["", "## Acceptance rate by draft position (all prompts)", "",
                "| system | method | k | " + " | ".join(str(i + 1) for i in range(width)) + " |",
                "|" + "---|" * (3 + width)]
        for r in spec:
            rates = [_pct(x) for x in r["acceptance_per_position"]] + [""] * (width - len(r["acceptance_per_position"]))
            out.append(f"| {r['system']} | {r['method']} | {r['k']} | " + " | ".join(rates) + " |")
    timed = [r for r in rows if r["task"] == "all" and r["time_share"]]
    if timed:
        out += ["", "## Where the time goes (specdecode, all prompts)", "",
                "| method | k | draft | verify | prefill | other |", "|---|---|---|---|---|---|"]
        out += [f"| {r['method']} | {r['k']} | " + " | ".join(f"{r['time_share'][x]:.1%}" for x in
                                                            ("draft", "verify", "prefill", "other")) + " |"
                for r in timed]
    chosen = [r for r in rows if r["task"] == "all" and r.get("drafter")]
    if chosen:
        out += ["", "## What the drafters chose (as of their last prompt)", ""]
        out += [f"- {r['system']} {r['method']} k={r['k']}: "
                + ", ".join(f"{key} {value}" for key, value in r["drafter"].items()) for r in chosen]
    out += ["", "## Losslessness", ""]
    if cfg["temperature"] != 0:
        out.append("Sampling run: outputs differ from plain decoding by design (the distribution is preserved).")
    else:
        diverging = [r for r in rows if r["task"] != "all" and r.get("first_divergence")]
        if not diverging:
            out.append("Every speculative output is identical to the same system's plain decoding.")
        for r in diverging:
            d = r["first_divergence"]
            gap = f", target logit gap {d['gap']:.3f}" if d.get("gap") is not None else ""
            out.append(f"- {r['system']} {r['method']} k={r['k']} on {r['task']}: {r['divergences']} of "
                       f"{r['prompts']} prompts differ; first: prompt {d['prompt_id']}, position {d['position']}, "
                       f"plain token {d['plain_token']} vs {d['token']}{gap}")
        cross = [r for r in rows if r["task"] == "all" and r["method"] == "plain" and r["system"] != "transformers"
                 and r.get("identical_share_vs_transformers_plain") is not None]
        for r in cross:
            out.append(f"- {r['system']} plain vs transformers plain (informative): "
                       f"{_pct(r['identical_share_vs_transformers_plain'])} of prompts identical")
    out += ["", "## Roofline", ""] + _roofline_lines(results["roofline"])
    if results["notes"]:
        out += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    out += ["", "## Plots", ""] + [f"![{key}]({name})" for key, name in PLOTS.items()]
    return "\n".join(out) + "\n"


def _save(fig, ax, path: Path, legend: bool) -> None:
    """Legend (when something is plotted), layout, PNG, and free the figure."""
    import matplotlib.pyplot as plt
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(out_dir: Path, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    # 1. speed-up over own plain decoding by task: each speculative (system, method) at its best k overall
    series = {}
    for r in rows:
        if r["task"] == "all" and r["method"] != "plain" and r["speedup"] is not None:
            name = (r["system"], r["method"])
            if name not in series or r["speedup"] > series[name]["speedup"]:
                series[name] = r
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 4))
    width = 0.8 / max(1, len(series))
    for i, ((system, method), best) in enumerate(series.items()):
        values = [next((r["speedup"] or 0 for r in rows if r["task"] == t and r["system"] == system and
                        r["method"] == method and r["k"] == best["k"]), 0) for t in tasks]
        ax.bar([x + i * width for x in range(len(tasks))], values, width, label=f"{system} {method} k={best['k']}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel("speed-up over own plain decoding")
    ax.set_title("Speed-up by task and system")
    _save(fig, ax, out_dir / PLOTS["speedup"], legend=bool(series))
    # 2. acceptance rate by draft position (all prompts)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["task"] == "all" and r["acceptance_per_position"]:
            ys = r["acceptance_per_position"]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{r['system']} {r['method']} k={r['k']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all prompts)")
    _save(fig, ax, out_dir / PLOTS["acceptance"], legend=bool(ax.lines))
    # 3. tokens/s against k (k = 0 is plain decoding)
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["task"] == "all" and r["system"] == system]
        plain = [r for r in mine if r["method"] == "plain"]
        for method in dict.fromkeys(r["method"] for r in mine if r["method"] != "plain"):
            points = sorted((r["k"], r["tokens_per_s"]) for r in mine if r["method"] == method)
            points = [(0, plain[0]["tokens_per_s"])] * bool(plain) + points
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{system} {method}")
        if plain and not any(r["method"] != "plain" for r in mine):
            ax.plot([0], [plain[0]["tokens_per_s"]], marker="s", label=f"{system} plain")
    ax.set_xlabel("k (draft tokens per step; 0 = plain decoding)")
    ax.set_ylabel("tokens/s (mean over prompts)")
    ax.set_title("Tokens/s vs k (all prompts)")
    _save(fig, ax, out_dir / PLOTS["k"], legend=bool(ax.lines))


def write_all(out_dir: Path, results: dict) -> None:
    out_dir = Path(out_dir)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "report.md").write_text(markdown(results), encoding="utf-8")
    plots(out_dir, results)
