"""The batched engine: many sequences, one target pass per step for all of them.

Each request is a ``Sequence``: its tokens, sampling parameters, random generator, drafter
and k policy, and one row of the target's KV cache. ``BatchEngine.step`` runs one
scheduling round:

1. admit waiting sequences into free cache rows (at most ``max_num_seqs`` run at once),
   reusing the longest cached prefix of the prompt (below);
2. prefill: one chunk (at most ``prefill_chunk`` tokens) of one admitted prompt, so a long
   prompt delays the running sequences by one chunk per step, never by its whole length;
3. decode: every prefilled sequence drafts its own k (0 for plain decoding), and the
   target scores all rows in one pass, ``[last, d_1 .. d_k]`` per row, ragged rows padded
   to the longest with the row's last token (padding sits after a row's real tokens, so
   causal attention keeps it out of them, and its cache slots are overwritten later);
4. verify each row with the same functions as ``SpeculativeEngine`` (greedy or rejection
   sampling with the row's generator) and commit: a row's cache length is simply its
   committed length minus one (the engine's cache convention), so rejected slots cost no
   copy.

Prefix caching (vLLM's automatic prefix caching, on by default): a cache row keeps its
KV entries after its sequence finishes, until the row is reused. An admitted prompt
starts from the longest prefix it shares with the valid entries of any row, free or
running (a chat template's system prompt, the earlier turns of a conversation, n samples
of one prompt). A free row whose entries the prompt extends is taken as it is; otherwise
the prefix's entries are copied into a free row (one holding nothing, else the least
recently freed), so a row's longer history survives a prompt that shares only its start.
Only the rest of the prompt is prefilled. The cache is the rows themselves: at most
``max_num_seqs`` histories, and only those of rows not running are at risk. A key or value
depends only on the tokens at and before it, and on the kernels it is computed the same
bits whatever else was in its pass, so a reused prefix gives the logits that prefilling it
again would. A sequence whose drafter reads the target's hidden states at every position
(EAGLE) prefills its whole prompt; Medusa's heads read only the latest one and reuse.

On specdecode's CPU kernels every row's logits are bitwise independent of the other rows
and of the padding (``--exact``), so a request's greedy output is the same whatever else
runs beside it. Tree drafters draft chains here (width 1): ragged trees in one pass would
need per-row masks.
"""

from __future__ import annotations

import copy
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..config import SamplingParams, SpecDecodeError
from ..engine import check_prompt, commit_tokens, ended_at_eos, past_the_end, verify_chain
from ..metrics import GenerationStats
from ..models import synchronize
from ..proposers.base import Proposal, check_capture, check_drafter, drafts_in_vocab, hidden_size_of
from ..text import TextTracker
from ..verify.sampling import PositionUniforms, seeded_generator

FINISH_REASONS = ("stop", "length", "abort")
logger = logging.getLogger("specdecode.serve")
PREFIX_WAIT_MIN = 16  # the shortest prefix still being prefilled that a new request waits for


@dataclass
class StepOutput:
    """What one step added to a sequence: new token ids, the text now safe to show, and
    the finish reason once it is done."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    drafted: int = 0  # draft tokens this step scored, and how many it accepted
    accepted: int = 0


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    proposer: object | None = None
    policy: object | None = None
    prior_alpha: float | None = None
    task_type: str | None = None
    # called from the engine's thread after every step that changed the sequence
    listener: Callable[["Sequence", StepOutput], None] | None = None
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    cache_row: int | None = None
    prefilled: int = 0  # prompt tokens (of all but the last) whose KV is in the cache
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # when it first got a row (its queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False
    method: str = "none"  # the drafter's method name (reports)
    error: str | None = None  # set when the engine failed the sequence
    last_emit: float | None = None  # when the server last streamed from it
    counted_prompt: bool = False  # the server's metrics have its prompt tokens and time to first token
    counted_generated: int = 0  # and this many of its output tokens
    ended_at_eos: bool = False  # its last token was EOS (in the count of output tokens, not in ``generated``)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    reported: bool = False  # the server has counted it finished (serve/app.py, _report)
    audit_of: "Sequence | None" = None  # an audit's plain re-run of this request (serve/audit.py)
    preempted: bool = False  # an audit's re-run stopped to give its row to a user request
    lost_drafter: object = None  # its drafter, where it failed and the request went on without (the audit's)
    looked_up: int = 0  # prompt tokens looked up in it (0 until the sequence gets a row)
    reuse_prefix: bool = True  # False: prefill the whole prompt (the audit's independent re-run)
    share_prefix: bool = True  # False: its row serves no other prompt (running at a cache reset)
    cache_salt: str | None = None  # vLLM's: prefixes are shared only between requests with the same salt
    batched_steps: int = 0  # decode steps it shared with other rows (its time was then the batch's)
    device: torch.device | str = "cpu"  # the target's: its generator draws where the drafts and logits are

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = seeded_generator(self.seed, self.device)
        self.draws = PositionUniforms(self.seed)  # the target's draws, one per position (engine.verify_chain)
        self.tracker: TextTracker | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_tokens(self) -> int:
        """Tokens the model produced for it: the visible ones and the EOS that ended it, as
        vLLM and OpenAI count completion tokens."""
        return len(self.generated) + self.ended_at_eos

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids) - 1

    @property
    def text(self) -> str:
        return self.tracker.text if self.tracker is not None else ""

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV entries in the sequence's cache row are final: the prefilled
        part of the prompt, then every committed token but the last (its entry is written
        by the next step; slots past it may hold rejected drafts)."""
        return self.tokens[:self.prefilled if not self.prefill_done else len(self.tokens) - 1]


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


class BatchEngine:
    """Continuous batching over one target runtime (a ``NativeRuntime``).

    ``make_drafter()`` returns a fresh proposer for one sequence, or None for plain
    decoding; ``make_policy()`` a fresh k policy for it (an int: a fixed k). Both are
    called once per request unless the request brings its own."""

    def __init__(self, runtime, tokenizer=None, eos_token_ids: tuple[int, ...] = (), max_num_seqs: int = 8,
                 max_model_len: int | None = None, make_drafter: Callable[[], object] | None = None,
                 make_policy: Callable[[], object] | None = None, prefill_chunk: int | None = None):
        if not hasattr(runtime, "forward_rows"):
            raise SpecDecodeError("the batched engine needs the native runtime (a Llama-family model)")
        if max_num_seqs < 1:
            raise SpecDecodeError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        if max_model_len is not None and not 1 <= max_model_len <= runtime.max_positions:
            raise SpecDecodeError(f"max_model_len {max_model_len} is outside 1..{runtime.max_positions} "
                                  "(this model's context)")
        self.max_model_len = max_model_len or runtime.max_positions
        self.prefill_chunk = prefill_chunk or runtime.prefill_chunk
        self.make_drafter = make_drafter
        self.make_policy = make_policy
        try:
            runtime.reset(self.max_model_len, batch=max_num_seqs, exact_capacity=True)
        except (RuntimeError, MemoryError) as error:  # found in review: an allocator's traceback
            if "alloc" not in str(error).lower() and not isinstance(error, MemoryError):
                raise
            raise SpecDecodeError(f"the KV cache for {max_num_seqs} sequences of {self.max_model_len} tokens does not "
                                  "fit in memory: lower --max-num-seqs or --max-model-len (`specdecode memory` "
                                  "estimates what fits)") from None
        runtime.cache_owner = self  # another engine's reset, or a plain forward, would take it
        self.free_rows = deque(range(max_num_seqs))  # least recently freed first
        self.reaped: list[Sequence] = []  # the sequences the current step has finished so far
        self.prefix_caching = True
        self.row_tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]  # a free row's valid entries
        self.row_salt: list[str | None] = [None] * max_num_seqs  # the cache_salt of the request that wrote them
        self._forget_prefixes = False
        self.prefix_queries = 0  # prompt tokens admitted, and how many of them came from the cache
        self.prefix_hits = 0
        self.waiting: deque[Sequence] = deque()
        self.left_waiting: list[Sequence] = []  # finished before they ran (aborted, failed to start)
        self.running: list[Sequence] = []
        self.lock = threading.Lock()  # guards waiting (other threads add and abort)
        self._ids = itertools.count()
        self.steps = 0
        # admission order: "fcfs" (arrival) or "task": prefer waiting requests of the task
        # type most of the running rows have (the router's label), so a batch holds rows of
        # similar acceptance and the shared draft cap suits them all; a request waiting
        # longer than max_wait_seconds is admitted first whatever its type
        self.schedule = "fcfs"
        self.max_wait_seconds = 2.0
        # batch_cost(rows, width, context) -> ms of a pass over that many rows of that many
        # tokens each (None: no batch-level cap); the server passes the cost profile's
        # batch_time_ms, measured on this machine at batch sizes
        self.batch_cost: Callable[[int, int, int], float] | None = None
        self.probe_every = 64  # batched steps per step on which probing rows may draft
        # Under load, once the shared cap has let no adaptive row draft for this many steps
        # at a batch size, those rows skip their draft label and k choice (about 0.15 ms a
        # row; 8 rows on a Zen 3: speculation 0.96x -> 1.00x of plain) except on every
        # recheck_every-th step and on probe steps, where the cap is worked out in full again
        self.recheck_every = 8
        self._capped_out: dict[int, int] = {}  # batch size -> steps in a row the cap was 0
        # kernel threads for prefill chunks (None: torch's, as for decode steps). A server
        # keeps a core for its front end while decoding, but a chunk is long and bound by
        # arithmetic: more threads pay there (rows are the same bits at any thread count)
        self.prefill_threads: int | None = None
        # kernel threads for decode passes, chosen per pass by measuring them
        # (control.threads.ThreadChoice; None: torch's, as always)
        self.decode_threads = None

    # -- requests ---------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt(prompt_ids, self.max_model_len, self.runtime.vocab_size, limit="the context")

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
            speculate: bool = True, proposer=None, policy=None, listener=None, prior_alpha: float | None = None,
            task_type: str | None = None, method: str = "none", reuse_prefix: bool = True,
            cache_salt: str | None = None) -> Sequence:
        """Queue a request (thread-safe). ``speculate=False`` decodes it plainly;
        ``reuse_prefix=False`` prefills its whole prompt even where a cached prefix could
        serve; ``cache_salt``: a prefix is reused only from requests with the same salt
        (vLLM's, for tenants who must not learn each other's prompts from cached_tokens).
        Everything the sequence carries is set before it is queued: the engine
        thread may finish it before this returns."""
        self.check_prompt(prompt_ids)
        if speculate and proposer is None and self.make_drafter is not None:
            proposer = self.make_drafter()
        if proposer is not None:
            check_drafter(proposer, self.runtime.vocab_size, hidden_size_of(self.runtime))
            check_capture(proposer, self.runtime)
        if proposer is not None and policy is None:
            policy = self.make_policy() if self.make_policy is not None else 1
        if isinstance(policy, int):
            from ..control.policies import FixedK

            policy = FixedK(policy)
        sequence = Sequence(request_id or f"seq-{next(self._ids)}", list(prompt_ids), params, proposer,
                            policy if proposer is not None else None, prior_alpha, task_type, listener,
                            method=method if proposer is not None else "none", reuse_prefix=reuse_prefix,
                            device=self.runtime.device, cache_salt=cache_salt)
        if params.stop and self.tokenizer is None:
            raise SpecDecodeError("stop strings need a tokenizer; this model has none")
        sequence.tracker = TextTracker(self.tokenizer, params.stop, prompt_ids)
        with self.lock:
            self.waiting.append(sequence)
        return sequence

    def abort(self, sequence: Sequence) -> None:
        """Stop a sequence (thread-safe): a waiting one leaves the queue now, a running one
        frees its cache row at the next step."""
        sequence.aborted = True
        with self.lock:
            index = next((i for i, s in enumerate(self.waiting) if s is sequence), None)
            if index is not None:
                del self.waiting[index]
        if index is not None:
            self._finish(sequence, "abort")
            with self.lock:
                self.left_waiting.append(sequence)  # the next step reports it with the others

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix at the next step (thread-safe): the free rows' entries
        now, the running rows' when they finish; the running rows serve no prompt meanwhile."""
        self._forget_prefixes = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.left_waiting)  # the last: to be reported

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one scheduling round -----------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit, prefill one chunk, decode every prefilled row once. Returns the
        sequences that finished in this step."""
        # kept on the engine until the step ends: a step that fails part way still reports
        # the sequences it had reaped (ServerState._fail_all takes them)
        finished = self.reaped = []
        if self._forget_prefixes:  # the free rows' histories, and those of the rows running now
            self._forget_prefixes = False
            self._forget_rows()
            for sequence in self.running:
                sequence.share_prefix = False
        self._reap(finished)
        self._admit()
        with self.lock:
            finished += self.left_waiting
            self.left_waiting = []
        pending = [s for s in self.running if not s.prefill_done]
        if pending:
            self._prefill_chunk(pending[0])
        ready = [s for s in self.running if s.prefill_done]
        if ready:
            self._decode(ready)
        self._reap(finished)
        self.steps += 1
        return finished

    def run(self) -> None:
        """Step until every queued sequence has finished (offline use and tests)."""
        while self.has_work:
            self.step()

    def _next_waiting(self, passed: set[int] = frozenset()) -> int | None:
        """The index in ``waiting`` of the sequence to admit next, among those not in
        ``passed`` (ids of sequences left waiting this round); None: none (the lock is held)."""
        candidates = [i for i, s in enumerate(self.waiting) if id(s) not in passed]
        if not candidates:
            return None
        first = candidates[0]
        if self.schedule != "task" or not self.running:
            return first
        if time.perf_counter() - self.waiting[first].arrival > self.max_wait_seconds:
            return first
        labels = [s.task_type for s in self.running]
        majority = max(set(labels), key=labels.count)
        return next((i for i in candidates if self.waiting[i].task_type == majority), first)

    def _admit(self) -> None:
        with self.lock:
            owned = self._claim_cache()
            # a sequence waiting for a prefix being prefilled stays where it is, with a free row
            # kept for it; those behind it may take the other free rows (found in review: it
            # stopped every admission, so a one-token prompt behind it waited out another
            # prompt's whole prefill, 23 steps instead of 1, with a row free throughout)
            passed: set[int] = set()
            while self.waiting and len(self.free_rows) > len(passed):
                index = self._next_waiting(passed)
                if index is None:
                    break
                sequence = self.waiting[index]
                if sequence.aborted:
                    del self.waiting[index]
                    self._finish(sequence, "abort")
                    self.left_waiting.append(sequence)
                    continue
                best, source = self._best_prefix(sequence) if owned else (0, None)
                if owned and self._prefix_coming(sequence, best):  # it stays where it is; admitted later, it copies
                    passed.add(id(sequence))
                    continue
                del self.waiting[index]
                try:
                    self._place(sequence, best, source, looked_up=owned and self._reusable(sequence))
                    capacity = min(len(sequence.prompt_ids) + sequence.params.max_new_tokens + 1
                                   + self._k_max(sequence), self.max_model_len)
                    if sequence.proposer is not None:
                        try:
                            sequence.proposer.start(sequence.tokens, capacity)
                            sequence.policy.start(sequence.prior_alpha)
                        except Exception:
                            self._drafter_failed(sequence, "starting")
                except Exception:  # fail this request alone, and keep its row
                    logger.exception("admitting request %s failed", sequence.request_id)
                    sequence.error = "internal error while admitting the request"
                    if sequence.cache_row is not None:
                        self._free_row(sequence)
                    self._finish(sequence, "abort")
                    self.left_waiting.append(sequence)
                    continue
                self.running.append(sequence)

    def _free_row(self, sequence: Sequence) -> None:
        """Return ``sequence``'s cache row, its entries kept as a cached prefix unless the
        sequence failed (an engine error may have left the row half written) or its row
        serves no other prompt."""
        shared = sequence.error is None and sequence.share_prefix
        self.row_tokens[sequence.cache_row] = sequence.kv_tokens if shared else []
        self.row_salt[sequence.cache_row] = sequence.cache_salt
        self.free_rows.append(sequence.cache_row)
        sequence.cache_row = None

    def _reusable(self, sequence: Sequence) -> bool:
        """Whether ``sequence`` may start from a cached prefix. A drafter that reads the
        target's hidden states needs them for every prompt position (an EAGLE head builds
        its own cache from them), unless it says it reads only the latest
        (``needs_prompt_states = False``: Medusa's heads), which a prefill of the rest or
        the first decode step gives it."""
        proposer = sequence.proposer
        needs_states = bool(getattr(proposer, "capture", ())) and getattr(proposer, "needs_prompt_states", True)
        return self.prefix_caching and sequence.reuse_prefix and not needs_states

    def _claim_cache(self) -> bool:
        """True when the rows' entries are this engine's to reuse. A write from outside (a
        reset, a plain forward) voids every free row's history; once nothing runs, the rows
        are the engine's again."""
        if self.runtime.cache_owner is not self:
            self._forget_rows()
            if not self.running:
                self.runtime.cache_owner = self
        return self.runtime.cache_owner is self

    def _forget_rows(self) -> None:
        """No free row's entries are a prefix to reuse any more."""
        self.row_tokens = [[] for _ in self.row_tokens]

    @staticmethod
    def _shared(sequence: Sequence, tokens: list[int]) -> int:
        """Prompt tokens of ``sequence`` whose entries ``tokens``' row can give it: their
        common prefix, all of the prompt but its last token at most (the first decode step
        scores that one)."""
        return min(common_prefix(sequence.prompt_ids, tokens), len(sequence.prompt_ids) - 1)

    def _best_prefix(self, sequence: Sequence) -> tuple[int, int | None]:
        """(length, row) of the longest prefix of ``sequence``'s prompt whose entries a row
        holds now (``_shared``), or (0, None)."""
        best, source = 0, None
        if self._reusable(sequence):
            salt = sequence.cache_salt
            candidates = [(row, self.row_tokens[row]) for row in self.free_rows if self.row_salt[row] == salt]
            candidates += [(s.cache_row, s.kv_tokens) for s in self.running if s.share_prefix and s.cache_salt == salt]
            for row, tokens in candidates:
                n = self._shared(sequence, tokens)
                if n > best:
                    best, source = n, row
        return best, source

    def _prefix_coming(self, sequence: Sequence, best: int) -> bool:
        """True when a running prompt still being prefilled shares more of ``sequence``'s
        prompt than the ``best`` prefix any row holds now (requests that arrive together
        with one system prompt, the n choices of one request), a prefix of PREFIX_WAIT_MIN
        tokens or more (not a lone BOS token). Prefill runs one prompt's chunk per step, so
        waiting for those entries costs ``sequence`` no time, and saves computing them; the
        requests queued behind it wait as long."""
        if not self._reusable(sequence):
            return False
        coming = max((self._shared(sequence, s.prompt_ids) for s in self.running
                      if s.share_prefix and not s.prefill_done and s.cache_salt == sequence.cache_salt), default=0)
        return coming >= PREFIX_WAIT_MIN and coming > best

    def _place(self, sequence: Sequence, best: int, source: int | None, looked_up: bool = True) -> None:
        """Give ``sequence`` a free cache row holding its ``best`` cached prefix, the entries
        of row ``source`` (``_best_prefix``). ``looked_up``: whether its prompt was looked up
        in the prefix cache (not with caching off, for a drafter that needs every prompt
        state, or on a cache written from outside), counted as vLLM counts queries (every
        prompt was: a server with caching off reported queries and a wrong hit rate)."""
        if source is not None and source in self.free_rows and best == len(self.row_tokens[source]):
            self.free_rows.remove(source)  # it holds nothing more: take it as it is
            row = source
        else:  # copy into a free row holding nothing, else the least recently freed one
            row = next((r for r in self.free_rows if not self.row_tokens[r] and r != source),
                       next((r for r in self.free_rows if r != source), None))
            if row is None:  # the only free row is the source: losing its other entries is unavoidable
                row = source
            self.free_rows.remove(row)
            sequence.cache_row = row  # before the copy: a copy that fails gives the row back (it leaked)
            if source is not None and source != row:
                self.runtime.copy_prefix(source, row, best)
        self.row_tokens[row] = []
        sequence.cache_row = row
        if sequence.scheduled_time is None:
            sequence.scheduled_time = time.perf_counter()
        sequence.prefilled = sequence.cached_tokens = best
        sequence.looked_up = len(sequence.prompt_ids) if looked_up else 0
        self.prefix_queries += sequence.looked_up
        self.prefix_hits += best

    @staticmethod
    def _k_max(sequence: Sequence) -> int:
        return 0 if sequence.policy is None else sequence.policy.k_max

    def _reap(self, finished: list[Sequence]) -> None:
        keep = []
        for sequence in self.running:
            if sequence.aborted and not sequence.finished:
                self._finish(sequence, "abort")
            if sequence.finished:
                self._free_row(sequence)
                finished.append(sequence)
            else:
                keep.append(sequence)
        self.running = keep

    def _capture(self, sequences: list[Sequence]) -> tuple[int, ...]:
        layers = set()
        for sequence in sequences:
            layers.update(getattr(sequence.proposer, "capture", ()) or ())
        return tuple(sorted(layers))

    @staticmethod
    def _drafter_failed(sequence: Sequence, doing: str) -> None:
        """A drafter's error (from inside an ``except``) costs its request the speculation,
        not the request, nor the other rows of the batch, which it failed with it before
        (found in review): drafts are only proposals, so the output is the same."""
        logger.exception("the drafter of request %s failed %s; it decodes without speculation from here",
                         sequence.request_id, doing)
        sequence.lost_drafter = sequence.proposer  # it drafted until here: the audit still checks it
        sequence.proposer = sequence.policy = None

    def _features(self, sequence: Sequence, features: torch.Tensor | None, layers: tuple[int, ...]):
        """The feature columns of the layers ``sequence``'s drafter reads, or None."""
        wanted = tuple(getattr(sequence.proposer, "capture", ()) or ())
        if features is None or not wanted:
            return None
        if wanted == layers:
            return features
        width = features.shape[-1] // len(layers)
        return torch.cat([features[..., layers.index(l) * width:(layers.index(l) + 1) * width] for l in wanted], dim=-1)

    def _prefill_chunk(self, sequence: Sequence) -> None:
        started = time.perf_counter()
        begin = sequence.prefilled
        end = min(begin + self.prefill_chunk, len(sequence.prompt_ids) - 1)
        layers = self._capture([sequence])
        out = self.runtime.forward_rows(torch.tensor([sequence.prompt_ids[begin:end]]), [sequence.cache_row], [begin],
                                        last_only=True, capture=layers, threads=self.prefill_threads)
        features = self._features(sequence, out[1] if layers else None, layers)
        if features is not None:
            try:
                sequence.proposer.observe(begin, features[0], sequence.tokens)
            except Exception:
                self._drafter_failed(sequence, "reading the prompt's states")
        synchronize(self.runtime.device)  # a GPU's chunk is charged here, not to the next row's drafting
        sequence.prefilled = end
        sequence.stats.prefill_seconds += time.perf_counter() - started

    def _decode(self, rows: list[Sequence]) -> None:
        started = time.perf_counter()
        skip = (len(rows) >= 2 and self.batch_cost is not None and self.steps % self.recheck_every != 0
                and self.steps % self.probe_every != 0 and self._capped_out.get(len(rows), 0) >= self.recheck_every)
        wanted = []
        for sequence in rows:
            if skip and hasattr(sequence.policy, "tau"):  # the cap would let it draft nothing
                wanted.append(0)
                continue
            try:
                if hasattr(sequence.policy, "use_label") and hasattr(sequence.proposer, "draft_label"):
                    sequence.policy.use_label(sequence.proposer.draft_label(sequence.tokens))
                k = sequence.policy.choose(len(sequence.tokens)) if sequence.policy is not None else 0
            except Exception:
                self._drafter_failed(sequence, "choosing its drafts")
                k = 0
            # each row's own room: the smallest of the batch's cut every row's drafts near one
            # row's context limit, and a seeded sampled row's output changed with its neighbours
            # (found in review); a row the batch's padding would carry past its cache runs alone
            room = self.max_model_len - len(sequence.tokens)
            wanted.append(max(min(k, sequence.params.max_new_tokens - len(sequence.generated) - 1, room), 0))
        wanted = self._batch_cap(rows, wanted)
        if len(rows) >= 2:
            adaptive = [w for w, s in zip(wanted, rows) if hasattr(s.policy, "tau")]
            self._capped_out[len(rows)] = 0 if any(adaptive) else self._capped_out.get(len(rows), 0) + 1
        plans, proposing = [], 0.0
        for sequence, k in zip(rows, wanted):
            proposal = Proposal.empty()
            if k > 0 and sequence.proposer is not None:
                began = time.perf_counter()
                try:
                    proposal = sequence.proposer.propose(sequence.tokens, k, sequence.params, sequence.generator)
                except Exception:
                    self._drafter_failed(sequence, "drafting")
                proposing = time.perf_counter() - began  # one row's: read below only when alone
            drafts = proposal.draft_ids[:k].to(torch.int64)
            usable = drafts_in_vocab(drafts, self.runtime.vocab_size)  # a bad id failed every row (found in review)
            plans.append((drafts[:usable], None if proposal.draft_probs is None else proposal.draft_probs[:usable]))
        width = 1 + max(d.numel() for d, _ in plans)
        # the rows whose cache holds the batch's width pass together; one near its context
        # limit (its own drafts fit, the padding to the widest would not) passes alone. The
        # width narrows as rows leave, and a row that fits the narrower one comes back.
        together = list(range(len(rows)))
        while together:
            narrow = 1 + max(plans[i][0].numel() for i in together)
            fits = [i for i in together if len(rows[i].tokens) - 1 + narrow <= self.max_model_len]
            if len(fits) == len(together):
                break
            together = fits
        narrow = 1 + max((plans[i][0].numel() for i in together), default=0)
        together += [i for i in range(len(rows)) if i not in together and plans[i][0].numel() < narrow
                     and len(rows[i].tokens) - 1 + narrow <= self.max_model_len]
        groups = [sorted(together)] + [[i] for i in range(len(rows)) if i not in together]
        drafted = time.perf_counter()
        layers = self._capture(rows)
        chooser = self.decode_threads
        row_logits, captured = [None] * len(rows), [None] * len(rows)
        for group in filter(None, groups):
            members = [rows[i] for i in group]
            group_width = 1 + max(plans[i][0].numel() for i in group)
            inputs = torch.empty(len(group), group_width, dtype=torch.int64)
            for j, i in enumerate(group):
                drafts = plans[i][0]
                inputs[j] = rows[i].tokens[-1]  # padding: the row's last token
                inputs[j, 1:1 + drafts.numel()] = drafts
            context = max(len(s.tokens) for s in members) - 1
            threads = chooser.choose(len(group), group_width, context) if chooser is not None else None
            began = time.perf_counter()
            out = self.runtime.forward_rows(inputs, [s.cache_row for s in members], [len(s.tokens) - 1 for s in members],
                                            capture=layers, threads=threads)
            logits, features = (out[0], out[1]) if layers else (out, None)
            synchronize(self.runtime.device)  # the pass's time, not the time to queue it on a GPU
            if chooser is not None:
                chooser.observe(threads, len(group), group_width, context, (time.perf_counter() - began) * 1e3)
            for j, i in enumerate(group):
                row_logits[i] = logits[j:j + 1]
                captured[i] = features[j:j + 1] if features is not None else None
        scored = time.perf_counter()
        if len(rows) == 1:  # alone, the pass is a step the k policy prices: what it cost, measured
            policy, drafts = rows[0].policy, plans[0][0].numel()
            note_cost, costs = getattr(policy, "observe_cost", None), getattr(policy, "costs", None)
            if note_cost is not None:
                # drafting as the single-sequence engine times it: the proposer's call, not
                # the k choice and the input built around it. Served, the whole stretch
                # before the pass also held waits for the GIL while the event loop
                # streamed the last step (0.72 ms a drafted step against 0.28 in-process,
                # docs/serving.md), which priced drafting at 2-3x its cost and drafted less
                note_cost(proposing, drafts, scored - drafted, drafts)
            elif costs is not None:
                costs.observe_step(width, (scored - drafted) * 1e3, len(rows[0].tokens) - 1)
        share = 1.0 / len(rows)  # each row is charged its share of the pass
        for i, (sequence, (drafts, draft_probs)) in enumerate(zip(rows, plans)):
            sequence.batched_steps += len(rows) > 1
            new_tokens = self._verify(sequence, drafts, draft_probs, row_logits[i][:, :1 + drafts.numel()])
            accepted = len(new_tokens) - 1
            stats = sequence.stats
            stats.observe_step(drafts.numel(), accepted)
            stats.draft_passes += drafts.numel()
            stats.draft_seconds += (drafted - started) * share
            stats.verify_seconds += (scored - drafted) * share
            row_features = self._features(sequence, captured[i], layers)
            context = len(sequence.tokens)
            if sequence.policy is not None:
                try:  # a policy's failure is its row's, as choose's (found in review: it failed every row)
                    sequence.policy.observe(drafts.numel(), accepted)
                except Exception:
                    self._drafter_failed(sequence, "learning from its step")
            self._commit(sequence, new_tokens, drafts.numel(), accepted)
            if row_features is not None and not sequence.finished and sequence.proposer is not None:
                try:
                    sequence.proposer.observe(context - 1, row_features[0, :accepted + 1], sequence.tokens)
                except Exception:
                    self._drafter_failed(sequence, "reading the accepted tokens' states")

    def _batch_cap(self, rows: list[Sequence], wanted: list[int]) -> list[int]:
        """Speculation under load: every row of a step is padded to the longest draft, so
        the step costs batch_cost(rows, 1 + d) for the largest d, plus every row's drafting.
        Pick the cap d on the adaptive rows' drafts that maximises the tokens the step is
        expected to yield (each row's own tau(k), from its measured acceptance) per
        millisecond; 0 when drafting would lose. Rows with a fixed k keep theirs. A row
        probing (a policy looking again at acceptance while speculation is off) would widen
        every row of the step, so its probe goes through on one batched step in ``probe_every``
        only, and is capped like the others in between."""
        if self.batch_cost is None or len(rows) < 2 or max(wanted) == 0:
            return wanted
        probe_step = self.steps % self.probe_every == 0
        adaptive = [hasattr(s.policy, "tau") and not (probe_step and getattr(s.policy, "probing", False))
                    for s in rows]
        if not any(adaptive):
            return wanted
        context = max(len(s.tokens) for s in rows)
        # the rows draft one after another before the pass: k passes of c steps each (a
        # chain's; c from each row's policy, what its drafting measured)
        step_ms = self.batch_cost(1, 1, context)
        costs = [getattr(s.policy, "_c", 0.0) for s in rows]
        best, best_rate = 0, 0.0
        for cap in range(max(w for w, a in zip(wanted, adaptive) if a) + 1):
            ks = [min(w, cap) if a else w for w, a in zip(wanted, adaptive)]
            expected = sum(s.policy.tau(k) if a else 1.0 for s, k, a in zip(rows, ks, adaptive))
            drafting = sum(k * c for k, c in zip(ks, costs)) * step_ms
            rate = expected / (self.batch_cost(len(rows), 1 + max(ks), context) + drafting)
            if rate > best_rate * (1.02 if cap else 1.0):  # drafting must win by a margin
                best, best_rate = cap, rate
        return [min(w, best) if a else w for w, a in zip(wanted, adaptive)]

    @staticmethod
    def _verify(sequence: Sequence, drafts: torch.Tensor, draft_probs, logits: torch.Tensor) -> list[int]:
        probs = None if draft_probs is None else draft_probs[None, :drafts.numel()]
        return verify_chain(drafts[None], probs, logits, sequence.params, sequence.generator, sequence.draws,
                            len(sequence.tokens))

    def _commit(self, sequence: Sequence, new_tokens: list[int], drafted: int, accepted: int) -> None:
        added, finish = commit_tokens(new_tokens, sequence.tokens, sequence.generated, sequence.tracker,
                                      sequence.params, self.eos_token_ids, self.max_model_len)
        # the request's own figures as the single-sequence engine's; the step's output keeps
        # vLLM's counts (every accepted draft) for /metrics
        sequence.stats.drop_accepted(past_the_end(new_tokens, added, finish, sequence.tracker))
        sequence.ended_at_eos = ended_at_eos(new_tokens, added, finish, sequence.tracker)
        if sequence.first_token_time is None:
            sequence.first_token_time = time.perf_counter()
        if finish:
            self._finish(sequence, finish, added, drafted, accepted)
        elif sequence.listener is not None:
            text = sequence.tracker.delta() if sequence.tracker is not None else ""
            sequence.listener(sequence, StepOutput(added, text, None, drafted, accepted))

    def _finish(self, sequence: Sequence, reason: str, added: list[int] | None = None, drafted: int = 0,
                accepted: int = 0) -> None:
        if sequence.tracker is not None and sequence.tracker.finish() and reason == "length":
            reason = "stop"  # the last tokens completed a character that completed a stop string
        sequence.finish_reason = reason
        sequence.finish_time = time.perf_counter()
        stats = sequence.stats
        stats.new_tokens = len(sequence.generated)
        stats.wall_seconds = sequence.finish_time - sequence.arrival
        if sequence.listener is not None:
            text = sequence.tracker.delta(final=True) if sequence.tracker is not None else ""
            sequence.listener(sequence, StepOutput(added or [], text, reason, drafted, accepted))


def clone_policy(template):
    """A fresh copy of a k policy for one sequence. Shared, not copied: the cost model and
    the drafting cost (``draft_cost``; the engine thread alone updates what it learns of
    step and draft costs, from single-row steps) and the acceptance per kind of draft
    (``CostAwareK.label_counts``, and ``label_waits``, when to look at a position priced
    out), all learnt over every request, and the probe countdown
    (``clock``: plain steps since speculation was last tried, counted over every request)."""
    shared = [getattr(template, name, None) for name in ("costs", "draft_cost", "label_counts", "label_waits", "clock")]
    return copy.deepcopy(template, {id(value): value for value in shared if value is not None})
