"""Verification of chain drafts: pure, batched tensor functions.

Terms, for a batch of B sequences each with k draft tokens:

- accepted tokens: the longest prefix of the draft tokens the verifier keeps;
- bonus token: the one token the target adds after the accepted prefix — the recovered
  (corrected) token at the first rejection, or a free extra token when all k pass.

Every function returns ``(output_ids [B, k+1], num_accepted [B])``: row b holds
``num_accepted[b]`` accepted draft tokens, then the bonus token, then ``PAD_ID``.
So every sequence gains ``num_accepted + 1`` tokens per step. Tensors are made on the
inputs' device; the generator must live there too.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import SpecDecodeError
from .sampling import argmax_ids, inverse_cdf, sample

# a proposal's draft distribution must be the one its tokens were drawn from: a drawn token
# has probability > 0 there
DRAWN_AT_ZERO = ("a draft token has probability 0 in the distribution it was said to be drawn from: the "
                 "proposer's draft_probs are not the distribution it sampled (the verifier would accept it "
                 "wherever the target allows it, biasing the output)")

PAD_ID = -1


def _accepted_prefix_length(accepted: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` bool -> ``[B]`` length of the all-True prefix (cumprod, no loop)."""
    return accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    batch, k = draft_ids.shape
    device = draft_ids.device
    slots = torch.arange(k + 1, device=device).expand(batch, k + 1)  # [B, k+1]
    padded = torch.cat([draft_ids, torch.full((batch, 1), PAD_ID, device=device)], dim=1)
    output = torch.where(slots < num_accepted[:, None], padded, PAD_ID)
    return output.scatter_(1, num_accepted[:, None], bonus[:, None])


def _match_drafts(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts ``[B, k]`` while they equal the target's own tokens ``[B, k+1]``;
    the bonus is the target's token after them."""
    if draft_ids.shape[1] == 0:  # a plain step: the target's token is the output (what _assemble gives)
        return target_ids[:, :1], torch.zeros(target_ids.shape[0], dtype=torch.int64, device=target_ids.device)
    num_accepted = _accepted_prefix_length(draft_ids == target_ids[:, :-1])  # [B]
    bonus = target_ids.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return _assemble(draft_ids, num_accepted, bonus), num_accepted


def greedy_verify(
    draft_ids: torch.Tensor,  # [B, k]
    target_logits: torch.Tensor,  # [B, k+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; the bonus is the argmax after."""
    return _match_drafts(draft_ids, argmax_ids(target_logits))


def coupled_verify(
    draft_ids: torch.Tensor,  # [B, k] drawn with no use of ``uniforms``
    target_probs: torch.Tensor,  # [B, k+1, V] processed target distributions
    uniforms: torch.Tensor,  # [B, k+1] each position's uniform draw (sampling.PositionUniforms)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling verification as greedy verification is: the target draws its own token at
    every position (``inverse_cdf`` with that position's uniform), drafts are accepted
    while they equal the draws, and the bonus is the draw after them.

    Each output token is a draw from the target given the tokens before it, with a
    uniform used for nothing else, so the output follows the target exactly, whatever the
    drafts (they only decide how many draws one pass yields). A deterministic draft x is
    accepted with probability target_probs(x), as in rejection sampling with a point mass
    (Leviathan et al. 2023); what differs is that the tokens are the ones plain sampling
    draws with the same uniforms: with ``PositionUniforms`` a seeded request gives the same
    tokens whatever k, drafter or batch (on a runtime whose logits do not depend on the
    rows scored beside them). Drafts drawn from a distribution keep ``rejection_sample``,
    which accepts them more often (sum of min(p, q) against sum of p q)."""
    return _match_drafts(draft_ids, inverse_cdf(target_probs, uniforms))


def greedy_tokens(draft: list[int], target: list[int]) -> list[int]:
    """One chain's greedy verification on plain lists: ``draft`` (k tokens) against the
    target's argmax at each of the k + 1 scored positions. The new tokens: the drafts up
    to the first that differs from the target's, then the target's token there (the
    bonus), as ``greedy_verify`` gives them for one sequence."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return draft[:accepted] + [target[accepted]]


def greedy_verify_rows(draft: list[int], row: Callable[[int], torch.Tensor]) -> tuple[int, int]:
    """Greedy verification of one chain that asks for the target's logits a position at a
    time, ``row(i)`` -> [V] at draft position i (0 = the last committed token), and stops at
    the first rejection: (accepted, bonus), what ``greedy_verify`` gives on the full logits.
    The rows after the first rejection are never asked for, so a target that computes rows
    on demand (``LazyLogits``) skips their share of the output head."""
    for position, token in enumerate(draft):
        best = int(argmax_ids(row(position)))
        if best != token:
            return position, best
    return len(draft), int(argmax_ids(row(len(draft))))


def rejection_sample(
    draft_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] distribution each draft token was drawn from
    target_probs: torch.Tensor,  # [B, k+1, V] processed target distributions
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    Draft token x_i is accepted with probability min(1, target_probs_i(x) / draft_probs_i(x)).
    At the first rejection the bonus token is drawn from the residual
    norm(max(0, target_probs_i - draft_probs_i)); if all k pass, from target_probs_k.
    The output is distributed exactly as tokens drawn from the target one by one.
    Deterministic drafters (n-gram) pass one-hot draft_probs.
    """
    batch, k = draft_ids.shape
    index = draft_ids[..., None]
    target_at_draft = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [B, k]
    draft_at_draft = draft_probs.gather(-1, index).squeeze(-1)  # [B, k]
    if bool((draft_at_draft <= 0).any()):  # u * 0 < p would accept it whenever p > 0 (found in review)
        raise SpecDecodeError(DRAWN_AT_ZERO)
    # float64: a float32 uniform is a multiple of 2^-24, 0 among them, so a token with
    # target/draft below 2^-24 would be accepted about 2^-24 of the time, not target/draft
    # (found in review)
    uniform = torch.rand(batch, k, generator=generator, dtype=torch.float64, device=target_probs.device)
    # u < target/draft, written without the division (draft_at_draft > 0 for drawn tokens)
    accepted = uniform * draft_at_draft.double() < target_at_draft.double()
    num_accepted = _accepted_prefix_length(accepted)  # [B]

    rows = torch.arange(batch, device=target_probs.device)
    bonus_target = target_probs[rows, num_accepted]  # [B, V]
    padded_draft = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)
    residual = (bonus_target - padded_draft[rows, num_accepted]).clamp_(min=0.0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only if target == draft at that position, where rejection has probability 0
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), bonus_target)
    bonus = sample(residual, generator)
    return _assemble(draft_ids, num_accepted, bonus), num_accepted
