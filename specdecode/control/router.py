"""Route each request by task type: classify the prompt, track acceptance per task with
decay, choose method and k per task, and turn speculation off where it loses.

The classifier scores weighted features of the prompt, not single keywords: code syntax
(``def``, braces and semicolons, indented blocks, backticks), JSON and form structure
(quoted keys, brackets, ``[placeholders]``), a long passage followed or preceded by a short
instruction (summaries and answers drawn from a text, which copy it), creative verbs
with creative nouns. ``docs/adaptive.md`` (section 5) compares it with plain keyword matching on a
labelled set written apart from the benchmark suite.

Tasks: code, structured (JSON, templates, forms), summarization (summaries and extraction
from a given passage), creative, general (questions, math, translation, chat).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import SpecDecodeError
from .policies import RetryPrior

TASKS = ("code", "structured", "summarization", "creative", "general")

# weighted evidence per task: (pattern, weight); patterns are case-insensitive
_FEATURES: dict[str, list[tuple[re.Pattern, float]]] = {
    "code": [
        (r"\b(def|class|return|import|lambda|function|const|let|var|public|static|void|fn|impl)\b[^.?!]{0,200}[(:{=]", 2.0),
        (r"```", 2.0),
        (r"^[ \t]{2,}\S.*$", 0.5),  # indented lines (\s took newlines too: quadratic on "\n" x 20000)
        (r"[;{}]\s*$", 1.0),
        (r"\b(python|javascript|typescript|rust|java|c\+\+|golang|sql|bash|regex|html|css)\b", 1.5),
        (r"\b(function|method|script|snippet|refactor|debug|compile|unit tests?|docstring|type hints?|bug)\b", 1.5),
        (r"`[A-Za-z_][\w.]*\(.*?\)`", 1.5),  # `name(args)`
        (r"\b(select|insert|update|delete)\b .{0,200} \b(from|into|set|where)\b", 1.5),
        (r"\b(query|implementation|class|algorithm|linked list|stack|queue|api|endpoint|regex|recursion)\b", 1.0),
    ],
    "structured": [
        (r"\bjson\b|\byaml\b|\bcsv\b|\bxml\b|\btoml\b", 3.0),
        (r"\"\w+\"\s*:", 1.5),  # "key":
        (r"[\[{]\s*\"", 1.0),
        (r"\[[a-z][a-z ]{1,20}\]", 1.5),  # [placeholder]
        (r"\b(template|fill in|form|fields?|keys?|schema|table|columns?|array of|list of objects)\b", 1.5),
        (r"^[ \t]*\w[\w ]{0,20}:\s*(\[|$)", 1.0),  # "Name: [name]" lines
        (r"(\b\w[\w ]{0,15}:\s+){3,}", 1.5),  # inline blank fields "Name: Age: Town:"
    ],
    "summarization": [
        (r"\b(summari[sz]e|summary|tl;?dr|condense|key points|main points|in \w+ sentences)\b", 3.0),
        (r"\b(passage|article|text|document|transcript|report|excerpt)\b", 1.0),
        (r"\b(according to|from the (passage|text|article)|using words from|quote|extract)\b", 2.0),
    ],
    "creative": [
        (r"\b(poem|haiku|limerick|sonnet|story|tale|fable|lyrics|song|verse|fiction|scene|dialogue|monologue)\b", 2.5),
        (r"\b(imagine|invent|creative|whimsical|fantasy|once upon)\b", 2.0),
        (r"\b(point of view|first person|letter from)\b", 1.5),
        (r"\b(write|compose|draft|tell)\b[^.?!]{0,40}\b(poem|story|tale|song|letter from|opening|scene)\b", 1.5),
        (r"\b(character|protagonist|narrator|plot)\b", 1.0),
    ],
}
_COMPILED = {task: [(re.compile(p, re.IGNORECASE | re.MULTILINE), w) for p, w in feats] for task, feats in _FEATURES.items()}
_THRESHOLD = 2.0  # evidence below this is "general"

# Starting guesses of the acceptance at draft position 1 (GenerationStats.first_alpha) per
# task type, used as the adaptive-k prior until this machine has measured its own
# (router-state-*.json in the cache, one per model; ``specdecode analyze`` and ``generate
# --route`` record them).
# ngram: acceptance at draft position 1 with fixed k = 5, greedy, fp32, on the built-in
# suite (docs/adaptive.md); other drafters start from the policy's neutral 0.5.
RETRY_PRIOR = RetryPrior(0.9)  # the acceptance a retried task's request starts from: it drafts until it measures otherwise
DEFAULT_PRIORS = {
    "ngram": {"code": 0.2, "structured": 0.35, "summarization": 0.35, "creative": 0.25, "general": 0.25},
}


def _passage_bonus(prompt: str) -> float:
    """A long block of prose (>= 60 words) beside a short instruction is a text to work from."""
    blocks = [b for b in re.split(r"\n\s*\n|(?<=:)\s+(?=[A-Z])", prompt) if b.strip()]
    longest = max((len(b.split()) for b in blocks), default=0)
    prose = longest >= 60 and not re.search(r"[{};]\s*$|```|\"\w+\"\s*:", prompt, re.MULTILINE)
    return 1.5 if prose else 0.0


CLASSIFIED_CHARS = (16_000, 4_000)  # a prompt's head and tail read by the classifier


def task_scores(prompt: str) -> dict[str, float]:
    # Bounded work: the spans after a keyword are bounded, at most 3 hits of a pattern are
    # counted, and a long prompt is read at its head and tail. Unbounded spans made the
    # classifier quadratic, 2 s for a prompt of 8,000 tokens ("return " x 8000), run on the
    # server's event loop (found in review).
    head, tail = CLASSIFIED_CHARS
    if len(prompt) > head + tail:
        prompt = prompt[:head] + "\n\n" + prompt[-tail:]
    scores = {}
    for task, features in _COMPILED.items():
        score = 0.0
        for pattern, weight in features:
            hits = sum(1 for _ in itertools.islice(pattern.finditer(prompt), 3))
            score += weight * min(hits, 3) ** 0.5  # repeated evidence counts, sub-linearly
        scores[task] = score
    scores["summarization"] += _passage_bonus(prompt)
    return scores


def classify(prompt: str) -> str:
    """The task type of a prompt: the best-scoring task, or 'general' on weak evidence."""
    scores = task_scores(prompt)
    task, score = max(scores.items(), key=lambda item: item[1])
    return task if score >= _THRESHOLD else "general"


def keyword_classify(prompt: str) -> str:
    """The baseline the classifier is compared with: first keyword hit wins."""
    text = prompt.lower()
    for task, words in (("code", ("code", "python", "function")), ("structured", ("json", "template")),
                        ("summarization", ("summar",)), ("creative", ("poem", "story"))):
        if any(word in text for word in words):
            return task
    return "general"


MIN_OBSERVED_TOKENS = 16  # a request shorter than this teaches the router nothing
SPEEDUP_RANGE = (0.25, 4.0)  # one request's measured speedup, clipped to this


@dataclass
class TaskRecord:
    """Decayed averages of what speculation achieved on one task with one method."""

    alpha: float = 0.0
    speedup: float = 1.0
    weight: float = 0.0  # decayed number of observations

    def update(self, alpha: float, speedup: float, decay: float) -> None:
        self.weight = self.weight * decay + 1.0
        share = 1.0 / self.weight
        self.alpha += (alpha - self.alpha) * share
        self.speedup += (speedup - self.speedup) * share


@dataclass
class Route:
    task: str
    method: str  # "none" when speculation is off for this task
    prior_alpha: float | None
    reason: str


@dataclass
class Router:
    """Per-task method choice from acceptance and speedup measured on past requests.

    ``methods``: task -> preferred speculative method (default ngram). A task is routed to
    plain decoding once its decayed mean speedup, over at least ``min_observations``
    requests, is below 1; it is retried every ``retry_every`` requests so that the
    decision follows the workload.
    """

    methods: dict[str, str] = field(default_factory=dict)
    decay: float = 0.9
    min_observations: float = 3.0
    retry_every: int = 20
    records: dict[str, TaskRecord] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)

    def prior(self, task: str, drafter: str) -> float | None:
        """The acceptance to expect from ``drafter`` on ``task``: measured here if known,
        else the built-in starting guess, else None (the policy's neutral prior)."""
        record = self.records.get(f"{task}/{drafter}")
        if record is not None and record.weight >= 1.0:
            return record.alpha
        return DEFAULT_PRIORS.get(drafter, {}).get(task)

    def route(self, prompt: str, method: str = "ngram", drafter: str = "ngram", task: str | None = None) -> Route:
        """Method and prior for ``prompt``. ``method``/``drafter``: the configured
        speculative method and its drafter's name; ``methods`` may override per task.
        ``task``: the caller's label for the prompt (a server request's ``task_type``),
        else the prompt is classified: the task routed on is the one its outcome is
        recorded under (found in review: a labelled task was routed by its classification
        and learnt under its label, so one that lost was never turned off)."""
        task = task or classify(prompt)
        if method == "none" and task not in self.methods:  # the caller's choice, not this task type's
            return Route(task, "none", None, f"{task}: method none was asked for; nothing to route")
        method = self.methods.get(task, method)
        if method == "none":
            return Route(task, "none", None, f"{task}: speculation disabled for this task type")
        record = self.records.get(f"{task}/{drafter}")
        prior = self.prior(task, drafter)
        self.requests[task] = self.requests.get(task, 0) + 1
        if record is None or record.weight < self.min_observations:
            seen = 0.0 if record is None else record.weight
            return Route(task, method, prior, f"{task}: learning ({seen:.1f} observations of {drafter})")
        if record.speedup < 1.0:
            if self.requests[task] % self.retry_every:
                return Route(task, "none", None, f"{task}: {drafter} measured {record.speedup:.2f}x (< 1), plain decoding")
            # the retry starts optimistic, so it drafts and measures again: with the measured
            # (low) acceptance as its prior the k policy decoded plainly from the first step,
            # a request shorter than its probe interval drafted nothing, only a request that
            # drafted is recorded, and the task stayed on plain decoding for good (found in review)
            return Route(task, method, RETRY_PRIOR, f"{task}: {drafter} measured {record.speedup:.2f}x (< 1); "
                         f"retried (every {self.retry_every} requests of the task)")
        return Route(task, method, prior, f"{task}: {drafter} measured {record.speedup:.2f}x, alpha {record.alpha:.2f}")

    def observe(self, task: str, drafter: str | None, alpha: float, speedup: float, tokens: int | None = None) -> None:
        """Record one request: acceptance at draft position 1 and speedup of ``drafter`` on
        ``task``. A request of fewer than ``MIN_OBSERVED_TOKENS`` new tokens says too little
        (its few steps carry a process's one-off costs), and a speedup is clipped to
        [``SPEEDUP_RANGE``]: one run on a contended machine measured 0.003 and, as the
        first observation of its task, sent that task to plain decoding (found in review)."""
        if drafter is None or (tokens is not None and tokens < MIN_OBSERVED_TOKENS):
            return
        if not (math.isfinite(alpha) and math.isfinite(speedup)):
            return
        low, high = SPEEDUP_RANGE
        self.records.setdefault(f"{task}/{drafter}", TaskRecord()).update(
            min(max(alpha, 0.0), 1.0), min(max(speedup, low), high), self.decay)

    def save(self, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed over it): two processes,
        or one stopped mid-write, never leave a torn file."""
        from ..models.loading import write_atomic

        try:
            write_atomic(path, json.dumps({"records": {k: asdict(v) for k, v in self.records.items()},
                                           "requests": self.requests}, indent=1))
        except OSError as error:  # a cache we cannot write: the request is done, its lesson is lost
            logging.getLogger("specdecode").warning("router state not saved to %s: %s", path, error)

    def load(self, path: Path, warn=None) -> "Router":
        """The measurements saved at ``path``; a file that cannot be read is set aside (with a
        line to ``warn``) and the router starts afresh, so it never stops a request."""
        if not path.is_file():
            return self
        try:
            data = json.loads(path.read_text())
            records = {str(k): TaskRecord(**v) for k, v in data.get("records", {}).items()}
            requests = {str(k): int(v) for k, v in data.get("requests", {}).items()}
            for record in records.values():
                values = [getattr(record, f) for f in ("alpha", "speedup", "weight")]
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values):
                    raise TypeError(f"a record that is not finite numbers: {record}")
                # NaN or 3.0 as an acceptance failed requests; a weight no decayed sum of
                # observations reaches, or a speedup outside the clipped range, held a task
                # on plain decoding through any number of retries (found in review)
                low, high = SPEEDUP_RANGE
                most = math.inf if self.decay >= 1.0 else 1.0 / (1.0 - self.decay) + 1e-6
                if not (0.0 <= record.alpha <= 1.0 and low <= record.speedup <= high and 0 <= record.weight <= most):
                    raise ValueError(f"a record out of range: {record}")
        except FileNotFoundError:  # another process set it aside meanwhile
            return self
        except (ValueError, TypeError, AttributeError, OverflowError, OSError, RecursionError) as error:
            aside = path.with_name(path.name + ".unreadable")
            try:
                os.replace(path, aside)  # kept for a look, out of the way of the next save
            except OSError:  # gone already, or a cache we cannot write: start afresh all the same
                pass
            if warn is not None:
                warn(f"router state {path} is unreadable ({type(error).__name__}: {error}); moved to {aside.name}, "
                     "starting afresh")
            return self
        self.records, self.requests = records, requests
        return self


def router_state_path(model: str = "default", engine_config=None) -> Path:
    """Where the CLI keeps per-task measurements between requests, one file per model (a
    drafter's acceptance and speedup on one target say nothing about another's), keyed by
    the checkpoint the name resolves to (its aliases and relative paths share one file)
    and, given ``engine_config``, by how it runs on this machine (dtype, weight format,
    backend, device, threads, CPU): the speedups a task is turned off by are the cost
    profile's facts, so they are keyed as it is (found in review: a task turned off under
    fp32, or on another machine sharing the cache, stayed off under bf16 here)."""
    from ..cost.profile import machine_id
    from ..models.loading import DEFAULT_MODEL_NAMES, cache_dir, default_gguf_path

    identity = "default" if model in DEFAULT_MODEL_NAMES else str(Path(model).expanduser().resolve())
    try:
        if identity == str(default_gguf_path().resolve()):  # the default model by its GGUF's own path
            identity = "default"
    except SpecDecodeError:  # the package that holds it is missing: then it is not this one
        pass
    if engine_config is not None:
        c = engine_config
        # not --exact: it changes no kernel that runs (the kernels are exact whatever it says,
        # and it refuses any other path), and keyed on it, what one command learnt was never
        # read by the same command without the flag (found in review)
        identity += (f"|{c.dtype}|{c.weights}|{c.backend}|{c.device}|threads {c.num_threads}|"
                     f"chunk {c.prefill_chunk}|{machine_id()}")
        if c.device == "cuda" and not c.cuda_graphs:  # as the cost profile's key (the runtime's description)
            identity += "|no CUDA graphs"
    return cache_dir() / f"router-state-{hashlib.sha1(identity.encode()).hexdigest()[:12]}.json"


def update_saved(path: Path, change, warn=None):
    """Apply ``change(router)`` to the state saved at ``path`` and save it, holding the
    file's lock from the read to the write; returns what ``change`` returned. Two CLI
    processes that each loaded the state, ran a request and saved lost one of the two
    lessons (the later save wrote its own, older copy over the other's)."""
    from ..models.loading import cache_lock

    with cache_lock(path):
        router = Router().load(path, warn=warn)
        result = change(router)
        router.save(path)
    return result


def plain_decode_seconds(stats, profile, prompt_tokens: int, costs=None) -> float:
    """What plain decoding would take for a request's new tokens: one step each, priced at
    the middle of the output by the profile. ``costs``: the k policy's CostModel, whose
    single-token steps say what a plain step costs here now against the profile (found in
    review: on a machine 20% slower than its profile, a task gaining 1.1x measured 0.9x
    and could be turned off)."""
    now = costs.steps.single_factor if costs is not None else 1.0
    return stats.new_tokens * profile.time_ms(1, prompt_tokens + stats.new_tokens // 2) * now / 1e3


def speedup_from_stats(stats, profile, prompt_tokens: int, decode_seconds: float | None = None,
                       costs=None) -> float:
    """A request's measured speedup without a plain run beside it: ``plain_decode_seconds``
    (as the server's seconds-saved estimate prices it) over its measured decode time
    (``decode_seconds``, default its wall time after the prefill)."""
    decode = stats.wall_seconds - stats.prefill_seconds if decode_seconds is None else decode_seconds
    if decode <= 0 or stats.new_tokens == 0:
        return 1.0
    return plain_decode_seconds(stats, profile, prompt_tokens, costs) / decode
