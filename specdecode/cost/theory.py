"""Expected tokens per step and expected speedup: the arithmetic every decision uses.

Terms (docs/architecture.md): alpha = acceptance rate, tau = tokens per target pass
including the bonus token, v(k) = cost of scoring k+1 tokens / one target decode step,
c = draft cost per token / one target decode step.

- With independent acceptance at rate alpha and k draft tokens (Leviathan et al. 2023,
  eq. 1): tau = (1 - alpha^(k+1)) / (1 - alpha).
- From measured per-position acceptance p_i, the share of *all* drafting steps in which
  the first i drafts were all accepted (vLLM's num_accepted_tokens_per_pos / num_drafts):
  tau = 1 + sum_i p_i over the drafting steps (vLLM's mean acceptance length; over all
  passes where every pass drafts). (``GenerationStats.acceptance_per_position`` divides by
  the steps that drafted position i; the two agree where every step drafts k tokens.)
- Acceptance is rarely independent per position: a draft that got its first token right
  is usually copying or continuing something, and its next tokens are right more often
  (n-gram matches run in bursts). With rate ``first`` at position 1 and ``later`` at each
  position after an accepted one: tau = 1 + first * (1 - later^k) / (1 - later). With
  first = later = alpha this is eq. 1 again.
- Expected speedup of decoding (prefill excluded) = tau / (v(k) + k * c); plain decoding
  (k = 0) has speedup 1 by definition.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..config import ConfigError


def expected_tau(alpha: float, k: int) -> float:
    """Mean tokens per target pass with k drafts accepted independently at rate alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tau_from_positions(acceptance_per_position: Sequence[float]) -> float:
    """Mean tokens per pass from measured per-position (prefix) acceptance rates."""
    if any(not 0.0 <= p <= 1.0 for p in acceptance_per_position):
        raise ConfigError(f"acceptance rates must be in [0, 1], got {list(acceptance_per_position)}")
    return 1.0 + sum(acceptance_per_position)


def tau_two_rates(first: float, later: float, k: int) -> float:
    """Mean tokens per pass when position 1 is accepted at rate ``first`` and each later
    position, given the one before it was accepted, at rate ``later``."""
    for name, rate in (("first", first), ("later", later)):
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"{name} acceptance rate must be in [0, 1], got {rate}")
    if k < 0:
        raise ConfigError(f"k must be >= 0, got {k}")
    run = float(k) if later == 1.0 else (1.0 - later**k) / (1.0 - later)
    return 1.0 + first * run


def tau_conditional(first: float, conditional: Sequence[float], k: int) -> float:
    """Mean tokens per pass when position 1 is accepted at rate ``first`` and position i
    (i >= 2), given position i - 1 was accepted, at ``conditional[i - 2]``:
    1 + first * (1 + c2 + c2 c3 + ... + c2...ck). With every conditional rate equal to
    ``later`` it is ``tau_two_rates``."""
    if k < 0 or k > len(conditional) + 1:
        raise ConfigError(f"k must be in 0..{len(conditional) + 1} for {len(conditional)} conditional rates, got {k}")
    return taus_conditional(first, conditional)[k]


def taus_conditional(first: float, conditional: Sequence[float]) -> list[float]:
    """``tau_conditional`` for every k = 0..len(conditional) + 1, in one pass."""
    if not 0.0 <= first <= 1.0 or any(not 0.0 <= rate <= 1.0 for rate in conditional):
        raise ConfigError(f"acceptance rates must be in [0, 1], got first={first}, conditional={list(conditional)}")
    taus, reach = [1.0], 1.0
    for rate in (1.0, *conditional):
        reach *= rate
        taus.append(taus[-1] + first * reach)
    return taus


def expected_speedup(tau: float, v: float, c: float, k: int) -> float:
    """tau / (v(k) + k c): tokens per unit of target-step time, relative to plain."""
    cost = v + k * c
    if cost <= 0:
        raise ConfigError(f"step cost must be positive, got v={v}, c={c}, k={k}")
    return tau / cost


def best_k(alpha: float, v: Callable[[int], float], c: float, k_max: int,
           tau: Callable[[int], float] | None = None) -> tuple[int, float]:
    """The k in 0..k_max with the highest expected speedup, and that speedup.

    ``tau(k)`` defaults to independent acceptance at ``alpha``. k = 0 (plain decoding,
    speedup 1) wins whenever no k beats it: speculation that would lose is not chosen.
    """
    if tau is None:
        def tau(k: int) -> float:
            return expected_tau(alpha, k)
    best, best_speedup = 0, 1.0
    for k in range(1, k_max + 1):
        speedup = expected_speedup(tau(k), v(k), c, k)
        if speedup > best_speedup:
            best, best_speedup = k, speedup
    return best, best_speedup


def break_even_alpha(k: int, v: float, c: float, tolerance: float = 1e-6) -> float | None:
    """The alpha at which k drafts exactly pay for themselves (speedup 1); None if even
    alpha = 1 loses. Bisection: expected_tau is increasing in alpha."""
    cost = v + k * c
    if expected_tau(1.0, k) < cost:
        return None
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        if expected_tau(middle, k) < cost:
            low = middle
        else:
            high = middle
    return high


def wall_speedup(new_tokens: int, prefill_steps: float, tau: float, step_cost: float) -> float:
    """Whole-request speedup, prefill included, in units of one target decode step:
    plain takes prefill + new_tokens steps; speculation takes prefill + (new_tokens / tau)
    passes of ``step_cost`` (= mean v + mean k * c) each."""
    if new_tokens <= 0 or tau <= 0:
        return 1.0
    return (prefill_steps + new_tokens) / (prefill_steps + new_tokens / tau * step_cost)
