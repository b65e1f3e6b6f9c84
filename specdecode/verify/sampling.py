"""Turning logits into the distribution a token is drawn from, and drawing it.

Speculative sampling is lossless with respect to the *processed* target distribution
(``logits_to_probs``: temperature, then top-k, then top-p) for any drafter, provided the
draft probabilities handed to verification are the distribution each draft was actually
drawn from. Processing the draft logits the same way only raises acceptance; an EAGLE head
applies top-k and top-p over its own draft vocabulary, and that is what it hands over.

Two ways to draw: ``sample`` takes its randomness from a ``torch.Generator`` in call order
(drafters, and the rejection sampler's corrections); ``inverse_cdf`` takes one uniform per
row, and ``PositionUniforms`` gives a request one uniform per position of its sequence.
Drawing the target's token at position t with u(t), whichever step scores it, makes a
sampled request's output a function of its seed alone (verify.chain.coupled_verify).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import SamplingParams, SpecDecodeError


class NonFiniteLogitsError(SpecDecodeError, FloatingPointError):
    """Logits with a NaN or an infinity where a token is chosen: the model overflowed in
    its dtype or its weights are damaged. Every path had picked some token silently, each
    another (greedy the NaN's index, inverse-CDF draws the last token, rejection sampling
    token 0; found in review)."""


def _refuse_non_finite(rows: int) -> None:
    raise NonFiniteLogitsError(f"the logits of {rows} scored row(s) hold a NaN or an infinity: the model overflowed "
                               "in its dtype (try --dtype fp32) or its weights are damaged")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 probabilities after temperature/top-k/top-p.

    Greedy (temperature 0) gives the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax_ids(logits)[..., None].to(logits.device), 1.0)
    # a temperature beyond float32's range became inf in the division and a -inf logit (a
    # drafter's padding) NaN (found in review): such a temperature divides as float32's largest
    logits = logits / min(params.temperature, torch.finfo(torch.float32).max)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(outside_nucleus(logits.softmax(-1), params.top_p), float("-inf"))
    probs = logits.softmax(-1)
    # a NaN or +inf logit (or a row of -inf) makes the row's every probability NaN: one
    # column shows it
    broken = torch.isnan(probs[..., 0])
    if bool(broken.any()):
        _refuse_non_finite(int(broken.sum()))
    return probs


def token_probabilities(logits: torch.Tensor, params: SamplingParams, tokens: dict) -> dict:
    """``{name: probability}`` of each token of ``tokens`` (``{name: id or None}``) under the
    processed distribution ``logits_to_probs`` gives: what a draw picks between, where two
    sampled runs part (None for a run that had ended)."""
    probs = logits_to_probs(logits, params)
    return {name: None if token is None else float(probs[token]) for name, token in tokens.items()}


def outside_nucleus(probs: torch.Tensor, top_p: float, first: int = 64) -> torch.Tensor:
    """``[..., V]`` bool: the tokens top-p sampling drops, those ranked below tokens that
    already reach ``top_p`` together. Ranked among the ``first`` most probable tokens
    (then 8 times as many, up to the vocabulary) once those reach ``top_p``: every token
    below them is dropped too, since a float sum of non-negative terms never falls. A
    top-64 takes 0.18 ms over SmolLM2's 49,152 tokens where a full sort took 4.4 ms, as
    much as a decode step.

    A row's nucleus depends on its probabilities alone: the tokens as probable as the last
    one kept are all kept (as top-k keeps ties), and the most probable token always. Which
    of several tied tokens ``topk`` ranks first differs with how many it is asked for, and
    that count depends on the other rows scored with this one: a speculative step then kept
    other tokens than a plain step, and a top_p below float32's resolution kept none (NaN
    probabilities). Both found in review."""
    vocab = probs.shape[-1]
    count = min(first, vocab)
    while True:
        top_probs = probs.topk(count, dim=-1).values  # [..., count], descending
        reached = top_probs.cumsum(-1)
        if count == vocab or bool((reached[..., -1] >= top_p).all()):
            break
        count = min(count * 8, vocab)
    keep = (reached - top_probs) < top_p  # what the tokens ranked above leave below top_p: a prefix
    keep[..., 0] = True
    cutoff = top_probs.gather(-1, keep.sum(-1, keepdim=True) - 1)  # the last kept token's probability
    return probs < cutoff


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (the first maximal index, as torch's), through numpy for
    CPU float32: torch's CPU argmax over a 49,152-token vocabulary took 92 µs per row here,
    numpy's about a sixth of that, and a plain decoding step pays it every token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.detach().numpy()
        ids = values.argmax(axis=-1)
        # argmax takes a NaN as the largest; the chosen values say whether a row had one
        chosen = np.take_along_axis(values, ids[..., None], axis=-1)
        if not np.isfinite(chosen).all():
            _refuse_non_finite(int((~np.isfinite(chosen)).sum()))
        return torch.as_tensor(ids)
    ids = logits.argmax(dim=-1)
    chosen = logits.gather(-1, ids[..., None])
    if not bool(torch.isfinite(chosen).all()):
        _refuse_non_finite(int((~torch.isfinite(chosen)).sum()))
    return ids


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row of ``[..., V]`` probs (any non-negative weights) with the
    row's uniform in [0, 1) (``uniforms`` [...]): the first index whose cumulative weight
    exceeds u times the row's total. A zero-weight index never exceeds what its
    predecessor reached, so it is never drawn, not even where float rounding of the sum
    would run past the end (the last index with weight is taken there)."""
    cumulative = probs.double().cumsum(-1)  # [..., V]; float64: rounding far below any weight drawn
    total = cumulative[..., -1:]
    ids = torch.searchsorted(cumulative, uniforms.to(cumulative)[..., None] * total, right=True)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int64).argmax(-1, keepdim=True)
    return torch.minimum(ids, last).squeeze(-1)


_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014) of a 64-bit state."""
    z = state & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class PositionUniforms:
    """A request's uniform draws, one per position of its token sequence: u(t) in [0, 1)
    depends on the seed and t alone (SplitMix64 at state key + t times its golden-ratio
    increment, the key itself mixed from the seed so that it shares nothing with a
    ``torch.Generator`` seeded alike). Distinct positions get independent-looking draws;
    the same position gets the same draw however the sequence was decoded up to it."""

    def __init__(self, seed: int):
        self.key = _splitmix64(seed ^ 0x5D5EC0DE5D5EC0DE)

    def __call__(self, start: int, count: int) -> torch.Tensor:
        """``[count]`` float64: u(start), ..., u(start + count - 1)."""
        return torch.tensor([(_splitmix64(self.key + (t + 1) * 0x9E3779B97F4A7C15) >> 11) * 2.0**-53
                             for t in range(start, start + count)], dtype=torch.float64)


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's ``torch.Generator`` (drafters that sample, rejection sampling's
    corrections). torch's CPU generator keeps only the low 32 bits of a seed (mt19937), so
    seeds 2**32 apart drew alike: every bit of the seed is mixed in first (SplitMix64,
    folded to 32 bits), on every device alike."""
    mixed = _splitmix64((seed ^ 0x6E5EED5EED5EED5E) & 0xFFFFFFFFFFFFFFFF)
    return torch.Generator(device=device).manual_seed((mixed ^ (mixed >> 32)) & 0xFFFFFFFF)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of ``[..., V]`` probs: argmax of probs / Exp(1) noise.

    Exact (the exponential-race form of sampling) and driven only by ``generator``.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # an exponential draw of exactly 0 would make probs / noise inf (or nan for a
    # zero-probability token, which argmax would then pick); a tiny floor keeps it finite
    return argmax_ids(probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny))
