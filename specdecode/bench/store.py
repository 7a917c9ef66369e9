"""The run directory: what is written while measuring, so an interrupted run keeps its data.

    run.json            config, machine, roofline, notes, prompts; written before the first
                        measurement (and merged on --resume)
    measurements.jsonl  one JSON object per line, appended and flushed as each generation ends:
                        {"type": "measurement", system, method, k, task, prompt_id, prompt_tokens,
                         tokens, token_ids, seconds, tokens_per_s, ttft_s, decode_ms_per_token,
                         steps, and for specdecode: emitted, drafted, accepted,
                         drafted_per_position, accepted_per_position, draft_s, verify_s,
                         prefill_s, total_s, finish_reason, drafter (what it chose, e.g. the layers
                         a layer-skip draft skips; when it reports anything)}
                        {"type": "divergence", system, method, k, task, prompt_id, position,
                         plain_token, token, gap, top1_top2_gap, ...}   (temperature 0 only)
                        {"type": "bandwidth", read_bandwidth_gbs}   (a probe after each prompt)

The aggregate files (results.json, report.md, plots) are rebuilt from these two files.
"""
from __future__ import annotations

import json
from pathlib import Path

RUN = "run.json"
MEASUREMENTS = "measurements.jsonl"
# settings that must match for --resume to reuse earlier measurements
RESUME_KEYS = ("model", "draft", "dtype", "max_tokens", "temperature", "seed", "threads", "eager")


def cell_key(record: dict) -> tuple:
    return (record["system"], record["method"], int(record["k"]), record["task"], str(record["prompt_id"]))


class Store:
    def __init__(self, out: str | Path) -> None:
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_path = self.dir / RUN
        self.jsonl_path = self.dir / MEASUREMENTS

    # --- run.json
    def read_run(self) -> dict | None:
        return json.loads(self.run_path.read_text()) if self.run_path.is_file() else None

    def write_run(self, run: dict) -> None:
        tmp = self.run_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(run, indent=2))
        tmp.replace(self.run_path)

    # --- measurements.jsonl
    def records(self) -> list[dict]:
        """Every complete line (a line cut short by a kill is ignored)."""
        if not self.jsonl_path.is_file():
            return []
        out = []
        for line in self.jsonl_path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def done(self) -> set[tuple]:
        return {cell_key(r) for r in self.records() if r.get("type") == "measurement"}

    def append(self, record: dict) -> None:
        with self.jsonl_path.open("a+b") as f:
            if f.tell() > 0:   # a line cut short by a kill: start on a fresh line
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(record) + "\n").encode("utf-8"))
            f.flush()

    def reset(self) -> None:
        """A fresh (not resumed) run: drop earlier measurements of this directory."""
        for path in (self.jsonl_path, self.run_path):
            if path.exists():
                path.unlink()


def check_resumable(previous: dict, config: dict) -> None:
    """Raise ValueError when --resume would mix measurements taken with other settings."""
    before = previous.get("config", {})
    diff = [f"{key} {before.get(key)!r} -> {config.get(key)!r}" for key in RESUME_KEYS
            if before.get(key) != config.get(key)]
    if diff:
        raise ValueError("--resume: the run in this directory used other settings (" + ", ".join(diff) +
                         "); use another --out or drop --resume")
