"""The speculation loop: propose -> score -> verify -> commit.

Cache convention (target and draft alike): the cache holds keys and values for every
committed token but the last one, which is fed at the start of the next step together with
the draft tokens. Scoring ``[last, d_1 .. d_k]`` is one target pass that yields k+1
distributions; after ``n`` drafts are accepted the cache is rolled back to keep
``last, d_1 .. d_n`` and the bonus token becomes the new last token.

Plain decoding is the same loop with no proposer (k = 0): one token scored, one produced.
"""

from __future__ import annotations

import numbers
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ConfigError, SamplingParams, SpecDecodeError
from .control.policies import FixedK, KPolicy
from .metrics import GenerationStats
from .models import synchronize
from .proposers.base import Proposal, Proposer, check_capture, check_drafter, drafts_in_vocab, hidden_size_of
from .text import TextTracker, not_utf8
from .verify.chain import coupled_verify, greedy_tokens, greedy_verify_rows, rejection_sample
from .verify.tree import coupled_tree_verify, greedy_tree_verify, tree_rejection_sample
from .verify.sampling import PositionUniforms, argmax_ids, logits_to_probs, seeded_generator, token_probabilities


class PromptError(SpecDecodeError, ValueError):
    """The prompt cannot be run: empty, or longer than the model's context."""


class ContextLengthError(PromptError):
    """The prompt does not fit the context."""


def check_prompt(prompt_ids: list[int], context: int, vocab_size: int, limit: str = "the model's context") -> None:
    """Refuse an empty prompt, one of ``context`` tokens or more (``limit`` names that
    bound in the message), and token ids outside the vocabulary."""
    if len(prompt_ids) == 0:
        raise PromptError("prompt is empty")
    if len(prompt_ids) >= context:
        raise ContextLengthError(f"prompt has {len(prompt_ids)} tokens but {limit} is {context} tokens; "
                                 "shorten the prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"prompt holds token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


def verify_chain(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 params: SamplingParams, generator: torch.Generator | None, draws: PositionUniforms,
                 position: int) -> list[int]:
    """Verify one sequence's chain drafts ``[1, k]`` against ``target_logits`` ``[1, k+1, V]``
    (row 0 scored at ``position - 1``, so it draws the token at ``position``): greedy, or
    sampling against the processed target distribution. Drafts drawn from ``draft_probs``
    ``[1, k, V]`` go through rejection sampling (``generator``); deterministic drafts
    (``draft_probs`` None) and plain steps through the target's own draws with the
    request's ``draws`` at positions ``position..position + k`` (``coupled_verify``: the
    tokens plain sampling draws with them). Returns the step's new tokens: the accepted
    drafts, then the bonus token.

    Greedy compares Python lists (``greedy_tokens``): the batched tensor functions took
    0.40 ms of small torch ops per speculative step of one sequence (0.17 per plain step)
    on a Zen 3, where this takes about 0.1."""
    if params.greedy:
        return greedy_tokens(draft_ids[0].tolist(), argmax_ids(target_logits[0]).tolist())
    target_probs = logits_to_probs(target_logits, params)
    draft_ids = draft_ids.to(target_probs.device)  # drafts may come from the CPU (lookup, a serving row)
    if draft_probs is None:
        uniforms = draws(position, draft_ids.shape[1] + 1)[None].to(target_probs.device)
        output_ids, num_accepted = coupled_verify(draft_ids, target_probs, uniforms)
    else:
        output_ids, num_accepted = rejection_sample(draft_ids, draft_probs.to(target_probs.device), target_probs,
                                                    generator)
    return output_ids[0, : int(num_accepted[0]) + 1].tolist()


def commit_tokens(new_tokens: list[int], tokens: list[int], generated: list[int], tracker: "TextTracker | None",
                  params: SamplingParams, eos_token_ids: frozenset, context: int) -> tuple[list[int], str | None]:
    """Append a step's tokens to the sequence (``tokens``) and the output (``generated``)
    until EOS, a stop string, the token budget or the context ends it. Returns the tokens
    added and the finish reason ("stop", "length") or None; accepted drafts past the end
    are dropped."""
    # with stop strings the tokens go to the text one at a time (the one that completes a
    # stop ends the output); without, the step's text comes in one decode
    one_at_a_time = tracker is not None and tracker.watches_stops
    added, finish = [], None
    for token in new_tokens:
        if token in eos_token_ids and not params.ignore_eos:
            finish = "stop"
            break
        tokens.append(token)
        generated.append(token)
        added.append(token)
        if one_at_a_time and tracker.add(token):
            finish = "stop"
            break
        if len(generated) >= params.max_new_tokens or len(tokens) >= context:
            finish = "length"
            break
    if tracker is not None and not one_at_a_time:
        tracker.add_many(added)
    return added, finish


def ended_at_eos(new_tokens: list[int], added: list[int], finish: str | None, tracker: "TextTracker | None") -> bool:
    """Whether an EOS token ended the output at this step (it is not in ``added``):
    ``commit_tokens``'s "stop" is an EOS or a stop string, and the tracker knows the latter."""
    return finish == "stop" and len(added) < len(new_tokens) and not (tracker is not None and tracker.stopped)


def past_the_end(new_tokens: list[int], added: list[int], finish: str | None, tracker: "TextTracker | None") -> int:
    """How many of a step's tokens (accepted drafts and bonus) came after the end of the
    output, given what ``commit_tokens`` added: they are not output, so the step's stats
    drop them (``GenerationStats.drop_accepted``; τ stays the tokens a pass produced, the
    EOS that ended the output one of them, but not an EOS after a stop string or after the
    token budget: found in review)."""
    if finish is None or len(added) >= len(new_tokens):
        return 0
    return len(new_tokens) - len(added) - ended_at_eos(new_tokens, added, finish, tracker)


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only, EOS and anything past a stop excluded
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats


def as_policy(k):
    """A k policy: an integer (numpy's too, as a sweep over np.arange gives) is a fixed k;
    anything else must choose k itself. Found in review: a numpy integer or a float was
    taken for a policy and failed later with an AttributeError naming neither."""
    if hasattr(k, "choose") and hasattr(k, "observe"):
        return k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ConfigError(f"k must be an integer >= 1 or a k policy, got {k!r}")
    return FixedK(int(k))


def check_own_cache(proposer, target) -> None:
    """A draft model must keep a cache of its own: handed the target's runtime, its resets
    and rollbacks rewrote the target's keys and values, and greedy output silently left
    plain decoding's (found in review)."""
    runtime = getattr(proposer, "runtime", None)
    shared = runtime is target or (runtime is not None and getattr(runtime, "k_cache", None) is not None
                                   and getattr(runtime, "k_cache", None) is getattr(target, "k_cache", None))
    if shared:
        raise ConfigError("the draft model runs on the target's own runtime and cache; load the draft separately "
                          "(or use a layer-skip view: --draft self:L)")


class SpeculativeEngine:
    def __init__(
        self,
        target,
        tokenizer=None,
        proposer: Proposer | None = None,
        k: "int | KPolicy" = 5,
        eos_token_ids: tuple[int, ...] = (),
    ):
        """``k``: a fixed number of draft tokens per step, or a policy that chooses it
        per step (``control.policies``: CostAwareK for ``--k auto``, ThresholdK)."""
        if proposer is not None:
            check_drafter(proposer, target.vocab_size, hidden_size_of(target))
            check_own_cache(proposer, target)
            check_capture(proposer, target)
            if getattr(target, "rolls_back", True) is False:  # before any request (found in review: mid-request)
                raise SpecDecodeError(f"{target.describe()} keeps a recurrent state that cannot be rolled back past "
                                      "rejected drafts: speculative decoding cannot run on it (use --method none)")
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.policy = None if proposer is None else as_policy(k)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.drafter: str | None = None  # the drafter's name in profiles and router records
        self.last_lazy = False  # whether the last step computed its logits on demand
        # kernel threads per decode pass, chosen by measuring the passes
        # (control.threads.ThreadChoice, as the server's; None: torch's count, always)
        self.threads = None

    @property
    def device(self) -> torch.device:
        """Where the target's logits live: verification and sampling run there."""
        return torch.device(getattr(self.target, "device", "cpu"))

    @property
    def tree_drafter(self) -> bool:
        """True when the proposer drafts trees (its budget is k nodes per step)."""
        return bool(getattr(self.proposer, "drafts_trees", False))

    @property
    def capture(self) -> tuple[int, ...]:
        """Target layers whose inputs the drafter reads (an EAGLE head), else ()."""
        return tuple(getattr(self.proposer, "capture", ()) or ())

    @property
    def k(self) -> int:
        """The most draft tokens a step may offer (0 for plain decoding)."""
        return 0 if self.policy is None else self.policy.k_max

    @property
    def k_label(self) -> str:
        return "0" if self.policy is None else self.policy.describe()

    @property
    def method(self) -> str:
        return self.proposer.name if self.proposer is not None else "none"

    def encode(self, prompt: str | list[dict], chat_template: bool = True) -> list[int]:
        """Prompt text, or a conversation (``[{"role", "content"}, ...]``, ending with the
        user's turn) -> token ids, through the chat template when asked and available.
        Without a template a conversation's turns are joined by blank lines."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages or not messages[-1]["content"] or not messages[-1]["content"].strip():
            raise PromptError("prompt is empty")
        if self.tokenizer is None:
            raise SpecDecodeError("this model has no tokenizer; pass token ids instead of text")
        for message in messages:  # bytes that are not UTF-8 (argv) arrive as lone surrogates: the tokenizer's TypeError
            if (problem := not_utf8(str(message["content"]))) is not None:
                raise PromptError(f"the prompt is not valid UTF-8 text ({problem})")
        if chat_template and self.tokenizer.chat_template:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            return list(encoded["input_ids"])
        return list(self.tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])

    @torch.inference_mode()
    def next_token_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The target's logits [V] for the token after ``token_ids`` (one prefill)."""
        self.target.reset(len(token_ids) + 1)
        return self.target(torch.tensor([token_ids]), last_only=True)[0, -1].float()

    def first_divergence(self, prompt_ids: list[int], reference: list[int], other: list[int],
                         params: SamplingParams | None = None) -> dict | None:
        """Where two generations from ``prompt_ids`` first differ, and the target's top-2
        logit margin there (after the shared prefix): a margin near 0 is a numerical
        near-tie, which rounding differences between kernels can flip; a large one would be
        a bug. Where one output is a prefix of the other, they diverge where the shorter one
        ended (its token there None: it ended at EOS). None when they are the same.
        ``params`` of a sampled run add each token's probability under the target's
        processed distribution there (what a draw picks between; the logit margin says
        little of it)."""
        position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
        if position is None:
            if len(reference) == len(other):
                return None
            position = min(len(reference), len(other))
        logits = self.next_token_logits(prompt_ids + reference[:position])
        top = logits.topk(2)
        token = lambda tokens: tokens[position] if position < len(tokens) else None  # noqa: E731
        found = {"position": position, "reference_token": token(reference), "other_token": token(other),
                 "top1_token": int(top.indices[0]), "top2_token": int(top.indices[1]),
                 "top2_margin": float(top.values[0] - top.values[1])}
        if params is not None and not params.greedy:
            found["probabilities"] = token_probabilities(logits, params, {"reference": found["reference_token"],
                                                                          "other": found["other_token"]})
        return found

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
        prior_alpha: float | None = None,
    ) -> Generation:
        """Generate from ``prompt_ids``; ``on_text`` receives text as it is accepted.
        ``prior_alpha``: the acceptance at draft position 1 expected for this kind of request (router),
        which seeds an adaptive k policy."""
        check_prompt(prompt_ids, self.target.max_positions, self.target.vocab_size)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        max_positions = self.target.max_positions
        capacity = min(len(prompt_ids) + params.max_new_tokens + self.k + 1, max_positions)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = seeded_generator(seed, self.device)
        draws = PositionUniforms(seed)  # the target's draws, one per position of the sequence
        tracker = TextTracker(self.tokenizer, params.stop, prompt_ids)
        tokens, generated, finish = list(prompt_ids), [], None

        started = time.perf_counter()
        self.target.reset(capacity)
        if self.proposer is not None:
            self.proposer.start(tokens, capacity)
            costs = getattr(self.policy, "costs", None)
            if costs is not None:  # what a step costs depends on whether the head runs lazily
                costs.lazy_head = self._can_lazy(params)
            self.policy.start(prior_alpha)
        if len(tokens) > 1:
            _, features = self._score(torch.tensor([tokens[:-1]]), prefill=True, last_only=True)
            if features is not None:  # a head drafter reads the prompt's hidden states
                self.proposer.observe(0, features[0], tokens)
        synchronize(self.device)  # a GPU's prefill is charged here, not to the first step
        stats.prefill_seconds = time.perf_counter() - started

        labelled = hasattr(self.policy, "use_label") and hasattr(self.proposer, "draft_label")
        while finish is None:
            before = (stats.draft_seconds, stats.verify_seconds, stats.draft_passes)
            if labelled:  # the policy prices the draft by its kind's acceptance
                looked_up = time.perf_counter()  # the lookup is the drafting (propose reuses it): charged as such
                self.policy.use_label(self.proposer.draft_label(tokens))
                stats.draft_seconds += time.perf_counter() - looked_up
            # never draft past the token budget or the context
            wanted = self.policy.choose(len(tokens)) if self.policy is not None else 0
            k = max(min(wanted, params.max_new_tokens - len(generated) - 1, capacity - len(tokens)), 0)
            if self.tree_drafter:  # a tree is scored in one pass: the root and its nodes in one prefill chunk
                k = min(k, getattr(self.target, "prefill_chunk", k + 1) - 1)  # (found in review: refused mid-request)
            if k > 0 and self.tree_drafter:
                new_tokens = self._tree_step(tokens, k, params, generator, draws, stats)
            else:
                new_tokens = self._step(tokens, k, params, generator, draws, stats)
            if self.policy is not None:
                note_cost = getattr(self.policy, "observe_cost", None)
                if note_cost is not None:  # what drafting and scoring cost here, measured
                    note_cost(stats.draft_seconds - before[0], stats.draft_passes - before[2],
                              stats.verify_seconds - before[1], stats.last_drafted, len(new_tokens), self.last_lazy)
                self.policy.observe(stats.last_drafted, len(new_tokens) - 1)
            added, finish = commit_tokens(new_tokens, tokens, generated, tracker, params, self.eos_token_ids,
                                          max_positions)
            stats.drop_accepted(past_the_end(new_tokens, added, finish, tracker))
            if on_text is not None and (piece := tracker.delta()):
                on_text(piece)

        if tracker.finish() and finish == "length":
            finish = "stop"  # the last tokens completed a character that completed a stop string
        if on_text is not None and (piece := tracker.delta(final=True)):
            on_text(piece)
        stats.new_tokens = len(generated)
        stats.wall_seconds = time.perf_counter() - started
        text = tracker.text if self.tokenizer is not None else ""
        return Generation(generated, text, finish, stats)

    def _can_lazy(self, params: SamplingParams) -> bool:
        """Whether this request's steps may compute logits on demand: greedy verification
        on a target that can (the CPU kernels), where the rows past the first rejection
        then skip the output head."""
        return bool(params.greedy and getattr(self.target, "lazy_logits", False))

    def _lazy(self, params: SamplingParams, drafted: int) -> dict:
        """The target-pass option for logits on demand, for a step with ``drafted`` drafts:
        where the request can, and the k policy (if it weighs costs) expects it to cost
        less than one pass of the head over every row."""
        decide = getattr(self.policy, "lazy", None)
        one_chunk = drafted + 1 <= getattr(self.target, "prefill_chunk", drafted + 1)  # else the pass returns them all
        self.last_lazy = bool(drafted and one_chunk and self._can_lazy(params) and (decide is None or decide(drafted)))
        return {"lazy_logits": True} if self.last_lazy else {}

    def _score(self, inputs: torch.Tensor, prefill: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target pass: logits, and the captured layer inputs a head drafter reads (else None).
        A decode pass (not ``prefill``) runs on the thread count ``self.threads`` chooses, and
        tells it what the pass took."""
        choice = None if prefill else self.threads
        if choice is None:
            return self._pass(inputs, **kwargs)
        width, context = inputs.shape[1], getattr(self.target, "length", 0)
        threads = choice.choose(1, width, context)
        began = time.perf_counter()
        out = self._pass(inputs, threads=threads, **kwargs)
        choice.observe(threads, 1, width, context, (time.perf_counter() - began) * 1e3)
        return out

    def _pass(self, inputs: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.capture:
            return self.target(inputs, capture=self.capture, **kwargs)
        return self.target(inputs, **kwargs), None

    def _tree_step(self, tokens: list[int], budget: int, params: SamplingParams, generator: torch.Generator,
                   draws: PositionUniforms, stats: GenerationStats) -> list[int]:
        """One step over a token tree of at most ``budget`` draft nodes: score every node in
        one pass (tree mask, positions by depth), walk down the accepted path, move its
        keys and values into contiguous slots."""
        started = time.perf_counter()
        proposal = self.proposer.propose_tree(tokens, budget, params, generator)
        trim = getattr(self.policy, "trim", None)
        if trim is not None:  # the tree budget policy keeps the nodes worth their cost
            proposal = trim(proposal, len(tokens), proposal.passes)
        # never more nodes than the budget, nor any from the first outside the vocabulary on
        # (found in review: a proposer that offered more ran past the context)
        proposal = proposal.first(min(budget, drafts_in_vocab(proposal.tree.tokens, self.target.vocab_size)))
        tree = proposal.tree
        scored = time.perf_counter()
        stats.draft_seconds += scored - started

        context = len(tokens)
        depths = tree.depths()
        inputs = torch.cat([torch.tensor([tokens[-1]]), tree.tokens]).to(self.device)[None]
        target_logits, features = self._score(inputs, positions=context - 1 + depths, tree_mask=tree.mask(),
                                              **self._lazy(params, tree.size))
        if params.greedy:
            rows = target_logits[0] if isinstance(target_logits, torch.Tensor) else lambda node: target_logits.row(0, node)
            path, bonus = greedy_tree_verify(tree, rows)
        else:
            target_probs = logits_to_probs(target_logits[0], params)
            if proposal.draft_probs is None:  # deterministic nodes: the target's own draws pick the path
                path, bonus = coupled_tree_verify(tree, target_probs, draws(context, int(depths.max()) + 1))
            else:
                path, bonus = tree_rejection_sample(tree, target_probs, proposal.draft_probs.to(self.device), generator)
        # commit: the root stays in its slot; the accepted nodes' entries move behind it
        if path:
            self.target.compact(torch.tensor(path) + context - 1, context)
        else:
            self.target.rollback(context)
        new_tokens = [int(tree.tokens[node - 1]) for node in path] + [bonus]
        stopped_at = path[-1] if path else 0
        stats.observe_step(tree.size, len(path), int(depths.max()) if tree.size else 0,
                           rejected=bool(tree.children()[stopped_at]))
        stats.draft_passes += proposal.passes
        observed = time.perf_counter()
        stats.verify_seconds += observed - scored
        if features is not None:
            rows = torch.tensor([0] + path)
            self.proposer.observe(context - 1, features[0, rows], tokens + new_tokens)
            stats.draft_seconds += time.perf_counter() - observed
        return new_tokens

    def _step(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        draws: PositionUniforms,
        stats: GenerationStats,
    ) -> list[int]:
        """One speculative step; returns the accepted tokens plus the bonus token."""
        # 1. propose
        started = time.perf_counter()
        proposal = (
            self.proposer.propose(tokens, k, params, generator)
            if k > 0 and self.proposer is not None
            else Proposal.empty()
        )
        draft_ids = proposal.draft_ids[:k]
        draft_ids = draft_ids[None, :drafts_in_vocab(draft_ids, self.target.vocab_size)].to(self.device)  # [1, k']
        num_drafted = draft_ids.shape[1]
        scored = time.perf_counter()
        stats.draft_seconds += scored - started

        # 2. score: the last committed token and every draft, one target pass
        context = len(tokens)
        inputs = torch.cat([torch.tensor([[tokens[-1]]], device=self.device), draft_ids], dim=1)
        target_logits, features = self._score(inputs, **self._lazy(params, num_drafted))  # [1, k'+1, V]

        # 3. verify
        if isinstance(target_logits, torch.Tensor):
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[None, :num_drafted]
            new_tokens = verify_chain(draft_ids, draft_probs, target_logits, params, generator, draws, context)
            accepted = len(new_tokens) - 1
        else:  # greedy on logits computed on demand: the rows up to the first rejection
            drafts = draft_ids[0].tolist()
            accepted, bonus = greedy_verify_rows(drafts, lambda position: target_logits.row(0, position))
            new_tokens = drafts[:accepted] + [bonus]

        # 4. commit: keep the last token and the accepted drafts in the cache
        self.target.rollback(context + accepted)
        stats.observe_step(num_drafted, accepted)
        stats.draft_passes += num_drafted
        observed = time.perf_counter()
        stats.verify_seconds += observed - scored
        if features is not None:  # the head's entries for the committed tokens (drafting work)
            self.proposer.observe(context - 1, features[0, : accepted + 1], tokens + new_tokens)
            stats.draft_seconds += time.perf_counter() - observed
        return new_tokens
