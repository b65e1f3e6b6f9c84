"""Native runtime for the Llama family (Llama, SmolLM2, Mistral, Qwen2), parameterised by config.

Two backends run the same model over the same KV cache:

- ``kernels`` (CPU, the default where the kernels build): specdecode's own kernels
  (``specdecode/kernels``) run the whole layer stack in one call per forward, reading
  each weight in its storage format (fp32, bf16, q8_0, q4_1; ``models/quant.py``). Every
  scored row's logits are bitwise the same whatever else is scored with it (``--exact``).
- ``torch`` (any device): PyTorch operations. Fused q/k/v and gate/up projections, RoPE on
  q and k in one pass, scaled-dot-product attention. The reference the kernels are tested
  against, and the CUDA path.

KV cache: preallocated ``[layers, batch, kv_heads, capacity, head_dim]`` with a length
pointer. ``forward`` writes the new tokens at slots ``[length, length + T)`` and advances
the pointer; rejecting drafts is ``rollback(n)`` — no copy, the stale slots are simply
overwritten later. Token trees pass explicit positions and a ``[T, T]`` mask over the new
tokens, then ``compact`` copies the accepted path into contiguous slots. Long inputs are
run in chunks of ``prefill_chunk`` tokens, so activation memory does not grow with the
prompt.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, SpecDecodeError, is_count
from . import device_label
from .quant import PackedLinear, check_block_shape, format_for_width

BACKENDS = ("kernels", "torch")
DEFAULT_PREFILL_CHUNK = 256
GRAPHED_MIN_CAPACITY = 2048  # cache slots a runtime with CUDA graphs allocates at least (a power of two)


OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def not_positive_ints(config: dict, keys) -> list[str]:
    """The ``keys`` that ``config`` holds with something other than a positive integer (a
    JSON ``true`` is not one, nor is ``"256"``)."""
    return [key for key in keys if config.get(key) is not None and (not is_count(config[key]) or config[key] < 1)]


DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}  # transformers' config defaults


def rope_config(config: dict) -> tuple[str, dict]:
    """(the key it was read from, a copy of) a config's RoPE settings: rope_scaling first, as
    transformers standardises them (found in review: the other order read a default
    rope_parameters over a linear rope_scaling; logits off by 7.2)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):  # (found in review: a TypeError from dict())
        raise SpecDecodeError(f"config.json: {key} must be an object, got {rope!r}")
    return key, dict(rope)


def max_positions_of(config: dict) -> int:
    """A config's context: its max_position_embeddings, or transformers' default for its
    type where it leaves it out or sets null (found in review: 2,048 for every type refused
    the longer prompts a Qwen2 or Mistral config allows; a null read as None)."""
    return config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS.get(config.get("model_type"), 2048)


def sliding_window(config: dict) -> int | None:
    """The attention window some layer of this config slides, as transformers reads it,
    or None where every layer attends to the whole context."""
    model_type = config.get("model_type")
    # transformers' MistralConfig reads an absent key as a 4,096-token window (found in
    # review: loaded here as full attention, the runtimes parted beyond 4,096 tokens), and
    # so does Qwen2Config where use_sliding_window is true (found in a mutation audit)
    window = config.get("sliding_window", 4096 if model_type in ("mistral", "qwen2") else None)
    if model_type == "mistral":
        # transformers' Mistral slides whatever use_sliding_window says (it reads the key for
        # Qwen2 only): a Mistral config with the key false loaded as full attention (found
        # in review: logits off by 7.6)
        return window or None
    if not window or not config.get("use_sliding_window", False):
        return None
    if model_type == "qwen2":
        # Qwen2 slides only the layers its layer_types name, by default those from
        # max_window_layers (28) up: a 24-layer Qwen2 with use_sliding_window attends to
        # everything in every layer (it was refused)
        layer_types = config.get("layer_types")
        if isinstance(layer_types, list):
            return window if "sliding_attention" in layer_types else None
        first = config.get("max_window_layers", 28)
        return window if not is_count(first) or first < config.get("num_hidden_layers", 0) else None
    return window


class NativeUnsupported(SpecDecodeError):
    """A checkpoint whose config the native runtime cannot compute exactly, but transformers
    can: with ``--runtime auto`` and no native-only flag, the model goes through transformers
    (``factory.load_model``)."""


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope: dict

    @classmethod
    def from_hf(cls, config: dict) -> "LlamaConfig":
        missing = [key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads") if not is_count(config.get(key)) or config[key] < 1]
        if missing:
            raise SpecDecodeError(f"config.json has no positive integer for {', '.join(missing)}, which the native "
                                  "runtime needs to read the checkpoint")
        model_type = config.get("model_type")
        if config.get("hidden_act", "silu") != "silu":
            raise NativeUnsupported(f"native runtime supports hidden_act 'silu' only, got {config['hidden_act']!r}")
        if config.get("mlp_bias"):
            raise NativeUnsupported("mlp_bias=True (biases on the MLP projections) is not supported by the native "
                                  "runtime; use --runtime hf")
        window = sliding_window(config)
        if window:
            raise NativeUnsupported(
                f"{model_type} with a sliding attention window ({window}) is not supported by the "
                "native runtime; use --runtime hf"
            )
        if config.get("attention_bias") and model_type not in ("qwen2", "mistral"):
            # transformers' Llama puts a bias on o_proj too, which the native runtime lacks
            raise NativeUnsupported(f"{model_type} with attention_bias (a bias on every attention projection, "
                                    "o_proj.bias too) is not supported by the native runtime; use --runtime hf")
        num_heads = config["num_attention_heads"]
        key, rope = rope_config(config)
        factor = rope.get("factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not 0 < factor < float("inf")):
            # (found in review: a factor of 0 loaded and gave NaN logits, a string failed in torch)
            raise SpecDecodeError(f"config.json: {key}.factor must be a positive number, got {factor!r}")
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            # a table narrower than a head: the kernels read past its end (found in review)
            raise NativeUnsupported(f"{model_type} with partial_rotary_factor {partial!r} (RoPE on part of each "
                                    "head) is not supported by the native runtime; use --runtime hf")
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        # the optional fields too (found in review: "256" for max_position_embeddings, "1e-6"
        # for rms_norm_eps or a string rope_theta crashed deep inside; "false" for
        # tie_word_embeddings read as true)
        bad = [f"{key} {config[key]!r}" for key in not_positive_ints(config, OPTIONAL_SIZES)]
        bad += [f"{name} {value!r}" for name, value in (("rms_norm_eps", config.get("rms_norm_eps", 1e-6)),
                                                         ("rope_theta", rope["rope_theta"]))
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")]
        bad += [f"{key} {config[key]!r}" for key in ("tie_word_embeddings", "attention_bias")
                if config.get(key) is not None and not isinstance(config[key], bool)]
        if bad:
            raise SpecDecodeError(f"config.json holds {', '.join(bad)}: expected positive integers for sizes, "
                                  "positive numbers for rms_norm_eps and rope_theta, true or false for flags")
        kv_heads = config.get("num_key_value_heads") or num_heads
        if num_heads % kv_heads:  # found in review: a torch traceback, and the kernels' refusal named other limits
            raise SpecDecodeError(f"config.json: num_attention_heads {num_heads} is not a multiple of "
                                  f"num_key_value_heads {kv_heads} (grouped-query attention shares each KV head "
                                  "among a whole number of query heads)")
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_positions=max_positions_of(config),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; transformers' Mistral has none whatever
            # attention_bias says (a Llama's attention_bias is refused above)
            qkv_bias=model_type == "qwen2",
            rope=rope,
        )


def rope_inverse_frequencies(cfg: LlamaConfig, model_dir: Path | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; non-default RoPE types via transformers."""
    if cfg.rope["rope_type"] == "default":
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        return (1.0 / cfg.rope["rope_theta"] ** exponents).float(), 1.0
    if model_dir is None:
        raise SpecDecodeError(f"RoPE type {cfg.rope['rope_type']!r} needs the checkpoint's config")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.rope["rope_type"] not in ROPE_INIT_FUNCTIONS:
        raise NativeUnsupported(f"unsupported RoPE type {cfg.rope['rope_type']!r}")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    # transformers checks RoPE parameters as it reads them; its strict checks raise
    # huggingface_hub's validation error, no ValueError (found in review: a traceback)
    except Exception as error:  # noqa: BLE001
        raise SpecDecodeError(f"config.json: RoPE parameters {cfg.rope} are not usable ({error})") from None
    # as transformers' longrope reads it: a top-level original_max_position_embeddings over
    # the one inside its RoPE parameters (found in review: the inner one bypassed the
    # refusal below, logits off by 9.6)
    standard = getattr(hf_config, "rope_parameters", None) or {}
    original = getattr(hf_config, "original_max_position_embeddings", None) or \
        (standard.get("original_max_position_embeddings") if isinstance(standard, dict) else None) or \
        cfg.rope.get("original_max_position_embeddings")
    if cfg.rope["rope_type"] == "longrope" and original and cfg.max_positions > original:
        # its factors switch from short to long past the original context; one table cannot
        # (found in review: logits off by 8.8 at 200 tokens of a 64-token original)
        raise NativeUnsupported(f"RoPE type 'longrope' changes its factors past {original} positions, which the "
                              "native runtime's single table does not; use --runtime hf")
    try:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope["rope_type"]](hf_config, "cpu")
    except Exception as error:  # noqa: BLE001 - transformers' own checks, whatever their type
        raise SpecDecodeError(f"config.json: RoPE parameters {cfg.rope} are not usable ({error})") from None
    if inv_freq.numel() != cfg.head_dim // 2:  # RoPE on part of each head: a narrower table than the kernels read
        raise NativeUnsupported(f"RoPE type {cfg.rope['rope_type']!r} rotates {2 * inv_freq.numel()} of each head's "
                                f"{cfg.head_dim} dimensions, which the native runtime does not; use --runtime hf")
    if not (torch.isfinite(inv_freq).all() and math.isfinite(float(scaling))):
        raise SpecDecodeError(f"config.json: RoPE parameters {cfg.rope} give non-finite frequencies")
    return inv_freq.float(), float(scaling)


def rope_tables(cfg: LlamaConfig, model_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] (each half repeated), fp32."""
    inv_freq, scaling = rope_inverse_frequencies(cfg, model_dir)
    angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling


class LlamaLayer(nn.Module):
    def __init__(self, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear,
                 input_norm: torch.Tensor, post_norm: torch.Tensor):
        super().__init__()
        self.input_norm = nn.Parameter(input_norm, requires_grad=False)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)


# checkpoint entries that are buffers, not parameters: nothing to load
IGNORED_TENSORS = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names of the dtypes a checkpoint may hold


class LlamaWeights(nn.Module):
    """The parameters only; runtimes (full model or a layer-skip view) share them.

    ``embed`` and ``lm_head`` are PackedLinear too (the same object when tied): an
    embedding row is a row of the table. ``carried`` records, per GGUF tensor read
    directly, whether its blocks were kept exactly or re-quantized."""

    def __init__(self, cfg: LlamaConfig, embed: PackedLinear, layers: list[LlamaLayer], norm: torch.Tensor,
                 lm_head: PackedLinear, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("rope_cos", rope[0], persistent=False)
        self.register_buffer("rope_sin", rope[1], persistent=False)
        self.carried: dict[str, str] = {}

    @property
    def weight_format(self) -> str:
        return self.layers[0].qkv.fmt

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, dtype: torch.dtype, weights: str | None = None,
                        gguf_path: Path | None = None) -> "LlamaWeights":
        """Load a checkpoint directory. ``weights``: the layers' format (``models/quant``;
        default: dense in ``dtype``). For q8_0/q4_1 with ``gguf_path``, the GGUF's own
        blocks are carried where they are in that format (no second quantization)."""
        from safetensors import safe_open

        cfg = LlamaConfig.from_hf(config)
        fmt = weights or {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        if fmt in ("q8_0", "q4_1"):
            for cols in (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size):
                check_block_shape(format_for_width(fmt, cols), cols)
        files = checkpoint_files(Path(model_dir))
        handles = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:  # safetensors' own error type: a truncated or corrupt file
                raise SpecDecodeError(f"{file} is not a readable safetensors file ({error})") from None
            twice = next((name for name in handle.keys() if name in handles), None)
            if twice is not None:  # which copy is the model's? the last file read used to win, silently
                raise SpecDecodeError(f"{model_dir}: tensor {twice!r} is in more than one safetensors file "
                                      f"({files[0].name} ... {file.name}); remove the stray file or add "
                                      "model.safetensors.index.json")
            handles.update({name: handle for name in handle.keys()})
        reader = _GGUFTensors(gguf_path, cfg, Path(model_dir)) if gguf_path is not None and fmt in ("q8_0", "q4_1") else None
        loader = _CheckpointReader(handles, cfg, fmt, dtype, reader)
        embed = loader.embedding("model.embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_layers)]
        norm = loader.tensor("model.norm.weight").to(dtype)
        if cfg.tie_word_embeddings:
            if loader.has("lm_head.weight") and not torch.equal(loader.tensor("lm_head.weight"),
                                                                loader.tensor("model.embed_tokens.weight")):
                # transformers then keeps the stored head: the two runtimes would differ (found in review)
                raise SpecDecodeError("config.json ties the output head to the token embedding "
                                      "(tie_word_embeddings), but the checkpoint stores an lm_head.weight that "
                                      "differs from it; set tie_word_embeddings to false to use the stored head")
            loader.consumed.add("lm_head.weight")  # a tied head stored anyway is the embedding
            lm_head = embed
        else:
            lm_head = loader.embedding("lm_head.weight")
        loader.check_all_consumed(model_dir)
        model = cls(cfg, embed, layers, norm, lm_head, rope_tables(cfg, model_dir), dtype)
        model.carried = dict(reader.carried) if reader is not None else {}
        model.requires_grad_(False).eval()
        return model

    def pack_for_cpu(self) -> None:
        """Add a oneDNN-prepacked copy of every bf16 projection (see ``_torch_linear``).
        The plain weights stay: the embedding lookup, the kernels and training read them.
        Weights on another device are left alone (the packed copy is a CPU tensor)."""
        if self.device.type != "cpu" or not (torch.backends.mkldnn.is_available()
                                             and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return
        linears = [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for linear in linears:
            if linear.weight is not None and linear.weight.dtype == torch.bfloat16:
                linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows for ``ids`` in the runtime dtype."""
        embed = self.embed
        if embed.weight is not None:
            return F.embedding(ids, embed.weight).to(self.dtype)
        if embed.layout in ("rows8", "rows16"):  # regrouped for the CPU kernels (a tied head): their lookup
            from .cpu_runtime import embed_lookup

            return embed_lookup(embed, ids).to(self.dtype)
        return embed.rows_selected(ids.reshape(-1)).dequantize().to(self.dtype).reshape(*ids.shape, -1)


def embed_format(fmt: str) -> str:
    """The embedding and output head stay 8-bit when the layers are 4-bit (as llama.cpp
    keeps them): one in every five parameters of a small model, and the most sensitive."""
    return "q8_0" if fmt == "q4_1" else fmt


class _CheckpointReader:
    """Reads Hugging Face parameter names into the fused layout, remembering every name it
    took, so that a checkpoint tensor the runtime does not implement is refused by name."""

    def __init__(self, handles: dict, cfg: LlamaConfig, fmt: str, dtype: torch.dtype, gguf: "_GGUFTensors | None"):
        self.handles, self.cfg, self.fmt, self.dtype, self.gguf = handles, cfg, fmt, dtype, gguf
        self.consumed: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.handles

    def expected_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape config.json implies for a parameter (None: a name not checked here)."""
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"embed_tokens.weight": (c.vocab_size, c.hidden_size), "lm_head.weight": (c.vocab_size, c.hidden_size),
                  "q_proj.weight": (q, c.hidden_size), "k_proj.weight": (kv, c.hidden_size),
                  "v_proj.weight": (kv, c.hidden_size), "o_proj.weight": (c.hidden_size, q),
                  "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
                  "gate_proj.weight": (c.intermediate_size, c.hidden_size),
                  "up_proj.weight": (c.intermediate_size, c.hidden_size),
                  "down_proj.weight": (c.hidden_size, c.intermediate_size), "layernorm.weight": (c.hidden_size,),
                  "norm.weight": (c.hidden_size,)}
        return next((shape for suffix, shape in shapes.items() if name.endswith(suffix)), None)

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse a tensor whose shape is not what config.json implies: the kernels would read
        past it or leave part of it unread, and compute wrong logits without an error."""
        expected = self.expected_shape(name)
        if expected is not None and tuple(shape) != expected:
            raise SpecDecodeError(f"checkpoint parameter {name!r} has shape {list(shape)}, but config.json implies "
                                  f"{list(expected)} (hidden_size {self.cfg.hidden_size}, intermediate_size "
                                  f"{self.cfg.intermediate_size}, vocab_size {self.cfg.vocab_size}, heads "
                                  f"{self.cfg.num_heads}/{self.cfg.num_kv_heads} of {self.cfg.head_dim}): the "
                                  "config does not describe these weights")

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.handles:
            raise SpecDecodeError(f"checkpoint lacks parameter {name!r}")
        view = self.handles[name].get_slice(name)
        self.check_shape(name, tuple(view.get_shape()))
        if view.get_dtype() not in FLOAT_DTYPES:  # found in review: an int8 or fp8 tensor was cast silently
            raise SpecDecodeError(f"checkpoint parameter {name!r} is stored as {view.get_dtype()}; this loader reads "
                                  f"floating-point checkpoints ({', '.join(sorted(FLOAT_DTYPES))}): a quantized one "
                                  "needs its own format (a GGUF, or --weights int8/int4 at load)")
        self.consumed.add(name)
        try:
            return self.handles[name].get_tensor(name)
        except Exception as error:  # safetensors' own error type: its data cut short or corrupt
            raise SpecDecodeError(f"checkpoint parameter {name!r} could not be read ({error})") from None

    def _dense_or_quantized(self, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> PackedLinear:
        if fmt in ("fp32", "bf16"):
            dense_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
            return PackedLinear.dense(weight, bias, dense_dtype)
        return PackedLinear.quantize(weight, format_for_width(fmt, weight.shape[1]), bias)

    def _carried(self, name: str, fmt: str) -> PackedLinear:
        layer = self.gguf.linear(name, fmt)
        self.check_shape(name, (layer.rows, layer.cols))
        self.consumed.add(name)
        return layer

    def linear(self, name: str, fmt: str) -> PackedLinear:
        if self.gguf is not None and self.gguf.has(name):
            return self._carried(name, fmt)
        return self._dense_or_quantized(self.tensor(name), fmt, None)

    def embedding(self, name: str) -> PackedLinear:
        """The token embedding or the output head: 8-bit where the layers are 4-bit
        (``embed_format``), but a GGUF's own 4-bit blocks stay as they are (asking for Q8_0
        de-quantized and quantized them again: an untied Q4_1 GGUF's logits moved by 0.16;
        found in review)."""
        fmt = embed_format(self.fmt)
        if self.fmt == "q4_1" and self.gguf is not None and self.gguf.has(name) and self.gguf.carries_4bit(name):
            fmt = "q4_1"
        return self.linear(name, fmt)

    def fused(self, names: list[str], biases: list[str] | None) -> PackedLinear:
        bias = torch.cat([self.tensor(b) for b in biases]) if biases else None
        if self.gguf is not None and all(self.gguf.has(n) for n in names):
            parts = [self._carried(n, self.fmt) for n in names]
            if len({part.fmt for part in parts}) > 1:  # e.g. a Q8_0 attn_v beside 4-bit q and k (llama.cpp's
                # Q4_K_M where a width is no multiple of 256): the 4-bit parts go to Q8_0, which holds their
                # values closely, and the load log says so (one format was refused with a message that named
                # no tensor; found in review)
                parts = [part if part.fmt == "q8_0" else self.gguf.requantized(name, "q8_0")
                         for name, part in zip(names, parts)]
            fused = PackedLinear.concat(parts)
            if bias is not None:
                fused.bias = nn.Parameter(bias.float(), requires_grad=False)
            return fused
        weight = torch.cat([self.tensor(n) for n in names], dim=0)
        return self._dense_or_quantized(weight, self.fmt, bias)

    def layer(self, index: int) -> LlamaLayer:
        hf = f"model.layers.{index}."
        attention = [f"{hf}self_attn.{p}_proj.weight" for p in "qkv"]
        biases = [f"{hf}self_attn.{p}_proj.bias" for p in "qkv"] if self.cfg.qkv_bias else None
        return LlamaLayer(
            qkv=self.fused(attention, biases),
            o=self.fused([f"{hf}self_attn.o_proj.weight"], None),
            gate_up=self.fused([f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"], None),
            down=self.fused([f"{hf}mlp.down_proj.weight"], None),
            input_norm=self.tensor(f"{hf}input_layernorm.weight").to(self.dtype),
            post_norm=self.tensor(f"{hf}post_attention_layernorm.weight").to(self.dtype),
        )

    def check_all_consumed(self, model_dir: Path) -> None:
        unused = sorted(n for n in self.handles if n not in self.consumed and not n.endswith(IGNORED_TENSORS))
        if unused:
            more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
            beyond = sorted({int(match.group(1)) for name in unused
                             if (match := re.match(r"model\.layers\.(\d+)\.", name))
                             and int(match.group(1)) >= self.cfg.num_layers})
            if beyond:  # found in review: blamed on a bias, with advice (--runtime hf) that refuses it too
                raise SpecDecodeError(
                    f"checkpoint {model_dir} holds layers up to {beyond[-1]} but its config.json names "
                    f"num_hidden_layers {self.cfg.num_layers}: the config does not describe these weights")
            raise SpecDecodeError(
                f"checkpoint {model_dir} holds parameter {unused[0]!r}{more}, which the native runtime does not "
                "implement (e.g. an o_proj or MLP bias); loading it would compute wrong logits. Use --runtime hf"
            )


class _GGUFTensors:
    """The GGUF's tensors under Hugging Face names, for carrying their blocks exactly.
    q and k rows are un-permuted (llama.cpp interleaves them for its RoPE) by moving whole
    rows, which keeps every block as stored."""

    NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}

    def __init__(self, path: Path, cfg: LlamaConfig, index_dir: Path | None = None):
        from .loading import gguf_tensor_index

        self.cfg, self.path = cfg, path
        self.tensors = gguf_tensor_index(path, index_dir)
        self.carried: dict[str, str] = {}

    def _gguf_name(self, name: str) -> str | None:
        if name == "model.embed_tokens.weight":
            return "token_embd.weight"
        if name == "lm_head.weight":
            return "output.weight"
        parts = name.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
            short = self.NAMES.get(f"{parts[3]}.{parts[4]}")
            return f"blk.{parts[2]}.{short}.weight" if short else None
        return None

    def has(self, name: str) -> bool:
        return self._gguf_name(name) in self.tensors

    def carries_4bit(self, name: str) -> bool:
        """Whether the GGUF stores ``name`` in 4-bit blocks that Q4_1 carries as they are
        (Q4_0 and Q4_1)."""
        from .quant import GGML_Q4_0, GGML_Q4_1

        return self.tensors[self._gguf_name(name)].tensor_type in (GGML_Q4_0, GGML_Q4_1)

    def requantized(self, name: str, fmt: str) -> PackedLinear:
        """``name`` in ``fmt`` from the GGUF's own values, recorded as fused with ``fmt``
        parts. Found in review: the part already converted to the format asked for was
        quantized again (a Q5_0 q_proj went Q5_0 -> Q4_1 -> Q8_0 and kept the 4-bit error)."""
        layer = self.linear(name, fmt)
        self.carried[self._gguf_name(name)] += f": fused with {fmt} parts"
        return layer

    def linear(self, name: str, fmt: str) -> PackedLinear:
        from .quant import from_gguf

        gguf_name = self._gguf_name(name)
        layer, how = from_gguf(self.tensors[gguf_name], self.path, fmt)
        self.carried[gguf_name] = f"{how} ({layer.fmt})"
        heads = {"attn_q": self.cfg.num_heads, "attn_k": self.cfg.num_kv_heads}.get(gguf_name.split(".")[-2])
        # llama.cpp reorders q/k rows for its llama architecture only (Mistral is written as
        # llama); a Qwen2 GGUF holds them in the checkpoint's order (found in review: undone
        # there too, its q/k were scrambled on the int8/int4 path)
        if heads is not None and self.cfg.model_type in ("llama", "mistral"):
            layer = layer.rows_selected(_unpermute_rows(layer.rows, heads))
        return layer


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: per head, row (half a, i) of the
    Hugging Face layout is GGUF row (i, a)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _torch_linear(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    """``layer(x)`` by the fastest torch kernel measured for the weights' form.

    bf16 weights are prepacked for oneDNN where the CPU supports bf16 (``pack_for_cpu``):
    a [3072, 576] product takes ~166 us for 1 to 16 rows, against 250-280 us through
    F.linear, with identical results. A single row on the CPU goes through torch.mv (fp32
    267 us, same as F.linear; bf16 157 us against 247 us), several rows through F.linear.
    Block formats are de-quantized (the reference path, not a fast one).
    """
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, layer.bias, "none", [], "")
        return out.view(*x.shape[:-1], -1)
    if layer.weight is None or layer.weight.dtype != x.dtype:
        return layer(x)
    if x.numel() != x.shape[-1] or x.device.type != "cpu":
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mv(layer.weight, x.reshape(-1))
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*x.shape[:-1], -1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as transformers' Llama does.
    (F.rms_norm takes ~43 us per call on a bf16 row here; this takes a few.)"""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def sdpa_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over keys and values [B, kv_heads, S, D] (heads
    grouped: query head h reads kv head h // (heads / kv_heads)) under a bool mask
    broadcast to [T, S], through torch's scaled_dot_product_attention."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


def matmul_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sdpa_attention`` as two batched products and a softmax (fp32): for a few query
    rows over a long cache on a GPU, scaled_dot_product_attention's kernel choice took
    121 us a layer for T = 2 over 4,065 slots on an H200 (cuDNN's), where T = 1 took 7
    (docs/performance.md, "GPU"). Each kv head's query rows are one product's rows."""
    batch, heads, num_new, dim = q.shape
    groups = keys.shape[1]
    if mask.dim() == 4:  # [B, 1, T, S] (the batched engine's rows): broadcast over each group's heads
        mask = mask[:, :, None]
    rows = q.reshape(batch, groups, heads // groups * num_new, dim)
    # scores in fp32, as SDPA keeps them: rounded to bf16 first, they lost up to 0.075 of a
    # probability against its 0.008 where |q.k| reached 300 (found in review)
    scores = torch.matmul(rows.float(), keys.float().transpose(-1, -2)) * dim ** -0.5  # [B, G, rep * T, S]
    scores = scores.view(batch, groups, heads // groups, num_new, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch, groups, heads // groups * num_new, -1)
    return torch.matmul(probs, values).view(batch, heads, num_new, dim)


ATTENTIONS = {"sdpa": sdpa_attention, "matmul": matmul_attention}


def _power_of_two_from(n: int) -> int:
    """The least power of two >= ``n`` (cache sizes and attention spans under CUDA graphs)."""
    return 1 << (n - 1).bit_length()


def _new_tokens(input_ids: torch.Tensor) -> tuple[int, int]:
    """(rows, new tokens) of a pass's ids [B, T], refused by name when either is 0: both
    backends failed deep inside on no tokens, each differently (found in review)."""
    batch, num_new = input_ids.shape
    if batch < 1 or num_new < 1:
        raise SpecDecodeError(f"a forward pass needs at least one row and one new token, got ids of shape "
                              f"{list(input_ids.shape)}")
    return batch, num_new


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _outputs(logits: list, hidden: list | None, features: list | None):
    """Join per-chunk outputs along T: logits, then hidden states and features when asked."""
    def join(parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    out = (join(logits),) + (() if hidden is None else (join(hidden),)) + (() if features is None else (join(features),))
    return out if len(out) > 1 else out[0]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint, as transformers picks them:
    ``model.safetensors``, else those that ``model.safetensors.index.json`` maps, else every
    ``*.safetensors`` (found in review: a leftover file beside the weights, or a Mistral
    repository's ``consolidated.safetensors``, was read as part of the model; and the index
    was taken over a ``model.safetensors`` beside it, which transformers loads: logits off
    by 8.6)."""
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            raise SpecDecodeError(f"{index} is not a safetensors index ({error})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SpecDecodeError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SpecDecodeError(f"{index} names {', '.join(missing[:3])}, which {model_dir} does not hold")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SpecDecodeError(f"{model_dir} holds no *.safetensors weights (only safetensors are read)")
    return files


class NativeRuntime:
    """A Llama-family model with a preallocated KV cache and a length pointer.

    ``num_layers`` below the checkpoint's makes a layer-skip view: the first L layers with
    the final norm and head, sharing every weight with the full model but keeping a cache
    of its own (the ``self:L`` drafter).
    """

    def __init__(self, weights: LlamaWeights, num_layers: int | None = None, backend: str = "torch",
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cuda_graphs: bool = True):
        cfg = weights.cfg
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.weights = weights
        self.cfg = cfg
        self.num_layers = cfg.num_layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= cfg.num_layers:
            raise SpecDecodeError(f"layer count must be in 1..{cfg.num_layers}, got {self.num_layers}")
        self.layers = list(weights.layers)[: self.num_layers]
        self.dtype = weights.dtype
        self.device = weights.device
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_positions
        self.prefill_chunk = prefill_chunk
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.length = 0
        self.cache_owner = None
        self.kernels = None
        if backend == "kernels":
            if self.device.type != "cpu":
                raise ConfigError("the kernels backend runs on the CPU; use backend 'torch' on other devices")
            from .cpu_runtime import KernelStack

            self.kernels = KernelStack(self)
        self.graphs = None  # CUDA graphs of small steps (models/cuda_graphs.py): the torch backend on a GPU
        # fixed here, as the description that keys the cost profile: a recording that fails
        # later turns the graphs off (``graphs.disabled``) but does not change the key
        self.cuda_graphs = bool(cuda_graphs and backend == "torch" and self.device.type == "cuda")
        if self.cuda_graphs:
            from .cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs(self)

    @property
    def weight_format(self) -> str:
        return self.weights.weight_format

    @property
    def exact(self) -> bool:
        """True when every scored row's logits are independent of the other rows."""
        return self.backend == "kernels"

    @property
    def lazy_logits(self) -> bool:
        """True when ``forward(..., lazy_logits=True)`` returns logits computed row by row
        on demand, each the same bits as in a full pass."""
        return self.kernels is not None

    def describe(self) -> str:
        """How it runs; it also keys the cost profile (``device_label``)."""
        return (f"{self.backend} backend{device_label(self.device)}{', CUDA graphs' if self.cuda_graphs else ''}, "
                f"{self.weight_format} weights, {str(self.dtype).removeprefix('torch.')} KV cache")

    # -- cache management -------------------------------------------------------------
    def reset(self, capacity: int, batch: int = 1, exact_capacity: bool = False) -> None:
        """Allocate (or reuse) a cache for ``capacity`` tokens and set the length to 0.
        With CUDA graphs a cache gets room to grow (a new one drops every recorded graph;
        spans bound the attention) unless ``exact_capacity``: a batched engine allocates
        its rows once, at --max-model-len, and rounding would only take memory (found in
        review: 1.6-2x the slots its estimate counted)."""
        cfg = self.cfg
        if self.graphs is not None and not exact_capacity:
            capacity = max(GRAPHED_MIN_CAPACITY, _power_of_two_from(capacity))
        capacity = min(capacity, cfg.max_positions)
        shape = (self.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        if self.k_cache is None or self.k_cache.shape[1] != batch or self.k_cache.shape[3] < capacity:
            # the old cache goes before the new one is allocated: holding both briefly took
            # the sum of the two at the peak. Both are made before either is kept: where one
            # fails, there is no cache (capacity 0 refuses a step) and the next reset makes
            # one (a half-made pair kept its size, so no later reset replaced it)
            self.k_cache = self.v_cache = None
            if self.graphs is not None:  # recorded over the old cache: their memory goes now, not at the next step
                self.graphs.drop()
            keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.k_cache, self.v_cache = keys, values
            if self.kernels is not None:
                self.kernels.bind_cache(self.k_cache, self.v_cache)
        self.length = 0
        self.cache_owner = None  # a batched engine that keeps rows' entries across requests claims it

    def copy_prefix(self, src_row: int, dst_row: int, length: int) -> None:
        """Copy the first ``length`` slots of cache row ``src_row`` into ``dst_row`` (every
        layer, keys and values): a shared prompt prefix reused instead of prefilled."""
        rows = self.k_cache.shape[1]
        if not (0 <= src_row < rows and 0 <= dst_row < rows and 0 <= length <= self.capacity):
            raise SpecDecodeError(f"cannot copy {length} slots from cache row {src_row} to {dst_row} "
                                  f"({rows} rows of {self.capacity})")
        self.k_cache[:, dst_row, :, :length] = self.k_cache[:, src_row, :, :length]
        self.v_cache[:, dst_row, :, :length] = self.v_cache[:, src_row, :, :length]

    @property
    def capacity(self) -> int:
        return 0 if self.k_cache is None else self.k_cache.shape[3]

    def rollback(self, length: int) -> None:
        """Forget every slot at and after ``length`` (O(1): the pointer moves)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}; cache holds {self.length}")
        self.length = length

    def compact(self, slots: torch.Tensor, start: int) -> None:
        """Copy cache slots ``slots`` (e.g. an accepted tree path) to ``start, start+1, ...``
        and set the length to ``start + len(slots)``."""
        slots = slots.to(self.device)
        dst = torch.arange(start, start + slots.numel(), device=self.device)
        self.k_cache[:, :, :, dst] = self.k_cache[:, :, :, slots]
        self.v_cache[:, :, :, dst] = self.v_cache[:, :, :, slots]
        self.length = start + slots.numel()

    # -- forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [T]; default length + arange(T)
        tree_mask: torch.Tensor | None = None,  # [T, T] bool, True = may attend
        last_only: bool = False,
        return_hidden: bool = False,
        capture: tuple[int, ...] = (),
        lazy_logits: bool = False,
        threads: int | None = None,
    ):
        """Run T new tokens, write their KV at ``[length, length+T)``, advance the length.

        Returns logits ``[B, T, V]`` (``[B, 1, V]`` if ``last_only``), and the final
        normalised hidden states ``[B, T, H]`` too if ``return_hidden``. ``capture``: layer
        indices whose inputs (the residual stream entering them, fp32; index L, the number of
        layers, is the last layer's output before the final norm) are returned last,
        concatenated as ``[B, T, len(capture) * H]`` for every new token even when
        ``last_only`` (what an EAGLE head reads). ``lazy_logits``: where ``self.lazy_logits``
        holds (the CPU kernels), a ``cpu_runtime.LazyLogits`` in place of the logits, whose
        rows are computed when read (greedy verification reads them up to the first
        rejection); elsewhere ignored. ``threads``: the CPU kernels' thread count for this
        call (default torch's; a row's logits are the same bits at any count); elsewhere ignored.
        """
        batch, num_new = _new_tokens(input_ids)
        end = self.length + num_new
        self.cache_owner = None  # rows written outside a batched engine's bookkeeping
        if end > self.capacity:
            raise SpecDecodeError(
                f"sequence of {end} tokens exceeds the KV cache capacity {self.capacity} "
                f"(context limit {self.cfg.max_positions})"
            )
        if self.k_cache is not None and batch != self.k_cache.shape[1]:  # (found in review: a torch shape error)
            raise SpecDecodeError(f"batch of {batch} rows, but the cache was reset for {self.k_cache.shape[1]}")
        if tree_mask is not None and num_new > self.prefill_chunk:
            raise SpecDecodeError(f"a token tree of {num_new} nodes exceeds prefill_chunk = {self.prefill_chunk}")
        if tree_mask is not None and (tuple(tree_mask.shape) != (num_new, num_new)
                                      or not bool(tree_mask.diagonal().all())):
            # the kernels read mask[t * T + j] for every t, j < T whatever its shape: a smaller
            # mask read memory past it, and a row that saw nothing was NaN (found in review)
            raise SpecDecodeError(f"a tree mask over {num_new} new tokens must be [{num_new}, {num_new}] with each "
                                  f"token seeing itself, got shape {list(tree_mask.shape)}")
        if any(not 0 <= layer <= self.num_layers for layer in capture):
            raise SpecDecodeError(f"capture layers must lie in 0..{self.num_layers}, got {capture}")
        if self.kernels is not None:
            return self.kernels.forward(input_ids, positions, tree_mask, last_only, return_hidden, capture,
                                        lazy_logits=lazy_logits, threads=threads)
        if (self.graphs is not None and num_new <= self.prefill_chunk
                and self.graphs.accepts(batch, num_new, False, last_only)):  # GPU
            out = self.graphs.run(input_ids, positions, tree_mask, last_only, return_hidden, tuple(capture))
            if out is not None:
                return out
        def run(begin, stop, last):
            chunk_positions = None if positions is None else positions[begin:stop]
            return self._forward_torch(input_ids[:, begin:stop], chunk_positions, tree_mask, last, return_hidden,
                                       capture)

        return self._chunked(num_new, last_only, return_hidden, capture, run)

    def _chunked(self, num_new: int, last_only: bool, return_hidden: bool, capture: tuple[int, ...], run):
        """The torch backend's chunked prefill (bounded activations): ``run(begin, stop,
        last_only)`` scores tokens [begin, stop) and returns (logits, hidden, features);
        the chunks' outputs are joined as ``forward`` returns them."""
        logits, hidden, features = [], [], []
        for begin in range(0, num_new, self.prefill_chunk):
            stop = min(begin + self.prefill_chunk, num_new)
            final = stop == num_new
            out = run(begin, stop, last_only and final)
            if final or not last_only:
                logits.append(out[0])
                hidden.append(out[1])
            features.append(out[2])
        return _outputs(logits, hidden if return_hidden else None, features if capture else None)

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, cache_rows: list[int], starts: list[int],
                     last_only: bool = False, return_hidden: bool = False, capture: tuple[int, ...] = (),
                     threads: int | None = None):
        """The batched engine's step: entry b of ``input_ids`` [n, T] continues the sequence
        in cache row ``cache_rows[b]``, which holds ``starts[b]`` tokens; its T new tokens
        are written after them (a row's padding past its real tokens is harmless: causal
        attention keeps it from the real tokens, and the slots are overwritten later). The
        runtime's own length is left alone: the caller keeps each row's length. ``threads``:
        the kernels' thread count for this call (default torch's; every row is the same
        bits at any count); the torch backend ignores it. Returns what ``forward`` returns."""
        batch, num_new = _new_tokens(input_ids)
        if len(cache_rows) != batch or len(starts) != batch:
            raise SpecDecodeError(f"{batch} rows need {batch} cache rows and starts, got {len(cache_rows)} and {len(starts)}")
        if len(set(cache_rows)) != batch or any(not 0 <= r < self.k_cache.shape[1] for r in cache_rows):
            raise SpecDecodeError(f"cache rows must be distinct and lie in 0..{self.k_cache.shape[1] - 1}, got {cache_rows}")
        if any(start < 0 or start + num_new > self.capacity for start in starts):
            raise SpecDecodeError(
                f"a row of {max(starts) + num_new} tokens exceeds the KV cache capacity {self.capacity} "
                f"(context limit {self.cfg.max_positions})")
        if self.kernels is not None:
            return self.kernels.forward(input_ids, None, None, last_only, return_hidden, capture,
                                        starts=list(starts), cache_rows=list(cache_rows), threads=threads)
        if (self.graphs is not None and not return_hidden and num_new <= self.prefill_chunk
                and self.graphs.accepts(batch, num_new, True, last_only)):  # GPU
            out = self.graphs.run_rows(input_ids, list(cache_rows), list(starts), last_only, tuple(capture))
            if out is not None:
                return out
        def run(begin, stop, last):
            return self._forward_rows_torch(input_ids[:, begin:stop], cache_rows, [s + begin for s in starts], last,
                                            capture)

        return self._chunked(num_new, last_only, return_hidden, capture, run)

    def _forward_rows_torch(self, input_ids, cache_rows, starts, last_only, capture=()):
        """Eagerly: the rows' step over the slots up to the longest row's end."""
        device = self.device
        return self._forward_rows_static(input_ids.to(device), torch.tensor(cache_rows, device=device),
                                         torch.tensor(starts, device=device), max(starts) + input_ids.shape[1],
                                         last_only, capture)

    def _forward_rows_static(self, input_ids, rows, starts, span, last_only, capture=(), attention: str = "sdpa"):
        """The batched engine's step over ``rows`` [n] (cache rows) after ``starts`` [n]
        tokens, device tensors: each row attends over the first ``span`` slots of its cache
        row under a causal mask from its start. Eagerly ``span`` is the longest row's end;
        a CUDA graph records it with a bucket that holds it (``graph_span``), so that its
        shapes and addresses do not depend on the rows' lengths. Returns (logits, final
        hidden states, captured layer inputs)."""
        w, device = self.weights, self.device
        num_new = input_ids.shape[1]
        positions = starts[:, None] + torch.arange(num_new, device=device)  # [n, T]
        cos = w.rope_cos[positions][:, :, None, :].to(self.dtype)  # [n, T, 1, head_dim]
        sin = w.rope_sin[positions][:, :, None, :].to(self.dtype)
        mask = (torch.arange(span, device=device)[None, None, :] <= positions[:, :, None])[:, None]  # [n, 1, T, span]

        def store(index, keys, values):  # [n, T, G, D] into each row's slots
            self.k_cache[index][rows[:, None], :, positions] = keys
            self.v_cache[index][rows[:, None], :, positions] = values

        def cached(index):
            return self.k_cache[index][rows, :, :span], self.v_cache[index][rows, :, :span]

        return self._layers_torch(input_ids, cos, sin, mask, store, cached, last_only, capture, ATTENTIONS[attention])

    def _forward_torch(self, input_ids, positions, tree_mask, last_only, return_hidden, capture=()):
        w, device = self.weights, self.device
        input_ids = input_ids.to(device)
        num_new = input_ids.shape[1]
        start, end = self.length, self.length + num_new
        if positions is None:
            cos, sin = w.rope_cos[start:end], w.rope_sin[start:end]
        else:
            positions = positions.to(device)
            cos, sin = w.rope_cos[positions], w.rope_sin[positions]
        cos, sin = cos[None, :, None, :].to(self.dtype), sin[None, :, None, :].to(self.dtype)  # [1, T, 1, head_dim]

        mask = None
        if num_new > 1 or tree_mask is not None:
            if tree_mask is None:
                tree_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_()
            mask = torch.ones(num_new, end, dtype=torch.bool, device=device)
            mask[:, start:] = tree_mask.to(device)

        def store(index, keys, values):  # [B, T, G, D] into slots start..end of every row
            self.k_cache[index, :, :, start:end] = keys.transpose(1, 2)
            self.v_cache[index, :, :, start:end] = values.transpose(1, 2)

        def cached(index):
            return self.k_cache[index, :, :, :end], self.v_cache[index, :, :, :end]

        out = self._layers_torch(input_ids, cos, sin, mask, store, cached, last_only, capture)
        self.length = end
        return out

    def graph_span(self, end: int) -> int:
        """The cache slots a recorded step attends over when its longest row ends at
        ``end``: the next power of two from 256, at most the capacity. Attending over the
        whole cache cost time in proportion to --max-model-len, not to the context (found in
        review: 8 rows at 16,384 slots ran 75x their eager step on the CPU); buckets keep
        the graphs per shape few."""
        return min(self.capacity, max(256, _power_of_two_from(end)))

    def _forward_static(self, input_ids, positions, start, tree_mask, span, last_only, return_hidden, capture=(),
                        attention: str = "sdpa"):
        """``_forward_torch`` with shapes and addresses that do not depend on the context,
        what a CUDA graph records (``models/cuda_graphs.py``): ``start`` is a 0-dim device
        tensor (the first new token's slot), ``positions`` [T] or None (then start + t),
        ``tree_mask`` [T, T] (causal for a chain). The new tokens attend over the first
        ``span`` slots of the cache (``graph_span``) under a mask that keeps the slots before
        ``start`` and the tree's own; the caller advances the length. ``attention``: a name
        in ``ATTENTIONS``."""
        w, device = self.weights, self.device
        num_new = input_ids.shape[1]
        slots = start + torch.arange(num_new, device=device)  # [T]
        if positions is None:
            positions = slots
        cos = w.rope_cos[positions][None, :, None, :].to(self.dtype)  # [1, T, 1, head_dim]
        sin = w.rope_sin[positions][None, :, None, :].to(self.dtype)
        mask = (torch.arange(span, device=device) < start).expand(num_new, -1).clone()  # [T, span]
        mask.scatter_(1, slots.expand(num_new, -1), tree_mask)

        def store(index, keys, values):  # [B, T, G, D] into the slots of every row
            self.k_cache[index].index_copy_(2, slots, keys.transpose(1, 2))
            self.v_cache[index].index_copy_(2, slots, values.transpose(1, 2))

        def cached(index):
            return self.k_cache[index, :, :, :span], self.v_cache[index, :, :, :span]

        logits, hidden, features = self._layers_torch(input_ids, cos, sin, mask, store, cached, last_only, capture,
                                                      ATTENTIONS[attention])
        return _outputs([logits], [hidden] if return_hidden else None, [features] if capture else None)

    def _layers_torch(self, input_ids, cos, sin, mask, store, cached, last_only, capture, attend=None):
        """The layer stack on torch ops: ``store(layer, keys, values)`` writes the new
        tokens' entries, ``cached(layer)`` gives the keys and values they attend over
        (under ``mask``), ``attend(q, keys, values, mask)`` (default ``sdpa_attention``)
        computes the attention. Returns (logits, final hidden states, captured layer inputs)."""
        attend = attend or sdpa_attention
        cfg, w = self.cfg, self.weights
        batch, num_new = input_ids.shape
        num_heads, num_kv = cfg.num_heads, cfg.num_kv_heads
        hidden = w.embed_rows(input_ids)  # [B, T, H]
        captured = {}
        for index, layer in enumerate(self.layers):
            if index in capture:
                captured[index] = hidden.float()
            normed = _rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = _torch_linear(normed, layer.qkv).view(batch, num_new, num_heads + 2 * num_kv, cfg.head_dim)
            qk = qkv[:, :, : num_heads + num_kv]
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :, :num_heads].transpose(1, 2)  # [B, heads, T, D]
            store(index, qk[:, :, num_heads:], qkv[:, :, num_heads + num_kv:])
            keys, values = cached(index)
            attn = attend(q, keys, values, mask)
            hidden = hidden + _torch_linear(attn.transpose(1, 2).reshape(batch, num_new, -1), layer.o)
            normed = _rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            gate, up = _torch_linear(normed, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + _torch_linear(F.silu(gate) * up, layer.down)
        if len(self.layers) in capture:  # the last layer's output (a Medusa head reads it)
            captured[len(self.layers)] = hidden.float()
        if last_only:
            hidden = hidden[:, -1:]
        hidden = _rms_norm(hidden, w.norm, cfg.rms_norm_eps)
        logits = _torch_linear(hidden, w.lm_head)
        return logits, hidden, torch.cat([captured[i] for i in capture], dim=-1) if capture else None

    __call__ = forward

    def layer_skip_view(self, num_layers: int) -> "NativeRuntime":
        """The first ``num_layers`` layers + final norm + head, sharing weights."""
        return NativeRuntime(self.weights, num_layers, self.backend, self.prefill_chunk, self.cuda_graphs)


def load_native(model_dir: Path, dtype: torch.dtype, weights: str | None = None, backend: str = "torch",
                gguf_path: Path | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                device: str = "cpu", cuda_graphs: bool = True) -> NativeRuntime:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):  # missing, unreadable or not JSON: resolve_model says which, by name
        from .loading import resolve_model

        config = resolve_model(str(model_dir)).config
    from .loading import transients_mapped

    with transients_mapped():  # the temporaries of re-quantizing and regrouping leave no holes resident
        loaded = LlamaWeights.from_pretrained(model_dir, config, dtype, weights, gguf_path)
        if device != "cpu":
            loaded = loaded.to(device)
        if dtype == torch.bfloat16 and (weights or "bf16") == "bf16" and backend == "torch":
            # a no-op off the CPU; the kernels backend reads the plain weights, and a packed copy
            # beside them would hold the layers twice (found in review)
            loaded.pack_for_cpu()
        return NativeRuntime(loaded, backend=backend, prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs)
