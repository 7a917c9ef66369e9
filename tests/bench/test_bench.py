"""`specdecode bench` end to end on the tiny random models (specdecode + transformers, and
llama.cpp's skip note when llama-cpp-python is missing): the results.json schema, the
markdown report, the plots, --resume, --rebuild, a custom prompt set, and the aggregation
arithmetic on synthetic records."""
from __future__ import annotations

import json
import shutil

import pytest

from specdecode.bench import aggregate
from specdecode.cli import main
from specdecode.engine.config import SPAN

ROW_KEYS = {"system", "method", "k", "task", "tokens_per_s", "tokens_per_s_total", "speedup",
            "speedup_vs_transformers_plain", "mean_accepted_length", "identical_share", "acceptance_per_position",
            "time_share", "ttft_s", "prompts", "first_divergence"}
TASKS = "translation,qa,math_reasoning"


def llamacpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def bench(out, tiny_models, *extra: str) -> int:
    """--full: every method unless --methods (--quick runs plain and ngram only)."""
    return main(["bench", "--full", "--model", str(tiny_models["llama"]), "--draft", str(tiny_models["llama_draft"]),
                 "--max-tokens", "8", "--prompts-per-task", "1", "--no-progress", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    code = bench(out, tiny_models, "--tasks", TASKS, "-k", "2,3",
                 "--systems", "specdecode,transformers,llama.cpp")
    assert code == 0
    return out


def lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "measurements.jsonl").read_text().splitlines()]


def test_results_schema(run):
    results = json.loads((run / "results.json").read_text())
    assert {"rows", "machine", "config", "roofline", "notes", "summary"} <= results.keys()
    assert {"cpu", "cores", "threads", "torch", "transformers", "llama_cpp"} <= results["machine"].keys()
    assert results["config"]["command"].startswith("specdecode bench")
    rows = results["rows"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
    cells = {(r["system"], r["method"], r["k"]) for r in rows}
    for system in ("specdecode", "transformers"):
        assert {(system, "plain", 0), (system, "ngram", 2), (system, "ngram", 3), (system, "model", 2),
                (system, "model", 3)} <= cells
    assert {r["task"] for r in rows} == set(TASKS.split(",")) | {"all"}
    roof = results["roofline"]
    assert roof["read_bandwidth_gbs"] > 0 and roof["floor_ms_per_token"] > 0
    probes = [r["read_bandwidth_gbs"] for r in lines(run) if r["type"] == "bandwidth"]
    assert len(probes) == 3 and roof["read_bandwidth_probes"] == 4   # start + one per prompt
    assert roof["read_bandwidth_gbs"] >= max(probes) and roof["read_bandwidth_lowest_gbs"] <= min(probes)
    assert roof["floor_ms_per_token"] == pytest.approx(roof["weight_mb"] / roof["read_bandwidth_gbs"])
    for system in ("specdecode", "transformers"):   # each prompt's plain run against the probe after it
        assert roof["systems"][system]["fraction_of_floor_paired"] > 0
    assert {"specdecode", "transformers"} <= roof["systems"].keys()


def test_specdecode_greedy_is_lossless(run):
    rows = json.loads((run / "results.json").read_text())["rows"]
    spec = [r for r in rows if r["system"] == "specdecode"]
    assert spec and all(r["identical_share"] == 1.0 for r in spec)
    for r in spec:
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["mean_accepted_length"] == 1.0
        else:
            # sized per step (engine/controller.py): at most k drafts (tree nodes), depth <= k; a copying
            # drafter (lookups) grows past k while its drafts are accepted whole, up to SPAN; a cascade's
            # lookups verified on rows planned plain may be as long where they are predicted to pay
            cap = max(r["k"], SPAN) if r["method"] in ("ngram", "suffix", "cascade") else r["k"]
            assert 1.0 <= r["mean_accepted_length"] <= cap + 1
            assert len(r["acceptance_per_position"]) <= cap and r["tree_nodes_mean"] <= cap
            assert abs(sum(r["time_share"][x] for x in ("draft", "verify", "prefill", "other")) - 1) < 1e-6
        assert r["ttft_s"] > 0


def test_llamacpp_skip_note(run):
    results = json.loads((run / "results.json").read_text())
    if llamacpp_installed():
        pytest.skip("llama-cpp-python is installed")
    assert "llama.cpp: skipped — pip install -e '.[llamacpp]' in the specdecode repository" in results["notes"]
    assert "llama.cpp: skipped" in (run / "report.md").read_text()
    assert not any(r["system"] == "llama.cpp" for r in results["rows"])


def test_report_and_plots(run):
    md = (run / "report.md").read_text()
    assert "| system | method | k | tok/s | speed-up |" in md
    assert "## Roofline" in md and "## Losslessness" in md
    assert "## What the drafters chose" in md and "layer-skip k=2: skip_layers [" in md     # the layers it skips
    for name in ("speedup_by_task.png", "acceptance_by_position.png", "tokens_per_s_vs_k.png"):
        data = (run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({name})" in md


def test_measurements_appended_per_generation(run):
    recs = [r for r in lines(run) if r["type"] == "measurement"]
    # 3 prompts x (specdecode: plain + 8 methods x 2 k, cascade over the draft model and the draft
    # through text among them; transformers: plain + 2 x 2)
    assert len(recs) == 3 * 22
    assert all(r["tokens"] == len(r["token_ids"]) > 0 and r["seconds"] > 0 for r in recs)


def test_resume_measures_only_missing_cells(run, tiny_models, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    kept = (out / "measurements.jsonl").read_text().splitlines()
    kept = [x for x in kept if json.loads(x)["type"] == "measurement"][:-4]
    (out / "measurements.jsonl").write_text("\n".join(kept) + "\n" + '{"type": "measurem')   # cut by a kill
    assert bench(out, tiny_models, "--tasks", TASKS, "-k", "2,3", "--systems", "specdecode,transformers,llama.cpp",
                 "--resume") == 0
    recs = [r for r in lines_lenient(out) if r["type"] == "measurement"]
    assert [json.dumps(r) for r in recs[:len(kept)]] == [json.dumps(json.loads(x)) for x in kept]
    keys = [aggregate_key(r) for r in recs]
    assert len(recs) == 3 * 22 and len(set(keys)) == 3 * 22
    # nothing left: a second resume measures nothing
    assert bench(out, tiny_models, "--tasks", TASKS, "-k", "2,3", "--systems", "specdecode,transformers,llama.cpp",
                 "--resume") == 0
    assert len([r for r in lines_lenient(out) if r["type"] == "measurement"]) == 3 * 22
    # each part's start probe is kept; a part that measured nothing adds no per-prompt probe
    probes = json.loads((out / "run.json").read_text())["roofline"]["read_bandwidth_samples"]
    assert len(probes) == 3


def lines_lenient(out) -> list[dict]:
    recs = []
    for x in (out / "measurements.jsonl").read_text().splitlines():
        try:
            recs.append(json.loads(x))
        except ValueError:
            pass
    return recs


def aggregate_key(r: dict) -> tuple:
    return (r["system"], r["method"], r["k"], r["task"], r["prompt_id"])


def test_resume_refuses_other_settings(run, tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    assert bench(out, tiny_models, "--tasks", TASKS, "--max-tokens", "9", "--resume") == 2
    assert "--resume" in capsys.readouterr().err


def test_rebuild_from_jsonl(run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    before = json.loads((out / "results.json").read_text())["rows"]
    for name in ("results.json", "report.md", "speedup_by_task.png"):
        (out / name).unlink()
    assert main(["bench", "--rebuild", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["rows"] == before
    assert (out / "report.md").is_file() and (out / "speedup_by_task.png").is_file()


def test_custom_prompts_and_sampling(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "the quick brown fox jumps over the lazy dog. the quick brown", "task": "mine"}\n'
                       '{"text": "1 2 3 4 5 6 7 8 9 10 11", "chat": false, "task": "mine"}\n')
    out = tmp_path / "out"
    assert main(["bench", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts), "--max-tokens", "6",
                 "--systems", "specdecode", "--methods", "plain,ngram", "--temperature", "0.8",
                 "--prompts-per-task", "2", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["task"] for r in results["rows"]} == {"mine", "all"}
    assert all(r["prompts"] == 2 and r["identical_share"] is None for r in results["rows"])
    assert all(r["speedup_vs_transformers_plain"] is None for r in results["rows"])


def test_prompts_with_their_own_json_schemas(tiny_models, tmp_path, capsys):
    """A prompts file may constrain each prompt by its own schema (an object, or a name of
    schemas/<name>.json beside the file): every answer follows it, speculation changes nothing;
    a schema that is missing or invalid is one line naming the file, the line and the problem."""
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "count.json").write_text(json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}))
    inline = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "count the sheep", "task": "a", "schema": "count"}) + "\n"
                       + json.dumps({"text": "is it ok", "task": "b", "schema": inline}) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts), "--max-tokens", "16",
                 "--systems", "specdecode", "--methods", "plain,ngram", "-k", "4", "--no-progress",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert all(r["identical_share"] == 1.0 for r in results["rows"])
    from specdecode.tokenizer import Tokenizer
    tok = Tokenizer(tiny_models["llama"])
    texts = {(r["task"], r["method"]): tok.decode(r["token_ids"]) for r in
             (json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines())
             if r.get("type") == "measurement"}
    assert all(t.startswith('{"n": ') for (task, _), t in texts.items() if task == "a"), texts
    assert all(t.startswith('{"ok": ') for (task, _), t in texts.items() if task == "b"), texts
    for line, problem in ((json.dumps({"text": "x", "schema": "missing"}), "no schemas/missing.json"),
                          (json.dumps({"text": "x", "schema": {"type": "objectx"}}), "invalid json_schema"),
                          (json.dumps({"text": "x", "schema": 5}), "must be a JSON schema object")):
        prompts.write_text(line + "\n")
        assert main(["bench", "--model", str(tiny_models["llama"]), "--prompts-file", str(prompts),
                     "--out", str(tmp_path / "bad")]) != 0
        err = capsys.readouterr().err
        assert f"{prompts}:1: schema" in err and problem in err, err


def test_aggregate_arithmetic():
    def rec(system, method, k, pid, tps, ids):
        return {"type": "measurement", "system": system, "method": method, "k": k, "task": "qa", "prompt_id": pid,
                "tokens": len(ids), "token_ids": ids, "seconds": len(ids) / tps, "tokens_per_s": tps}
    records = [rec("transformers", "plain", 0, "1", 10.0, [1, 2, 3]), rec("transformers", "plain", 0, "2", 20.0, [4]),
               rec("transformers", "ngram", 3, "1", 30.0, [1, 2, 3]), rec("transformers", "ngram", 3, "2", 30.0, [5]),
               {"type": "divergence", "system": "transformers", "method": "ngram", "k": 3, "task": "qa",
                "prompt_id": "2", "gap": 0.01, "top1_top2_gap": 0.01}]
    rows = {(r["method"], r["task"]): r for r in aggregate.build_rows(records, ["qa"], greedy=True)}
    ngram = rows[("ngram", "qa")]
    assert ngram["speedup"] == pytest.approx(30.0 / 15.0)        # ratio of per-prompt means
    assert ngram["speedup_vs_transformers_plain"] == pytest.approx(2.0)
    assert ngram["tokens_per_s_total"] == pytest.approx(4 / (3 / 30 + 1 / 30))
    assert ngram["identical_share"] == 0.5 and ngram["divergences"] == 1
    assert ngram["first_divergence"] == {"task": "qa", "prompt_id": "2", "position": 0, "plain_token": 4,
                                         "token": 5, "gap": 0.01, "top1_top2_gap": 0.01}
    assert rows[("plain", "all")]["identical_share"] == 1.0
    assert aggregate.first_difference([1, 2], [1, 2, 3]) == 2 and aggregate.first_difference([1], [1]) is None


def test_drafter_options_reach_the_drafters_that_take_them(tiny_models, tmp_path, capsys, monkeypatch):
    from specdecode.drafters import registry
    built = []
    real = registry.build_drafter

    def spy(method, target, **options):
        built.append((method, {k: v for k, v in options.items() if k == "draft_confidence"}))
        return real(method, target, **options)
    monkeypatch.setattr(registry, "build_drafter", spy)
    out = tmp_path / "out"
    assert bench(out, tiny_models, "--tasks", "qa", "--systems", "specdecode", "--methods", "plain,ngram,model",
                 "--drafter-option", "draft_confidence=0.5") == 0
    cells = [(m, o) for m, o in built if m in ("ngram", "model")]
    assert ("model", {"draft_confidence": 0.5}) in cells and ("ngram", {}) in cells      # ngram has no such option
    results = json.loads((out / "results.json").read_text())
    assert "--drafter-option draft_confidence=0.5" in results["config"]["command"]     # reproduces the run
    assert all(r["identical_share"] == 1.0 for r in results["rows"])
    # an option no selected method takes: one line naming it and the options there are
    assert main(["bench", "--methods", "plain,ngram", "--drafter-option", "draft_confidence=0.5", "--out",
                 str(tmp_path / "x")]) != 0
    assert "--drafter-option 'draft_confidence' is not an option of any of --methods plain,ngram (their options: " \
           "ngram_max, ngram_min, text_match)" in capsys.readouterr().err


def test_regressions_are_flagged_in_the_report():
    from specdecode.bench.report import _regression_lines, regressions
    rows = [{"system": "specdecode", "method": "plain", "k": 0, "task": "all", "speedup": 1.0},
            {"system": "specdecode", "method": "ngram", "k": 5, "task": "all", "speedup": 1.2},
            {"system": "specdecode", "method": "ngram", "k": 5, "task": "qa", "speedup": 0.95},
            {"system": "specdecode", "method": "eagle", "k": 5, "task": "rag", "speedup": 0.969},
            {"system": "transformers", "method": "model", "k": 5, "task": "all", "speedup": None}]
    assert [(r["method"], r["task"]) for r in regressions(rows)] == [("ngram", "qa"), ("eagle", "rag")]
    text = "\n".join(_regression_lines(rows))
    assert "2 cell(s) below 0.97x" in text and text.index("0.95x") < text.index("0.97x |")
    assert _regression_lines(rows[:2]) == ["No speculative cell is below 0.97x its system's plain decoding."]


def test_quick_runs_plain_and_the_default_drafter_on_a_prompt_per_task():
    """`bench --quick` (the default) is the short look the docs promise: plain decoding and the default
    drafter on one prompt of each task; --full runs every method, and --methods still wins."""
    from specdecode.api import default_method
    from specdecode.bench.cli import config_from, methods
    from specdecode.cli import build_parser
    quick = config_from(build_parser().parse_args(["bench"]))
    assert quick["methods"] == ["plain", default_method(None)] and quick["prompts_per_task"] == 1
    assert quick["command"] == "specdecode bench --quick -k 5 --out bench-out", quick["command"]
    full = config_from(build_parser().parse_args(["bench", "--full"]))
    assert full["methods"] == list(methods()) and "--methods" not in full["command"]
    chosen = config_from(build_parser().parse_args(["bench", "--methods", "plain,suffix"]))
    assert chosen["methods"] == ["plain", "suffix"] and "--methods plain,suffix" in chosen["command"]
