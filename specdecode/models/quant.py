"""Weight formats of a linear layer, and conversions between them.

=========  ===========================================  ====================================
format     storage (rows = out features, cols = in)      value of weight i of a block of 32
=========  ===========================================  ====================================
fp32       float32 [rows, cols]                          w
bf16       bfloat16 [rows, cols]                         w
q8_0       int8 [rows, cols], fp16 scale per block       d * q,        q in [-127, 127]
q4_1       4-bit [rows, cols / 2], fp16 scale and min    d * q + m,    q in [0, 15]
=========  ===========================================  ====================================

q8_0 and q4_1 are GGUF's Q8_0 and Q4_1 blocks, byte for byte (Q4_1 keeps GGUF's nibble
order: byte j of a block holds weight j in its low and weight j + 16 in its high nibble),
so a GGUF's tensors in those formats are carried without a second quantization
(``from_gguf``). Checkpoints in fp32/bf16 are quantized group-wise at load
(``quantize``): q8_0 with scale max|w| / 127, q4_1 with min and (max - min) / 15 per
block, as llama.cpp quantizes; scales are rounded to fp16 first and the codes computed
against the rounded scale.

The CPU kernels read every format as stored; ``PackedLinear.forward`` (PyTorch, any
device) dequantizes, as the reference the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError

WEIGHT_FORMATS = ("fp32", "bf16", "q8_0", "q4_1")
BLOCK = 32
# names on the command line -> formats of the layer weights
WEIGHT_CHOICES = {"fp32": "fp32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_1"}

# GGML type ids (ggml.h) of the formats carried exactly
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
# GGUF block types that int4 carries exactly (Q4_1 as it is, Q4_0 with minimum -8 scale):
# only a file of these is a 4-bit model to --weights auto. K-quants are not: int4 would
# quantize them a second time, and a Q4_K_M file's Q6_K tensors from 6 bits to 4 (found in
# review: auto chose that on speed alone)
GGML_4BIT = (GGML_Q4_0, GGML_Q4_1)


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with W stored in one of ``WEIGHT_FORMATS``.

    Dense formats keep ``weight`` as a parameter (so ``named_parameters`` counts it and
    oneDNN may prepack it); block formats keep ``qweight`` and fp16 ``scales`` (and
    ``mins`` for q4_1) as buffers. ``bias`` is fp32 beside block formats and in the
    dense format's dtype beside dense weights (bf16 for bf16); ``forward`` casts it to the
    activations' dtype."""

    def __init__(self, rows: int, cols: int, fmt: str = "fp32", bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
        self.fmt, self.rows, self.cols = fmt, rows, cols
        # q4_1 and q8_0: "rows8" once interleave_rows8 regrouped the blocks; q4_1: "rows16"
        # once interleave_rows16 paired those groups
        self.layout = "rows"
        if fmt in ("fp32", "bf16"):
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        else:
            self.weight = None
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype), requires_grad=False) if bias else None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> "PackedLinear":
        dtype = weight.dtype if dtype is None else dtype
        fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
        if fmt is None:
            raise ConfigError(f"dense weights must be float32 or bfloat16, got {dtype}")
        layer = cls(weight.shape[0], weight.shape[1], fmt, dtype=dtype)
        layer.weight = nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.to(dtype).contiguous(), requires_grad=False)
        return layer

    @classmethod
    def from_blocks(cls, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> "PackedLinear":
        rows = qweight.shape[0]
        cols = qweight.shape[1] * (2 if fmt == "q4_1" else 1)
        layer = cls(rows, cols, fmt)
        layer.register_buffer("qweight", qweight.contiguous())
        layer.register_buffer("scales", scales.to(torch.float16).contiguous())
        layer.register_buffer("mins", None if mins is None else mins.to(torch.float16).contiguous())
        if bias is not None:
            layer.bias = nn.Parameter(bias.float().contiguous(), requires_grad=False)
        return layer

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> "PackedLinear":
        """Group-wise quantization of a dense [rows, cols] weight (fp32 math)."""
        if fmt in ("fp32", "bf16"):
            return cls.dense(weight, bias, torch.float32 if fmt == "fp32" else torch.bfloat16)
        rows, cols = weight.shape
        check_block_shape(fmt, cols)
        blocks = weight.float().reshape(rows, cols // BLOCK, BLOCK)
        if fmt == "q8_0":
            scales = (blocks.abs().amax(-1) / 127.0).to(torch.float16)
            scale = scales.float()[..., None]
            inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
            codes = (blocks * inverse).round().clamp(-127, 127).to(torch.int8)
            return cls.from_blocks(fmt, codes.reshape(rows, cols), scales, bias=bias)
        low, high = blocks.amin(-1), blocks.amax(-1)
        mins = low.to(torch.float16)
        scales = ((high - mins.float()) / 15.0).to(torch.float16)
        scale = scales.float()[..., None]
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = ((blocks - mins.float()[..., None]) * inverse).round().clamp(0, 15).to(torch.uint8)
        return cls.from_blocks(fmt, pack_nibbles(codes).reshape(rows, cols // 2), scales, mins, bias)

    # -- the CPU kernels' 8-row layout ---------------------------------------------------
    def interleave_rows8(self) -> None:
        """Regroup a q4_1 or q8_0 layer's blocks in place into the CPU kernels' 8-row
        layouts (specdecode/kernels/cpu.cpp): per 8 output rows and block of 32, the 8 rows'
        codes interleaved 4 weights at a time, and their scales (and minima) side by side.
        Q4_1X8: 128 bytes whose byte ``32 i + 4 r + t`` holds row r's weights ``8 i + t``
        (low nibble) and ``8 i + 4 + t`` (high); Q8_0X8: 256 bytes whose byte
        ``32 i + 4 r + t`` holds row r's weight ``4 i + t``. The same values, bytes and
        memory: nothing is quantized again. Every view below (``dequantize``, ``blocks``)
        still returns GGUF's order."""
        if self.layout in ("rows8", "rows16"):  # rows16: paired, from the 8-row layout
            return
        if self.fmt not in ("q4_1", "q8_0") or self.rows % 8:
            raise ConfigError(f"only q4_1 and q8_0 layers with a multiple of 8 rows regroup by 8 rows, "
                              f"not {self.fmt} x {self.rows}")
        groups, blocks = self.rows // 8, self.cols // BLOCK
        if self.fmt == "q8_0":
            codes = self.qweight.reshape(groups, 8, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # g, b, i, r, t
            self.qweight.copy_(codes.reshape(self.rows, self.cols).clone())
        else:
            codes = unpack_nibbles(self.qweight.reshape(self.rows, blocks, BLOCK // 2))
            codes = codes.reshape(groups, 8, blocks, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # g, b, i, nibble, r, t
            packed = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).to(torch.uint8)
            self.qweight.copy_(packed.reshape(self.rows, self.cols // 2))
        for values in (self.scales, self.mins):
            if values is not None:
                values.copy_(values.reshape(groups, 8, blocks).transpose(1, 2).reshape(self.rows, blocks).clone())
        self.layout = "rows8"

    def interleave_rows16(self) -> None:
        """Pair a q4_1 layer's 8-row groups in place into the kernels' Q4_1X16 layout
        (specdecode/kernels/cpu.cpp; rows a multiple of 16): per pair of groups and block,
        the two groups' Q4_1X8 bytes alternate 32 at a time, and their 8 scales (and
        minima) sit side by side. The same bytes, moved; every view still returns GGUF's
        order."""
        if self.layout == "rows16":
            return
        if self.fmt != "q4_1" or self.rows % 16:
            raise ConfigError(f"only q4_1 layers with a multiple of 16 rows pair their 8-row groups, "
                              f"not {self.fmt} x {self.rows}")
        self.interleave_rows8()
        self.qweight.copy_(self._pairs(self.qweight, 4, 32).clone())
        for values in (self.scales, self.mins):
            values.copy_(self._pairs(values, 1, 8).clone())
        self.layout = "rows16"

    def _pairs(self, tensor: torch.Tensor, runs: int, width: int, inverse: bool = False) -> torch.Tensor:
        """The Q4_1X8 order of ``tensor`` (codes: 4 runs of 32 bytes a block; scales: 1 run
        of 8) as Q4_1X16's, the two groups of a pair alternating run by run; ``inverse``:
        back. [rows, -1]: a copy, or a view of ``tensor`` where the permutation moves
        nothing (interleave_rows16 clones it before writing it back)."""
        pairs, blocks = self.rows // 16, self.cols // BLOCK
        if inverse:  # p, b, run, half, width -> p, half, b, run, width
            moved = tensor.reshape(pairs, blocks, runs, 2, width).permute(0, 3, 1, 2, 4)
        else:  # p, half, b, run, width -> p, b, run, half, width
            moved = tensor.reshape(pairs, 2, blocks, runs, width).permute(0, 2, 3, 1, 4)
        return moved.reshape(self.rows, -1)

    def blocks(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, scales, mins) in GGUF's order, whatever the layout in memory: of every
        row, or of the rows ``index`` names (a few embedding rows read only their groups)."""
        if self.layout not in ("rows8", "rows16"):
            if index is None:
                return self.qweight, self.scales, self.mins
            return self.qweight[index], self.scales[index], None if self.mins is None else self.mins[index]
        groups, blocks = self.rows // 8, self.cols // BLOCK
        per_row = 8 if self.fmt == "q8_0" else 4  # 4-byte runs of a row in a block
        if index is not None and self.layout == "rows16":  # the named rows' pairs only, as below
            index = index.reshape(-1).cpu().numpy()
            pair, half, lane = index // 16, index // 8 % 2, index % 8
            codes = torch.from_numpy(self.qweight.reshape(groups // 2, blocks, per_row, 2, 8, 4).numpy()
                                     [pair, :, :, half, lane])  # n, b, i, t
            scales, mins = (None if v is None else torch.from_numpy(v.reshape(groups // 2, blocks, 2, 8).numpy()
                                                                    [pair, :, half, lane]) for v in (self.scales, self.mins))
            return self._from_grouped(codes, scales, mins, len(index))
        qweight, scale_values, min_values = self.qweight, self.scales, self.mins
        if self.layout == "rows16":  # back to the 8-row layout's order first
            qweight = self._pairs(qweight, 4, 32, inverse=True)
            scale_values, min_values = (None if v is None else self._pairs(v, 1, 8, inverse=True)
                                        for v in (scale_values, min_values))
        grouped = qweight.reshape(groups, blocks, per_row, 8, 4)  # g, b, i, r, t
        scales, mins = (None if v is None else v.reshape(groups, blocks, 8) for v in (scale_values, min_values))
        if index is None:  # every row: g, b, i, r, t -> g, r, b, i, t
            codes = grouped.permute(0, 3, 1, 2, 4)
            scales, mins = (None if v is None else v.transpose(1, 2).reshape(self.rows, blocks) for v in (scales, mins))
        else:  # only the named rows' groups (numpy indexes a few rows in µs, torch in ~100)
            index = index.reshape(-1).cpu().numpy()
            group, lane = index // 8, index % 8
            codes = torch.from_numpy(grouped.numpy()[group, :, :, lane])  # n, b, i, t
            scales, mins = (None if v is None else torch.from_numpy(v.numpy()[group, :, lane]) for v in (scales, mins))
        return self._from_grouped(codes, scales, mins, self.rows if index is None else len(index))

    def _from_grouped(self, codes: torch.Tensor, scales, mins, count: int):
        """(qweight, scales, mins) in GGUF's order from a regrouped layout's codes, each row's
        [blocks, runs, 4] bytes (blocks() above)."""
        blocks = self.cols // BLOCK
        codes = codes.reshape(count, blocks, -1, 4)  # per row and block: 8 runs of 4 bytes (q8_0) or 4 (q4_1)
        if self.fmt == "q8_0":  # byte (i, t) is weight 4 i + t
            return codes.reshape(count, self.cols), scales, mins
        # byte (i, t) holds weights 8 i + t (low nibble) and 8 i + 4 + t (high)
        values = torch.stack([codes & 0x0F, codes >> 4], dim=3).reshape(count, blocks, BLOCK)
        return pack_nibbles(values).reshape(count, self.cols // 2), scales, mins

    # -- views ----------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [rows, cols]: exactly the values the format stores."""
        if self.weight is not None:
            return self.weight.float()
        blocks = self.cols // BLOCK
        qweight, scales, mins = self.blocks()
        scales = scales.float()[..., None]
        if self.fmt == "q8_0":
            codes = qweight.reshape(self.rows, blocks, BLOCK).float()
            return (codes * scales).reshape(self.rows, self.cols)
        codes = unpack_nibbles(qweight.reshape(self.rows, blocks, BLOCK // 2)).float()
        return (codes * scales + mins.float()[..., None]).reshape(self.rows, self.cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weight if self.weight is not None else self.dequantize()).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads for this layer (weight, scales, mins, bias)."""
        tensors = [self.weight] if self.weight is not None else [self.qweight, self.scales, self.mins]
        tensors.append(self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rows_selected(self, index: torch.Tensor) -> "PackedLinear":
        """A layer made of the given rows (exact: whole rows of blocks move)."""
        bias = None if self.bias is None else self.bias[index]
        if self.weight is not None:
            return PackedLinear.dense(self.weight[index], bias)
        return PackedLinear.from_blocks(self.fmt, *self.blocks(index), bias)

    @staticmethod
    def concat(parts: list["PackedLinear"]) -> "PackedLinear":
        """Stack layers of one format along the rows (fused q/k/v, gate/up)."""
        fmt = parts[0].fmt
        if any(p.fmt != fmt or p.cols != parts[0].cols for p in parts):
            raise ConfigError("only layers of one format and input width can be fused")
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.rows, dtype=torch.float32) for b, p in zip(biases, parts)])
        if parts[0].weight is not None:
            return PackedLinear.dense(torch.cat([p.weight for p in parts]), bias)
        blocks = [p.blocks() for p in parts]
        mins = None if blocks[0][2] is None else torch.cat([b[2] for b in blocks])
        return PackedLinear.from_blocks(fmt, torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks]), mins,
                                        bias)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, cols={self.cols}, fmt={self.fmt}"


def format_for_width(fmt: str, cols: int) -> str:
    """The format a layer of input width ``cols`` is held in when ``fmt`` is asked for: the
    kernels read Q4_1 in pairs of blocks (64 columns), so under int4 a layer whose width is an
    odd number of blocks keeps 8 bits (Q8_0) instead of being refused."""
    return "q8_0" if fmt == "q4_1" and cols % 64 and not cols % BLOCK else fmt


def check_block_shape(fmt: str, cols: int) -> None:
    multiple = 64 if fmt == "q4_1" else BLOCK
    if cols % multiple:
        raise ConfigError(f"weight format {fmt} needs an input width that is a multiple of {multiple}, got {cols}")


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes in GGUF's Q4_1 order."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values 0..15 (inverse of ``pack_nibbles``)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


@dataclass(frozen=True)
class GGUFTensor:
    """Where a tensor lies in a GGUF file: what the loader needs, without parsing the file's
    metadata again (``models/loading.gguf_tensor_index`` caches these)."""

    name: str
    tensor_type: int  # GGML type id
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data_offset: int
    n_bytes: int

    def read(self, path) -> np.ndarray:
        """The raw bytes [rows, bytes per row], read from the file (a memory map's touched
        pages would count in the process's memory for as long as it is mapped)."""
        with open(path, "rb") as handle:
            handle.seek(self.data_offset)
            raw = np.frombuffer(handle.read(self.n_bytes), dtype=np.uint8)
        return raw.reshape(self.shape[1] if len(self.shape) > 1 else 1, -1)


def from_gguf(tensor: GGUFTensor, path, fmt: str, bias: torch.Tensor | None = None) -> tuple[PackedLinear, str]:
    """A GGUF tensor as a PackedLinear in ``fmt``, and how it was carried: 'exact' when the
    GGUF's blocks are the format's (Q4_1 and Q8_0; Q4_0 as Q4_1 with min = -8 scale, exact
    in fp16; F32/F16/BF16 into fp32 or bf16 when no rounding is needed), else 'requantized'
    (de-quantized by the gguf library, then quantized to ``fmt``: a second quantization)."""
    kind = tensor.tensor_type
    rows, cols = tensor.shape[1], tensor.shape[0]  # GGUF lists dims fastest first
    fmt = format_for_width(fmt, cols)
    raw = tensor.read(path)
    if kind == GGML_Q4_1 and fmt == "q4_1":
        blocks = raw.reshape(rows, cols // BLOCK, 20)
        scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        codes = torch.from_numpy(blocks[..., 4:20].copy()).reshape(rows, cols // 2)
        return PackedLinear.from_blocks("q4_1", codes, scales, mins, bias), "exact"
    if kind == GGML_Q4_0 and fmt == "q4_1":
        blocks = raw.reshape(rows, cols // BLOCK, 18)
        scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
        codes = torch.from_numpy(blocks[..., 2:18].copy()).reshape(rows, cols // 2)
        return PackedLinear.from_blocks("q4_1", codes, scales, -8 * scales, bias), "exact"
    if kind == GGML_Q8_0 and fmt in ("q8_0", "q4_1"):
        # a Q8_0 tensor keeps its 8 bits even when the layers are asked for in 4 bits
        blocks = raw.reshape(rows, cols // BLOCK, 34)
        scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
        codes = torch.from_numpy(blocks[..., 2:34].copy().view(np.int8)).reshape(rows, cols)
        return PackedLinear.from_blocks("q8_0", codes, scales, bias=bias), "exact"
    lossless = {GGML_F32: ("fp32",), GGML_F16: ("fp32",), GGML_BF16: ("fp32", "bf16")}.get(kind, ())
    return _requantized(raw, kind, rows, cols, fmt, bias), "exact" if fmt in lossless else "requantized"


REQUANTIZE_VALUES = 1 << 18  # values de-quantized and quantized at a time (1 MB of fp32)


def _requantized(raw: np.ndarray, kind: int, rows: int, cols: int, fmt: str, bias: torch.Tensor | None) -> PackedLinear:
    """The GGUF blocks ``raw`` ([rows, bytes per row]) de-quantized by the gguf library and
    quantized to ``fmt``, a few rows at a time into the layer's own tensors: the same bits
    as the whole tensor at once (each row is quantized alone), without its fp32 copy and
    the library's temporaries (found in review: about 12 bytes a parameter at the peak,
    three times the fp32 size ``specdecode memory`` counts for the load)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(kind)
    step = max(1, REQUANTIZE_VALUES // cols)
    whole: dict[str, torch.Tensor | None] = {}
    for start in range(0, rows, step):
        values = np.asarray(gguf.quants.dequantize(raw[start : start + step], qtype), dtype=np.float32)
        part = PackedLinear.quantize(torch.from_numpy(values.reshape(-1, cols)), fmt)
        tensors = {"weight": part.weight} if part.weight is not None else \
            {"qweight": part.qweight, "scales": part.scales, "mins": part.mins}
        for name, tensor in tensors.items():
            if tensor is None:
                whole[name] = None
                continue
            if name not in whole:
                whole[name] = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype)
            whole[name][start : start + tensor.shape[0]] = tensor
    if "weight" in whole:
        return PackedLinear.dense(whole["weight"], bias)
    return PackedLinear.from_blocks(fmt, whole["qweight"], whole["scales"], whole["mins"], bias)
