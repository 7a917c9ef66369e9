"""Numbers and tables of `specdecode bench sessions`: per kind and arm summaries (TTFT of the first
and of later turns, decode and output tok/s, cached share of the prompts, accepted draft and
prediction tokens), speculation on/off and prefix cache on/off comparisons, the losslessness
check (greedy answers compared turn by turn, arm against arm), results.json, report.md and
transcripts.jsonl."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

ALL = "all"


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _sum(rows, key):
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) if values else None


def _ratio(a, b, digits=4):
    return round(a / b, digits) if a is not None and b else None


def share(rows) -> float | None:
    """Cached prompt tokens / prompt tokens over the turns that report both."""
    known = [r for r in rows if r["cached_tokens"] is not None and r["prompt_tokens"]]
    return _ratio(sum(r["cached_tokens"] for r in known), sum(r["prompt_tokens"] for r in known)) if known else None


def decode_rate(rows) -> float | None:
    """(output tokens - 1) / (e2e - TTFT), summed over the turns with a decode rate."""
    timed = [r for r in rows if r["decode_tok_s"] is not None]
    if not timed:
        return None
    return _ratio(sum(r["output_tokens"] - 1 for r in timed), sum(r["e2e"] - r["ttft"] for r in timed), 3)


def output_rate(rows) -> float | None:
    """Output tokens / end-to-end seconds (prefill and TTFT included)."""
    ok = [r for r in rows if r["ok"] and r["output_tokens"] is not None]
    return _ratio(sum(r["output_tokens"] for r in ok), sum(r["e2e"] for r in ok), 3) if ok else None


def summarize(rows: list[dict]) -> dict:
    """One kind under one arm."""
    ok = [r for r in rows if r["ok"]]
    later = [r for r in ok if r["turn"] > 1]
    accepted, drafted = _sum(ok, "accepted_tokens"), _sum(ok, "drafted_tokens")
    return {
        "sessions": len({r["session"] for r in rows}), "turns": len(rows), "failed": len(rows) - len(ok),
        "ttft_turn1_p50_s": _median(r["ttft"] for r in ok if r["turn"] == 1),
        "ttft_later_p50_s": _median(r["ttft"] for r in later),
        "ttft_later_max_s": round(max(r["ttft"] for r in later), 4) if later else None,
        "e2e_s": round(sum(r["e2e"] for r in ok), 4), "output_tokens": _sum(ok, "output_tokens"),
        "output_tok_s": output_rate(ok), "decode_tok_s": decode_rate(ok),
        "decode_turns": sum(r["decode_tok_s"] is not None for r in ok),
        "prompt_tokens": _sum(ok, "prompt_tokens"), "cached_tokens": _sum(ok, "cached_tokens"),
        "cached_share": share(ok), "cached_share_later": share(later),
        "accepted_tokens": accepted, "drafted_tokens": drafted, "acceptance_rate": _ratio(accepted, drafted),
        "accepted_prediction_tokens": _sum(ok, "accepted_prediction_tokens"),
        "rejected_prediction_tokens": _sum(ok, "rejected_prediction_tokens"),
        "tool_calls": sum(r["tool_calls"] for r in ok), "turns_with_tool_calls": sum(r["tool_calls"] > 0 for r in ok),
    }


def identity(rows_a: list[dict], rows_b: list[dict]) -> dict:
    """Answers of two arms compared turn by turn per session, up to the first turn that differs
    (after it the conversations differ) or that one arm did not complete."""
    a = {(r["session"], r["turn"]): r for r in rows_a}
    b = {(r["session"], r["turn"]): r for r in rows_b}
    sessions = sorted({s for s, _ in a} & {s for s, _ in b})
    compared = identical = same_sessions = 0
    divergences = []
    for session in sessions:
        turn, diverged = 1, False
        while (session, turn) in a and (session, turn) in b:
            ra, rb = a[session, turn], b[session, turn]
            if not (ra["ok"] and rb["ok"]):
                break
            compared += 1
            if ra["answer_sha1"] != rb["answer_sha1"]:
                diverged = True
                divergences.append({"session": session, "turn": turn})
                break
            identical += 1
            turn += 1
        same_sessions += not diverged
    return {"sessions": len(sessions), "identical_sessions": same_sessions, "turns_compared": compared,
            "identical_turns": identical, "divergences": divergences}


def cells(records: list[dict]) -> list[tuple[str, str]]:
    """The (prefix cache, speculation) arms in the order they ran."""
    return list(dict.fromkeys((r["cache"], r["arm"]) for r in records))


def kinds_of(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["kind"] for r in records))


def pick(records, kind, cache, arm):
    return [r for r in records if (kind == ALL or r["kind"] == kind) and r["cache"] == cache and r["arm"] == arm]


def paired(rows_a, rows_b):
    """The turns both arms completed (by session and turn)."""
    def key(r):
        return r["session"], r["turn"]
    keys = {key(r) for r in rows_a if r["ok"]} & {key(r) for r in rows_b if r["ok"]}
    return [r for r in rows_a if key(r) in keys], [r for r in rows_b if key(r) in keys]


def compare(records: list[dict], greedy: bool) -> dict:
    """Speculation on vs off within each prefix-cache arm, and prefix cache on vs off within each
    speculation arm, per kind and over all kinds."""
    out: dict = {"speculation": [], "prefix_cache": []}
    arms = cells(records)
    kinds = [*kinds_of(records), ALL]
    for cache in dict.fromkeys(c for c, _ in arms):
        if (cache, "on") not in arms or (cache, "off") not in arms:
            continue
        for kind in kinds:
            on, off = paired(pick(records, kind, cache, "on"), pick(records, kind, cache, "off"))
            out["speculation"].append({
                "kind": kind, "cache": cache, "paired_turns": len(on),
                "speedup_output_tok_s": _ratio(output_rate(on), output_rate(off)),
                "speedup_decode_tok_s": _ratio(decode_rate(on), decode_rate(off)),
                "e2e_ratio_off_over_on": _ratio(sum(r["e2e"] for r in off), sum(r["e2e"] for r in on)),
                "identity": identity(pick(records, kind, cache, "on"), pick(records, kind, cache, "off"))
                if greedy else None})
    for arm in dict.fromkeys(a for _, a in arms):
        if ("on", arm) not in arms or ("off", arm) not in arms:
            continue
        for kind in kinds:
            on, off = pick(records, kind, "on", arm), pick(records, kind, "off", arm)
            s_on, s_off = summarize(on), summarize(off)
            out["prefix_cache"].append({
                "kind": kind, "arm": arm,
                "ttft_turn1_ratio_off_over_on": _ratio(s_off["ttft_turn1_p50_s"], s_on["ttft_turn1_p50_s"]),
                "ttft_later_ratio_off_over_on": _ratio(s_off["ttft_later_p50_s"], s_on["ttft_later_p50_s"]),
                "output_tok_s_ratio_on_over_off": _ratio(output_rate(paired(on, off)[0]),
                                                         output_rate(paired(on, off)[1])),
                "identity": identity(on, off) if greedy else None})
    return out


def build(records: list[dict], greedy: bool) -> dict:
    """`summary` (per kind and arm, `all` included) and `comparison` of results.json."""
    summary = [{"kind": kind, "cache": cache, "arm": arm, **summarize(pick(records, kind, cache, arm))}
               for cache, arm in cells(records) for kind in [*kinds_of(records), ALL]
               if pick(records, kind, cache, arm)]
    return {"summary": summary, "comparison": compare(records, greedy)}


# ------------------------------------------------------------------ report.md
def _f(value, spec=".2f", suffix=""):
    return "–" if value is None else format(value, spec) + suffix


def _label(cache: str, arm: str, caches: set) -> str:
    spec = {"on": "spec on", "off": "spec off", "server": "spec (server's choice)"}[arm]
    return spec if caches == {"server"} else f"cache {cache}, {spec}"


def _identity_text(ident: dict | None) -> str:
    if ident is None:
        return "– (sampling)"
    text = f"{ident['identical_turns']}/{ident['turns_compared']} turns"
    if ident["divergences"]:
        first = ident["divergences"][0]
        text += f", first diverges: {first['session']} turn {first['turn']}"
    return text


def markdown(results: dict) -> str:
    cfg, server, machine = results["config"], results["server"], results["machine"]
    records = results["turns"]
    caches = {r["cache"] for r in records}
    loads = [x[0] for x in (machine.get("load_average_start"), machine.get("load_average_end")) if x]
    busy = [f"**Shared CPU: the load average ({max(loads):.1f}) exceeded the {machine['cores']} cores during the run; "
            "other processes took CPU time, so the timings (TTFT, tok/s, speed-ups) are unreliable. Token counts, "
            "cached tokens, accepted tokens and the identity of answers do not depend on it.**", ""] \
        if loads and max(loads) > machine["cores"] else []
    lines = ["# specdecode bench sessions", "",
             f"Command: `{cfg['command']}`", "", *busy,
             f"Machine: {machine['cpu']}"
             + (f" (family {machine['cpu_family']}, model {machine['cpu_model']})" if machine.get("cpu_family") else "")
             + f", {machine['cores']} cores"
             + (f" (load average {machine['load_average_start'][0]:.1f} at the start, "
                f"{machine['load_average_end'][0]:.1f} at the end)" if machine.get("load_average_start") else "")
             + ". Server: "
             + ("started by the run" if server["local"] else f"`{server['url']}`")
             + f", model `{server['model']}`" + (f", args `{' '.join(server['args'])}`" if server.get("args") else "")
             + f". Max tokens {cfg['max_tokens']}, temperature {cfg['temperature']:g}"
             + (", prediction sent on edit turns" if cfg["prediction"] else "")
             + (f", {cfg['interleave']} sessions interleaved "
                f"({'one after another' if cfg['round_robin'] else 'at once'} at each turn)"
                if cfg["interleave"] > 1 else ", one session at a time") + ".", "",
             "TTFT in seconds (p50 over sessions); decode tok/s = (tokens - 1) / (e2e - TTFT) summed over turns "
             "streamed in 2+ chunks; output tok/s = tokens / e2e (prefill included); cached = cached prompt tokens "
             "/ prompt tokens of later turns; accepted = accepted / drafted tokens of the speculation.", "",
             "| kind | arm | sessions | turns (failed) | TTFT turn 1 | TTFT later p50 / max | decode tok/s "
             "| output tok/s | cached | accepted / drafted | prediction accepted / rejected | tool calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["summary"]:
        pred = ("–" if s["accepted_prediction_tokens"] is None and s["rejected_prediction_tokens"] is None
                else f"{s['accepted_prediction_tokens'] or 0} / {s['rejected_prediction_tokens'] or 0}")
        acc = "–" if s["accepted_tokens"] is None else f"{s['accepted_tokens']} / {_f(s['drafted_tokens'], 'd')}"
        lines.append(f"| {s['kind']} | {_label(s['cache'], s['arm'], caches)} | {s['sessions']} | {s['turns']} "
                     f"({s['failed']}) | {_f(s['ttft_turn1_p50_s'], '.3f')} | {_f(s['ttft_later_p50_s'], '.3f')} / "
                     f"{_f(s['ttft_later_max_s'], '.3f')} | {_f(s['decode_tok_s'], '.1f')} | "
                     f"{_f(s['output_tok_s'], '.1f')} "
                     f"| {_f(None if s['cached_share_later'] is None else 100 * s['cached_share_later'], '.0f', ' %')} "
                     f"| {acc} | {pred} | {s['tool_calls']} |")
    comp = results["comparison"]
    if comp["speculation"]:
        lines += ["", "## Speculation on vs off", "",
                  "Over the turns both arms completed; identical = greedy answers equal turn by turn (the "
                  "losslessness check; compared up to a session's first divergence).", "",
                  "| kind | prefix cache | turns | speed-up, output tok/s | speed-up, decode tok/s "
                  "| identical answers |",
                  "|---|---|---|---|---|---|"]
        for c in comp["speculation"]:
            lines.append(f"| {c['kind']} | {c['cache']} | {c['paired_turns']} "
                         f"| {_f(c['speedup_output_tok_s'], '.2f', 'x')} "
                         f"| {_f(c['speedup_decode_tok_s'], '.2f', 'x')} | {_identity_text(c['identity'])} |")
    if comp["prefix_cache"]:
        lines += ["", "## Prefix cache on vs off", "",
                  "| kind | speculation | TTFT turn 1 off/on | TTFT later turns off/on | output tok/s on/off "
                  "| identical answers |", "|---|---|---|---|---|---|"]
        for c in comp["prefix_cache"]:
            lines.append(f"| {c['kind']} | {c['arm']} | {_f(c['ttft_turn1_ratio_off_over_on'], '.2f', 'x')} "
                         f"| {_f(c['ttft_later_ratio_off_over_on'], '.2f', 'x')} "
                         f"| {_f(c['output_tok_s_ratio_on_over_off'], '.2f', 'x')} | {_identity_text(c['identity'])} |")
    lines += turn_table(records, "document", caches)
    if results["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in results["notes"]]
    failed = [r for r in records if not r["ok"]]
    if failed:
        lines += ["", "## Failed turns", ""]
        lines += [f"- {r['session']} turn {r['turn']} ({_label(r['cache'], r['arm'], caches)}): {r['error']}"
                  for r in failed[:20]]
    return "\n".join(lines) + "\n"


def turn_table(records: list[dict], kind: str, caches: set) -> list[str]:
    rows = [r for r in records if r["kind"] == kind and r["ok"]]
    if not rows:
        return []
    arms = cells(rows)
    lines = ["", f"## TTFT per turn: {kind} sessions", "",
             "TTFT in seconds, p50 over the sessions; in brackets the mean cached prompt tokens.", "",
             "| turn | prompt tokens (mean) | " + " | ".join(_label(c, a, caches) for c, a in arms) + " |",
             "|---|---|" + "---|" * len(arms)]
    for turn in sorted({r["turn"] for r in rows}):
        at = [r for r in rows if r["turn"] == turn]
        prompts = [r["prompt_tokens"] for r in at if r["prompt_tokens"] is not None]
        cols = []
        for cache, arm in arms:
            mine = [r for r in at if r["cache"] == cache and r["arm"] == arm]
            cached = [r["cached_tokens"] for r in mine if r["cached_tokens"] is not None]
            cols.append(f"{_f(_median(r['ttft'] for r in mine), '.3f')}"
                        + (f" ({sum(cached) / len(cached):.0f})" if cached else ""))
        mean_prompt = sum(prompts) / len(prompts) if prompts else None
        lines.append(f"| {turn} | {_f(mean_prompt, '.0f')} | " + " | ".join(cols) + " |")
    return lines


def write(out: Path, results: dict, transcripts: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    with open(out / "transcripts.jsonl", "w", encoding="utf-8") as f:
        for row in transcripts:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(markdown(results))
