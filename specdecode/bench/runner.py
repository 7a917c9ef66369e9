"""The measuring loop of `specdecode bench`.

Every system is loaded once; then, for each prompt, every cell (system x method x k) runs
back to back, in an order rotated by one per prompt, so slow drift of a shared machine
spreads over all cells instead of favouring whichever runs first. Each generation is
appended to measurements.jsonl as soon as it ends; `--resume` skips cells already there.
"""
from __future__ import annotations

import platform
import sys
import time
import zlib

import torch

from ..engine.threads import usable_cpus
from . import aggregate, llamacpp, report, workload
from .store import Store, cell_key, check_resumable
from .systems import Cell, SpecdecodeSystem, System, TransformersSystem


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained read bandwidth: the best of a few sums over a buffer far larger than the caches."""
    buf = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return megabytes * (1 << 20) / best / 1e9


def machine_info(threads: int, llamacpp_version: str | None) -> dict:
    import transformers

    from ..fast.linear import cpu_label
    cpu = cpu_label()
    cores = usable_cpus()
    return {"cpu": cpu, "cores": cores, "threads": threads, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "llama_cpp": llamacpp_version}


def prompt_seed(seed: int, prompt: workload.BenchPrompt) -> int:
    """A per-prompt seed that does not depend on which prompts were selected (stable on --resume)."""
    return seed + zlib.crc32(f"{prompt.task}/{prompt.id}".encode()) % 1_000_000


def build_systems(config: dict, llm, prompts: list[workload.BenchPrompt], notes: list[str],
                  run: dict) -> list[System]:
    from ..models.loader import parse_dtype
    systems: list[System] = []
    wanted = config["systems"]
    if "specdecode" in wanted:
        systems.append(SpecdecodeSystem(llm, config.get("drafter"), config.get("adaptive"), config.get("json_schema"),
                                        config.get("drafter_options") or {}))
    if config.get("json_schema") is not None or any(p.schema for p in prompts):   # llama.cpp gets no grammar here
        for peer in [w for w in wanted if w not in ("specdecode", "transformers")]:
            notes.append(f"{peer}: skipped — JSON schemas constrain specdecode and transformers only")
        wanted = [w for w in wanted if w in ("specdecode", "transformers")]
    if "transformers" in wanted:
        try:
            systems.append(TransformersSystem(llm, parse_dtype(config["dtype"] or "bf16"), notes,
                                              config.get("json_schema")))
            run.setdefault("roofline", {})["transformers_mb"] = systems[-1].weight_bytes() / 1e6
            notes.append(f"weights: specdecode {llm.target.weights_kind}; transformers "
                         f"{str(systems[-1].model.dtype).removeprefix('torch.')} (from {llm.target.dense_path().name})")
        except Exception as exc:  # noqa: BLE001
            notes.append(f"transformers: skipped — cannot load {llm.target.path} ({type(exc).__name__}: {exc})")
    if "llama.cpp" in wanted:
        ok, _ = llamacpp.available()
        path = llamacpp.gguf_path(config["model"]) if ok else None
        if not ok:
            notes.append(llamacpp.INSTALL_NOTE)
        elif path is None:
            notes.append("llama.cpp: skipped — the target is not a .gguf file")
        elif (why := llamacpp.probe(path)) is not None:
            notes.append(f"llama.cpp: skipped — llama-cpp-python is installed but broken here: {why}")
        else:
            ks = config["ks"] if "ngram" in config["methods"] else []
            n_ctx = max(len(p.ids) for p in prompts) + config["max_tokens"] + max(config["ks"]) + 16
            systems.append(llamacpp.LlamaCppSystem(path, llm.target.eos_token_ids, n_ctx,
                                                   torch.get_num_threads(), ks))
            run["roofline"]["gguf_mb"] = path.stat().st_size / 1e6
            if "model" in config["methods"] and config["draft"]:
                notes.append("llama.cpp: method model skipped — llama-cpp-python only drafts by prompt lookup")
    if "model" in config["methods"] and not config["draft"]:
        notes.append("method model skipped — no --draft given")
    for method in config["methods"]:
        if method in ("plain", "model") or any(sys_.supports(method) for sys_ in systems):
            continue
        if method in ("eagle", "cascade") and not config.get("drafter"):
            notes.append(f"method {method} skipped — no trained drafter for this target (--drafter DIR)")
        else:
            sd = next((s for s in systems if isinstance(s, SpecdecodeSystem)), None)
            why = sd.skipped.get(method, "no system runs it") if sd is not None else "specdecode is not measured"
            notes.append(f"method {method} skipped — {why}")
    return systems


def rotated(cells: list[Cell], turn: int) -> list[Cell]:
    shift = turn % len(cells) if cells else 0
    return cells[shift:] + cells[:shift]


def record_divergences(store: Store, sd: SpecdecodeSystem, prompt: workload.BenchPrompt, done: dict,
                       diverged: set) -> None:
    """Greedy only: for each specdecode speculative cell whose output differs from specdecode
    plain on this prompt, store the target's logit gap between the two tokens there."""
    plain = done.get(("specdecode", "plain", 0, prompt.task, prompt.id))
    if plain is None:
        return
    for key, rec in list(done.items()):
        system, method, k, task, pid = key
        if system != "specdecode" or method == "plain" or (task, pid) != (prompt.task, prompt.id) or key in diverged:
            continue
        pos = aggregate.first_difference(plain["token_ids"], rec["token_ids"])
        if pos is None or pos >= min(len(plain["token_ids"]), len(rec["token_ids"])):
            continue
        a, b = plain["token_ids"][pos], rec["token_ids"][pos]
        gap = sd.logit_gap(list(prompt.ids), plain["token_ids"][:pos], a, b)
        store.append({"type": "divergence", "system": system, "method": method, "k": k, "task": task,
                      "prompt_id": pid, "position": pos, "plain_token": a, "token": b, **gap})
        diverged.add(key)


def measure(config: dict, store: Store, progress: bool = True) -> dict:
    """Load everything, measure every missing cell, return the run document."""
    from tqdm import tqdm

    from ..api import LLM

    previous = store.read_run()
    if config["resume"] and previous:
        check_resumable(previous, config)
    elif not config["resume"]:
        store.reset()
    llm = LLM(model=config["model"], draft=config["draft"], method="none", num_speculative_tokens=0,
              dtype=config["dtype"], threads=config["threads"], fast=not config["eager"], progress=progress,
              weights=config.get("weights", "auto"), draft_dtype=config.get("draft_dtype"))
    threads = torch.get_num_threads()
    notes: list[str] = []
    room = max(config["ks"]) + 2
    prompts, prompt_notes = workload.select(llm, config["tasks"], config["prompts_per_task"], config["max_tokens"],
                                            room, config["prompts_file"])
    notes += prompt_notes
    if not prompts:
        raise ValueError("no prompt to measure (all were too long for the model's context)")
    prompts = workload.interleave(prompts)
    # the machine's bandwidth drifts (other tenants): probe it now, after every prompt, and keep
    # the probes of earlier parts of a resumed run; the report takes the floor from the highest
    earlier = ((previous or {}).get("roofline") or {}) if config["resume"] else {}
    samples = aggregate.start_probes(earlier) + [read_bandwidth_gbs()]
    run = {"config": config, "notes": notes, "tasks": list(dict.fromkeys(p.task for p in prompts)),
           "prompts": [{"task": p.task, "id": p.id, "tokens": len(p.ids)} for p in prompts],
           "roofline": {"read_bandwidth_samples": samples, "weight_mb": llm.target.model.weight_bytes() / 1e6}}
    systems = build_systems(config, llm, prompts, notes, run)
    run["machine"] = machine_info(threads, llamacpp.available()[1])
    cells = [c for s in systems for c in s.cells(config["methods"], config["ks"])]
    run["cells"] = [c.label for c in cells]
    if previous and config["resume"]:
        run["notes"] = list(dict.fromkeys(previous.get("notes", []) + notes + ["resumed"]))
    store.write_run(run)
    by_name = {s.name: s for s in systems}

    done, diverged = {}, set()
    for r in store.records():
        if r.get("type") == "measurement":
            done[cell_key(r)] = r
        elif r.get("type") == "divergence":
            diverged.add(cell_key(r))
    todo = [(p, c) for p in prompts for c in cells if (c.system, c.method, c.k, p.task, p.id) not in done]
    # warm-up: one short generation per cell on the shortest prompt (one-time costs, not measured)
    shortest = min(prompts, key=lambda p: len(p.ids))
    for c in cells if todo else []:
        by_name[c.system].run(c, list(shortest.ids), min(8, config["max_tokens"]), config["temperature"], 0,
                              schema=shortest.schema)

    greedy = config["temperature"] == 0
    bar = tqdm(total=len(prompts) * len(cells), initial=len(prompts) * len(cells) - len(todo), desc="bench",
               unit="gen", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        for turn, p in enumerate(prompts):
            measured = False
            for c in rotated(cells, turn):
                key = (c.system, c.method, c.k, p.task, p.id)
                if key in done:
                    continue
                measured = True
                bar.set_postfix_str(f"{p.task}/{p.id} {c.label}", refresh=False)
                m = by_name[c.system].run(c, list(p.ids), config["max_tokens"], config["temperature"],
                                          prompt_seed(config["seed"], p), schema=p.schema)
                rec = {"type": "measurement", "system": c.system, "method": c.method, "k": c.k, "task": p.task,
                       "prompt_id": p.id, "prompt_tokens": len(p.ids), **m}
                store.append(rec)
                done[key] = rec
                bar.update(1)
            if greedy and "specdecode" in by_name:
                record_divergences(store, by_name["specdecode"], p, done, diverged)
            if measured:
                store.append({"type": "bandwidth", "read_bandwidth_gbs": read_bandwidth_gbs(repeats=2)})
    finally:
        bar.close()
    return run


def build_outputs(store: Store, run: dict | None = None) -> dict:
    """(Re)write results.json, report.md and the plots from run.json + measurements.jsonl."""
    run = run or store.read_run()
    if run is None:
        raise FileNotFoundError(f"{store.run_path} not found: nothing was measured in {store.dir}")
    records = store.records()
    greedy = run["config"]["temperature"] == 0
    rows = aggregate.build_rows(records, run.get("tasks", []), greedy)
    results = {"schema": "specdecode-bench/1", "config": run["config"], "machine": run.get("machine", {}),
               "roofline": aggregate.roofline(run, rows, records), "notes": run.get("notes", []),
               "summary": aggregate.summary(rows), "rows": rows}
    report.write_all(store.dir, results)
    return results
