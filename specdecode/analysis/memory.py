"""Memory of a target + drafter deployment: weights, KV cache and activations, and
whether it fits a budget.

Reads a real ``config.json`` (a model name, a checkpoint directory or the file itself) or
takes a named size (135M ... 70B: reference Llama-family shapes). Counts, per model:

- weights: every parameter of the architecture at the weight dtype (a tied output head is
  counted once);
- KV cache: 2 (keys, values) x layers x KV heads x head dim x context x batch, at the
  activation dtype (bf16 for int8/int4 weights);
- activations: the larger of one prefill chunk (``prefill_chunk`` tokens, default 512:
  hidden states, MLP intermediates, fp32 attention scores against the whole context,
  last-token logits) and a verification step of k+1 tokens per sequence (fp32 logits for
  every scored token). An unchunked prefill of a long context needs far more: pass
  ``prefill_chunk=context`` to see it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

GIB = 1024**3
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5625}  # int4: + group scales

# Reference shapes (hidden, layers, heads, kv heads, intermediate, vocab, tied head)
NAMED_SIZES = {
    "135M": (576, 30, 9, 3, 1536, 49152, True),  # SmolLM2-135M
    "360M": (960, 32, 15, 5, 2560, 49152, True),  # SmolLM2-360M
    "1B": (2048, 16, 32, 8, 8192, 128256, True),  # Llama-3.2-1B
    "3B": (3072, 28, 24, 8, 8192, 128256, True),  # Llama-3.2-3B
    "7B": (4096, 32, 32, 32, 11008, 32000, False),  # Llama-2-7B
    "8B": (4096, 32, 32, 8, 14336, 128256, False),  # Llama-3-8B
    "13B": (5120, 40, 40, 40, 13824, 32000, False),  # Llama-2-13B
    "70B": (8192, 80, 64, 8, 28672, 128256, False),  # Llama-3-70B
}


@dataclass
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    head_dim: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden // self.heads

    @property
    def parameters(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        per_layer = attention + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * per_layer + h + head

    @classmethod
    def from_config(cls, name: str, config: dict) -> "Shape":
        try:
            heads = config["num_attention_heads"]
            return cls(
                name, config["hidden_size"], config["num_hidden_layers"], heads,
                config.get("num_key_value_heads", heads), config["intermediate_size"],
                config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                config.get("head_dim") or config["hidden_size"] // heads,
            )
        except KeyError as missing:
            raise ConfigError(f"{name}: config.json lacks {missing}, which a memory estimate needs") from None


def resolve_shape(name: str) -> Shape:
    """A named size, a config.json file, a checkpoint directory, or a model name."""
    if name.upper() in NAMED_SIZES:
        return Shape(name.upper(), *NAMED_SIZES[name.upper()])
    path = Path(name)
    if path.is_file() and path.suffix == ".json":
        return Shape.from_config(name, json.loads(path.read_text()))
    from ..models.loading import resolve_model

    try:
        source = resolve_model(name)
    except Exception as error:  # noqa: BLE001 - re-raised with the sizes that would work
        raise ConfigError(f"{error}; or give a named size: {', '.join(NAMED_SIZES)}") from None
    return Shape.from_config(name, source.config)


def model_memory(shape: Shape, dtype: str, batch: int, context: int, k: int,
                 shares_weights: bool = False, layers: int | None = None, prefill_chunk: int = 512) -> dict[str, float]:
    """Bytes of weights, KV cache and peak activations. ``shares_weights``: a layer-skip
    drafter (``self:L``) reuses the target's weights and keeps only its own KV cache."""
    if dtype not in BYTES:
        raise ConfigError(f"dtype must be one of {sorted(BYTES)}, got {dtype!r}")
    act = 2.0 if dtype in ("int8", "int4", "bf16", "fp16") else 4.0
    layers = shape.layers if layers is None else layers
    weights = 0.0 if shares_weights else shape.parameters * BYTES[dtype]
    kv = 2 * layers * shape.kv_heads * shape.head_dim * context * batch * act
    chunk = min(prefill_chunk, context)
    prefill = batch * chunk * (4 * shape.hidden + 2 * shape.intermediate) * act \
        + batch * shape.heads * chunk * context * 4 + batch * shape.vocab * 4
    verify = batch * (k + 1) * (shape.vocab * 4 + (4 * shape.hidden + 2 * shape.intermediate) * act)
    return {"weights": weights, "kv_cache": kv, "activations": max(prefill, verify)}


def deployment_memory(target: str, draft: str | None, dtype: str = "bf16", batch: int = 1,
                      context: int = 2048, k: int = 5, budget_gib: float | None = None) -> dict:
    """Both models' memory, the total and whether it fits ``budget_gib`` (default: RAM)."""
    if batch < 1 or context < 1 or k < 0:
        raise ConfigError(f"batch and context must be >= 1 and k >= 0, got {batch}, {context}, {k}")
    target_shape = resolve_shape(target)
    rows = {"target": model_memory(target_shape, dtype, batch, context, k)}
    draft_note = None
    if draft in (None, "", "none", "ngram"):
        rows["draft"] = {"weights": 0.0, "kv_cache": 0.0, "activations": 0.0}
        draft_note = "prompt lookup needs no model" if draft == "ngram" else "no drafter"
    elif draft.startswith("self:"):
        layers = int(draft.split(":", 1)[1])
        rows["draft"] = model_memory(target_shape, dtype, batch, context, 0, shares_weights=True, layers=layers)
        draft_note = f"the target's first {layers} layers: shares its weights, own KV cache"
    else:
        rows["draft"] = model_memory(resolve_shape(draft), dtype, batch, context, 0)
    # the two never run at once: activations peak in one of them
    total = sum(rows[m]["weights"] + rows[m]["kv_cache"] for m in rows) + max(rows[m]["activations"] for m in rows)
    budget = budget_gib * GIB if budget_gib is not None else total_ram()
    return {
        "target": target_shape.name, "target_parameters": target_shape.parameters, "draft": draft,
        "draft_note": draft_note, "dtype": dtype, "batch": batch, "context": context, "k": k,
        "models": rows, "total": total, "budget": budget, "fits": total <= budget,
    }


def total_ram() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def format_report(report: dict) -> str:
    def gib(value: float) -> str:
        return f"{value / GIB:9.3f}"

    lines = [
        f"target {report['target']} ({report['target_parameters'] / 1e6:,.0f}M parameters), draft {report['draft'] or 'none'}"
        + (f" ({report['draft_note']})" if report["draft_note"] else ""),
        f"dtype {report['dtype']}, batch {report['batch']}, context {report['context']}, k {report['k']}",
        f"{'GiB':<12}{'weights':>9}{'KV cache':>10}{'activ.':>9}",
    ]
    for name, row in report["models"].items():
        lines.append(f"{name:<12}{gib(row['weights'])}{gib(row['kv_cache']):>10}{gib(row['activations'])}")
    verdict = "fits" if report["fits"] else "DOES NOT FIT"
    lines.append(f"total {report['total'] / GIB:.3f} GiB of a {report['budget'] / GIB:.1f} GiB budget: {verdict}")
    return "\n".join(lines)
