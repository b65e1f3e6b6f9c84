"""Memory of a target + drafter deployment on specdecode's runtime, and whether it fits a
budget.

Reads a real ``config.json`` (a model name, a checkpoint directory or the file itself) or
takes a named size (135M ... 70B: reference Llama-family shapes). Counts, per model, what
the runtime allocates (models/llama.py, models/cpu_runtime.py):

- weights: every parameter in its storage format (fp32 4 bytes, bf16 2, int8 = Q8_0 34
  bytes per 32, int4 = Q4_1 20 bytes per 32; with int4 layers the embedding and output
  head stay int8), a tied head counted once, plus the fp32 RoPE tables;
- KV cache: 2 (keys, values) x layers x KV heads x head dim x context x batch, at the
  KV dtype (--dtype);
- activations: the kernels' scratch for one chunk of ``prefill_chunk`` tokens per
  sequence (it is allocated whole, whatever the prompt), the attention partials, and the
  fp32 logits of a verification step of k + 1 tokens per sequence;
- load: what loading holds beside the weights at its peak: a safetensors checkpoint is
  memory-mapped while its tensors are converted (its file's size); a GGUF's blocks are
  read by file I/O (nothing), but a tensor quantized again (int8 of a Q4_1 file) passes
  through fp32 (the largest such tensor's fp32 size).

The total adds the process itself (Python, torch, the tokenizer: measured once on this
machine with ``process_baseline``, cached) when asked, which makes it comparable with the
peak resident memory a run reports (``peak_rss_mb``; docs/performance.md compares them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import MAX_K, ConfigError, EngineConfig, self_draft_layers
from ..cost.profile import proc_field_bytes

GIB = 1024**3
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 34 / 32, "int4": 20 / 32}  # block formats: + fp16 scales
KV_DTYPES = ("fp32", "bf16", "fp16")
PARTIAL_ITEMS = 4096  # models/cpu_runtime.PARTIAL_ITEMS

NAMED_SIZES = {
    "135M": (576, 30, 9, 3, 1536, 49152, True, 8192),  # SmolLM2-135M
    "360M": (960, 32, 15, 5, 2560, 49152, True, 8192),  # SmolLM2-360M
    "1B": (2048, 16, 32, 8, 8192, 128256, True, 131072),  # Llama-3.2-1B
    "3B": (3072, 28, 24, 8, 8192, 128256, True, 131072),  # Llama-3.2-3B
    "7B": (4096, 32, 32, 32, 11008, 32000, False, 4096),  # Llama-2-7B
    "8B": (4096, 32, 32, 8, 14336, 128256, False, 8192),  # Llama-3-8B
    "13B": (5120, 40, 40, 40, 13824, 32000, False, 4096),  # Llama-2-13B
    "70B": (8192, 80, 64, 8, 28672, 128256, False, 8192),  # Llama-3-70B
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
    max_positions: int = 2048
    head_dim: int = 0
    checkpoint_bytes: int | None = None  # size of its safetensors files, for a real checkpoint
    gguf: bool = False  # converted from a GGUF, whose blocks int8/int4 read by file I/O
    # of a GGUF, as the loader carries it under int4: the share of the layers' weights that
    # stay 8-bit (a Q8_0 tensor, and every part of a fused q/k/v or gate/up group beside
    # one; found in review: priced at 4 bits, a Q8_0 file read 32% low, a Q8_0 attn_v 6%),
    # and whether the embedding and the head are 4-bit blocks it carries as they are (each
    # its own: a 4-bit embedding beside an F16 head was priced at 4 bits for both)
    gguf_8bit_share: float = 0.0
    gguf_4bit_embedding: bool = False
    gguf_4bit_head: bool = False
    # the fp32 bytes of the largest tensor de-quantized and quantized again at load, per
    # weight format (found in review: not counted, int8 of a Q4_1 file read 19% low)
    gguf_requantized: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden // self.heads

    @property
    def parameters(self) -> int:
        return self.layer_parameters(self.layers) + self.embedding_parameters + self.hidden

    def projections(self) -> tuple[tuple[int, int], ...]:
        """One layer's projections as (input width, parameters): q/k/v and gate/up read the
        hidden state, o the heads, down the MLP (the width decides an int4 layer's format)."""
        h, q, inner = self.hidden, self.heads * self.head_dim, self.intermediate
        return (h, h * (q + 2 * self.kv_heads * self.head_dim)), (h, 2 * h * inner), (q, q * h), (inner, inner * h)

    def layer_parameters(self, layers: int) -> int:
        """Parameters of ``layers`` transformer layers (projections and norms)."""
        return layers * (sum(params for _, params in self.projections()) + 2 * self.hidden)

    @property
    def embedding_parameters(self) -> int:
        """The embedding, and the output head unless it is tied to it."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @classmethod
    def from_config(cls, name: str, config: dict) -> "Shape":
        from ..models.llama import OPTIONAL_SIZES, not_positive_ints

        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                 *OPTIONAL_SIZES)
        bad = [f"{key} {config[key]!r}" for key in not_positive_ints(config, sizes)]
        if bad:  # found in review: "256" for max_position_embeddings crashed inside the estimate
            raise ConfigError(f"{name}: config.json holds {', '.join(bad)}; sizes must be positive integers")
        from ..models.llama import max_positions_of

        try:
            heads = config["num_attention_heads"]
            # as the runtime reads them (models.llama.LlamaConfig.from_hf): null is the default,
            # and a missing context is transformers' default for the type (found in review: a
            # null ended in a traceback, a Qwen2 config without it was held to 2,048 positions)
            positions = max_positions_of(config)
            return cls(
                name, config["hidden_size"], config["num_hidden_layers"], heads,
                config.get("num_key_value_heads") or heads, config["intermediate_size"],
                config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                positions, config.get("head_dim") or config["hidden_size"] // heads,
            )
        except KeyError as missing:
            raise ConfigError(f"{name}: config.json lacks {missing}, which a memory estimate needs") from None


def resolve_shape(name: str) -> Shape:
    """A named size, a config.json file, a checkpoint directory, or a model name."""
    if name.upper() in NAMED_SIZES:
        return Shape(name.upper(), *NAMED_SIZES[name.upper()])
    path = Path(name)
    if path.is_file() and path.suffix == ".json":
        try:  # found in review: a damaged file's JSONDecodeError (or a list's AttributeError) as a traceback
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{name} is not a readable model config (JSON): {error}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{name} must hold a JSON object (a model's config.json), not {type(config).__name__}")
        return Shape.from_config(name, config)
    from ..models.loading import resolve_model

    try:
        source = resolve_model(name)
    except Exception as error:  # noqa: BLE001 - re-raised with the sizes that would work
        raise ConfigError(f"{error}; or give a named size: {', '.join(NAMED_SIZES)}") from None
    shape = Shape.from_config(name, source.config)
    shape.checkpoint_bytes = sum(f.stat().st_size for f in source.path.glob("*.safetensors"))
    shape.gguf = source.gguf is not None
    if shape.gguf:
        from ..models.loading import gguf_tensor_index

        gguf_formats(shape, gguf_tensor_index(source.gguf, source.path))
    return shape


# the fused groups of a layer the loader builds (models.llama: q/k/v, gate/up), by GGUF name
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def gguf_formats(shape: Shape, tensors: dict) -> None:
    """``shape``'s GGUF fields from the file's tensor types, by the loader's rules
    (models.quant.from_gguf, models.llama's ``fused`` and ``embedding``): under int4, Q4_0
    and Q4_1 stay 4-bit and Q8_0 8-bit, any other type is quantized again to 4 bits, and a
    fused group with an 8-bit part is 8-bit whole; the embedding and the head stay 4-bit
    only where the file's are, else 8-bit; under int8 every tensor but a Q8_0 is quantized
    again."""
    from ..models.quant import GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, format_for_width

    four_bit = (GGML_Q4_0, GGML_Q4_1)
    size = {name: math.prod(t.shape) for name, t in tensors.items()}
    # a group whose input width (a GGUF shape lists it first) is an odd number of 32-blocks
    # is held in Q8_0 under int4 whatever its blocks (found in review: priced at 4 bits)
    narrow = {name: format_for_width("q4_1", t.shape[0]) == "q8_0" for name, t in tensors.items()}
    eight = total = 0
    requantized = {"int4": 0, "int8": 0}

    def passes_fp32(weights: str, params: int) -> None:  # a tensor quantized again under ``weights``
        requantized[weights] = max(requantized[weights], 4 * params)

    for layer in range(shape.layers):
        for group in FUSED_GROUPS:
            names = [f"blk.{layer}.{part}.weight" for part in group]
            present = [n for n in names if n in tensors]
            kinds = [tensors[n].tensor_type for n in present]
            params = sum(size[n] for n in present)
            total += params
            group_8bit = GGML_Q8_0 in kinds or any(narrow[n] for n in present)
            eight += params if group_8bit else 0
            for name, kind in zip(present, kinds):
                if kind not in four_bit + (GGML_Q8_0,) or (group_8bit and kind != GGML_Q8_0):
                    passes_fp32("int4", size[name])
                if kind != GGML_Q8_0:
                    passes_fp32("int8", size[name])
    shape.gguf_8bit_share = eight / max(total, 1)
    embedding, head = tensors.get("token_embd.weight"), tensors.get("output.weight")
    head = head if head is not None and not shape.tied else embedding
    shape.gguf_4bit_embedding = embedding is not None and embedding.tensor_type in four_bit and not narrow["token_embd.weight"]
    shape.gguf_4bit_head = head is not None and head.tensor_type in four_bit and not narrow[head.name]
    for tensor, carried in ((embedding, shape.gguf_4bit_embedding), (head, shape.gguf_4bit_head)):
        if tensor is not None and tensor.tensor_type != GGML_Q8_0:
            if not carried:
                passes_fp32("int4", math.prod(tensor.shape))
            passes_fp32("int8", math.prod(tensor.shape))
    shape.gguf_requantized = requantized


def _layer_bytes(shape: Shape, weights: str, layers: int) -> float:
    """``layers`` layers (and the final norm) stored in ``weights``. Under int4 a projection
    whose input width is an odd number of 32-blocks is held in Q8_0, as the loader holds it
    (``models.quant.format_for_width``; found in review: priced at 4 bits, 31% low)."""
    from ..models.quant import format_for_width

    per_layer = sum(params * BYTES["int8" if weights == "int4" and format_for_width("q4_1", cols) == "q8_0"
                                  else weights] for cols, params in shape.projections())
    return layers * per_layer + (2 * layers + 1) * shape.hidden * BYTES[weights]  # and the norms


def model_memory(shape: Shape, weights: str, kv_dtype: str, batch: int, context: int, k: int,
                 shares_weights: bool = False, layers: int | None = None, prefill_chunk: int = 256) -> dict[str, float]:
    """Bytes of weights (+ RoPE tables), KV cache, activations and the loading transient.
    ``shares_weights``: a layer-skip drafter (``self:L``) reuses the target's weights and
    keeps only its own KV cache and scratch."""
    if weights not in BYTES:
        raise ConfigError(f"weights must be one of {sorted(BYTES)}, got {weights!r}")
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"KV dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    layers = shape.layers if layers is None else layers
    embedding_format = head_format = "int8" if weights == "int4" else weights
    table = shape.vocab * shape.hidden
    if weights == "int4" and shape.gguf:  # as the loader carries a GGUF's blocks (gguf_formats)
        layer_bytes = shape.gguf_8bit_share * BYTES["int8"] + (1 - shape.gguf_8bit_share) * BYTES["int4"]
        embedding_format = "int4" if shape.gguf_4bit_embedding else "int8"
        head_format = "int4" if shape.gguf_4bit_head else "int8"
        stored_layers = (shape.layer_parameters(layers) + shape.hidden) * layer_bytes
    else:
        stored_layers = _layer_bytes(shape, weights, layers)
    stored = stored_layers + table * BYTES[embedding_format] + (0 if shape.tied else table * BYTES[head_format])
    rope = 2 * shape.max_positions * shape.head_dim * 4
    weight_bytes = 0.0 if shares_weights else stored + rope
    kv = 2 * layers * shape.kv_heads * shape.head_dim * context * batch * BYTES[kv_dtype]
    rows = batch * prefill_chunk
    widest = max(shape.hidden, shape.intermediate, shape.heads * shape.head_dim)  # as attach_scratch sizes it
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    scratch = rows * (4 * (2 * shape.hidden + widest + qkv + shape.heads * shape.head_dim + 2 * shape.intermediate)
                      + widest + 8 * (widest // 32 + 1))
    partial = PARTIAL_ITEMS * (shape.heads // shape.kv_heads) * (shape.head_dim + 2) * 4
    logits = batch * (k + 1) * shape.vocab * 4
    from_file = weights in ("int8", "int4") and shape.gguf
    if shares_weights:
        load = 0.0
    elif from_file:  # blocks read by file I/O; a tensor quantized again passes through fp32
        load = float(shape.gguf_requantized.get(weights, 0))
    else:  # the memory-mapped checkpoint (assumed bf16 for a named size)
        load = float(shape.checkpoint_bytes if shape.checkpoint_bytes is not None else shape.parameters * 2)
    return {"weights": weight_bytes, "kv_cache": kv, "activations": scratch + partial + logits, "load": load}


def deployment_memory(target: str, draft: str | None, dtype: str = "bf16", batch: int = 1,
                      context: int | None = None, k: int = 5, budget_gib: float | None = None,
                      weights: str | None = None, prefill_chunk: int = 256, process: bool = False) -> dict:
    """Both models' memory, the total and whether it fits ``budget_gib`` (default: RAM).

    ``dtype``: the KV cache's (int8/int4 here mean those weights with a bf16 cache, as
    before ``weights`` existed). ``weights``: their storage format (default: ``dtype``).
    ``process``: add the measured memory of the Python process itself. ``context``: tokens
    per sequence (default 2,048, or the model's limit if that is less)."""
    for flag, value, least in (("--batch", batch, 1), ("--context", context, 1), ("--k", k, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    if budget_gib is not None and not 0 < budget_gib < math.inf:  # inf "fit" anything (found in review)
        raise ConfigError(f"--budget must be a finite number > 0 GiB, got {budget_gib}")
    if not 0 <= k <= MAX_K:  # a billion drafts reported 183,105 GiB
        raise ConfigError(f"--k must be in 0..{MAX_K} (draft tokens a step), got {k}")
    EngineConfig(prefill_chunk=prefill_chunk)  # the runtime's bounds on a chunk, checked where they are defined
    if dtype in ("int8", "int4"):
        weights, dtype = weights or dtype, "bf16"
    weights = weights or dtype
    target_shape = resolve_shape(target)
    if context is None:
        context = min(2048, target_shape.max_positions)
    elif context > target_shape.max_positions:  # as serve --max-model-len (and vLLM) refuse it
        raise ConfigError(f"--context {context} is beyond the model's {target_shape.max_positions} positions")
    rows = {"target": model_memory(target_shape, weights, dtype, batch, context, k, prefill_chunk=prefill_chunk)}
    draft_note = None
    if draft in (None, "", "none", "ngram"):
        rows["draft"] = {"weights": 0.0, "kv_cache": 0.0, "activations": 0.0, "load": 0.0}
        draft_note = "prompt lookup needs no model" if draft == "ngram" else "no drafter"
    elif draft.startswith("self:"):
        layers = self_draft_layers(draft, target_shape.layers)
        rows["draft"] = model_memory(target_shape, weights, dtype, batch, context, 0, shares_weights=True, layers=layers,
                                     prefill_chunk=prefill_chunk)
        draft_note = f"the target's first {layers} layers: shares its weights, own KV cache"
    else:
        draft_shape = resolve_shape(draft)  # its cache holds no more than its own positions (found in review)
        if draft_shape.vocab != target_shape.vocab:  # a sizing of a pair every run refuses says so (found in review)
            draft_note = (f"its vocabulary ({draft_shape.vocab} tokens) is not the target's ({target_shape.vocab}): "
                          "generate refuses this pair unless both share one tokenizer padded to different sizes")
        rows["draft"] = model_memory(draft_shape, weights, dtype, batch, min(context, draft_shape.max_positions), 0,
                                     prefill_chunk=prefill_chunk)
    resident = sum(rows[m]["weights"] for m in rows)
    # loading peaks before the caches exist; running holds both caches and both scratches
    running = sum(rows[m]["kv_cache"] + rows[m]["activations"] for m in rows)
    loading = max(rows[m]["load"] for m in rows)
    baseline = process_baseline() if process else 0.0
    total = baseline + resident + max(running, loading)
    budget = budget_gib * GIB if budget_gib is not None else total_ram()
    return {
        "target": target_shape.name, "target_parameters": target_shape.parameters, "draft": draft,
        "draft_note": draft_note, "dtype": dtype, "weights": weights, "batch": batch, "context": context, "k": k,
        "prefill_chunk": prefill_chunk, "models": rows, "process": baseline, "running": running, "loading": loading,
        "total": total, "budget": budget, "fits": total <= budget,
    }


BASELINE_SCRIPT = """
import sys
import specdecode.factory
from specdecode.analysis.memory import peak_rss_bytes
from specdecode.models.loading import load_tokenizer, resolve_model
if len(sys.argv) > 1:  # as a run loads it (the conversion is cached by then)
    load_tokenizer(resolve_model("default"))
print(peak_rss_bytes())
"""


def process_baseline() -> float:
    """Peak resident bytes of a Python process that imports the runtime and loads the
    default model's tokenizer: what every run holds before its weights. Measured once per
    machine and interpreter (a child process), cached."""
    from ..cost.profile import machine_id
    from ..models.loading import cache_dir

    key = f"{machine_id()}|{sys.version.split()[0]}|vmhwm|tokenizer as a run loads it"
    path = cache_dir() / "memory-baseline.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return float(cached["bytes"])
    except (OSError, KeyError, ValueError, AttributeError, TypeError):  # a damaged cache entry is measured again
        pass
    from ..models.loading import ModelNotFoundError, resolve_model

    try:  # resolved here, so that a first conversion of the default model is not measured
        tokenizer_dir = [str(resolve_model("default").path)]  # (the child resolves it again, from the cache)
    except ModelNotFoundError:
        tokenizer_dir = []
    result = subprocess.run([sys.executable, "-c", BASELINE_SCRIPT, *tokenizer_dir], capture_output=True, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode != 0:
        raise ConfigError(f"measuring the process baseline failed: {result.stderr.strip()[-500:]}")
    baseline = float(result.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "bytes": baseline}))
    return baseline


def peak_rss_bytes() -> float:
    """This process's peak resident memory so far. Linux's VmHWM, the high-water mark of this
    process's own address space: ``getrusage``'s ``ru_maxrss`` survives ``execve``, so a child
    started from a large parent would report the parent's size (seen in CI: 3.9 GB for a run
    estimated at 1.3 GB, started from a pytest process holding several models)."""
    peak = proc_field_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def total_ram() -> float:
    total = proc_field_bytes("/proc/meminfo", "MemTotal")
    if total is not None:
        return total
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def format_report(report: dict) -> str:
    def gib(value: float) -> str:
        return f"{value / GIB:9.3f}"

    lines = [
        f"target {report['target']} ({report['target_parameters'] / 1e6:,.0f}M parameters), draft {report['draft'] or 'none'}"
        + (f" ({report['draft_note']})" if report["draft_note"] else ""),
        f"weights {report['weights']}, KV cache {report['dtype']}, batch {report['batch']}, context {report['context']}, "
        f"k {report['k']}, prefill chunk {report['prefill_chunk']}",
        f"{'GiB':<12}{'weights':>9}{'KV cache':>10}{'activ.':>9}{'load':>9}",
    ]
    for name, row in report["models"].items():
        lines.append(f"{name:<12}{gib(row['weights'])}{gib(row['kv_cache']):>10}{gib(row['activations'])}{gib(row['load'])}")
    if report["process"]:
        lines.append(f"{'process':<12}{gib(report['process'])}   (Python, torch and the tokenizer, measured here)")
    phase = "running" if report["running"] >= report["loading"] else "loading"
    verdict = "fits" if report["fits"] else "DOES NOT FIT"
    lines.append(f"peak (while {phase}) {report['total'] / GIB:.3f} GiB of a {report['budget'] / GIB:.1f} GiB budget: {verdict}")
    return "\n".join(lines)
