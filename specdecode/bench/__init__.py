"""`specdecode bench`: Spec-Bench and HumanEval, specdecode side by side with Hugging Face
transformers and llama.cpp, on the same prompts, weights, dtype and machine, in one run.

Modules: cli (options, `cmd_bench`), workload (prompt selection), systems (specdecode and
transformers runners), llamacpp (optional llama-cpp-python runner), runner (the interleaved
measuring loop), store (run.json + measurements.jsonl, resume), aggregate (rows of
results.json), report (report.md, PNG plots, console summary). The output schema is
documented in specdecode/bench/README.md.

`specdecode bench serve` load-tests a server: serve_cli (options, levels, interleaved
speculation arms), serve_load (streaming requests, concurrency / Poisson arrivals),
serve_server (a local `specdecode serve`, memory sampling), serve_report (percentiles,
goodput, results.json, requests.jsonl, report.md).

`specdecode bench sessions` runs multi-turn sessions through a server: sessions_cli (options, arms,
own servers), sessions_data (the shipped sessions, conversations growing turn by turn),
sessions_run (streaming turns, groups in lockstep), sessions_report (summaries, on/off
comparisons, the losslessness check, results.json, report.md, transcripts.jsonl).
"""
from .cli import add_parser, cmd_bench

__all__ = ["add_parser", "cmd_bench"]
