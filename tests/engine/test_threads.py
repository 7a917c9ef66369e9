"""The thread tuner (engine/threads.py): steps move to the thread count that measures faster and
follow a machine that becomes busy or idle again; answers do not depend on the count."""
from __future__ import annotations

import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.threads import ThreadTuner


def drive(tuner, steps, seconds_per_row):
    """Run `steps` steps of 3 rows whose time per row is seconds_per_row(threads)."""
    for _ in range(steps):
        tuner.before()
        tuner.after(3 * seconds_per_row(tuner.running), 3)


def test_the_tuner_follows_a_machine_that_becomes_busy_and_idle_again():
    calls = []
    tuner = ThreadTuner(max_threads=2, period=10, max_period=20, trial=4, set_threads=calls.append)
    idle = {2: 1.0, 1: 1.6}.get            # idle: 2 threads faster
    busy = {2: 2.5, 1: 1.7}.get            # another process on a core: 1 thread faster
    drive(tuner, 40, idle)
    assert tuner.current == 2 and tuner.switches == 0 and 1 in calls       # tried 1, kept 2
    drive(tuner, 30, busy)                 # within a few dozen steps: 1 thread
    assert tuner.current == 1
    drive(tuner, 30, idle)
    assert tuner.current == 2 and tuner.switches == 2
    assert ThreadTuner(max_threads=1).active is False


def test_steps_that_suddenly_take_many_times_as_long_start_a_trial_at_once():
    """A machine whose other processes crowd the cores: 2-thread steps went from ~10 ms to seconds.
    Two such steps in a row start a trial (not after up to max_period steps); a lone spike does not."""
    tuner = ThreadTuner(max_threads=2, period=8, max_period=512, trial=3, set_threads=lambda n: None)
    drive(tuner, 200, {2: 1.0, 1: 1.6}.get)                 # idle: the interval grew to its max
    assert tuner.current == 2 and tuner.interval >= 128
    trials = tuner.trials
    drive(tuner, 1, {2: 10.0, 1: 1.6}.get)                  # one descheduled step: nothing
    drive(tuner, 1, {2: 1.0, 1: 1.6}.get)
    assert tuner.trials == trials
    drive(tuner, 8, {2: 50.0, 1: 1.7}.get)                  # crowded: 1 thread within a few steps
    assert tuner.current == 1 and tuner.trials == trials + 1


def test_noise_within_the_margin_does_not_switch_and_lost_trials_back_off():
    tuner = ThreadTuner(max_threads=2, period=8, max_period=64, trial=4, set_threads=lambda n: None)
    drive(tuner, 300, {2: 1.0, 1: 0.97}.get)
    assert tuner.current == 2 and tuner.switches == 0
    assert tuner.interval == 64 and tuner.trials <= 8          # 8, 16, 32, 64, 64, ...: few trials


def test_a_trial_compares_passes_of_the_same_size_only():
    """A pass of 8 rows costs ~1.5 one-row steps: per row it is cheap on either count. Steps of one row
    on 2 threads, then a trial on 1 thread whose steps are 8-row passes, must not take 1 thread
    (the old per-row comparison across sizes did, and the server then ran on one thread)."""
    cost = {(2, 1): 1.0, (1, 1): 1.6, (2, 8): 1.5, (1, 8): 2.4}      # seconds per pass: 1 thread slower
    tuner = ThreadTuner(max_threads=2, period=10, max_period=40, trial=3, set_threads=lambda n: None)
    for step in range(200):
        tuner.before()
        rows = 8 if tuner.running == 1 or step % 5 == 0 else 1      # the trial's steps happen to be large
        tuner.after(cost[tuner.running, rows], rows)
    assert tuner.current == 2 and tuner.switches == 0 and tuner.trials >= 3


def test_a_trial_without_same_size_steps_runs_longer_then_decides():
    tuner = ThreadTuner(max_threads=2, period=10, max_period=40, trial=3, set_threads=lambda n: None)
    sizes = iter([1] * 9 + [16, 16, 16, 1, 1, 1] + [1] * 100)       # the trial starts on unseen sizes
    cost = {2: 1.0, 1: 0.5}                                          # 1 thread is faster (a busy core)
    for _ in range(30):
        tuner.before()
        rows = next(sizes)
        tuner.after(cost[tuner.running] * rows, rows)
    assert tuner.current == 1 and tuner.switches == 1


def test_answers_do_not_depend_on_the_thread_count(tiny_models):
    threads = torch.get_num_threads()
    try:
        llm = LLM(model=str(tiny_models["llama"]), method="ngram", dtype="fp32", progress=False, prefix_cache=False)
        prompt = llm.tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
        params = [SamplingParams(max_tokens=120, ignore_eos=True),
                  SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.9, seed=4)]
        want = [o.token_ids for o in llm.generate([prompt, prompt], params)]
        llm.core.threads = ThreadTuner(max_threads=2, period=3, max_period=3, trial=2)      # trials every few steps
        got = [o.token_ids for o in llm.generate([prompt, prompt], params)]
        assert got == want and llm.core.threads.steps > 20
    finally:
        torch.set_num_threads(threads)
