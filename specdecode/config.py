"""Configuration dataclasses, validated at construction.

Every invalid value raises ``ConfigError`` naming the field, so a bad flag or request
never reaches the tensor code.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

from .text import not_utf8


class SpecDecodeError(Exception):
    """Base class of every error specdecode raises on purpose (bad input, bad model)."""


class ConfigError(SpecDecodeError, ValueError):
    """A configuration field holds an invalid value."""


class VocabularyMismatchError(SpecDecodeError, ValueError):
    """Draft and target do not share a vocabulary, so draft ids mean nothing to the target."""


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("none", "ngram", "suffix", "draft", "eagle", "tree", "medusa")
# vLLM's speculative method names (--speculative-config, per request) -> ours
VLLM_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "eagle": "eagle", "eagle3": "eagle", "draft_model": "draft",
                "tree": "tree", "suffix": "suffix", "medusa": "medusa", "none": "none"}
K_POLICIES = ("cost", "threshold")


def is_count(value) -> bool:
    """An integer, and not a bool (True passed ``isinstance(value, int)`` as a k of 1, and
    2.5 passed a range check; found in a mutation audit)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_k(text: str | int) -> int | str:
    """'auto' or a positive integer, from a flag or a config file."""
    if isinstance(text, int) or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"k must be 'auto' or an integer >= 1, got {text!r}") from None


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (vLLM's _SAMPLING_EPS)
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit seed, as the server's requests take


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. A temperature below ``GREEDY_BELOW`` (0 included)
    means greedy (argmax): dividing logits by a smaller one overflows float32 to
    inf - inf = nan, and a tiny temperature's distribution is the argmax's anyway.

    The target's logits go through temperature, then top-k, then top-p; speculative
    sampling draws exactly from that distribution whatever the drafter's (drafters that
    process their logits alike are accepted more often).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        for name in ("top_k", "max_new_tokens", "seed"):  # a float top_k failed in topk() mid-decode (found in review)
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            if value is not None and type(value) is not int:  # a numpy seed overflowed in the seed's mixing
                object.__setattr__(self, name, int(value))
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        for string in self.stop:  # a lone surrogate (bytes that were not UTF-8) could never match the text
            if not_utf8(string) is not None:
                raise ConfigError(f"stop string {string!r} is not valid UTF-8 text")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ConfigError(f"seed must be a signed 64-bit integer ({SEED_RANGE[0]} to {SEED_RANGE[1]}), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


MAX_SERVED_K = 64  # draft tokens a served request (or the server's config) may fix: a /metrics series each
MAX_K = 512  # draft tokens (or tree nodes) a step: the most rows one pass scores (MAX_PREFILL_CHUNK)
DEFAULT_TREE_WIDTH = 3  # measured: docs/training.md, "Measured (2026-11-24 ...)" (eagle@4x3, @6x3)
MAX_TREE_WIDTH = 64
DEFAULT_SELF_DRAFT = "self:4"  # --method draft without --draft: the target's first 4 layers


DEFAULT_NGRAM_SIZES = (3, 2, 1)  # prompt lookup's n-gram sizes, longest first
MAX_NGRAM = 64  # the longest n-gram looked up, and the most sizes tried a step


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter proposes tokens and how many per step.

    method: "none" (plain decoding), "ngram" (prompt lookup), "suffix" (prompt lookup, then
    a store of the target's own earlier answers; ``draft`` is the store's directory,
    default: the store shipped for the default model), "draft" (a draft model;
    ``draft`` is a model path/name, or ``self:L`` for the target's first L layers) or
    "eagle" (a trained EAGLE head; ``draft`` is its directory, default: the head shipped
    for the default model) or "tree" (prompt lookup's chain and the head's tree merged
    into one token tree per step; ``k`` is its node budget) or "medusa" (trained Medusa
    heads on the target's last hidden state; ``draft`` is their directory, default: the
    heads shipped for the default model; k is at most the number of heads). The head drafts dynamic trees
    of ``k`` nodes (``tree_width`` children per expanded node), or chains at width 1.
    k: draft tokens per step, or "auto" (the default): chosen per step by ``k_policy`` —
    "cost" (expected speedup from measured acceptance and the cost profile, 0 included)
    or "threshold" (the acceptance-threshold rule from the literature), at most ``k_max``.
    The dataclass's method is prompt lookup, which needs nothing shipped for a target; the
    CLI and the server default to "suffix".
    """

    method: str = "ngram"
    k: int | str = "auto"
    draft: str | None = None
    ngram_sizes: tuple[int, ...] = DEFAULT_NGRAM_SIZES
    k_policy: str = "cost"
    k_max: int = 10
    # eagle/tree: children per expanded node of the head's dynamic tree (EAGLE-2); 1 drafts
    # chains. None: DEFAULT_TREE_WIDTH for eagle and tree, 1 for the others
    tree_width: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.k != "auto" and not (is_count(self.k) and 1 <= self.k <= MAX_K):
            # the most rows one pass scores, as k_max (found in review: --k 100000 ran, labelled so)
            raise ConfigError(f"k (draft tokens per step) must be 'auto' or an integer in 1..{MAX_K}, got {self.k!r}")
        if self.k_policy not in K_POLICIES:
            raise ConfigError(f"k_policy must be one of {K_POLICIES}, got {self.k_policy!r}")
        if self.tree_width is None:
            object.__setattr__(self, "tree_width", DEFAULT_TREE_WIDTH if self.method in ("eagle", "tree") else 1)
        if not is_count(self.tree_width) or not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            # a head pass scores the expanded nodes in one masked pass of at most 256 rows
            raise ConfigError(f"tree width (--tree-width, children per expanded node) must be an integer in "
                              f"1..{MAX_TREE_WIDTH}, got {self.tree_width!r}")
        # each step weighs every k up to it: 10**8 hung generation
        if not is_count(self.k_max) or not 1 <= self.k_max <= MAX_K:
            raise ConfigError(f"k_max must be an integer in 1..{MAX_K}, got {self.k_max!r}")
        if self.method == "draft" and not self.draft:
            raise ConfigError("method 'draft' needs a draft model: --draft PATH or --draft self:L")
        if (not self.ngram_sizes or len(self.ngram_sizes) > MAX_NGRAM
                or any(not is_count(n) or not 1 <= n <= MAX_NGRAM for n in self.ngram_sizes)):
            # each size is a lookup on every step: 10**10 of them ran out of memory (found in review)
            raise ConfigError(f"ngram_sizes must be at most {MAX_NGRAM} integers in 1..{MAX_NGRAM}, "
                              f"got {self.ngram_sizes}")


WEIGHTS = ("auto", "fp32", "bf16", "int8", "int4")
BACKENDS = ("auto", "kernels", "torch")
DEVICES = ("cpu", "cuda")
MAX_PREFILL_CHUNK = 512  # rows per kernel call: attention builds its key lists for at most this many


@dataclass(frozen=True)
class EngineConfig:
    """Where the target comes from and how it runs.

    dtype: the KV cache and, on the torch backend, activations and dense weights ("fp32"
    means full precision everywhere, weights included). weights: the layers' storage
    format; "auto" measures which is fastest on this machine (docs/performance.md).
    backend: "kernels" (specdecode's CPU kernels, batch invariant) or "torch"; "auto"
    takes the kernels on the CPU wherever they build. exact: every scored row's logits
    independent of what else is scored (needs the kernels); None = wherever they run.
    prefill_chunk: tokens per forward chunk (bounds activation memory). cuda_graphs: on a
    CUDA device, replay small steps (decode, verification, trees) as recorded CUDA graphs
    (models/cuda_graphs.py); ignored elsewhere.
    """

    model: str = "default"
    dtype: str = "bf16"
    chat_template: bool = True
    num_threads: int | None = None
    weights: str = "auto"
    backend: str = "auto"
    exact: bool | None = None
    device: str = "cpu"
    prefill_chunk: int = 256
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.num_threads is not None and (not is_count(self.num_threads) or self.num_threads < 1):
            raise ConfigError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")
        most = 4 * (os.cpu_count() or 1)
        if self.num_threads is not None and self.num_threads > most:  # 100000 crashed in the tokenizer's pool
            raise ConfigError(f"num_threads {self.num_threads} is more than 4x this machine's {os.cpu_count()} cores")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not is_count(self.prefill_chunk) or not 1 <= self.prefill_chunk <= MAX_PREFILL_CHUNK:
            raise ConfigError(f"prefill_chunk must be an integer in 1..{MAX_PREFILL_CHUNK}, got {self.prefill_chunk!r}")
        if self.exact and self.backend == "torch":
            raise ConfigError("exact mode needs the kernels backend (backend 'torch' is not batch invariant)")
        if self.exact and self.device != "cpu":
            raise ConfigError(f"exact mode needs specdecode's CPU kernels; device {self.device!r} runs on torch")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


def load_presets() -> dict[str, dict]:
    """The named presets shipped in ``specdecode/data/presets.toml``."""
    import tomllib
    from importlib import resources

    return tomllib.loads(resources.files("specdecode.data").joinpath("presets.toml").read_text())


def self_draft_layers(draft: str, total: int) -> int:
    """L of a ``self:L`` drafter (the target's first L layers), checked against the target's
    ``total`` layers before anything loads."""
    try:
        layers = int(draft.split(":", 1)[1])
    except ValueError:
        raise ConfigError(f"draft self:L needs an integer layer count, got {draft!r}") from None
    if not 1 <= layers < total:
        default = f" ({DEFAULT_SELF_DRAFT} is --method draft's drafter when --draft is not given)" \
            if draft == DEFAULT_SELF_DRAFT else ""
        raise ConfigError(f"draft self:L needs 1 <= L < {total} (the target's layers), got {layers}{default}")
    return layers


def parse_int_list(text, name: str) -> tuple[int, ...]:
    """``"4,3,2"`` (a flag's or a preset's value) -> (4, 3, 2); anything else is refused by ``name``."""
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{name} takes comma-separated integers, got {text!r}") from None


def preset(name: str) -> dict:
    presets = load_presets()
    if name not in presets:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(presets)}")
    return {key: value for key, value in presets[name].items() if key != "description"}
