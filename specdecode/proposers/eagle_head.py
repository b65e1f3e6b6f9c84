"""An EAGLE-3-style draft head for a Llama-family target (Li et al. 2025, "EAGLE-3").

The head drafts from the target's own residual stream. For committed token ``x_{p+1}`` it
reads the target's hidden states at token ``x_p`` taken at three depths (the inputs of
layers 2, L/2 and L-3), fuses them ``3H -> H`` (``fc``), and runs one decoder layer whose
attention reads ``[norm(embed(x_{p+1})); norm(fused)]`` (2H wide) while the residual
stream carries the fused feature. Its output ``g_p`` gives, through a final norm and an LM
head over a reduced *draft vocabulary* (the N most frequent tokens of the training data,
``d2t`` maps draft ids to target ids), the distribution of ``x_{p+2}``; drafting deeper,
``g_p`` stands in for the target's feature of the token just drafted.

The token embeddings are the target's (frozen, not stored here). Training unrolls the head
on its own outputs (``unrolled_attention``): step j at position p attends to the step-0
entries at positions <= p and to its own entries of steps 1..j at p, which is exactly what
a draft chain of depth j sees at inference.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError, SpecDecodeError
from ..models.loading import shared_mode
from .base import DraftVocabulary


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    draft_vocab_size: int
    capture_layers: tuple[int, ...]

    @classmethod
    def for_target(cls, cfg, draft_vocab_size: int, intermediate_size: int | None = None) -> "EagleConfig":
        """Sizes from the target's LlamaConfig; the capture layers EAGLE-3 uses."""
        capture = capture_layers(cfg.num_layers)
        if cfg.rope.get("rope_type", "default") != "default":
            raise SpecDecodeError(f"EAGLE heads support default RoPE only, the target uses {cfg.rope['rope_type']!r}")
        return cls(cfg.hidden_size, intermediate_size or cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.rms_norm_eps, float(cfg.rope["rope_theta"]), cfg.vocab_size,
                   min(draft_vocab_size, cfg.vocab_size), capture)


def capture_layers(layers: int) -> tuple[int, ...]:
    """The target layers whose input a head reads: EAGLE-3's 2, L/2 and L-3; under 7 layers,
    where those collide or fall out of order, the first, middle and last (distinct and
    ascending, as vLLM gathers them, where the target has 3 layers or more)."""
    capture = (min(2, layers - 1), layers // 2, max(layers - 3, 0))
    if not capture[0] < capture[1] < capture[2]:
        capture = (0, layers // 2, layers - 1) if layers >= 3 else tuple(sorted(capture))
    return capture


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(DraftVocabulary, nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        c = self.config = config
        h, d = c.hidden_size, c.head_dim
        self.fc = nn.Linear(len(c.capture_layers) * h, h, bias=False)
        self.input_norm = RMSNorm(h, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)  # on the fused feature
        self.q_proj = nn.Linear(2 * h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        inverse = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inverse, persistent=False)
        self.fast: dict | None = None  # drafting only: projections on the CPU kernels (use_kernels)
        self.fast_format: str | None = None

    def use_kernels(self, fmt: str = "q8_0") -> bool:
        """Run the projections through the CPU kernels with weights in ``fmt`` (drafting
        reads every weight once per draft token; Q8_0 reads a quarter of fp32). Returns
        False, leaving torch in charge, where the kernels cannot load."""
        from ..kernels import KernelsUnavailable
        from ..models.cpu_runtime import KernelLinear
        from ..models.quant import PackedLinear

        if self.fast is not None and self.fast_format == fmt:
            return True  # already packed (another proposer of this head did it)
        fused = {"fc": [self.fc], "qkv": [self.q_proj, self.k_proj, self.v_proj], "o": [self.o_proj],
                 "gate_up": [self.gate_proj, self.up_proj], "down": [self.down_proj], "lm_head": [self.lm_head]}
        try:
            self.fast = {name: KernelLinear(PackedLinear.quantize(torch.cat([m.weight.detach() for m in mods]), fmt))
                         for name, mods in fused.items()}
        except (KernelsUnavailable, ConfigError):  # no kernels here, or a width they cannot pack (as Medusa's)
            self.fast = None
        self.fast_format = fmt
        return self.fast is not None

    def project(self, name: str, x: torch.Tensor, fast: bool = True) -> torch.Tensor:
        """One (fused) projection: fc, qkv, o, gate_up, down or lm_head; through the packed
        kernels where ``use_kernels`` made them and ``fast`` (a proposer built without the
        kernels says False: another proposer of the head may have packed it; found in review)."""
        if fast and self.fast is not None:
            return self.fast[name](x)
        modules = {"fc": (self.fc,), "qkv": (self.q_proj, self.k_proj, self.v_proj), "o": (self.o_proj,),
                   "gate_up": (self.gate_proj, self.up_proj), "down": (self.down_proj,), "lm_head": (self.lm_head,)}[name]
        return modules[0](x) if len(modules) == 1 else torch.cat([m(x) for m in modules], dim=-1)

    # -- pieces shared by training and drafting -------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for integer positions [T]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, fast: bool = True):
        """embeds, hidden [B, T, H] -> q [B, heads, T, D], k and v [B, kv_heads, T, D], rotated."""
        c = self.config
        batch, length, _ = hidden.shape
        x = torch.cat((self.input_norm(embeds), self.hidden_norm(hidden)), dim=-1)
        q, k, v = self.project("qkv", x, fast).split([c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2, dim=-1)
        q = q.reshape(batch, length, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor, fast: bool = True) -> torch.Tensor:
        """Residual + o_proj(attention [B, heads, T, D]) and the MLP: the layer's output g."""
        batch, _, length, _ = attn.shape
        hidden = hidden + self.project("o", attn.transpose(1, 2).reshape(batch, length, -1), fast)
        gate, up = self.project("gate_up", self.post_norm(hidden), fast).chunk(2, dim=-1)
        return hidden + self.project("down", F.silu(gate) * up, fast)

    def logits(self, g: torch.Tensor, fast: bool = True) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] from the layer's output."""
        return self.project("lm_head", self.norm(g), fast)

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        groups = self.config.num_heads // self.config.num_kv_heads
        return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv

    # -- training: several unrolled steps -------------------------------------------------
    def unrolled(self, features: torch.Tensor, embeds: list[torch.Tensor], positions: torch.Tensor) -> list[torch.Tensor]:
        """Training-time test. ``features`` [B, T, 3H]: the target's captured states at
        positions 0..T-1; ``embeds[j]`` [B, T, H]: the embedding of the token at position
        p+1+j for row p. Returns the layer's output [B, T, H] per step j (``logits`` of it
        drafts; the trainer takes them only for the rows it trains); step j's row p predicts
        the token at p+2+j."""
        scale = 1.0 / math.sqrt(self.config.head_dim)
        hidden = self.project("fc", features)
        causal = torch.ones(features.shape[1], features.shape[1], dtype=torch.bool, device=features.device).tril()
        keys, values, outputs = [], [], []
        for step, embed in enumerate(embeds):
            q, k, v = self.qkv(embed, hidden, positions + step)
            k, v = self._expand(k), self._expand(v)
            keys.append(k)
            values.append(v)
            scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, heads, T, T] against step 0
            scores = scores.masked_fill(~causal, float("-inf"))
            diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # own earlier steps
            probs = torch.cat([scores] + diagonal, dim=-1).softmax(dim=-1)
            length = scores.shape[-1]
            attn = probs[..., :length] @ values[0]
            for index, value in enumerate(values[1:]):
                attn = attn + probs[..., length + index : length + index + 1] * value
            hidden = self.finish(hidden, attn)
            outputs.append(hidden)
        return outputs

    # -- files ----------------------------------------------------------------------------
    def save(self, directory: Path, metadata: dict | None = None) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to(torch.bfloat16 if t.is_floating_point() else t.dtype).contiguous()
                 for name, t in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"))
        shared_mode(directory / "model.safetensors", 0o666)  # safetensors writes 0600
        config = asdict(self.config) | {"architecture": "specdecode-eagle3", **(metadata or {})}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path, target_layers: int | None = None) -> "EagleHead":
        """A head written by ``save``, or by vLLM/EAGLE-3 or speculators (``eagle_formats``);
        ``target_layers`` places the layers a foreign checkpoint reads if it does not say."""
        from .eagle_formats import check_sizes, detect, import_head, load_checked, read_tensors

        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise SpecDecodeError(f"{directory} is not an EAGLE head (needs config.json and model.safetensors)")
        try:
            raw = json.loads((directory / "config.json").read_text())
        except ValueError as error:  # UnicodeDecodeError too (a UTF-16 file; found in review)
            raise SpecDecodeError(f"{directory}/config.json is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise SpecDecodeError(f"{directory}/config.json does not describe an EAGLE head: not a JSON object")
        fmt = detect(raw)
        if fmt != "specdecode":
            return import_head(directory, raw, fmt, target_layers)
        fields = EagleConfig.__dataclass_fields__
        missing = [name for name in fields if name not in raw]
        if missing:
            raise SpecDecodeError(f"{directory}/config.json lacks {', '.join(missing)}")
        try:
            config = EagleConfig(**{k: v for k, v in raw.items() if k in fields})
            config.capture_layers = tuple(int(layer) for layer in config.capture_layers)
            check_sizes(config, directory)
            head = cls(config)
        except (TypeError, ValueError, RuntimeError) as error:
            raise SpecDecodeError(f"{directory}/config.json does not describe a head: {error}") from None
        tensors = read_tensors(directory / "model.safetensors")
        state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        load_checked(head, state, directory)
        return head.eval()
