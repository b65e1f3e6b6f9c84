"""Native runtime for the Llama family (Llama, SmolLM2, Mistral, Qwen2), parameterised by config.

Why not transformers: one decode step of a 135M model on this CPU is dominated by per-op
overhead, not arithmetic. This runtime fuses the q/k/v and gate/up projections, applies
RoPE to q and k in one pass, writes keys and values into a preallocated cache, and
computes logits only where asked.

KV cache: preallocated ``[layers, batch, kv_heads, capacity, head_dim]`` with a length
pointer. ``forward`` writes the new tokens at slots ``[length, length + T)`` and advances
the pointer; rejecting drafts is ``rollback(n)`` — no copy, the stale slots are simply
overwritten later. Token trees pass explicit positions and a ``[T, T]`` mask over the new
tokens, then ``compact`` copies the accepted path into contiguous slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SpecDecodeError


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
        model_type = config.get("model_type")
        if config.get("hidden_act", "silu") != "silu":
            raise SpecDecodeError(f"native runtime supports hidden_act 'silu' only, got {config['hidden_act']!r}")
        window = config.get("sliding_window")
        if window and config.get("use_sliding_window", model_type == "mistral"):
            raise SpecDecodeError(
                f"{model_type} with a sliding attention window ({window}) is not supported by the "
                "native runtime; use --runtime hf"
            )
        num_heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
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
            max_positions=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or config.get("attention_bias", False),
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
        raise SpecDecodeError(f"unsupported RoPE type {cfg.rope['rope_type']!r}")
    hf_config = AutoConfig.from_pretrained(model_dir)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope["rope_type"]](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        qkv_width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, qkv_width, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class LlamaWeights(nn.Module):
    """The parameters only; runtimes (full model or a layer-skip view) share them."""

    def __init__(self, cfg: LlamaConfig, model_dir: Path | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = self._rope_tables(cfg, model_dir)  # [max_positions, head_dim] each
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, dtype: torch.dtype) -> "LlamaWeights":
        from safetensors.torch import load_file

        cfg = LlamaConfig.from_hf(config)
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise SpecDecodeError(f"{model_dir} holds no *.safetensors weights (only safetensors are read)")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        with torch.device("meta"):  # no memory for random init; real tensors are assigned
            weights = cls(cfg, model_dir)
        weights.rope_cos, weights.rope_sin = cls._rope_tables(cfg, model_dir)
        weights.load_state_dict(_fuse_hf_state(state, cfg), assign=True, strict=True)
        if cfg.tie_word_embeddings:
            weights.lm_head.weight = weights.embed.weight
        weights = weights.to(dtype).eval().requires_grad_(False)
        if dtype == torch.bfloat16:
            weights.pack_for_cpu()
        return weights

    def pack_for_cpu(self) -> None:
        """Add a oneDNN-prepacked copy of every bf16 projection (see ``_linear``).
        The plain weights stay: the embedding lookup and training read them."""
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return
        linears = [self.lm_head] + [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for linear in linears:
            linear.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)

    @staticmethod
    def _rope_tables(cfg: LlamaConfig, model_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = rope_inverse_frequencies(cfg, model_dir)
        angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * scaling, angles.sin() * scaling


def _fuse_hf_state(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names onto the fused layout of ``LlamaWeights``."""

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise SpecDecodeError(f"checkpoint lacks parameter {name!r}")
        return state[name]

    fused = {"embed.weight": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    fused["lm_head.weight"] = fused["embed.weight"] if cfg.tie_word_embeddings else take("lm_head.weight")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = [take(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"]
        fused[ours + "qkv.weight"] = torch.cat(attn, dim=0)
        if cfg.qkv_bias:
            fused[ours + "qkv.bias"] = torch.cat([take(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"])
        fused[ours + "o.weight"] = take(f"{hf}self_attn.o_proj.weight")
        fused[ours + "gate_up.weight"] = torch.cat(
            [take(f"{hf}mlp.gate_proj.weight"), take(f"{hf}mlp.up_proj.weight")], dim=0
        )
        fused[ours + "down.weight"] = take(f"{hf}mlp.down_proj.weight")
        fused[ours + "input_norm"] = take(f"{hf}input_layernorm.weight")
        fused[ours + "post_norm"] = take(f"{hf}post_attention_layernorm.weight")
    return fused


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` by the fastest kernel measured on this CPU for the weights' form.

    bf16 weights are prepacked for oneDNN (``pack_for_cpu``): a [3072, 576] product takes
    ~166 us for 1 to 16 rows, against 250-280 us through F.linear, with identical results.
    Otherwise a single row goes through torch.mv (fp32 267 us, same as F.linear; bf16
    157 us against 247 us), and several rows through F.linear.
    """
    packed = getattr(layer, "packed_weight", None)
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, layer.bias, "none", [], "")
        return out.view(*x.shape[:-1], -1)
    if x.numel() != x.shape[-1]:
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NativeRuntime:
    """A Llama-family model with a preallocated KV cache and a length pointer.

    ``num_layers`` below the checkpoint's makes a layer-skip view: the first L layers with
    the final norm and head, sharing every weight with the full model but keeping a cache
    of its own (the ``self:L`` drafter).
    """

    def __init__(self, weights: LlamaWeights, num_layers: int | None = None):
        cfg = weights.cfg
        self.weights = weights
        self.cfg = cfg
        self.num_layers = cfg.num_layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= cfg.num_layers:
            raise SpecDecodeError(f"layer count must be in 1..{cfg.num_layers}, got {self.num_layers}")
        self.layers = list(weights.layers)[: self.num_layers]
        self.dtype = weights.embed.weight.dtype
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_positions
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.length = 0

    # -- cache management -------------------------------------------------------------
    def reset(self, capacity: int, batch: int = 1) -> None:
        """Allocate (or reuse) a cache for ``capacity`` tokens and set the length to 0."""
        cfg = self.cfg
        capacity = min(capacity, cfg.max_positions)
        shape = (self.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        if self.k_cache is None or self.k_cache.shape[1] != batch or self.k_cache.shape[3] < capacity:
            self.k_cache = torch.zeros(shape, dtype=self.dtype)
            self.v_cache = torch.zeros(shape, dtype=self.dtype)
        self.length = 0

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
        dst = torch.arange(start, start + slots.numel())
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
    ):
        """Run T new tokens, write their KV at ``[length, length+T)``, advance the length.

        Returns logits ``[B, T, V]`` (``[B, 1, V]`` if ``last_only``), and the final
        normalised hidden states ``[B, T, H]`` too if ``return_hidden``.
        """
        cfg, w = self.cfg, self.weights
        batch, num_new = input_ids.shape
        start, end = self.length, self.length + num_new
        if end > self.capacity:
            raise SpecDecodeError(
                f"sequence of {end} tokens exceeds the KV cache capacity {self.capacity} "
                f"(context limit {cfg.max_positions})"
            )
        if positions is None:
            cos, sin = w.rope_cos[start:end], w.rope_sin[start:end]
        else:
            cos, sin = w.rope_cos[positions], w.rope_sin[positions]
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, head_dim]

        mask = None
        if num_new > 1 or tree_mask is not None:
            if tree_mask is None:
                tree_mask = torch.ones(num_new, num_new, dtype=torch.bool).tril_()
            mask = torch.ones(num_new, end, dtype=torch.bool)
            mask[:, start:] = tree_mask

        num_heads, num_kv = cfg.num_heads, cfg.num_kv_heads
        hidden = w.embed(input_ids)  # [B, T, H]
        for index, layer in enumerate(self.layers):
            normed = _rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = _linear(normed, layer.qkv).view(batch, num_new, num_heads + 2 * num_kv, cfg.head_dim)
            qk = qkv[:, :, : num_heads + num_kv]
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :, :num_heads].transpose(1, 2)  # [B, heads, T, D]
            self.k_cache[index, :, :, start:end] = qk[:, :, num_heads:].transpose(1, 2)
            self.v_cache[index, :, :, start:end] = qkv[:, :, num_heads + num_kv :].transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q,
                self.k_cache[index, :, :, :end],
                self.v_cache[index, :, :, :end],
                attn_mask=mask,
                enable_gqa=num_heads != num_kv,
            )  # [B, heads, T, D]
            hidden = hidden + _linear(attn.transpose(1, 2).reshape(batch, num_new, -1), layer.o)
            normed = _rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            gate, up = _linear(normed, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + _linear(F.silu(gate) * up, layer.down)
        self.length = end

        if last_only:
            hidden = hidden[:, -1:]
        hidden = _rms_norm(hidden, w.norm, cfg.rms_norm_eps)
        logits = _linear(hidden, w.lm_head)
        return (logits, hidden) if return_hidden else logits

    __call__ = forward

    def layer_skip_view(self, num_layers: int) -> "NativeRuntime":
        """The first ``num_layers`` layers + final norm + head, sharing weights."""
        return NativeRuntime(self.weights, num_layers)


def load_native(model_dir: Path, dtype: torch.dtype) -> NativeRuntime:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return NativeRuntime(LlamaWeights.from_pretrained(model_dir, config, dtype))
