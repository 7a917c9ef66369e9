"""Tests for specdecode.verify: hand-built cases and the losslessness (distribution) test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdecode.verify as verify_module
from specdecode.params import SamplingParams
from specdecode.sampling import probs_from_logits, transform_logits
from specdecode.verify import PAD_TOKEN, VerifyResult, verify

N_SAMPLES = 100_000
CHUNK = 2_000             # rows per verify call: a few [CHUNK, vocab] tensors (8 MB at vocab 1000)
P_VALUE_MIN = 1e-3
TV_MAX = 0.01
TV_NOISE_MAX = 0.004      # only assert TV < TV_MAX where an exact sampler's expected TV is below this
CHI2_MIN_SAMPLES = 1_000  # positions with fewer samples are not checked


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """These tests run many small ops; torch's intra-op threads make them up to 20x slower when
    the CPU is shared with other processes (threads wait for each other), so use one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def one_hot(tokens, vocab):
    """[...] token ids -> [..., vocab] float32 one-hot (greedy target / draft distributions)."""
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


# ----------------------------------------------------------------------------- hand-built


def test_greedy_perfect_match_accepts_all_and_adds_bonus():
    target_probs = one_hot([[3, 1, 4, 1]], 6)                 # [1, k+1=4, 6]
    result = verify(torch.tensor([[3, 1, 4]]), torch.tensor([3]), None, target_probs, torch.tensor([True]))
    assert isinstance(result, VerifyResult)
    assert result.tokens.tolist() == [[3, 1, 4, 1]]
    assert result.num_accepted.tolist() == [3]
    assert result.num_emitted.tolist() == [4]
    assert result.tokens.dtype == result.num_accepted.dtype == result.num_emitted.dtype == torch.int64


def test_greedy_early_mismatch_emits_target_argmax_then_padding():
    target_probs = one_hot([[3, 1, 4, 1], [3, 1, 4, 1]], 6)
    draft_tokens = torch.tensor([[3, 2, 4], [0, 1, 4]])
    result = verify(draft_tokens, torch.tensor([3, 3]), None, target_probs, torch.tensor([True, True]))
    assert result.tokens.tolist() == [[3, 1, PAD_TOKEN, PAD_TOKEN], [3, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]]
    assert result.num_accepted.tolist() == [1, 0]
    assert result.num_emitted.tolist() == [2, 1]


def test_greedy_with_non_one_hot_target_uses_argmax_and_draft_probs():
    target_probs = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.3, 0.5]]])          # [1, 2, 3]
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]]])
    result = verify(torch.tensor([[1]]), torch.tensor([1]), draft_probs, target_probs, torch.tensor([True]))
    assert result.tokens.tolist() == [[1, 2]]
    result = verify(torch.tensor([[2]]), torch.tensor([1]), draft_probs, target_probs, torch.tensor([True]))
    assert result.tokens.tolist() == [[1, PAD_TOKEN]]


def test_empty_draft_k0_samples_one_token_from_target():
    target_probs = torch.tensor([[[0.0, 0.0, 1.0, 0.0]], [[0.0, 0.7, 0.0, 0.3]], [[0.5, 0.5, 0.0, 0.0]]])
    result = verify(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), None,
                    target_probs, torch.tensor([False, False, True]), torch.Generator().manual_seed(0))
    assert result.tokens.shape == (3, 1)
    assert result.tokens[0, 0].item() == 2
    assert result.tokens[1, 0].item() in (1, 3)
    assert result.tokens[2, 0].item() == 0                    # greedy tie -> lowest index
    assert result.num_accepted.tolist() == [0, 0, 0] and result.num_emitted.tolist() == [1, 1, 1]
    # Same with an empty draft_probs tensor.
    result = verify(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                    torch.zeros(3, 0, 4), target_probs, torch.tensor([False, False, True]))
    assert result.tokens[0, 0].item() == 2 and result.tokens[2, 0].item() == 0


def test_ragged_rows_and_num_draft_zero_rows():
    vocab = 8
    # Row 0: 3 drafts, all match. Row 1: 1 draft (match) then padding. Row 2: no drafts.
    # Row 3: 2 drafts, second mismatches. Padding draft tokens may be anything, incl. -1.
    target_probs = one_hot([[1, 2, 3, 4], [5, 6, 7, 0], [2, 2, 2, 2], [1, 1, 1, 1]], vocab)
    draft_tokens = torch.tensor([[1, 2, 3], [5, -1, -1], [2, 2, 2], [1, 0, 1]])
    num_draft = torch.tensor([3, 1, 0, 2])
    result = verify(draft_tokens, num_draft, None, target_probs, torch.tensor([True] * 4))
    assert result.num_accepted.tolist() == [3, 1, 0, 1]
    assert result.num_emitted.tolist() == [4, 2, 1, 2]
    assert result.tokens.tolist() == [[1, 2, 3, 4], [5, 6, -1, -1], [2, -1, -1, -1], [1, 1, -1, -1]]
    # Sampled rows with one-hot targets behave the same (acceptance prob is 0 or 1).
    sampled = verify(draft_tokens, num_draft, None, target_probs, torch.tensor([False] * 4),
                     torch.Generator().manual_seed(1))
    assert sampled.tokens.tolist() == result.tokens.tolist()


def test_padding_beyond_num_emitted_and_accepted_prefix_is_draft():
    gen = torch.Generator().manual_seed(2)
    batch, k, vocab = 64, 5, 12
    target_probs = torch.rand(batch, k + 1, vocab, generator=gen).softmax(-1)
    draft_probs = torch.rand(batch, k, vocab, generator=gen).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    greedy = torch.rand(batch, generator=gen) < 0.3
    result = verify(draft_tokens, num_draft, draft_probs, target_probs, greedy, gen)
    assert result.tokens.shape == (batch, k + 1)
    assert (result.num_accepted <= num_draft).all() and (result.num_accepted >= 0).all()
    assert torch.equal(result.num_emitted, result.num_accepted + 1)
    for b in range(batch):
        n_acc, n_emit = result.num_accepted[b].item(), result.num_emitted[b].item()
        assert result.tokens[b, :n_acc].tolist() == draft_tokens[b, :n_acc].tolist()
        assert 0 <= result.tokens[b, n_acc].item() < vocab
        assert (result.tokens[b, n_emit:] == PAD_TOKEN).all()


def test_mixed_greedy_and_sampled_rows():
    vocab = 5
    target_probs = torch.tensor([[0.1, 0.2, 0.6, 0.05, 0.05]]).repeat(2, 3, 1)   # [2, 3, 5]
    draft_tokens = torch.tensor([[2, 0], [2, 2]])
    draft_probs = one_hot(draft_tokens, vocab)
    gen = torch.Generator().manual_seed(3)
    result = verify(draft_tokens, torch.tensor([2, 2]), draft_probs, target_probs, torch.tensor([True, False]), gen)
    assert result.tokens[0].tolist() == [2, 2, PAD_TOKEN]     # greedy: 0 != argmax -> argmax 2
    # Greedy row results do not depend on the sampled rows or the RNG.
    alone = verify(draft_tokens[:1], torch.tensor([2]), draft_probs[:1], target_probs[:1], torch.tensor([True]))
    assert alone.tokens.tolist() == result.tokens[:1].tolist()


def test_draft_equal_to_target_accepts_everything_without_nan():
    gen = torch.Generator().manual_seed(4)
    batch, k, vocab = 2_000, 4, 30
    target_logits = torch.randn(1, k + 1, vocab, generator=gen) * 2
    params = [SamplingParams(temperature=0.9, top_k=10)]
    target_probs = probs_from_logits(transform_logits(target_logits, params), params)[0]   # [k+1, vocab]
    draft_probs = target_probs[:k]
    draft_tokens = torch.multinomial(draft_probs, batch, replacement=True, generator=gen).T
    result = verify(draft_tokens, torch.full((batch,), k), draft_probs.expand(batch, -1, -1),
                    target_probs.expand(batch, -1, -1), torch.zeros(batch, dtype=torch.bool), gen)
    assert (result.num_accepted == k).all()
    assert (result.tokens >= 0).all()
    assert target_probs[k][result.tokens[:, k]].min() > 0    # bonus from target[k]'s support
    # Point-mass drafts of a one-hot target are always accepted too.
    point_target = one_hot(draft_tokens[:, list(range(k)) + [0]], vocab)
    result = verify(draft_tokens, torch.full((batch,), k), None, point_target,
                    torch.zeros(batch, dtype=torch.bool), gen)
    assert (result.num_accepted == k).all()


def test_per_row_generators_reproducible_and_independent_of_batch():
    gen = torch.Generator().manual_seed(5)
    vocab = 20

    def row(k):
        target = torch.randn(k + 1, vocab, generator=gen).softmax(-1)
        draft = torch.randn(k, vocab, generator=gen).softmax(-1)
        tokens = torch.multinomial(draft, 1, generator=gen).view(k)
        return target, draft, tokens

    rows = [row(2), row(4), row(1), row(3)]
    seeds = [100, 200, 300, 400]

    def run(order, k_pad):
        batch = len(order)
        target_probs = torch.zeros(batch, k_pad + 1, vocab)
        target_probs[..., 0] = 1.0
        draft_probs = torch.full((batch, k_pad, vocab), 1.0 / vocab)
        draft_tokens = torch.full((batch, k_pad), -1)
        num_draft = torch.zeros(batch, dtype=torch.long)
        for i, r in enumerate(order):
            target, draft, tokens = rows[r]
            k = tokens.numel()
            target_probs[i, :k + 1] = target
            draft_probs[i, :k] = draft
            draft_tokens[i, :k] = tokens
            num_draft[i] = k
        generators = [torch.Generator().manual_seed(seeds[r]) for r in order]
        result = verify(draft_tokens, num_draft, draft_probs, target_probs,
                        torch.zeros(batch, dtype=torch.bool), generators)
        return {r: result.tokens[i, :result.num_emitted[i]].tolist() for i, r in enumerate(order)}

    full = run([0, 1, 2, 3], 4)
    assert full == run([0, 1, 2, 3], 4)                      # reproducible
    assert run([3, 2, 1, 0], 6) == full                      # order and padding independent
    for r in range(4):
        assert run([r], len(rows[r][2]))[r] == full[r]       # alone == in a batch


def test_per_row_generators_unaffected_by_greedy_rows_in_batch():
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 3, 3, 16
    target_probs = torch.randn(batch, k + 1, vocab, generator=gen).softmax(-1)
    draft_probs = torch.randn(batch, k, vocab, generator=gen).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, k)
    num_draft = torch.tensor([3, 2, 3])

    def run(greedy):
        generators = [torch.Generator().manual_seed(50 + b) for b in range(batch)]
        return verify(draft_tokens, num_draft, draft_probs, target_probs, torch.tensor(greedy), generators)

    all_sampled = run([False, False, False])
    mixed = run([True, False, True])
    assert mixed.tokens[1].tolist() == all_sampled.tokens[1].tolist()
    for b in (0, 2):   # greedy rows: argmax semantics
        n_acc = mixed.num_accepted[b].item()
        assert mixed.tokens[b, n_acc].item() == target_probs[b, n_acc].argmax().item()


def test_per_row_generators_change_results():
    vocab = 50
    target_probs = torch.full((8, 1, vocab), 1.0 / vocab)
    empty = torch.zeros(8, 0, dtype=torch.long)
    a = verify(empty, torch.zeros(8, dtype=torch.long), None, target_probs, torch.zeros(8, dtype=torch.bool),
               [torch.Generator().manual_seed(s) for s in range(8)])
    b = verify(empty, torch.zeros(8, dtype=torch.long), None, target_probs, torch.zeros(8, dtype=torch.bool),
               [torch.Generator().manual_seed(s) for s in range(8, 16)])
    assert not torch.equal(a.tokens, b.tokens)


def test_residual_falls_back_to_target_when_numerically_zero():
    target_probs = torch.tensor([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]])
    residual_probs = verify_module._residual_probs(target_probs, draft_probs)
    assert torch.equal(residual_probs[0], target_probs[0])
    assert torch.allclose(residual_probs[1], torch.tensor([0.0, 0.0, 1.0]))


def test_invalid_shapes_raise():
    with pytest.raises(ValueError):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), None, torch.rand(1, 2, 5),
               torch.tensor([False]))
    with pytest.raises(ValueError):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), None, torch.rand(1, 3, 5),
               torch.tensor([False]))
    with pytest.raises(ValueError):      # a real (non-padding) draft outside the vocabulary
        verify(torch.tensor([[1, 7]]), torch.tensor([2]), None, torch.rand(1, 3, 5), torch.tensor([False]))
    verify(torch.tensor([[1, 7]]), torch.tensor([1]), None, torch.rand(1, 3, 5), torch.tensor([False]))


# ----------------------------------------------------------------------------- distribution


def expected_tv_noise(probs: torch.Tensor, n: int) -> float:
    """E[TV(empirical, probs)] of an exact sampler with n draws (normal approximation):
    E|count_x - n p_x| ~= sqrt(2 n p_x (1 - p_x) / pi), TV = sum_x |...| / (2 n)."""
    p = probs.double()
    return (p * (1 - p) / (2 * math.pi * n)).sqrt().sum().item()


def distribution_check(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value, total variation distance, observations outside the support)."""
    counts = counts.double()
    n = counts.sum().item()
    probs = probs.double() / probs.double().sum()
    outside = int(counts[probs == 0].sum().item())
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    support = probs > 0
    observed, expected = counts[support].numpy(), (probs[support] * n).numpy()
    # Merge all cells with expected count < 5 into one; if that cell is still < 5, add the
    # next smallest cells until it is not.
    order = [int(i) for i in np.argsort(expected, kind="stable")]
    small = [i for i in order if expected[i] < 5]
    rest = [i for i in order if expected[i] >= 5]
    merged_obs = float(sum(observed[i] for i in small))
    merged_exp = float(sum(expected[i] for i in small))
    while 0 < merged_exp < 5 and rest:
        i = rest.pop(0)
        merged_obs += observed[i]
        merged_exp += expected[i]
    f_obs = [observed[i] for i in rest] + ([merged_obs] if merged_exp else [])
    f_exp = [expected[i] for i in rest] + ([merged_exp] if merged_exp else [])
    if len(f_obs) < 2:
        return 1.0, tv, outside
    f_exp = np.asarray(f_exp) * (sum(f_obs) / sum(f_exp))
    return float(chisquare(f_obs, f_exp).pvalue), tv, outside


def make_distributions(vocab: int, k: int, seed: int):
    """Per-position target [k+1, vocab] and draft [k, vocab] probs, independent of the prefix.

    Both go through the same SamplingParams transform (temperature, top_k, top_p, min_p). For
    vocab 1000 the logits have std 3 and the filters are tight, so each distribution has a few
    dozen tokens at most and the TV noise of 10^5 exact samples stays well below TV_MAX.
    """
    gen = torch.Generator().manual_seed(seed)
    if vocab <= 10:
        std, params = 1.5, SamplingParams(temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    else:
        std, params = 3.0, SamplingParams(temperature=0.8, top_k=20, top_p=0.85, min_p=0.01)
    target_logits = torch.randn(1, k + 1, vocab, generator=gen) * std
    draft_logits = target_logits[:, :k] + torch.randn(1, k, vocab, generator=gen) * (0.4 * std)
    target_probs = probs_from_logits(transform_logits(target_logits, [params]), [params])[0]
    draft_probs = probs_from_logits(transform_logits(draft_logits, [params]), [params])[0]
    return target_probs, draft_probs


def run_verifier(target_probs, draft_probs, n, seed, point_mass=False):
    """n independent verification steps of one row configuration, batched as rows.

    Draft tokens are sampled from draft_probs; with point_mass=True the verifier is told they
    are point masses (draft_probs=None). Returns tokens [n, k+1] and num_emitted [n].
    """
    k = target_probs.shape[0] - 1
    gen = torch.Generator().manual_seed(seed)
    all_tokens, all_emitted = [], []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        if k:
            draft_tokens = torch.multinomial(draft_probs, m, replacement=True, generator=gen).T   # [m, k]
        else:
            draft_tokens = torch.zeros(m, 0, dtype=torch.long)
        result = verify(draft_tokens, torch.full((m,), k),
                        None if point_mass else draft_probs.expand(m, -1, -1),
                        target_probs.expand(m, -1, -1), torch.zeros(m, dtype=torch.bool), gen)
        assert not (result.tokens[:, 0] < 0).any()
        all_tokens.append(result.tokens)
        all_emitted.append(result.num_emitted)
    return torch.cat(all_tokens), torch.cat(all_emitted)


def check_positions(tokens, num_emitted, target_probs):
    """Every position with enough samples follows target_probs[j].

    The token at position j among rows that emitted > j tokens must follow target_probs[j]
    (targets do not depend on the prefix). Chi-square is checked where there are at least
    CHI2_MIN_SAMPLES samples; TV < TV_MAX where an exact sampler's expected TV is below
    TV_NOISE_MAX. Returns (chi-square-checked positions, TV-checked positions).
    """
    vocab = target_probs.shape[-1]
    chi2_checked, tv_checked = [], []
    for j in range(target_probs.shape[0]):
        at_j = tokens[num_emitted > j, j]
        n = at_j.numel()
        if n < CHI2_MIN_SAMPLES:
            continue
        counts = torch.bincount(at_j, minlength=vocab)
        p_value, tv, outside = distribution_check(counts, target_probs[j])
        assert outside == 0, f"position {j}: {outside} tokens outside the target's support"
        assert p_value > P_VALUE_MIN, f"position {j}: chi-square p={p_value:.2e} (n={n}, tv={tv:.4f})"
        chi2_checked.append(j)
        if expected_tv_noise(target_probs[j], n) <= TV_NOISE_MAX:
            assert tv < TV_MAX, f"position {j}: TV={tv:.4f} (n={n})"
            tv_checked.append(j)
    return chi2_checked, tv_checked


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("vocab", [10, 1000])
def test_output_distribution_equals_target(vocab, k, point_mass):
    seed = 1000 * vocab + 10 * k + point_mass
    target_probs, draft_probs = make_distributions(vocab, k, seed)
    # The test is only meaningful if position 0's TV noise is well below TV_MAX.
    assert expected_tv_noise(target_probs[0], N_SAMPLES) <= TV_NOISE_MAX
    tokens, num_emitted = run_verifier(target_probs, draft_probs, N_SAMPLES, seed, point_mass)
    chi2_checked, tv_checked = check_positions(tokens, num_emitted, target_probs)
    assert 0 in tv_checked
    if k > 1:
        assert len(chi2_checked) >= 2      # some later position had enough samples too


def test_k0_output_distribution_equals_target():
    target_probs, _ = make_distributions(1000, 0, seed=7)
    tokens, num_emitted = run_verifier(target_probs, torch.zeros(0, 1000), N_SAMPLES, seed=7)
    assert (num_emitted == 1).all()
    assert check_positions(tokens, num_emitted, target_probs) == ([0], [0])


def test_draft_disjoint_from_target_rejects_at_position_zero():
    vocab, k = 10, 3
    gen = torch.Generator().manual_seed(8)
    target_probs = torch.zeros(k + 1, vocab)
    target_probs[:, :5] = torch.rand(k + 1, 5, generator=gen) + 0.1
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.zeros(k, vocab)
    draft_probs[:, 5:] = torch.rand(k, 5, generator=gen) + 0.1
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    for point_mass in (False, True):
        tokens, num_emitted = run_verifier(target_probs, draft_probs, N_SAMPLES, seed=9, point_mass=point_mass)
        assert (num_emitted == 1).all()
        assert check_positions(tokens, num_emitted, target_probs) == ([0], [0])


def test_draft_equal_to_target_bonus_distribution():
    target_probs, _ = make_distributions(10, 3, seed=10)
    tokens, num_emitted = run_verifier(target_probs, target_probs[:3].clone(), N_SAMPLES, seed=11)
    assert (num_emitted == 4).all()
    assert check_positions(tokens, num_emitted, target_probs) == ([0, 1, 2, 3], [0, 1, 2, 3])


# ----------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize("vocab", [10, 1000])
def test_negative_control_sampling_from_draft_is_detected(vocab):
    target_probs, draft_probs = make_distributions(vocab, 1, seed=1000 * vocab + 10)
    gen = torch.Generator().manual_seed(12)
    wrong = torch.multinomial(draft_probs[0], N_SAMPLES, replacement=True, generator=gen)
    p_value, tv, _ = distribution_check(torch.bincount(wrong, minlength=vocab), target_probs[0])
    assert p_value < P_VALUE_MIN and tv > TV_MAX


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("vocab", [10, 1000])
def test_negative_control_verifier_without_residual_is_detected(vocab, point_mass, monkeypatch):
    """A verifier that resamples from the target instead of the residual after a rejection
    over-weights the tokens the draft likes; the distribution test must catch it."""
    k = 1
    seed = 1000 * vocab + 10 * k + point_mass        # as in test_output_distribution_equals_target
    target_probs, draft_probs = make_distributions(vocab, k, seed)
    # Analytic bias of the buggy sampler at position 0: output = min(p, q) + (1 - alpha) p.
    p = target_probs[0].double()
    q = draft_probs[0].double()
    if point_mass:
        # Point-mass draft d ~ q: output(x) = q(x) p(x) + p(x) sum_d q(d)(1 - p(d)).
        buggy = q * p + p * (q * (1 - p)).sum()
    else:
        buggy = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    assert 0.5 * (buggy - p).abs().sum().item() > 3 * TV_MAX

    monkeypatch.setattr(verify_module, "_residual_probs", lambda target, draft: target)
    tokens, num_emitted = run_verifier(target_probs, draft_probs, N_SAMPLES, seed, point_mass)
    counts = torch.bincount(tokens[:, 0], minlength=vocab)
    p_value, tv, _ = distribution_check(counts, target_probs[0])
    assert p_value < P_VALUE_MIN and tv > TV_MAX
    # The correct verifier passes on this very setup (same seed and distributions):
    # test_output_distribution_equals_target[vocab-1-draft_probs / point_mass].
