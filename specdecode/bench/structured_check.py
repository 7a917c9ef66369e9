"""Structured output at scale: every constrained answer parses and validates against its schema, and
speculation changes nothing under greedy decoding.

The workload is specdecode/data/json_extract/validation.jsonl (100 prompts for each of the 5
schemas in schemas/, written for this project by scripts/setup/make_structured_prompts.py). Each
prompt runs under its own schema (one batch mixes schemas), greedy with speculation off and on
(outputs must be token-identical) and sampled with speculation on. Run it with:

    python -m specdecode.bench.structured_check --out benchmarks/structured-validation [--per-schema 100]

It writes results.json (per schema: valid / finished / identical counts, mean accepted length)
and prints a table. Validation uses the `jsonschema` package (the test extra).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "json_extract"


def load_workload(per_schema: int) -> tuple[list[dict], dict[str, dict]]:
    """(the first `per_schema` prompts of each schema, schema name -> JSON schema)."""
    schemas = {p.stem: json.loads(p.read_text()) for p in sorted((DATA / "schemas").glob("*.json"))}
    prompts, seen = [], {name: 0 for name in schemas}
    for line in (DATA / "validation.jsonl").read_text().splitlines():
        record = json.loads(line)
        if seen[record["schema"]] < per_schema:
            seen[record["schema"]] += 1
            prompts.append(record)
    return prompts, schemas


def check(llm, prompts: list[dict], schemas: dict[str, dict], k: int = 8, batch_size: int = 16,
          max_tokens: int = 128, seed: int = 0) -> dict:
    """Run the three passes over `prompts` and count, per schema, what validates."""
    import jsonschema

    from ..params import SamplingParams
    from ..structured import Structured
    ids = [llm.encode(p["text"], chat=p.get("chat", True)) for p in prompts]
    structured = {name: Structured("json_schema", schema) for name, schema in schemas.items()}

    def run(temperature: float, spec_k: int) -> list:
        outs = []
        for start in range(0, len(prompts), batch_size):
            chunk = range(start, min(start + batch_size, len(prompts)))
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                     seed=seed + i if temperature else None,
                                     structured=structured[prompts[i]["schema"]]) for i in chunk]
            outs += llm.generate([ids[i] for i in chunk], params, num_speculative_tokens=spec_k)
        return outs

    started = time.perf_counter()
    passes = {"greedy_plain": run(0.0, 0), "greedy_spec": run(0.0, k), "sampled_spec": run(0.7, k)}
    per_schema: dict[str, dict] = {name: {"prompts": 0, "identical": 0} for name in schemas}
    failures = []
    for i, p in enumerate(prompts):
        row = per_schema[p["schema"]]
        row["prompts"] += 1
        row["identical"] += passes["greedy_plain"][i].token_ids == passes["greedy_spec"][i].token_ids
        for name, outs in passes.items():
            out = outs[i]
            row.setdefault(f"{name}_finished", 0)
            row.setdefault(f"{name}_valid", 0)
            row[f"{name}_finished"] += out.finish_reason == "stop"
            try:
                jsonschema.validate(json.loads(out.text), schemas[p["schema"]])
                row[f"{name}_valid"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append({"id": p["id"], "pass": name, "finish_reason": out.finish_reason,
                                 "text": out.text[:200], "error": str(exc)[:200]})
        for name in ("greedy_spec", "sampled_spec"):
            row.setdefault(f"{name}_mal", []).append(passes[name][i].stats.get("mean_accepted_length") or 1.0)
    for row in per_schema.values():
        for name in ("greedy_spec", "sampled_spec"):
            values = row.pop(f"{name}_mal")
            row[f"{name}_mean_accepted_length"] = round(sum(values) / max(len(values), 1), 3)
    return {"per_schema": per_schema, "failures": failures, "seconds": round(time.perf_counter() - started, 1),
            "method": llm.method, "k": k, "max_tokens": max_tokens}


def table(result: dict) -> str:
    head = ("| schema | prompts | greedy valid (off / on) | identical | sampled valid | finished (greedy on) "
            "| mean accepted length (greedy / sampled) |\n|---|---|---|---|---|---|---|")
    rows = [f"| {name} | {r['prompts']} | {r['greedy_plain_valid']} / {r['greedy_spec_valid']} | {r['identical']} | "
            f"{r['sampled_spec_valid']} | {r['greedy_spec_finished']} | {r['greedy_spec_mean_accepted_length']} / "
            f"{r['sampled_spec_mean_accepted_length']} |" for name, r in result["per_schema"].items()]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-schema", type=int, default=100)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.per_schema <= 100:
        parser.error(f"--per-schema must be in [1, 100], got {args.per_schema}")
    from ..api import LLM
    llm = LLM(model=args.model, method=args.method, num_speculative_tokens=args.k, threads=args.threads,
              progress=False, adaptive=False, prefix_cache=False)
    prompts, schemas = load_workload(args.per_schema)
    result = check(llm, prompts, schemas, args.k, args.batch_size, args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text(table(result) + "\n")
    print(table(result))
    print(f"{len(result['failures'])} failures; {result['seconds']} s; results in {out}")
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
