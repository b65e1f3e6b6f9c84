"""Medusa heads (Cai et al. 2024, "Medusa"): K small heads on the target's last hidden state.

The target's output head at position p gives token p+1; Medusa head i (1..K) at the same
position guesses token p+1+i. Each head is one residual block on the state the output
head reads, ``y = x + SiLU(W_i x + b_i)`` with ``x = norm(h_p)`` (the target's final
RMSNorm of its last layer's output), followed by the target's own output rows restricted
to a *draft vocabulary* (the N most frequent tokens of the training data; ``d2t`` maps
draft ids to target ids). The norm and the rows are the target's, frozen, bound at load
(``bind``); only the K blocks are trained and stored (K x (H^2 + H) parameters). A block
starts at zero, so an untrained head guesses what the target's own head guesses.

Drafting: the engine tells the proposer the target's last-layer output for each committed
position (``observe``, capture layer L). With n committed tokens the target has run
positions 0..n-2, and position n-2 predicted token n-1, the last committed one. Heads
1..k at position n-2 then guess tokens n..n+k-1: the k drafts, in one pass of k blocks and
one k-row product with the draft rows, whatever the drafts are (the heads do not read
each other's guesses, as in Medusa-1). Drafts are top-1 choices, deterministic; the
target's own draws verify them, so sampled output stays the target's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError, SamplingParams, SpecDecodeError, is_count
from ..models.loading import shared_mode
from .base import DraftVocabulary, Proposal

ARCHITECTURE = "specdecode-medusa"


@dataclass
class MedusaConfig:
    hidden_size: int
    num_heads: int  # K: drafts per step at most
    target_vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float


class MedusaHeads(DraftVocabulary, nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        if config.num_heads < 1:
            raise SpecDecodeError(f"Medusa needs at least one head, got {config.num_heads}")
        self.config = c = config
        # the K blocks as one [K*H, H] product: every head reads the same state
        self.blocks = nn.Linear(c.hidden_size, c.num_heads * c.hidden_size)
        nn.init.zeros_(self.blocks.weight)
        nn.init.zeros_(self.blocks.bias)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        # the target's final norm weight [H] and output rows for the draft vocabulary [N, H]
        self.register_buffer("norm_weight", torch.ones(c.hidden_size), persistent=False)
        self.register_buffer("rows", torch.zeros(c.draft_vocab_size, c.hidden_size), persistent=False)
        self.fast = None  # drafting only: blocks and rows on the CPU kernels (use_kernels)
        self.bound = False  # rows hold the output head's rows for the current draft vocabulary

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        super().set_draft_vocab(d2t)
        # the rows bound before were the old vocabulary's (found in review: drafting went on
        # through them, lossless but guessing other tokens): bind again before drafting
        self.bound, self.fast = False, None

    def bind(self, norm_weight: torch.Tensor, output_rows: torch.Tensor) -> "MedusaHeads":
        """The target's final norm weight [H] and its whole output head [V, H] (the rows of
        the draft vocabulary are kept)."""
        c = self.config
        if tuple(output_rows.shape) != (c.target_vocab_size, c.hidden_size) or norm_weight.numel() != c.hidden_size:
            raise SpecDecodeError(f"Medusa heads for a target with {c.target_vocab_size} tokens and hidden size "
                                  f"{c.hidden_size} cannot bind an output head of shape {tuple(output_rows.shape)}")
        self.norm_weight = norm_weight.detach().float().to(self.d2t.device).clone()
        self.rows = output_rows.detach().float()[self.d2t.to(output_rows.device)].to(self.d2t.device).contiguous()
        self.fast = None
        self.bound = True
        return self

    def _check_bound(self) -> None:
        if not self.bound:
            raise SpecDecodeError("Medusa heads are not bound to their target's output head for this draft "
                                  "vocabulary: call bind() after load() or set_draft_vocab()")

    def normalise(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm of its last layer's output."""
        hidden = hidden.float()
        return self.norm_weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def states(self, normed: torch.Tensor, count: int | None = None, fast: bool = True) -> torch.Tensor:
        """[..., H] normalised states -> [..., count, H]: the first ``count`` heads' blocks
        (through the packed kernels where ``use_kernels`` made them and ``fast``)."""
        c, count = self.config, count or self.config.num_heads
        if fast and self.fast is not None and normed.dim() == 1:
            out = self.fast["blocks"](normed[None])[0]
        else:
            out = F.linear(normed, self.blocks.weight[: count * c.hidden_size], self.blocks.bias[: count * c.hidden_size])
        out = out[..., : count * c.hidden_size].unflatten(-1, (count, c.hidden_size))
        return normed.unsqueeze(-2) + F.silu(out)

    def logits(self, states: torch.Tensor, fast: bool = True) -> torch.Tensor:
        """[..., H] -> draft-vocabulary logits [..., N] through the target's rows."""
        self._check_bound()
        if fast and self.fast is not None and states.dim() == 2:
            return self.fast["rows"](states.contiguous())
        return states @ self.rows.T

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """Training: normalised states [..., H] -> logits [..., K, N]."""
        return self.logits(self.states(normed))

    def use_kernels(self, fmt: str = "q8_0") -> bool:
        """Blocks and rows through the CPU kernels in ``fmt`` (drafting reads every row once
        per step). False, leaving torch in charge, where the kernels cannot load."""
        from ..kernels import KernelsUnavailable
        from ..models.cpu_runtime import KernelLinear
        from ..models.quant import PackedLinear

        self._check_bound()
        if self.d2t.device.type != "cpu":
            return False
        if self.fast is not None:
            return True  # already packed (another proposer of these heads did it)
        try:
            blocks = KernelLinear(PackedLinear.quantize(self.blocks.weight.detach().float(), fmt))
            rows = KernelLinear(PackedLinear.quantize(self.rows, fmt))
        except (KernelsUnavailable, ConfigError):  # no kernels here, or a width they cannot pack
            self.fast = None
            return False
        bias = self.blocks.bias.detach().float()
        self.fast = {"blocks": lambda x: blocks(x) + bias, "rows": rows}
        return True

    # -- files ----------------------------------------------------------------------------
    def save(self, directory: Path, metadata: dict | None = None) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {"blocks.weight": self.blocks.weight.detach().to(torch.bfloat16).contiguous(),
                 "blocks.bias": self.blocks.bias.detach().to(torch.bfloat16).contiguous(),
                 "d2t": self.d2t.detach().contiguous()}
        save_file(state, str(directory / "model.safetensors"))
        shared_mode(directory / "model.safetensors", 0o666)  # safetensors writes 0600
        config = asdict(self.config) | {"architecture": ARCHITECTURE, **(metadata or {})}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "MedusaHeads":
        """Heads written by ``save`` (unbound: ``bind`` them to their target)."""
        from .eagle_formats import load_checked, read_tensors

        directory = Path(directory)
        if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
            raise SpecDecodeError(f"{directory} is not a Medusa head directory (needs config.json and model.safetensors)")
        try:
            raw = json.loads((directory / "config.json").read_text())
        except ValueError as error:  # UnicodeDecodeError too (a UTF-16 file; found in review)
            raise SpecDecodeError(f"{directory}/config.json is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise SpecDecodeError(f"{directory}/config.json does not describe Medusa heads: not a JSON object")
        if raw.get("architecture") != ARCHITECTURE:
            raise SpecDecodeError(f"{directory} holds {raw.get('architecture')!r}, not Medusa heads "
                                  f"({ARCHITECTURE!r}, written by `specdecode train medusa`)")
        fields = MedusaConfig.__dataclass_fields__
        missing = [name for name in fields if name not in raw]
        if missing:
            raise SpecDecodeError(f"{directory}/config.json lacks {', '.join(missing)}")
        config = MedusaConfig(**{k: raw[k] for k in fields})
        sizes = (config.hidden_size, config.num_heads, config.draft_vocab_size, config.target_vocab_size)
        eps = config.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise SpecDecodeError(f"{directory}/config.json: rms_norm_eps must be a number in (0, 1), got {eps!r}")
        if not all(is_count(size) for size in sizes) or not (
                config.hidden_size >= 1 and config.num_heads >= 1 and 1 <= config.draft_vocab_size <= config.target_vocab_size):
            raise SpecDecodeError(f"{directory}/config.json does not describe Medusa heads: needs hidden_size >= 1, "
                                  f"num_heads >= 1 and 1 <= draft_vocab_size <= target_vocab_size, got {sizes}")
        try:
            heads = cls(config)
        except (TypeError, ValueError, RuntimeError) as error:
            raise SpecDecodeError(f"{directory}/config.json does not describe Medusa heads: {error}") from None
        tensors = read_tensors(directory / "model.safetensors")
        load_checked(heads, {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, directory)
        return heads.eval()


class MedusaProposer:
    name = "medusa"
    samples_drafts = False  # top-1 drafts: the target's own draws verify them
    # only the latest position's state is read: a server may start the sequence from a
    # cached prompt prefix (serve/batch.py, _reusable)
    needs_prompt_states = False

    def __init__(self, heads: MedusaHeads, target_layers: int, kernels: bool = True):
        """``target_layers``: the target's layer count L; the heads read its capture layer L
        (the last layer's output)."""
        self.heads = heads.eval().requires_grad_(False)
        self.capture = (target_layers,)
        self.max_drafts = heads.config.num_heads  # one guess per head: k above it is refused
        self.kernels = kernels and heads.use_kernels()  # False: torch, whoever else packed the heads
        self.last: torch.Tensor | None = None  # the last observed position's state [H]
        self.position = -1

    @property
    def feature_width(self) -> int:
        """Width of the target states ``observe`` takes (the hidden size)."""
        return self.heads.config.hidden_size

    def start(self, prompt_ids: list[int], capacity: int) -> None:
        self.last, self.position = None, -1

    def observe(self, start: int, features: torch.Tensor, tokens: list[int]) -> None:
        """The target's last-layer outputs [m, H] for committed positions start..start+m-1."""
        if features.shape[0] == 0:
            return
        self.last = features[-1].clone()  # not a view that would keep a whole prefill's states alive
        self.position = start + features.shape[0] - 1

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        if self.last is None or self.position != len(tokens) - 2 or k < 1:
            return Proposal.empty()
        heads = self.heads
        count = min(k, heads.config.num_heads)
        states = heads.states(heads.normalise(self.last.to(heads.d2t.device)), count, fast=self.kernels)  # [count, H]
        chosen = heads.logits(states, fast=self.kernels).argmax(-1).tolist()
        d2t = heads.d2t_list  # the current vocabulary's (a copy taken at construction outlived set_draft_vocab)
        return Proposal(torch.tensor([d2t[i] for i in chosen], dtype=torch.int64))
