"""The offline replay of lookup drafting (scripts/analysis/lookup_ceiling.py) against the engine."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from specdecode import LLM, SamplingParams

SCRIPT = Path(__file__).parents[2] / "scripts" / "analysis" / "lookup_ceiling.py"
spec = importlib.util.spec_from_file_location("lookup_ceiling", SCRIPT)
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)
COSTS = ceiling.cost_table(list(ceiling.DEFAULT_COSTS), 16)


def test_replay_without_drafts_is_plain_decoding():
    sample = {"task": "t", "prompt": [1, 2, 3], "output": [4, 5, 6, 7], "max_tokens": 4}
    result = ceiling.replay([sample], lambda context, room: [], COSTS)
    assert result["mean_accepted_length"] == 1.0 and result["decode_speedup"] == 1.0


def test_replay_prices_steps_and_stops_at_the_output_end():
    # the prompt holds the whole output after "9": one step accepts 3 drafts (+1 bonus), the
    # room rule (max_tokens - emitted - 1) caps the draft at 3, so 4 tokens in one step
    sample = {"task": "t", "prompt": [9, 4, 5, 6, 7, 0, 9], "output": [4, 5, 6, 7], "max_tokens": 4}
    result = ceiling.replay([sample], lambda c, room: [ceiling.lookup(c, min(5, room), 1, 4)], COSTS)
    assert result["mean_accepted_length"] == 4.0
    assert result["decode_speedup"] == pytest.approx(4 / COSTS[3])


def test_cost_table_extrapolates_past_the_measured_table():
    table = ceiling.cost_table([1.1, 1.2, 1.3], 5)
    assert table[:4].tolist() == [1.0, 1.1, 1.2, 1.3] and table[5] == pytest.approx(1.5)


def test_replay_reproduces_the_engine_mean_accepted_length(tiny_models, one_thread):
    llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", adaptive=False)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = llm.generate(prompt, params, num_speculative_tokens=0)[0]
    spec_out = llm.generate(prompt, params, num_speculative_tokens=5)[0]
    assert spec_out.token_ids == plain.token_ids
    sample = {"task": "t", "prompt": list(prompt), "output": list(plain.token_ids), "max_tokens": 40}
    result = ceiling.replay([sample], lambda c, room: [ceiling.lookup(c, min(5, room), 1, 4)], COSTS)
    stats = spec_out.stats
    assert result["mean_accepted_length"] == pytest.approx(stats["mean_accepted_length"], abs=1e-3)
    assert stats["accepted_tokens"] > 0 and np.isfinite(result["decode_speedup"])
