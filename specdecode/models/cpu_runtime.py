"""A NativeRuntime's layer stack on specdecode's CPU kernels (``specdecode/kernels``).

The kernels see the runtime's weights and KV cache in place (pointers to the same
tensors) and keep their activations in scratch buffers allocated once for
``prefill_chunk`` rows per batch row. One forward of T tokens is: embedding rows (a
kernel), one call through every layer per chunk of at most ``prefill_chunk`` tokens, then
the final norm and the output head for the rows asked for. Activations stay fp32 between
stages; the KV cache is stored in the runtime's dtype.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from .. import kernels
from ..config import MAX_PREFILL_CHUNK, SpecDecodeError
from .llama import _outputs
from .quant import PackedLinear

PARTIAL_ITEMS = 4096  # attention partials held at once: (row, kv head, key chunk) items


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def linear_entry(layer: PackedLinear, keep: list, rows8: bool = True) -> kernels.Linear:
    """The kernels' view of a PackedLinear; tensors it points to are appended to ``keep``.
    With ``rows8`` a q4_1 or q8_0 layer is regrouped in place into the kernels' 8-row
    layout (about 1.5x fewer instructions per weight on AVX2; docs/performance.md), and a
    q4_1 layer's groups paired (Q4_1X16) where the kernels have 512-bit VNNI tiles for
    them. A regrouped layer keeps its layout in every later entry (a tied embedding's
    lookups read it too): a layer in 8-row groups is not paired later, since entries made
    before would read the moved bytes in the old format (found in review)."""
    pairs = layer.fmt == "q4_1" and layer.layout == "rows" and layer.rows % 16 == 0
    if rows8 and pairs and kernels.load().sd_pairs16():
        layer.interleave_rows16()
    elif rows8 and layer.fmt in ("q4_1", "q8_0") and layer.rows % 8 == 0:
        layer.interleave_rows8()
    fmt = {"rows8": layer.fmt + "x8", "rows16": layer.fmt + "x16"}.get(layer.layout, layer.fmt)
    entry = kernels.Linear(kernels.FORMATS[fmt], layer.rows, layer.cols, 0)
    if layer.weight is not None:
        weight = layer.weight.detach().contiguous()
        keep.append(weight)
        entry.w = weight.data_ptr()
    else:
        entry.w, entry.d = _ptr(layer.qweight), _ptr(layer.scales)
        entry.m = _ptr(layer.mins)
    if layer.bias is not None:
        bias = layer.bias.detach().float().contiguous()
        keep.append(bias)
        entry.bias = bias.data_ptr()
    return entry


def embed_lookup(table: PackedLinear, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows of an embedding table for ``ids`` (any shape) by the kernels' lookup, which
    reads any layout (a regrouped table's rows through torch cost ~100 µs more each call)."""
    entry = getattr(table, "_kernel_entry", None)
    if entry is None:
        entry = table._kernel_entry = linear_entry(table, [], rows8=False)  # the table keeps its tensors
    flat = ids.reshape(-1).to(torch.int64).cpu().contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= table.rows):
        raise SpecDecodeError(f"token ids must lie in 0..{table.rows - 1}")
    out = torch.empty(flat.numel(), table.cols)
    kernels.load().sd_embed(ctypes.byref(entry), flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.view(*ids.shape, table.cols)


def check_attention_shape(cfg) -> None:
    """The attention shapes the kernels take (a target's LlamaConfig or a head's EagleConfig)."""
    if cfg.head_dim > 256 or cfg.head_dim % 8 or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 16:
        raise SpecDecodeError(f"the CPU kernels need head_dim <= 256 (a multiple of 8) and at most 16 query heads "
                              f"per KV head; this model has {cfg.head_dim} and {cfg.num_heads // cfg.num_kv_heads}")


def describe_model(model: kernels.Model, cfg, num_layers: int, kv_fmt: str, layers) -> None:
    """The shape fields of the kernels' model struct, from a config (a target's
    LlamaConfig or a head's EagleConfig: the same field names)."""
    model.num_layers, model.hidden, model.intermediate = num_layers, cfg.hidden_size, cfg.intermediate_size
    model.heads, model.kv_heads, model.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    model.kv_fmt = kernels.FORMATS[kv_fmt]
    model.eps = cfg.rms_norm_eps
    model.attn_scale = 1.0 / math.sqrt(cfg.head_dim)
    model.layers = ctypes.cast(layers, ctypes.POINTER(kernels.Layer))


def partial_items(cfg, capacity: int) -> int:
    """Attention partials for a cache of ``capacity`` slots: at least one row's (every KV
    head and key chunk of it), which the kernels need whatever the row grouping. A fixed
    4,096 items overflowed beyond 1,048,576 / kv_heads tokens (32 KV heads: 32,768; found
    in review)."""
    return max(PARTIAL_ITEMS, cfg.num_kv_heads * -(-capacity // kernels.load().sd_key_chunk()))


def attach_scratch(model: kernels.Model, cfg, rows: int, widest: int,
                   items: int = PARTIAL_ITEMS) -> dict[str, torch.Tensor]:
    """Scratch buffers for ``rows`` rows, pointed to by ``model``; ``widest``: the widest
    input a layer's linear takes (quantized activations, norms): at least the hidden size,
    the intermediate size and o's input, heads x head_dim (a model whose heads were wider
    than both wrote past the codes; found in review). ``items``: attention partials."""
    widest = max(widest, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    buffers = {
        "normed": torch.empty(rows, widest),
        "qkv": torch.empty(rows, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
        "attn": torch.empty(rows, cfg.num_heads * cfg.head_dim),
        "gate_up": torch.empty(rows, 2 * cfg.intermediate_size),
        "xq": torch.empty(rows, widest, dtype=torch.int8),
        "xd": torch.empty(rows, widest // 32 + 1),
        "xs": torch.empty(rows, widest // 32 + 1),
        "partial": torch.empty(items, cfg.num_heads // cfg.num_kv_heads * (cfg.head_dim + 2)),
    }
    for name, tensor in buffers.items():
        setattr(model, name, tensor.data_ptr())
    model.partial_items, model.max_rows = items, rows
    return buffers


class KernelLinear:
    """One PackedLinear on the CPU kernels, outside a model: ``y = x W^T`` for fp32 rows
    (the drafter heads' projections)."""

    def __init__(self, layer: PackedLinear):
        self.lib = kernels.load()
        self.rows, self.cols = layer.rows, layer.cols
        self._keep: list[torch.Tensor] = [layer]
        self.entry = linear_entry(layer, self._keep)
        self.scratch: dict[str, torch.Tensor] = {}
        self._grow(1)

    def _grow(self, rows: int) -> None:
        if self.scratch and self.scratch["xq"].shape[0] >= rows:
            return
        self.scratch = {"xq": torch.empty(rows, self.cols, dtype=torch.int8),
                        "xd": torch.empty(rows, self.cols // 32 + 1), "xs": torch.empty(rows, self.cols // 32 + 1)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.cols).float().contiguous()
        rows = flat.shape[0]
        self._grow(rows)
        out = torch.empty(rows, self.rows)
        s = self.scratch
        self.lib.sd_linear_forward(ctypes.byref(self.entry), flat.data_ptr(), rows, out.data_ptr(), s["xq"].data_ptr(),
                                   s["xd"].data_ptr(), s["xs"].data_ptr(), torch.get_num_threads())
        return out.view(*x.shape[:-1], self.rows)


class KernelHeadLayer:
    """An EAGLE head's decoder layer as one kernel call (``sd_eagle_layer``): norms, the
    fused projections (the head's ``KernelLinear`` weights, shared), RoPE, attention over
    the head's own cache and the MLP, in one OpenMP region. Through torch the same pass
    made about 60 small ops, which cost more than its weights do (docs/training.md).

    The cache is the proposer's: fp32 tensors [kv_heads, capacity, head_dim] (``bind``).
    Rows are causal at their slots (chains, committed entries), or see the slots a mask
    marks (a tree pass: the committed entries, the node's ancestors from earlier passes, its
    own), which a small attention loop of its own serves."""

    CHUNK = 256  # rows per call: the attention kernel takes at most 512 new rows

    def __init__(self, head, fast: dict[str, KernelLinear]):
        c = head.config
        check_attention_shape(c)
        self.lib = kernels.load()
        self.config = c
        self.linears = dict(fast)  # their weights, which the entries below point into
        hidden_norm, post_norm, self.embed_norm, self.final_norm = (
            m.weight.detach().float().contiguous() for m in (head.hidden_norm, head.post_norm, head.input_norm, head.norm))
        self._norms = (hidden_norm, post_norm)  # the layer struct points into them
        self.lm_head = fast["lm_head"]
        self.rope_of = head.rope  # the torch path's tables, so both paths rotate alike
        self.layer = kernels.Layer()
        self.layer.qkv, self.layer.o = fast["qkv"].entry, fast["o"].entry
        self.layer.gate_up, self.layer.down = fast["gate_up"].entry, fast["down"].entry
        self.layer.input_norm, self.layer.post_norm = hidden_norm.data_ptr(), post_norm.data_ptr()
        self.layers = (kernels.Layer * 1)(self.layer)
        self.model = kernels.Model()
        self.model.batch = 1
        describe_model(self.model, c, 1, "fp32", self.layers)
        self.widest = 2 * c.hidden_size  # the qkv projection reads [embedding; feature], 2 hidden wide
        self.buffers = attach_scratch(self.model, c, self.CHUNK, self.widest)
        self.rope = (torch.empty(0), torch.empty(0))
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The head's cache, fp32 [kv_heads, capacity, head_dim]; RoPE tables for every slot."""
        if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise SpecDecodeError("the head's kernel layer needs a contiguous fp32 cache")
        capacity = k_cache.shape[1]
        if partial_items(self.config, capacity) > self.model.partial_items:  # attention partials for the longer cache
            self.buffers = attach_scratch(self.model, self.config, self.CHUNK, self.widest,
                                          partial_items(self.config, capacity))
        if self.rope[0].shape[0] < capacity:
            self.rope = tuple(t.contiguous() for t in self.rope_of(torch.arange(capacity)))
            self.model.rope_cos, self.model.rope_sin = self.rope[0].data_ptr(), self.rope[1].data_ptr()
        self.cache = (k_cache, v_cache)
        self.model.capacity = capacity
        self.layer.k_cache, self.layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self.layers[0] = self.layer

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, start: int, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Fused features ``hidden`` [T, H] with token embeddings ``embeds`` [T, H] as cache
        entries start..start+T-1, at ``positions`` (default: the slots); causal, or each
        row seeing the slots its row of ``mask`` [T, start + T] marks (a tree pass: every
        committed slot, its ancestors', its own). Returns the outputs g [T, H]."""
        count = hidden.shape[0]
        if self.cache is None or start + count > self.model.capacity:
            raise SpecDecodeError("the head's cache is too small for these entries (bind a larger one)")
        embeds = embeds.float().contiguous()
        out = hidden.float().clone().contiguous()
        self.model.num_threads = torch.get_num_threads()
        at = (np.arange(start, start + count, dtype=np.int64) if positions is None else
              np.ascontiguousarray(positions.to(torch.int64).numpy()))
        if at.shape != (count,) or (count and not 0 <= int(at.min()) <= int(at.max()) < self.model.capacity):
            # the RoPE tables hold the bound cache's positions: one past them was read from
            # beyond the table (found in review, under AddressSanitizer)
            raise SpecDecodeError(f"the head's positions must be {count} values in 0..{self.model.capacity - 1}")
        if mask is not None:  # one call (a tree pass has a few rows): the slots after the fully visible prefix
            if count > self.CHUNK or mask.shape != (count, start + count):
                raise SpecDecodeError(f"a masked head pass takes at most {self.CHUNK} rows and a [T, start + T] mask")
            prefix = int(mask.all(0).int().cumprod(0).sum())
            prefix = min(prefix, start)
            visible = np.ascontiguousarray(mask[:, prefix:].numpy(), dtype=np.uint8)
            self.lib.sd_eagle_layer(ctypes.byref(self.model), embeds.data_ptr(), self.embed_norm.data_ptr(),
                                    out.data_ptr(), count, start, at.ctypes.data, prefix, visible.ctypes.data)
            return out
        for begin in range(0, count, self.CHUNK):
            rows = min(self.CHUNK, count - begin)
            self.lib.sd_eagle_layer(ctypes.byref(self.model), embeds[begin].data_ptr(), self.embed_norm.data_ptr(),
                                    out[begin].data_ptr(), rows, start + begin, at[begin:].ctypes.data, 0, None)
        return out

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] of outputs g [..., H] (final norm, LM head)."""
        flat = g.reshape(-1, self.config.hidden_size).float().contiguous()
        normed = torch.empty_like(flat)
        self.lib.sd_rms_norm(flat.data_ptr(), self.final_norm.data_ptr(), flat.shape[0], flat.shape[1],
                             self.config.rms_norm_eps, normed.data_ptr(), torch.get_num_threads())
        return self.lm_head(normed).view(*g.shape[:-1], -1)


class LazyLogits:
    """The logits of a scored block, each row computed when first asked for.

    The output head is a fifth of a one-token step here (30 MB of int8 weights for 49,152
    tokens). Greedy verification reads the rows in order and stops at the first rejection,
    so the rows after it are never computed. That saves where the head is bound by its
    multiplies (AVX2 Zen 1: about 0.9 ms a row); where it is bound by reading its weights
    (Zen 4) each row read streams them again, and the k policy asks for one full pass
    instead (``CostModel.step_cost``). A row is bit for bit the row a full head pass gives
    (the kernels compute each row alone)."""

    def __init__(self, stack: "KernelStack", hidden: torch.Tensor):
        self._stack, self._hidden = stack, hidden  # [B, T, H] final hidden states, before the norm
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        self.shape = (*hidden.shape[:2], stack.runtime.cfg.vocab_size)

    def row(self, b: int, t: int) -> torch.Tensor:
        """Logits [V] of entry b's t-th scored token."""
        if (b, t) not in self._rows:
            self._rows[b, t] = self._stack.head_logits(self._hidden[b, t : t + 1])[0]
        return self._rows[b, t]

    @property
    def computed(self) -> int:
        """How many rows have been computed."""
        return len(self._rows)


class KernelStack:
    def __init__(self, runtime):
        self.lib = kernels.load()
        self.runtime = runtime
        self.head_rows = 0  # rows through the output head via head_logits (lazy logits)
        cfg = runtime.cfg
        check_attention_shape(cfg)
        if not 1 <= runtime.prefill_chunk <= MAX_PREFILL_CHUNK:  # the kernels' per-call key lists hold that many
            raise SpecDecodeError(f"prefill_chunk must be in 1..{MAX_PREFILL_CHUNK} on the kernels backend, "
                                  f"got {runtime.prefill_chunk}")
        self._keep: list[torch.Tensor] = []  # every tensor a pointer below refers to
        self.layers = (kernels.Layer * runtime.num_layers)()
        for index, layer in enumerate(runtime.layers):
            entry = self.layers[index]
            entry.qkv, entry.o = self._linear(layer.qkv), self._linear(layer.o)
            entry.gate_up, entry.down = self._linear(layer.gate_up), self._linear(layer.down)
            entry.input_norm = self._fp32(layer.input_norm)
            entry.post_norm = self._fp32(layer.post_norm)
        weights = runtime.weights
        # the head first: a tied embedding is the same table, regrouped with it (sd_embed
        # reads either layout); an untied one is only looked up and keeps GGUF's
        self.head = self._linear(weights.lm_head)
        self.embed = linear_entry(weights.embed, self._keep, rows8=False)
        self.final_norm = self._fp32(weights.norm)
        self.rope_cos = weights.rope_cos.float().contiguous()
        self.rope_sin = weights.rope_sin.float().contiguous()
        self.max_rows = 0
        self.model = kernels.Model()
        self._init_model()

    # -- construction ---------------------------------------------------------------------
    def _fp32(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().float().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _linear(self, layer: PackedLinear) -> kernels.Linear:
        return linear_entry(layer, self._keep)

    def _init_model(self) -> None:
        runtime, model = self.runtime, self.model
        describe_model(model, runtime.cfg, runtime.num_layers, "fp32" if runtime.dtype == torch.float32 else "bf16",
                       self.layers)
        model.rope_cos, model.rope_sin = self.rope_cos.data_ptr(), self.rope_sin.data_ptr()

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Point every layer at its slice of the runtime's (re)allocated KV cache."""
        if k_cache.dtype not in (torch.float32, torch.bfloat16) or not k_cache.is_contiguous():
            raise SpecDecodeError("the CPU kernels need a contiguous fp32 or bf16 KV cache")
        self.model.capacity, self.model.batch = k_cache.shape[3], k_cache.shape[1]
        for index in range(self.runtime.num_layers):
            self.layers[index].k_cache = k_cache[index].data_ptr()
            self.layers[index].v_cache = v_cache[index].data_ptr()
        self._scratch(self.runtime.prefill_chunk * k_cache.shape[1], partial_items(self.runtime.cfg, k_cache.shape[3]))

    def _scratch(self, rows: int, items: int = PARTIAL_ITEMS) -> None:
        if rows <= self.max_rows and items <= self.model.partial_items:
            return
        cfg = self.runtime.cfg
        rows, items = max(rows, self.max_rows), max(items, self.model.partial_items)
        self.buffers = {"hidden": torch.empty(rows, cfg.hidden_size),
                        **attach_scratch(self.model, cfg, rows, cfg.hidden_size, items)}
        self.max_rows = rows

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in getattr(self, "buffers", {}).values())

    # -- forward --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, tree_mask: torch.Tensor | None,
                last_only: bool, return_hidden: bool, capture: tuple[int, ...] = (),
                starts: list[int] | None = None, cache_rows: list[int] | None = None, lazy_logits: bool = False,
                threads: int | None = None):
        """T new tokens for each of ``input_ids``' rows. Without ``starts`` the rows are the
        cache's rows, all at the runtime's length, which advances. With ``starts`` and
        ``cache_rows``, entry b is the sequence in cache row ``cache_rows[b]`` holding
        ``starts[b]`` tokens (its new tokens go to the slots after them; the runtime's
        length is left alone): the batched engine's ragged rows. ``lazy_logits`` (one
        chunk, no hidden states asked): a ``LazyLogits`` in place of the logits. ``threads``:
        this call's thread count (default torch's)."""
        runtime, cfg, lib, model = self.runtime, self.runtime.cfg, self.lib, self.model
        batch, num_new = input_ids.shape
        shared = starts is None
        if shared:  # NativeRuntime.forward refused a row count other than the cache's
            starts, cache_rows = [runtime.length] * batch, list(range(batch))
        model.num_threads = threads or torch.get_num_threads()
        # the small per-call arrays are numpy's: each torch op costs ~10-20 µs of dispatch
        # on these cores, and a decode step made ~25 of them (0.6 ms of a 6.5 ms step)
        ids = input_ids.to(torch.int64).contiguous()
        ids_np = ids.numpy()
        if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= cfg.vocab_size):  # the kernels read the row unchecked
            raise SpecDecodeError(f"token ids must lie in 0..{cfg.vocab_size - 1}, got {int(ids_np.min())}.."
                                  f"{int(ids_np.max())}")
        starts_np = np.asarray(starts, dtype=np.int32)
        rows_np = np.asarray(cache_rows, dtype=np.int32)
        if positions is None:
            positions_np = starts_np.astype(np.int64)[:, None] + np.arange(num_new, dtype=np.int64)
        else:
            positions_np = np.ascontiguousarray(np.broadcast_to(positions.to(torch.int64).cpu().numpy(), (batch, num_new)))
        if positions_np.max() >= cfg.max_positions or positions_np.min() < 0:
            raise SpecDecodeError(f"positions must lie in 0..{cfg.max_positions - 1}")
        mask = None if tree_mask is None else tree_mask.to(torch.uint8).contiguous()
        chunk = runtime.prefill_chunk
        hidden_buffer = self.buffers["hidden"]
        outputs, states, features = [], [], []
        bounds = sorted(set(capture) | {0, runtime.num_layers})
        for begin in range(0, num_new, chunk):
            stop = min(begin + chunk, num_new)
            rows = batch * (stop - begin)
            hidden = hidden_buffer[:rows]
            chunk_ids = ids if stop - begin == num_new else ids[:, begin:stop].contiguous()
            lib.sd_embed(ctypes.byref(self.embed), chunk_ids.data_ptr(), rows, hidden.data_ptr())
            chunk_positions = np.ascontiguousarray(positions_np[:, begin:stop])
            chunk_starts = starts_np + np.int32(begin)
            captured = {}
            for first, last in zip(bounds, bounds[1:]):  # stop at each captured layer's input
                if first in capture:
                    captured[first] = hidden.view(batch, stop - begin, -1).clone()
                lib.sd_forward_layers(ctypes.byref(model), first, last, hidden.data_ptr(), batch, stop - begin,
                                      chunk_starts.ctypes.data, rows_np.ctypes.data, chunk_positions.ctypes.data,
                                      _ptr(mask))
            if runtime.num_layers in capture:  # the last layer's output (a Medusa head reads it)
                captured[runtime.num_layers] = hidden.view(batch, stop - begin, -1).clone()
            if capture:
                features.append(torch.cat([captured[layer] for layer in capture], dim=-1))
            if shared:
                runtime.length += stop - begin
            if last_only and stop < num_new:
                continue
            selected = hidden.view(batch, stop - begin, -1)[:, -1:] if last_only else hidden.view(batch, stop - begin, -1)
            if lazy_logits and stop == num_new and begin == 0 and not return_hidden:
                outputs.append(LazyLogits(self, selected.clone()))
                continue
            logits, normed = self._head(selected.reshape(-1, cfg.hidden_size).contiguous())
            outputs.append(logits.view(batch, -1, cfg.vocab_size))
            states.append(normed.view(batch, -1, cfg.hidden_size))
        return _outputs(outputs, states if return_hidden else None, features if capture else None)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm and output head for final hidden states [rows, H] -> logits
        [rows, V]; every row the same bits as in any other call (the kernels' rows are
        independent)."""
        self.head_rows += hidden.shape[0]
        return self._head(hidden.float().contiguous())[0]

    def _head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final RMSNorm and output head for [rows, H] fp32 -> (logits [rows, V], normed)."""
        rows = hidden.shape[0]
        cfg, lib, buffers = self.runtime.cfg, self.lib, self.buffers
        normed = torch.empty_like(hidden)
        threads = self.model.num_threads
        lib.sd_rms_norm(hidden.data_ptr(), self.final_norm, rows, cfg.hidden_size, cfg.rms_norm_eps, normed.data_ptr(), threads)
        logits = torch.empty(rows, cfg.vocab_size)
        lib.sd_linear_forward(ctypes.byref(self.head), normed.data_ptr(), rows, logits.data_ptr(),
                              buffers["xq"].data_ptr(), buffers["xd"].data_ptr(), buffers["xs"].data_ptr(), threads)
        return logits, normed
