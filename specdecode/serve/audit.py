"""The losslessness audit: a sampled fraction of finished requests that speculated is
decoded again without speculation, when the engine is otherwise idle, and compared token
by token. Greedy requests, and sampled ones whose drafter does not sample (its drafts are
verified by the target's own draws, one uniform per position: the re-run with the
request's seed must draw the same tokens). A mismatch is counted in /metrics and logged
with the request id, the first divergent position and the target's top-2 logit margin
there (a margin near 0 is a numerical near-tie, a large one a bug); for a sampled
request also both tokens' probabilities under its processed distribution, which is what
a draw picks between (as ``SpeculativeEngine.first_divergence`` reports them)."""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import replace

import torch

from ..verify.sampling import token_probabilities

logger = logging.getLogger("specdecode.serve")


class Auditor:
    def __init__(self, engine, rate: float, metrics, seed: int = 0, backlog: int = 64):
        self.engine = engine
        self.rate = rate
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.backlog: deque = deque(maxlen=backlog)  # oldest audits are dropped under load
        self.mismatches: list[dict] = []

    def offer(self, sequence) -> None:
        """A finished request; audited with probability ``rate`` if it speculated, greedily
        or with drafts that the target's own draws verify."""
        if sequence.audit_of is not None:
            self.compare(sequence)
            return
        # a request whose drafter failed part way drafted until then: checked too (found in review:
        # the path most worth checking was never audited)
        drafter = sequence.proposer if sequence.proposer is not None else sequence.lost_drafter
        comparable = sequence.params.greedy or not getattr(drafter, "samples_drafts", False)
        if comparable and drafter is not None and sequence.finish_reason != "abort" \
                and self.rng.random() < self.rate:
            self.backlog.append(sequence)

    def run_one(self) -> bool:
        """Queue one plain re-run (called by the engine thread when it has nothing else)."""
        if not self.backlog:
            return False
        original = self.backlog.popleft()
        params = replace(original.params, seed=original.seed)  # the seed it drew with, if it was not given one
        # prefilled in full: an independent re-run; under the request's cache_salt, since its row serves
        # prefixes like any other (unsalted, a tenant's prompt was offered to every unsalted request; found
        # in review)
        audit = self.engine.add(original.prompt_ids, params, f"{original.request_id}-audit", speculate=False,
                                 reuse_prefix=False, cache_salt=original.cache_salt)
        audit.audit_of = original
        audit.task_type = original.task_type
        return True

    @torch.inference_mode()
    def compare(self, audit) -> None:
        original = audit.audit_of
        if audit.preempted:  # a user request took its row: run it again later
            self.backlog.appendleft(original)
            return
        if audit.finish_reason == "abort" or audit.error is not None:
            # the re-run failed (an engine error aborted it): nothing was compared, and an empty
            # output is no evidence of a mismatch (it was counted as one)
            logger.warning("audit of request %s did not run to its end (%s); not compared", original.request_id,
                           audit.error or "aborted")
            return
        self.metrics.labels(self.metrics.audit_checked).inc()
        if audit.generated == original.generated and audit.finish_reason == original.finish_reason:
            return
        position = next((i for i, (a, b) in enumerate(zip(original.generated, audit.generated)) if a != b),
                        min(len(original.generated), len(audit.generated)))
        record = {"request_id": original.request_id, "position": position, "top2_margin": None,
                  "speculative_token": original.generated[position] if position < len(original.generated) else None,
                  "plain_token": audit.generated[position] if position < len(audit.generated) else None}
        self.mismatches.append(record)  # counted first: the margin's pass may fail
        self.metrics.labels(self.metrics.audit_mismatch).inc()
        sampled = ""
        try:
            logits = self.logits_after(original.prompt_ids + original.generated[:position])
            if logits is not None:
                top = logits.topk(2).values
                record["top2_margin"] = float(top[0] - top[1])
                if not original.params.greedy:  # a draw picks by probability; the logit margin says little
                    record["probabilities"] = token_probabilities(
                        logits, original.params, {"speculative": record["speculative_token"],
                                                  "plain": record["plain_token"]})
                    sampled = ", probabilities %s" % record["probabilities"]
        except Exception:  # noqa: BLE001 - the mismatch stands without its margin
            logger.exception("the top-2 margin of the audit mismatch of request %s could not be computed",
                             original.request_id)
        margin = record["top2_margin"]
        logger.warning("audit mismatch: request %s differs from plain decoding at token %d (top-2 margin %.4g%s)",
                       original.request_id, position, margin if margin is not None else float("nan"), sampled)

    def logits_after(self, tokens: list[int]) -> torch.Tensor | None:
        """The target's logits for the token after ``tokens``, on a free row (None if none is free)."""
        engine = self.engine
        if not engine.free_rows:
            return None
        row = engine.free_rows[0]
        engine.row_tokens[row] = []  # overwritten here: no longer a cached prefix
        return engine.runtime.forward_rows(torch.tensor([tokens]), [row], [0], last_only=True)[0, -1].float()
