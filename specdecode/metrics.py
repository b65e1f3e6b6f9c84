"""Counters for one generation. Sinks (CLI line, JSON, later Prometheus) read these.

Definitions, stated once:
- drafted: draft tokens offered to the verifier; accepted: those it kept.
- alpha (acceptance rate) = accepted / drafted; trial_alpha = accepted / (accepted +
  rejections), the per-position rate of the independent-acceptance model.
- first_alpha = acceptance at draft position 1; later_alpha = acceptance at a position
  given the one before it was accepted (the two rates of theory.tau_two_rates).
- tau (mean accepted length) = tokens produced per target forward pass *including the
  bonus token* = (accepted + passes - ended_early) / passes. Plain decoding has tau = 1.
  Where the output ended inside a step (EOS, a stop string, the budget, the context), the
  tokens after its end are not output: the step's own token (the target's, always last)
  is not counted (``ended_early``), nor are the drafts after the end, as drafted or
  accepted (``drop_accepted``).
- acceptance at draft position i = share of the steps that drafted position i in which
  the i-th draft token was accepted; acceptance is a prefix, so that needs every earlier
  position accepted too. vLLM divides by every step that drafted instead (its
  num_accepted_tokens_per_pos / num_drafts, as bench-serve reports it): the two agree where
  every step drafts the same number of tokens; with k auto, or a lookup that finds a
  shorter match, ours is the acceptance of the drafts that were made, and only vLLM's sums
  to the mean acceptance length - 1 (accepted per drafting step; tau - 1 where every pass
  drafts).
- tokens_per_s = new tokens / wall time of the whole request, prefill included;
  decode_tokens_per_s excludes the prefill.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # steps in which a draft token was rejected
    # drafter calls, each costing the profile's c: one per chain draft token, a tree's passes
    draft_passes: int = 0
    target_forwards: int = 0  # decoding passes after the prefill; each yields accepted + 1
    ended_early: int = 0  # passes whose own token came after the end of the output (0 or 1)
    # steps by the number of draft tokens scored: {d: steps that scored d drafts + 1}
    steps_by_drafted: dict[int, int] = field(default_factory=dict)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    last_drafted: int = field(default=0, repr=False)
    last_accepted: int = field(default=0, repr=False)
    last_depth: int = field(default=0, repr=False)  # positions the last step counted as drafted
    last_rejected: bool = field(default=False, repr=False)  # whether it counted a rejection

    def observe_step(self, num_drafted: int, num_accepted: int, depth: int | None = None,
                     rejected: bool | None = None) -> None:
        """One verification pass. A tree of ``num_drafted`` nodes passes its ``depth``:
        per-position counts are then per depth (a chain's depth is its length), and
        ``rejected``: whether the walk stopped at a node that had children (a path that
        ends at a leaf rejected nothing; default: it stopped short of ``depth``)."""
        self.target_forwards += 1
        self.last_drafted, self.last_accepted = num_drafted, num_accepted
        self.steps_by_drafted[num_drafted] = self.steps_by_drafted.get(num_drafted, 0) + 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        depth = num_drafted if depth is None else depth
        self.last_depth = depth
        self.last_rejected = (num_accepted < depth) if rejected is None else bool(rejected)
        self.rejections += self.last_rejected
        grow = depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for position in range(depth):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < num_accepted

    def drop_accepted(self, count: int) -> None:
        """The step just observed produced ``count`` tokens fewer than its accepted drafts and
        own token: the output ended inside it (EOS, a stop string, the token budget, the
        context), and what came after is not output. Those are its last ``count`` tokens:
        its own token (the target's, last) and then its last accepted drafts. The drafts count
        neither as drafted nor as accepted, the own token not toward τ, which stays the tokens
        a pass produced (a lookup drafter that copies the chat template's end-of-turn and the
        next turn's start reported τ 3.33 for 2.67 tokens a pass; found in review). A draft
        before the end, an EOS that ended the output among them, stays accepted (found in
        review: an EOS drafted first lost its acceptance, and later acceptance went wrong).

        The drafts past the end that were not accepted go too: the rejected one (and the
        rejection: the output never reached it) and those after it, on a chain; a tree's
        positions past the end likewise, and of its nodes the accepted path's. Kept, they
        made the acceptance depend on whether a draft the output never reached was right
        (found in review: [EOS, wrong] read α 0.5 where [EOS, right] read 1.0, for the same
        output)."""
        if count <= 0:
            return
        self.ended_early += 1
        drafts = min(count - 1, self.last_accepted)
        kept = self.last_accepted - drafts  # accepted drafts before the end
        for position in range(kept, self.last_depth):
            self.drafted_per_position[position] -= 1
            self.accepted_per_position[position] -= position < self.last_accepted
        chain = self.last_depth == self.last_drafted
        dropped = self.last_drafted - kept if chain else drafts
        self.accepted_tokens -= drafts
        self.draft_tokens -= dropped
        self.rejections -= self.last_rejected  # the own token ends past the end, so the rejection does
        self.last_rejected = False
        self.last_accepted = kept
        self.last_drafted -= dropped
        self.last_depth = kept

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def drafting_steps(self) -> int:
        """Verification passes that scored at least one draft (vLLM's num_drafts)."""
        return sum(count for drafted, count in self.steps_by_drafted.items() if drafted)

    @property
    def trial_alpha(self) -> float:
        """Acceptance per draft *trial*: accepted / (accepted + rejections). Drafts after a
        rejection are never tried, so this is the alpha of the independent-acceptance
        model (theory.expected_tau), and higher than ``alpha`` at large k."""
        trials = self.accepted_tokens + self.rejections
        return self.accepted_tokens / trials if trials else 0.0

    @property
    def first_alpha(self) -> float:
        drafted = self.drafted_per_position[0] if self.drafted_per_position else 0
        return self.accepted_per_position[0] / drafted if drafted else 0.0

    @property
    def later_alpha(self) -> float:
        return acceptance_rates([self])[1]

    @property
    def tau(self) -> float:
        return tau_of(self.accepted_tokens, self.target_forwards, self.ended_early)

    @property
    def acceptance_per_position(self) -> list[float]:
        """Accepted over drafted, per draft position, up to the deepest position drafted. A
        position whose drafts were all taken back (past the end of the output,
        ``drop_accepted``) was never drafted: it read 0.0 and was averaged as rejections
        (found in review); such positions are always the deepest ones, and are left out."""
        drafted = self.drafted_per_position
        depth = max((i + 1 for i, d in enumerate(drafted) if d), default=0)
        return [a / d for a, d in zip(self.accepted_per_position[:depth], drafted[:depth])]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.wall_seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    def to_dict(self) -> dict:
        record = asdict(self)
        del record["last_drafted"], record["last_accepted"], record["last_depth"], record["last_rejected"]
        for name in ("alpha", "trial_alpha", "first_alpha", "later_alpha", "tau", "acceptance_per_position", "tokens_per_s", "decode_tokens_per_s"):
            record[name] = getattr(self, name)
        return record

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_seconds:.2f}s ({self.tokens_per_s:.1f} tok/s, "
            f"decode {self.decode_tokens_per_s:.1f} tok/s) | drafted {self.draft_tokens}, "
            f"accepted {self.accepted_tokens}, alpha {self.alpha:.2f}, tau {self.tau:.2f}, "
            f"target passes {self.target_forwards} | draft {self.draft_seconds:.2f}s, "
            f"verify {self.verify_seconds:.2f}s, prefill {self.prefill_seconds:.2f}s"
        )


def tau_of(accepted: int, passes: int, ended_early: int = 0) -> float:
    """Tokens produced per target pass (module docstring); 0 without a pass."""
    return (accepted + passes - ended_early) / passes if passes else 0.0


def acceptance_rates(runs: list[GenerationStats]) -> tuple[float, float]:
    """(first, later) acceptance pooled over runs. Position 1 is tried in every step that
    drafted; later positions only after an accepted one, and a step ends its run with at
    most one rejection, so the later rejections are all rejections but those at position 1.
    With no later position tried, later = first (independent acceptance, eq. 1)."""
    drafted = sum(s.drafted_per_position[0] for s in runs if s.drafted_per_position)
    first_accepted = sum(s.accepted_per_position[0] for s in runs if s.drafted_per_position)
    later_accepted = sum(s.accepted_tokens for s in runs) - first_accepted
    later_rejected = sum(s.rejections for s in runs) - (drafted - first_accepted)
    later_trials = later_accepted + later_rejected
    first = first_accepted / drafted if drafted else 0.0
    return first, later_accepted / later_trials if later_trials else first
