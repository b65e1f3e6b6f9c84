"""The verifiers as pure functions: table-driven cases and the distribution they sample."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import pooled_chisquare

from specdecode.config import SamplingParams
from specdecode.verify.chain import PAD_ID, coupled_verify, greedy_tokens, greedy_verify, greedy_verify_rows, rejection_sample
from specdecode.verify.sampling import (PositionUniforms, argmax_ids, inverse_cdf, logits_to_probs, outside_nucleus,
                                       sample)


def one_hot_logits(ids: list[int], vocab: int = 6) -> torch.Tensor:
    """[1, len(ids), vocab] logits whose argmax at position i is ids[i]."""
    return torch.nn.functional.one_hot(torch.tensor([ids]), vocab).float() * 5


@pytest.mark.parametrize(
    "draft, target_argmax, expected, num_accepted",
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),  # all accepted + free bonus token
        ([5, 2, 3], [1, 2, 3, 4], [1, PAD_ID, PAD_ID, PAD_ID], 0),  # first rejected
        ([1, 5, 3], [1, 2, 3, 4], [1, 2, PAD_ID, PAD_ID], 1),  # later rejection ends the prefix
        ([1], [1, 0], [1, 0], 1),
    ],
)
def test_greedy_verify_table(draft, target_argmax, expected, num_accepted):
    output, accepted = greedy_verify(torch.tensor([draft]), one_hot_logits(target_argmax))
    assert output.tolist() == [expected]
    assert accepted.tolist() == [num_accepted]


def test_greedy_verify_batched_rows_are_independent():
    drafts = torch.tensor([[1, 2], [3, 3]])
    logits = torch.cat([one_hot_logits([1, 2, 0]), one_hot_logits([3, 1, 4])])
    output, accepted = greedy_verify(drafts, logits)
    assert output.tolist() == [[1, 2, 0], [3, 1, PAD_ID]]
    assert accepted.tolist() == [2, 1]


def test_greedy_verify_rows_agrees_and_stops_at_the_first_rejection():
    """The row-at-a-time verifier gives greedy_verify's result and asks for no row past
    the first rejection (nor past the bonus)."""
    generator = torch.Generator().manual_seed(2)
    for _ in range(300):
        k = int(torch.randint(0, 6, (1,), generator=generator))
        drafts = torch.randint(0, 3, (k,), generator=generator)
        logits = torch.randn(k + 1, 3, generator=generator)
        output, accepted = greedy_verify(drafts[None], logits[None])
        asked = []
        n, bonus = greedy_verify_rows(drafts.tolist(), lambda i: asked.append(i) or logits[i])
        assert (n, bonus) == (int(accepted[0]), int(output[0, n]))
        assert asked == list(range(n + 1))


def test_greedy_tokens_on_lists_agrees_with_the_batched_verifier():
    """The list verifier the engines use for one sequence gives greedy_verify's tokens:
    every draft length (0 = a plain step), full acceptance, a first-position rejection."""
    assert greedy_tokens([], [7]) == [7]
    assert greedy_tokens([1, 2], [1, 2, 9]) == [1, 2, 9]
    assert greedy_tokens([1, 2], [3, 2, 9]) == [3]
    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        k = int(torch.randint(0, 6, (1,), generator=generator))
        drafts = torch.randint(0, 3, (1, k), generator=generator)
        logits = torch.randn(1, k + 1, 3, generator=generator)
        output, accepted = greedy_verify(drafts, logits)
        expected = output[0, : int(accepted[0]) + 1].tolist()
        assert greedy_tokens(drafts[0].tolist(), logits[0].argmax(-1).tolist()) == expected


def test_rejection_sample_certain_cases():
    vocab = 4
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]]])
    # drafts equal to the only tokens the target allows: always accepted, bonus = 3
    draft_probs = torch.nn.functional.one_hot(torch.tensor([[1, 2]]), vocab).float()
    output, accepted = rejection_sample(torch.tensor([[1, 2]]), draft_probs, target, gen)
    assert output.tolist() == [[1, 2, 3]] and accepted.tolist() == [2]
    # first draft has target probability 0: always rejected, recovered token = 1
    draft_probs = torch.nn.functional.one_hot(torch.tensor([[0, 2]]), vocab).float()
    output, accepted = rejection_sample(torch.tensor([[0, 2]]), draft_probs, target, gen)
    assert output.tolist() == [[1, PAD_ID, PAD_ID]] and accepted.tolist() == [0]


def test_a_draft_the_target_never_draws_is_rejected_even_at_a_zero_uniform(monkeypatch):
    """Acceptance is u < p/q: at u = 0 a draft of target probability 0 (outside its top-k,
    say) is still rejected (a mutation audit: u <= p/q passed every other test)."""
    from specdecode.verify import chain

    monkeypatch.setattr(chain.torch, "rand", lambda *args, **kwargs: torch.zeros(*args[:2], dtype=kwargs.get("dtype")))
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0]]])
    target = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]])
    output, accepted = rejection_sample(torch.tensor([[0]]), draft_probs, target, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [0] and output[0, 0].item() in (1, 2)


def test_acceptance_uniforms_have_float64_resolution(monkeypatch):
    """Found in review: the uniforms were float32, multiples of 2^-24 with 0 among them, so a
    draft with target/draft below 2^-24 was accepted about 2^-24 of the time instead of
    target/draft. The uniforms the acceptance test reads must be finer than that."""
    from specdecode.verify import chain

    drawn, real_rand = [], torch.rand

    def recording_rand(*args, **kwargs):
        values = real_rand(*args, **kwargs)
        drawn.append(values)
        return values

    monkeypatch.setattr(chain.torch, "rand", recording_rand)
    probs = torch.softmax(torch.randn(64, 5, 7, generator=torch.Generator().manual_seed(2)), -1)
    drafts = torch.zeros(64, 4, dtype=torch.long)
    rejection_sample(drafts, probs[:, :4], probs, torch.Generator().manual_seed(3))
    scaled = torch.cat([u.flatten() for u in drawn]).double() * 2**24
    assert bool((scaled != scaled.floor()).any())


def forced_rejection(monkeypatch, module) -> None:
    """Every uniform just below 1: a draft with target/draft just below 1 is rejected."""
    monkeypatch.setattr(module.torch, "rand", lambda *args, **kwargs: torch.full(
        tuple(a for a in args if isinstance(a, int)), 1 - 1e-8, dtype=kwargs.get("dtype")))


# p <= q everywhere after float rounding: a rejection here leaves a residual of mass 0
NEAR_TIE_TARGET = [0.0, 0.49999997, 0.49999997]
NEAR_TIE_DRAFT = [0.0, 0.5, 0.5000001]


def test_a_rejection_with_nothing_left_in_the_residual_draws_from_the_target(monkeypatch):
    """A mutation audit: without the fallback to the target's distribution where the
    residual max(p - q, 0) has no mass (float rounding only), the bonus came from all zeros,
    token 0, which the target gives probability 0; no test noticed."""
    from specdecode.verify import chain

    forced_rejection(monkeypatch, chain)
    target = torch.tensor([[NEAR_TIE_TARGET, [0.0, 0.5, 0.5]]])
    output, accepted = rejection_sample(torch.tensor([[1]]), torch.tensor([[NEAR_TIE_DRAFT]]), target,
                                        torch.Generator().manual_seed(0))
    assert accepted.tolist() == [0] and output[0, 0].item() in (1, 2)


def test_a_draft_token_its_own_distribution_gives_zero_is_refused():
    """Found in review: a proposal whose draft_probs give its own token probability 0 (not
    the distribution it sampled) had that token accepted wherever the target allows it (u *
    0 < p): the first token came out [1, 0] where the target says [0.5, 0.5]. Refused by name."""
    from specdecode.config import SpecDecodeError

    target = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    wrong = torch.tensor([[[0.0, 1.0, 0.0]]])  # token 0 was "drawn" from a distribution without it
    with pytest.raises(SpecDecodeError, match="probability 0 in the distribution it was said to be drawn from"):
        rejection_sample(torch.tensor([[0]]), wrong, target, torch.Generator().manual_seed(0))


def test_rejection_sample_is_seeded():
    probs = torch.softmax(torch.randn(8, 4, 10, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(2))
    runs = [
        rejection_sample(drafts, probs[:, :3], probs.flip(-1), torch.Generator().manual_seed(7))[0]
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
]


def three_token_joint(verifier, params: SamplingParams, rows: int = 200_000, seed: int = 1234):
    """Run ``verifier`` on N steps of two drafts each and count the first three output
    tokens: the two drafts' positions and the bonus after full acceptance.

    Toy models over a 5-token vocabulary whose next-token logits depend on the previous
    token (tables [V, V]). Each of N rows: the draft samples d1 from draft_table[x0] and
    d2 from draft_table[d1]; the target scores them; the verifier runs. Where the step ends
    early, the next tokens come from the target directly (as the next step would, by the
    same argument). A lossless verifier's triple (y1, y2, y3) follows
    target(y1|x0)·target(y2|y1)·target(y3|y2). Returns (observed counts, expected counts,
    accepted [N]).
    """
    vocab, x0 = 5, 0
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(vocab, vocab, generator=gen)  # a related, wrong draft
    target_table = logits_to_probs(target_logits, params)  # [V, V] row = previous token
    draft_table = logits_to_probs(draft_logits, params)

    d1 = sample(draft_table[x0].expand(rows, vocab), gen)  # [N]
    d2 = sample(draft_table[d1], gen)  # [N]
    draft_ids = torch.stack([d1, d2], dim=1)  # [N, 2]
    draft_probs = torch.stack([draft_table[x0].expand(rows, vocab), draft_table[d1]], dim=1)
    target_probs = torch.stack(
        [target_table[x0].expand(rows, vocab), target_table[d1], target_table[d2]], dim=1
    )  # [N, 3, V]
    output, accepted = verifier(draft_ids, draft_probs, target_probs, gen)

    y1 = output[:, 0]
    y2 = torch.where(accepted >= 1, output[:, 1], sample(target_table[y1], gen))
    y3 = torch.where(accepted >= 2, output[:, 2], sample(target_table[y2], gen))
    observed = torch.bincount((y1 * vocab + y2) * vocab + y3, minlength=vocab ** 3).double()
    joint = (target_table[x0].double()[:, None, None] * target_table.double()[:, :, None]
             * target_table.double()[None, :, :])
    expected = (joint / joint.sum()).flatten() * rows
    return observed, expected, accepted


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_speculative_sampling_reproduces_target_distribution(params):
    """Joint distribution of the first three tokens of a step (the bonus after full
    acceptance included) equals the target's."""
    observed, expected, accepted = three_token_joint(rejection_sample, params)
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token the processed target forbids"
    assert (accepted == 0).any() and (accepted == 1).any() and (accepted == 2).any(), \
        "the test must exercise rejection at each position and full acceptance"
    p_value = pooled_chisquare(observed, expected)
    assert p_value > 1e-3, p_value


def residual_bug_verifier(draft_ids, draft_probs, target_probs, generator):
    """A classic mistake: on rejection, draw the correction from the target itself instead
    of the residual max(0, target - draft). Everything else as rejection_sample."""
    output, accepted = rejection_sample(draft_ids, draft_probs, target_probs, generator)
    rows = torch.arange(draft_ids.shape[0])
    rejected = accepted < draft_ids.shape[1]
    bonus = sample(target_probs[rows, accepted], generator)
    output[rows[rejected], accepted[rejected]] = bonus[rejected]
    return output, accepted


def test_wrong_verifier_would_be_caught():
    """The statistical test itself has power: the same harness run on a verifier that
    draws corrections from the target instead of the residual rejects it."""
    observed, expected, accepted = three_token_joint(residual_bug_verifier, SamplingParams(temperature=1.0))
    assert (accepted < 2).float().mean() > 0.2  # enough rejections for the bug to show
    p_value = pooled_chisquare(observed, expected)
    assert p_value < 1e-6, p_value


def stale_bonus_verifier(draft_ids, draft_probs, target_probs, generator):
    """A plausible mistake: after full acceptance, the bonus drawn from the target's
    distribution at the last draft's parent instead of after it."""
    output, accepted = rejection_sample(draft_ids, draft_probs, target_probs, generator)
    k = draft_ids.shape[1]
    full = accepted == k
    output[full, k] = sample(target_probs[full, k - 1], generator)
    return output, accepted


def test_wrong_bonus_would_be_caught():
    """The harness counts the bonus after full acceptance: a verifier that draws it from
    the wrong position fails."""
    observed, expected, accepted = three_token_joint(stale_bonus_verifier, SamplingParams(temperature=1.0))
    assert (accepted == 2).float().mean() > 0.2
    assert pooled_chisquare(observed, expected) < 1e-6


def coupled(draft_ids, draft_probs, target_probs, generator):
    """coupled_verify in the harness's signature: the drafts' distributions are unused, and
    every position gets a fresh uniform from the harness's generator."""
    uniforms = torch.rand(target_probs.shape[:2], generator=generator, dtype=torch.float64)
    return coupled_verify(draft_ids, target_probs, uniforms)


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_coupled_verification_reproduces_target_distribution(params):
    """The target's own draws, one uniform per position, follow the target whatever the
    drafts (here drawn from a related, wrong draft)."""
    observed, expected, accepted = three_token_joint(coupled, params)
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token the processed target forbids"
    assert (accepted == 0).any() and (accepted == 1).any() and (accepted == 2).any()
    p_value = pooled_chisquare(observed, expected)
    assert p_value > 1e-3, p_value


def one_uniform_for_all_positions(draft_ids, draft_probs, target_probs, generator):
    """A plausible mistake: one uniform per step, reused at every position of it."""
    uniforms = torch.rand(target_probs.shape[0], 1, generator=generator, dtype=torch.float64)
    return coupled_verify(draft_ids, target_probs, uniforms.expand(-1, target_probs.shape[1]))


def test_reused_uniform_would_be_caught():
    observed, expected, _ = three_token_joint(one_uniform_for_all_positions, SamplingParams(temperature=1.0))
    p_value = pooled_chisquare(observed, expected)
    assert p_value < 1e-6, p_value


def test_coupled_verification_outputs_the_plain_draws():
    """Whatever the drafts, the output is the target's draw at each position up to the
    first draft that differs from it, then that draw: what plain sampling emits with the
    same uniforms (when the rows' distributions are the same)."""
    generator = torch.Generator().manual_seed(5)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=generator))
        probs = torch.softmax(torch.randn(1, k + 1, 4, generator=generator) * 2, -1)
        uniforms = torch.rand(1, k + 1, generator=generator, dtype=torch.float64)
        plain = inverse_cdf(probs, uniforms)[0].tolist()
        drafts = torch.where(torch.rand(1, k, generator=generator) < 0.7, torch.tensor([plain[:k]]),
                             torch.randint(0, 4, (1, k), generator=generator))
        output, accepted = coupled_verify(drafts, probs, uniforms)
        n = int(accepted[0])
        assert output[0, : n + 1].tolist() == plain[: n + 1]
        assert n == k or int(drafts[0, n]) != plain[n]


def test_inverse_cdf_never_draws_a_zero_weight_token():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.5], [1e-30, 0.0, 1.0, 0.0, 0.0]])
    step = float(weights[0, 1])  # 0.3 as float32 weights hold it: where row 0's draw moves on
    ends = torch.tensor([0.0, step - 1e-9, step, 1 - 2**-53], dtype=torch.float64)  # u = 0, below and at a step, the largest u
    drawn = torch.stack([inverse_cdf(weights, u.expand(3)) for u in ends])
    assert drawn.tolist() == [[1, 4, 0], [1, 4, 2], [3, 4, 2], [3, 4, 2]]
    uniform = torch.rand(10_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(inverse_cdf(weights[0].expand(10_000, 5), uniform), minlength=5)
    assert counts[[0, 2, 4]].sum() == 0 and 2_700 < counts[1] < 3_300


def test_position_uniforms_depend_on_seed_and_position_alone():
    draws = PositionUniforms(7)
    assert torch.equal(draws(0, 10)[4:], draws(4, 6)) and torch.equal(draws(3, 1), PositionUniforms(7)(3, 1))
    assert not torch.equal(draws(0, 10), PositionUniforms(8)(0, 10))
    assert not torch.equal(draws(0, 10), PositionUniforms(-7)(0, 10))
    many = PositionUniforms(-(2**63))(0, 20_000)  # any signed 64-bit seed
    assert ((many >= 0) & (many < 1)).all() and many.unique().numel() == 20_000
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many[1:] @ many[:-1]) / 19_999 - 0.25) < 0.01


def test_request_generators_use_every_bit_of_the_seed():
    """torch's CPU generator keeps a seed's low 32 bits: seeds 2**32 apart drew the same
    drafts and corrections (found in review). A request's generator mixes in all 64."""
    from specdecode.verify.sampling import seeded_generator

    def draws(seed):
        return torch.rand(8, generator=seeded_generator(seed))

    assert torch.equal(draws(5), draws(5)) and torch.equal(draws(2**63 - 1), draws(2**63 - 1))
    for other in (5 + 2**32, 5 - 2**32, 5 + 2**62, -5, 6):
        assert not torch.equal(draws(5), draws(other)), other
    assert not torch.equal(draws(-(2**63)), draws(0))


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [True, True, False, False]
    # top-k keeps every token tied with the k-th (as transformers' TopKLogitsWarper, and as the
    # nucleus search assumes); keeping the first k by index passed every other test
    tied = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert (logits_to_probs(tied, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [True, True, True, False]
    probs = logits.softmax(-1)  # ~[0.64, 0.24, 0.09, 0.03]
    kept = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [True, True, False, False]
    assert probs[0] < 0.8 < probs[:2].sum()
    greedy = logits_to_probs(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_then_top_k_then_top_p_by_value():
    """Found in review: the distribution tests compare speculation with logits_to_probs
    itself, so a logits_to_probs that ignored the temperature passed them all. Fixed values:
    softmax(l / T); top-p over the tempered distribution (p = [0.83, 0.11, ...] at T = 0.5
    keeps 1 token at top_p 0.6, where [0.56, 0.21, ...] at T = 1 keeps 2); top-p over the
    top-k renormalised (top_k 3 then top_p 0.8 keeps 2, top-p over the whole row 3)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (0.5, 1.3):
        assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=temperature)),
                              (logits / temperature).softmax(-1))
    sharp = logits_to_probs(logits, SamplingParams(temperature=0.5, top_p=0.6))
    assert sharp.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert (logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6)) > 0).sum() == 2
    both = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.allclose(both, torch.tensor([2.0, 1.0, -math.inf, -math.inf, -math.inf]).softmax(-1))
    # a temperature beyond float32's range: uniform over the tokens a drafter's -inf padding
    # leaves (found in review: NaN, as -inf / inf)
    padded = torch.tensor([2.0, 1.0, -math.inf])
    assert logits_to_probs(padded, SamplingParams(temperature=1e39)).tolist() == [0.5, 0.5, 0.0]


def test_a_rows_nucleus_depends_on_that_row_alone():
    """Found in review: ten tokens tied at the top, top_p 0.25: which three of them topk
    ranked first changed with how many tokens it was asked for, which a flat row beside
    this one raised from 64 to 512, so a speculative step kept other tokens than a plain
    step (300 seeds of 300 drew another first token). Ties at the cutoff are all kept. A
    top_p below float32's resolution kept no token (NaN); the most probable always stays."""
    row = torch.full((5000,), -10.0)
    row[100:110] = 5.0
    alone = outside_nucleus(row.softmax(-1)[None], 0.25)
    beside = outside_nucleus(torch.stack([row, torch.zeros(5000)]).softmax(-1), 0.25)
    assert torch.equal(alone[0], beside[0]) and (~alone[0]).nonzero().flatten().tolist() == list(range(100, 110))
    tiny = logits_to_probs(torch.tensor([0.5, 2.0, 1.0]), SamplingParams(temperature=1.0, top_p=1e-50))
    assert tiny.tolist() == [0.0, 1.0, 0.0]


def test_the_nucleus_from_the_top_tokens_is_the_one_a_full_sort_gives():
    """Top-p from the 64 most probable tokens (then 512, 4,096, ...) keeps what ranking
    the whole vocabulary keeps: peaked rows, flat rows that need more than the first 64,
    and a small vocabulary."""
    generator = torch.Generator().manual_seed(4)
    for vocab, scale in ((5000, 0.5), (5000, 4.0), (40, 1.0), (6, 2.0)):
        probs = (torch.randn(6, vocab, generator=generator) * scale).softmax(-1)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
            expected = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
            assert torch.equal(outside_nucleus(probs, top_p), expected), (vocab, scale, top_p)


def test_rejection_sample_with_no_drafts_samples_the_target():
    target = torch.tensor([[[0.0, 0.0, 1.0]]])
    output, accepted = rejection_sample(
        torch.empty(1, 0, dtype=torch.int64), torch.empty(1, 0, 3), target, torch.Generator().manual_seed(0)
    )
    assert output.tolist() == [[2]] and accepted.tolist() == [0]


def test_sample_survives_zero_exponential_noise(monkeypatch):
    """An exponential draw of exactly 0 must not turn into nan and select a token the
    distribution forbids."""
    def zeros(self, *args, **kwargs):
        return self.zero_()

    monkeypatch.setattr(torch.Tensor, "exponential_", zeros)
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert sample(probs, None).tolist() == [1, 3]


def test_argmax_ids_is_torch_argmax():
    """The numpy argmax the verifiers use on CPU picks what torch's does: the first of tied
    maxima, on strided views too, with the same shape and dtype."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (3, 5, 257), generator=generator).float()  # many ties
    for view in (logits, logits.transpose(0, 1), logits[:, ::2, 1:]):
        ours, theirs = argmax_ids(view), view.argmax(dim=-1)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert torch.equal(argmax_ids(logits.double()), logits.double().argmax(dim=-1))
    row = logits[0, 0]  # one row: a 0-d index, as torch gives
    assert argmax_ids(row).shape == () and int(argmax_ids(row)) == int(row.argmax())
