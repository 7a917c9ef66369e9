"""Server parts without a server: the paged KV cache against the contiguous one, its block
accounting, and the speculation policy's switching (torch-free)."""
from __future__ import annotations

import pytest
import torch

from specdecode.kv_cache import KVCache
from specdecode.serve.paged_cache import CacheFull, PagedKVCache
from specdecode.engine.costs import SPIKE
from specdecode.serve.policy import AUTO, OFF, ON, Decision, RowPolicy, SpeculationPolicy, expected_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_models):
    from specdecode.models.loader import load_model
    return load_model(str(tiny_models["qwen2"]), dtype="fp32", progress=False)


def paged_for(model, rows=4, max_len=96, num_blocks=64, block_size=4):
    c = model.config
    return PagedKVCache(c.num_layers, rows, c.num_kv_heads, c.head_dim, max_len, num_blocks, block_size,
                        model.dtype, model.device)


def test_paged_cache_gives_the_logits_of_the_contiguous_cache(target):
    """Ragged prefill + ragged multi-token steps with rollbacks: same logits as KVCache."""
    model = target.model
    c = model.config
    dense = KVCache(c.num_layers, 3, c.num_kv_heads, c.head_dim, 96, model.dtype)
    paged = paged_for(model, rows=5)
    rows = [3, 0, 4]                     # arbitrary paged rows for dense rows 0, 1, 2
    for r in rows:
        paged.reserve(r, 80)
    gen = torch.Generator().manual_seed(0)
    lengths = [0, 0, 0]
    for step, width in enumerate([11, 1, 4, 3, 6, 2]):
        tokens = torch.randint(0, model.vocab_size, (3, width), generator=gen)
        starts = torch.tensor(lengths)
        want = model.forward(tokens, dense, starts, rows=torch.arange(3))
        got = model.forward(tokens, paged, starts, rows=torch.tensor(rows))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        keep = [width - (b + step) % width for b in range(3)]      # ragged acceptance, some rollback
        for b in range(3):
            lengths[b] += keep[b]
            dense.truncate(b, lengths[b])
            paged.truncate(rows[b], lengths[b])
    assert [paged.lengths[r] for r in rows] == lengths


def test_blocks_follow_the_tokens_held_and_return_on_release(target):
    paged = paged_for(target.model, rows=2, num_blocks=9, block_size=4)      # 8 usable blocks
    assert paged.can_reserve(32) and not paged.can_reserve(33)
    paged.reserve(0, 20)                              # 5 blocks reserved, none allocated yet
    assert paged.used_blocks == 0 and paged.used_bytes() == 0
    with pytest.raises(CacheFull):
        paged.reserve(1, 16)                          # 4 more blocks: over the 8
    tokens = torch.randint(0, 50, (1, 6))
    target.model.forward(tokens, paged, torch.tensor([0]), rows=torch.tensor([0]))
    assert paged.used_blocks == 2                     # positions 0..5 -> blocks 0 and 1
    paged.truncate(0, 4)                              # rolled back to a block boundary: block 1 freed
    assert paged.used_blocks == 1
    target.model.forward(torch.randint(0, 50, (1, 30)), paged, torch.tensor([4]), rows=torch.tensor([0]))
    assert paged.used_blocks == 5                     # capped at the reservation; the rest went to scratch
    paged.truncate(0, 20)
    paged.release(0)
    assert paged.used_blocks == 0 and paged.reserved_blocks == 0 and paged.lengths[0] == 0
    paged.reserve(1, 32)                              # the whole pool is free again
    with pytest.raises(ValueError, match="row 1 is in use"):
        paged.reserve(1, 4)


def rows(n, k=5, mode=AUTO):
    return [RowPolicy(mode=mode, k=k, probe_wait=8) for _ in range(n)]


def run_steps(policy, rs, alpha_hits, steps, plain_s=0.01, spec_s=0.012):
    """Steps where each drafting row accepts `alpha_hits` drafts of k; returns the decisions."""
    decisions = []
    for _ in range(steps):
        ks, d = policy.plan(rs)
        decisions += d
        drafted = ks
        accepted = [min(alpha_hits, k) for k in ks]
        decisions += policy.observe(rs, ks, drafted, accepted, spec_s if any(ks) else plain_s)
    return decisions


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_a_request_whose_drafts_are_never_accepted_is_switched_off_then_probed_back_on():
    policy = SpeculationPolicy(shadow=False, draft_cost=0.1)
    rs = rows(1)
    decisions = run_steps(policy, rs, alpha_hits=0, steps=6)
    assert [(d.scope, d.action, d.reason) for d in decisions if d.action == "disabled"] == \
        [("request", "disabled", "low_acceptance")]
    assert not rs[0].on
    # off: plain steps, then a probe step after probe_wait; the probe fails -> back-off doubles
    decisions = run_steps(policy, rs, alpha_hits=0, steps=9)
    assert any(d.action == "probe" for d in decisions) and rs[0].probe_wait == 16 and not rs[0].on
    # the drafts become good: the next probe switches it back on
    decisions = run_steps(policy, rs, alpha_hits=5, steps=17)
    assert ("request", "enabled", "probe") in [(d.scope, d.action, d.reason) for d in decisions]
    assert rs[0].on


def test_lookup_drafts_are_scored_for_free_while_off():
    policy = SpeculationPolicy(shadow=True, draft_cost=0.01)
    rs = rows(1)
    run_steps(policy, rs, alpha_hits=0, steps=6)
    assert not rs[0].on
    ks, _ = policy.plan(rs)
    assert ks == [0]                                  # no probes: shadow drafts instead
    assert policy.observe_shadow(rs[0], 1, drafted=5, matched=0) == []
    decisions = policy.observe_shadow(rs[0], 1, drafted=5, matched=5)
    decisions += policy.observe_shadow(rs[0], 1, drafted=5, matched=5)
    assert ("request", "enabled", "acceptance_recovered") in [(d.scope, d.action, d.reason) for d in decisions]


def test_one_descheduled_drafting_step_does_not_keep_a_lookup_off():
    """A row's drafting steps are the only measure of a speculative step's cost, and a row switched
    off stops drafting: a step slowed 10x among them (another process took the core) is counted at
    most SPIKE times the estimate, so good shadow drafts switch the row back on."""
    policy = SpeculationPolicy(shadow=True, draft_cost=0.01)
    rs = rows(1)
    plain_s, spec_s, drafting_steps = 0.01, 0.012, 0
    while rs[0].on:                                       # rejected drafts: switched off after a few steps
        ks, _ = policy.plan(rs)
        drafting_steps += any(ks)
        seconds = plain_s if not any(ks) else 10 * spec_s if drafting_steps == 1 else spec_s
        policy.observe(rs, ks, ks, [0], seconds)          # the first drafting step is descheduled
    assert drafting_steps == 3 and policy.cost_ratio(1, 5) < SPIKE * (1.0 + 5 * (0.01 + 0.03))
    decisions = sum((policy.observe_shadow(rs[0], 1, drafted=5, matched=5) for _ in range(3)), [])
    assert rs[0].on and decisions == [Decision("request", "enabled", "acceptance_recovered")]
    policy.costs.spec[(1, 5)] = spec_s
    policy.observe(rs, [5], [5], [5], 100 * spec_s)      # measured: a later spike moves it a bounded step
    assert policy.costs.spec[(1, 5)] == pytest.approx(0.8 * spec_s + 0.2 * SPIKE * spec_s)


def test_the_policy_imports_without_torch():
    """serve/policy.py (and engine/costs.py's SPIKE and toward, which it reads) stay torch-free."""
    import subprocess
    import sys
    code = "import sys, specdecode.serve.policy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_forced_modes_are_left_alone():
    policy = SpeculationPolicy(shadow=False, draft_cost=0.5)
    forced_on, forced_off = rows(1, mode=ON), rows(1, mode=OFF)
    run_steps(policy, forced_on + forced_off, alpha_hits=0, steps=10)
    ks, _ = policy.plan(forced_on + forced_off)
    assert ks == [5, 0] and forced_on[0].on


def test_the_batch_is_switched_off_when_verifying_costs_more_than_it_saves_and_on_when_it_shrinks():
    policy = SpeculationPolicy(shadow=False, draft_cost=0.05)
    rs = rows(8, k=4)
    # a spec step costs 3x a plain one at batch 8, one accepted draft in four: E = 1.33 < 3
    decisions = run_steps(policy, rs, alpha_hits=1, steps=8, plain_s=0.01, spec_s=0.03)
    assert ("batch", "disabled", "batch_cost") in [(d.scope, d.action, d.reason) for d in decisions]
    assert not policy.batch_on and policy.plan(rs)[0] == [0] * 8
    decisions = run_steps(policy, rs[:3], alpha_hits=4, steps=1)
    assert ("batch", "enabled", "batch_size_dropped") in [(d.scope, d.action, d.reason) for d in decisions]


def test_the_batch_stays_off_when_it_shrinks_to_a_size_measured_not_to_pay():
    policy = SpeculationPolicy(shadow=False, draft_cost=0.05)
    rs = rows(8, k=4)
    policy.costs.plain[7], policy.costs.spec[(7, 4)] = 0.01, 0.03        # measured at batch 7
    decisions = run_steps(policy, rs, alpha_hits=1, steps=8, plain_s=0.01, spec_s=0.03)
    assert not policy.batch_on and ("batch", "disabled", "batch_cost") in [(d.scope, d.action, d.reason) for d in decisions]
    ks, decisions = policy.plan(rs[:7])
    assert ks == [0] * 7 and not any(d.action == "enabled" for d in decisions) and policy.batch_off_at == 7
    ks, decisions = policy.plan(rs[:3])               # never measured at 3: try again
    assert ("batch", "enabled", "batch_size_dropped") in [(d.scope, d.action, d.reason) for d in decisions]


def test_a_batch_switched_off_for_its_rows_acceptance_does_not_keep_other_requests_plain():
    """The batch was switched off with its rows' acceptance; when it shrinks, the rows now in it are
    judged by their own: a lone new request by its own policy, and rows whose shadow drafts pay at
    a size measured not to pay with the old rows' acceptance."""
    policy = SpeculationPolicy(shadow=True, draft_cost=0.01)
    rs = rows(8, k=4)
    for size in (1, 2, 3):
        policy.costs.plain[size], policy.costs.spec[(size, 4)] = 0.01, 0.02   # a step of drafts: 2 plain
        policy.costs.plain_age[size] = 0
    run_steps(policy, rs, alpha_hits=1, steps=8, plain_s=0.01, spec_s=0.03)
    assert not policy.batch_on and policy.batch_alpha <= 0.5     # E = 1.94 tokens: below 2 steps
    ks, decisions = policy.plan(rows(1, k=4))         # a new request alone (an exact Predicted Output, say)
    assert ks == [4] and Decision("batch", "enabled", "batch_size_dropped") in decisions
    run_steps(policy, rs, alpha_hits=1, steps=8, plain_s=0.01, spec_s=0.03)
    assert not policy.batch_on
    ks, _ = policy.plan(rs[:3])                       # the old rows at 3: measured not to pay, stay off
    assert ks == [0, 0, 0] and not policy.batch_on and policy.batch_off_at == 3
    fresh = rows(2, k=4)
    for r in fresh:                                   # new rows whose shadow drafts are all right
        policy.observe_shadow(r, 2, drafted=4, matched=4)
    ks, decisions = policy.plan(fresh)
    assert ks == [4] * 2 and Decision("batch", "enabled", "batch_size_dropped") in decisions


def test_a_batch_of_lookup_rows_is_probed_only_when_its_shadow_drafts_would_pay():
    """Off for cost at 8 rows, a lookup drafter's batch is not probed blind (PROBE_ALPHA): the rows'
    shadow drafts measure their acceptance, and the batch is probed once that acceptance would pay."""
    policy = SpeculationPolicy(shadow=True, draft_cost=0.01)
    rs = rows(8, k=4)
    run_steps(policy, rs, alpha_hits=1, steps=8, plain_s=0.01, spec_s=0.025)     # a step of drafts: 2.5 plain
    assert not policy.batch_on and policy.batch_reason == "batch_cost"
    probes = []
    for step in range(60):                      # shadows right one draft in four: no probe
        for r in rs:
            policy.observe_shadow(r, 8, drafted=4, matched=1)
        ks, decisions = policy.plan(rs)
        probes += [d for d in decisions if d.action == "probe"]
        policy.observe(rs, ks, [0] * 8, [0] * 8, 0.01)
    assert probes == [] and not policy.batch_on
    for r in rs:                                # then every shadow draft right: probed at the next step
        for _ in range(4):
            policy.observe_shadow(r, 8, drafted=4, matched=4)
    ks, decisions = policy.plan(rs)
    assert ks == [4] * 8 and Decision("batch", "probe", "periodic") in decisions


def test_fixed_batch_size_limit():
    policy = SpeculationPolicy(shadow=True, draft_cost=0.01, max_batch_size=2)
    ks, decisions = policy.plan(rows(3))
    assert ks == [0, 0, 0] and decisions[0].reason == "batch_size"
    ks, decisions = policy.plan(rows(2))
    assert decisions[0].reason == "batch_size_dropped"


class _CharTokenizer:
    """Token i is the character chr(i)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("stop", [["7"], ["5, 6"], [" 7"], ["xyz", ", 6"]])
def test_streamed_text_never_shows_a_stop_string(stop):
    """Streaming sends the text the engine returns without streaming: nothing of a stop string,
    even when the token that completes it arrives in the same step as text before it."""
    from specdecode.params import SamplingParams
    from specdecode.serve.app import TextStream
    text = "1, 2, 3, 4, 5, 6, 7, 8"
    end = min(text.find(s) for s in stop if s in text)
    for step in (1, 2, 3, 5):
        stream = TextStream(_CharTokenizer(), SamplingParams(stop=stop))
        sent = ""
        for i in range(0, len(text), step):
            sent += stream.add([ord(c) for c in text[i:i + step]], False)[0]
            assert all(s not in sent for s in stop) and text.startswith(sent)
            if any(s in text[:i + step] for s in stop):
                break
        sent += stream.finish(end)
        assert sent == text[:end], (step, sent)


def test_held_tokens_post_one_merged_event_then_the_last():
    """A non-streamed choice's sink keeps its tokens on the engine thread: nothing is posted per
    step; at the end one Tokens event with every id, kind and logprob in order, then the final event."""
    from specdecode.serve.app import HeldTokens
    from specdecode.serve.scheduler import Failed, Finished, Tokens
    posted = []
    sink = HeldTokens(posted.append)
    sink(Tokens([1, 2], ["accepted", "bonus"], [-0.1, -0.2]))
    sink(Tokens([3], ["recovered"], [-0.3]))
    assert posted == []
    done = Finished("stop", None, {}, {})
    sink(done)
    assert [type(e) for e in posted] == [Tokens, Finished] and posted[1] is done
    assert (posted[0].ids, posted[0].kinds, posted[0].logprobs) == ([1, 2, 3], ["accepted", "bonus", "recovered"],
                                                                    [-0.1, -0.2, -0.3])
    posted.clear()
    failing = HeldTokens(posted.append)
    failing(Tokens([7], ["bonus"], None))
    failing(Failed(500, "boom"))                 # an error after some tokens: the tokens first, then it
    assert [type(e) for e in posted] == [Tokens, Failed] and posted[0].logprobs is None


def test_paced_tokens_send_the_first_at_once_then_at_most_every_interval(monkeypatch):
    """A streamed choice's sink: the first tokens go at once (time to first token), later ones
    are merged until `interval` has passed since the last post, and what is held goes before the
    final event; ids, kinds and logprobs in order."""
    import specdecode.serve.app as app
    from specdecode.serve.scheduler import Finished, Tokens
    now = [100.0]
    monkeypatch.setattr(app.time, "monotonic", lambda: now[0])
    posted = []
    sink = app.PacedTokens(posted.append, interval=0.02)
    sink(Tokens([1], ["bonus"], [-0.1]))
    assert [e.ids for e in posted] == [[1]]                       # at once
    for t, token in ((0.005, 2), (0.010, 3), (0.019, 4)):
        now[0] = 100.0 + t
        sink(Tokens([token], ["accepted"], [-0.2]))
    assert len(posted) == 1                                      # within 20 ms: held
    now[0] = 100.021
    sink(Tokens([5], ["recovered"], [-0.3]))
    assert posted[1].ids == [2, 3, 4, 5] and posted[1].kinds == ["accepted"] * 3 + ["recovered"]
    assert posted[1].logprobs == [-0.2, -0.2, -0.2, -0.3]
    now[0] = 100.025
    sink(Tokens([6], ["bonus"], None))
    done = Finished("length", None, {}, {})
    sink(done)
    assert [e.ids for e in posted[2:3]] == [[6]] and posted[3] is done and len(posted) == 4


@pytest.mark.parametrize("bad", [-1, 10_001, "20", True, float("nan")])
def test_bad_stream_interval_is_refused_by_name(bad):
    from specdecode.params import ParamError
    from specdecode.serve.scheduler import ServeConfig
    with pytest.raises(ParamError, match=r"stream_interval_ms must be a number of milliseconds in \[0, 10000\]"):
        ServeConfig(stream_interval_ms=bad)


def test_server_shadow_drafts_are_one_call_and_take_a_bounded_share():
    """The server drafts the shadows of all switched-off rows in one propose call, and only every
    n-th step where they cost more than SHADOW_SHARE of a step (a call per row per step cost 24
    rows ~5% of their steps)."""
    from types import SimpleNamespace as NS

    from specdecode.drafters.base import DraftProposal
    from specdecode.engine.shadows import SHADOW_SHARE
    from specdecode.serve.policy import RowPolicy
    from specdecode.serve.scheduler import Scheduler

    calls = []

    def propose(seqs, rooms):
        calls.append(len(seqs))
        return DraftProposal.from_lists([[7, 8, 9][:room] for room in rooms])

    rows = [NS(policy=RowPolicy(k=3), k_now=0, params=NS(max_tokens=50), num_output=i) for i in range(4)]
    sched = NS(policy=NS(shadow=True, batch_on=False), inner_drafter=NS(propose=propose),
               shadow_seconds=0.0, step_seconds=0.0, shadow_steps=0, shadowed_now=False)
    Scheduler._shadow_drafts(sched, rows)
    assert calls == [4] and [r.policy.shadow for r in rows] == [(i, [7, 8, 9]) for i in range(4)]
    sched.step_seconds, sched.shadow_seconds = 1.0, 3 * SHADOW_SHARE           # three steps' share a shadow
    for step in range(12):
        for r in rows:
            r.policy.shadow = None
        Scheduler._shadow_drafts(sched, rows)
    assert calls[1:] == [4] * 4                                               # every third step
