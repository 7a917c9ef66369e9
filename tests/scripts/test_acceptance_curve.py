"""The acceptance curve (scripts/measure/acceptance_curve.py): the corruption that sets a prediction's
acceptance, the break-even read off the curve, and a short run end to end on the tiny random Qwen3-MoE."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_qwen3_moe

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "measure" / "acceptance_curve.py"
spec = importlib.util.spec_from_file_location("acceptance_curve", SCRIPT)
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)


def test_corruption_keeps_each_token_at_the_rate_and_replaces_it_by_another():
    ids = list(range(50)) * 40
    assert curve.corrupt(ids, 1.0, 100, seed=1) == ids
    assert all(a != b for a, b in zip(curve.corrupt(ids, 0.0, 100, seed=1), ids))
    kept = sum(a == b for a, b in zip(curve.corrupt(ids, 0.7, 100, seed=2), ids)) / len(ids)
    assert kept == pytest.approx(0.7, abs=0.03)
    assert all(0 <= t < 100 for t in curve.corrupt(ids, 0.3, 100, seed=3))


def test_break_even_is_where_the_speed_up_crosses_one():
    assert curve.break_even([(0.3, 0.6), (0.7, 0.9), (0.9, 1.3)]) == "0.75"
    assert curve.break_even([(0.5, 1.1), (0.9, 2.0)]) == "<= 0.50"
    assert curve.break_even([(0.5, 0.7), (1.0, 0.9)]) == "> 1.00"


def test_bad_rates_and_sizes_are_one_clear_line():
    for argv, said in ((["--rates", "0.5,1.5"], "--rates takes values in [0.0, 1.0]"),
                       (["--k", "0"], "--k takes values in [1, 16]"), (["--rounds", "0"], "--rounds must be >= 1")):
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_short_curve_on_a_tiny_moe_runs_end_to_end(tmp_path):
    make_qwen3_moe(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path), "--rates", "0.5,1.0", "--k", "2",
                           "--prompts", "1", "--tokens", "16", "--rounds", "1", "--threads", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "worst case for the union of experts" in out and "outputs identical to plain decoding: yes" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("k=2 ", "auto "))]
    assert [r[:2] for r in rows] == [["k=2", "0.50"], ["k=2", "1.00"], ["auto", "0.50"], ["auto", "1.00"]]
    assert rows[1][5] == "1.00" and float(rows[1][7]) >= 2.5        # every draft accepted: k + 1 tokens a step
    assert float(rows[0][5]) < 0.8                                   # (but the last, cut by max_tokens)
