"""specdecode's CPU kernels: arithmetic against references, and batch invariance (--exact):
a row's logits are bitwise the same whatever else is scored with it."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from conftest import save_tiny_model
from specdecode import kernels
from specdecode.config import ConfigError, SamplingParams, SpecDecodeError
from specdecode.engine import SpeculativeEngine
from specdecode.models.cpu_runtime import linear_entry
from specdecode.models.llama import load_native
from specdecode.models.quant import PackedLinear, unpack_nibbles
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}")

# x8: regrouped by 8 rows, as models run; x16: those groups paired (what 512-bit VNNI runs;
# every build reads it)
FORMATS = ("fp32", "bf16", "q8_0", "q4_1", "q4_1x8", "q8_0x8", "q4_1x16")


def quantized(weight: torch.Tensor, fmt: str) -> PackedLinear:
    layer = PackedLinear.quantize(weight, fmt.removesuffix("x8").removesuffix("x16"))
    if fmt.endswith("x8"):
        layer.interleave_rows8()
    if fmt.endswith("x16"):
        layer.interleave_rows16()
    return layer


def grouped_rows(fmt: str, odd: int) -> int:
    """A row count the format takes: an odd count of 8-row groups for x8 (the 512-bit pair
    tiles leave the last group to the 256-bit ones), of pairs for x16, else ``odd``."""
    return 72 if fmt.endswith("x8") else 80 if fmt.endswith("x16") else odd


def kernel_linear(layer: PackedLinear, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    lib = kernels.load()
    keep: list[torch.Tensor] = []
    entry = linear_entry(layer, keep, rows8=False)  # the layout the layer already has
    rows = x.shape[0]
    x = x.float().contiguous()
    out = torch.empty(rows, layer.rows)
    xq = torch.empty(rows, layer.cols, dtype=torch.int8)
    xd, xs = torch.empty(rows, layer.cols // 32), torch.empty(rows, layer.cols // 32)
    lib.sd_linear_forward(ctypes.byref(entry), x.data_ptr(), rows, out.data_ptr(), xq.data_ptr(), xd.data_ptr(),
                          xs.data_ptr(), threads)
    return out


def quantized_reference(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The block formats' kernels in float64 from their definition: activations quantized
    per row and block of 32 (scale max|x|/127, round half to even), integer block sums,
    scaled by weight and activation scales, plus the Q4_1 minimum times the block's sum of
    the quantized activations (scale times the sum of the codes, as llama.cpp's Q8_1)."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes_x = (blocks * inverse).round()  # fp32 product, as the kernel computes it
    scale_x = (amax / 127.0).double()
    qweight, scales, mins = layer.blocks()
    if layer.fmt == "q8_0":
        codes_w = qweight.reshape(layer.rows, cols // 32, 32).double()
    else:
        codes_w = unpack_nibbles(qweight.reshape(layer.rows, cols // 32, 16)).double()
    sums = torch.einsum("rbi,nbi->rnb", codes_x.double(), codes_w)  # exact integers
    out = (sums * scales.double()[None] * scale_x[:, None, :, 0]).sum(-1)
    if layer.fmt == "q4_1":
        sums_x = (amax[..., 0] / 127.0) * codes_x.sum(-1)  # fp32, as the kernel stores it
        out = out + (mins.double()[None] * sums_x.double()[:, None, :]).sum(-1)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_its_reference(fmt):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(grouped_rows(fmt, 71), 192, generator=generator) * 0.05  # odd: the last row alone
    x = torch.randn(5, 192, generator=generator)
    layer = quantized(weight, fmt)
    out = kernel_linear(layer, x).double()
    if fmt in ("fp32", "bf16"):
        reference = x.double() @ layer.dequantize().double().T
        tolerance = 1e-5
    else:
        reference = quantized_reference(layer, x)
        tolerance = 1e-5
    assert (out - reference).abs().max() < tolerance * reference.abs().max()
    # and the format's total error against the dense weight, with quantized activations
    dense = x.double() @ weight.double().T
    bound = {"fp32": 1e-6, "bf16": 1e-2, "q8_0": 2e-2, "q4_1": 0.1, "q4_1x8": 0.1, "q8_0x8": 2e-2, "q4_1x16": 0.1}[fmt]
    assert (out - dense).abs().max() < bound * dense.abs().max()


@pytest.mark.parametrize("fmt", ["q4_1", "q4_1x8", "q4_1x16"])
def test_q4_1_products_carry_only_the_activations_rounding(fmt):
    """Against the product with the format's own weights (what the model is), a Q4_1 layer
    errs only by the 8-bit activations, as much as a Q8_0 layer does. Found in review: the
    minimum multiplied the exact sum of x while the scaled part used the quantized x, so
    the error per block was sum((w - min) * e), about twice sum(w * e) (relative error
    0.0125 against 0.0053 on a Gaussian layer; the default model's logits 0.48 off against
    0.20)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(512, 576, generator=generator) * 0.05
    x = torch.randn(64, 576, generator=generator)

    def relative_error(layer):
        exact = x.double() @ layer.dequantize().double().T
        return float((kernel_linear(layer, x).double() - exact).norm() / exact.norm())

    q4, q8 = relative_error(quantized(weight, fmt)), relative_error(quantized(weight, "q8_0"))
    assert q4 < 1.25 * q8, (q4, q8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_rows_are_independent_of_the_batch(fmt):
    """Each row alone equals the same row inside batches of 2..64 rows, bit for bit, with
    1 or 2 threads."""
    generator = torch.Generator().manual_seed(1)
    layer = quantized(torch.randn(grouped_rows(fmt, 131) + 64, 320, generator=generator) * 0.05, fmt)  # odd rows
    rows = torch.randn(64, 320, generator=generator)
    alone = torch.cat([kernel_linear(layer, rows[i : i + 1]) for i in range(64)])
    for batch in (2, 3, 5, 6, 7, 14, 16, 33, 35, 38, 64):  # every tile shape, with and without the table
        for threads in (1, 2):
            together = kernel_linear(layer, rows[:batch], threads)
            assert torch.equal(together, alone[:batch]), (batch, threads)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_rows8_regrouping_keeps_the_blocks(fmt):
    """interleave_rows8 moves the blocks' bytes, scales and minima without changing a value,
    the kernels read the moved layout (equal to GGUF's up to the order of the float sums),
    and every view still sees GGUF's order."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(48, 256, generator=generator) * 0.05
    plain, moved = PackedLinear.quantize(weight, fmt), PackedLinear.quantize(weight, fmt)
    moved.interleave_rows8()
    moved.interleave_rows8()  # a second call leaves it as it is
    assert not torch.equal(moved.qweight, plain.qweight)
    for a, b in zip(moved.blocks(), plain.blocks()):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(moved.dequantize(), plain.dequantize())
    picked = torch.tensor([3, 17, 47, 3])
    assert torch.equal(moved.rows_selected(picked).dequantize(), plain.dequantize()[picked])
    x = torch.randn(3, 256, generator=generator)
    assert torch.allclose(kernel_linear(moved, x), kernel_linear(plain, x), rtol=1e-5, atol=1e-5)
    assert not torch.equal(kernel_linear(moved, x), kernel_linear(plain, x[:, torch.randperm(256, generator=generator)]))
    ids = torch.tensor([0, 5, 13, 47], dtype=torch.int64)  # embedding rows read from either layout
    for layer in (plain, moved):
        entry = linear_entry(layer, [], rows8=False)
        rows = torch.empty(len(ids), layer.cols)
        kernels.load().sd_embed(ctypes.byref(entry), ids.data_ptr(), len(ids), rows.data_ptr())
        assert torch.equal(rows, plain.dequantize()[ids])
    with pytest.raises(ConfigError, match="multiple of 8 rows"):
        PackedLinear.quantize(torch.randn(12, 64), fmt).interleave_rows8()


def test_rows16_pairs_compute_what_rows8_computes(monkeypatch):
    """interleave_rows16 pairs the 8-row groups without changing a value; every build (the
    512-bit VNNI pair tiles here, the 8-row kernels reading one group of a pair on AVX2,
    256-bit VNNI and portable builds) computes every row of it bit for bit as from the 8-row layout,
    for 1 to 19, 33 and 64 rows and 1 or 2 threads; lookups and views read either."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(96, 320, generator=generator) * 0.05
    rows8, rows16 = quantized(weight, "q4_1x8"), quantized(weight, "q4_1x16")
    rows16.interleave_rows16()  # a second call leaves it as it is
    rows16.interleave_rows8()  # and so does asking for the 8-row layout
    assert rows16.layout == "rows16" and not torch.equal(rows16.qweight, rows8.qweight)
    assert not torch.equal(rows16.scales, rows8.scales)
    for a, b in zip(rows16.blocks(), PackedLinear.quantize(weight, "q4_1").blocks()):
        assert torch.equal(a, b)
    picked = torch.tensor([3, 17, 95, 8, 3])
    assert torch.equal(rows16.rows_selected(picked).dequantize(), rows8.dequantize()[picked])
    x = torch.randn(64, 320, generator=generator)
    x[0] = x[0].sign() * 4.0  # every activation code at +-127
    rows16.qweight[:4] = 255  # codes at their extremes in both groups of the first pair
    rows8 = PackedLinear.from_blocks("q4_1", *rows16.blocks())
    rows8.interleave_rows8()
    builds = [kernels.load()] + [kernels.load_build(march) for march in ("haswell", "x86-64")
                                  if __import__("platform").machine() in ("x86_64", "AMD64")]
    if kernels.load().sd_pairs16():  # this CPU runs a build with 256-bit VNNI and no 512-bit tiles
        vnni256 = kernels.load_build("native -mno-avx512bw")
        assert vnni256.sd_simd() == 3 and not vnni256.sd_pairs16()
        builds.append(vnni256)
    for library in builds:
        monkeypatch.setattr(kernels, "load", lambda library=library: library)
        for rows in (*range(1, 20), 33, 64):
            for threads in (1, 2):
                assert torch.equal(kernel_linear(rows16, x[:rows], threads), kernel_linear(rows8, x[:rows], threads)), \
                    (library.sd_simd(), rows, threads)
        ids = torch.tensor([0, 7, 8, 15, 16, 95], dtype=torch.int64)
        entry = linear_entry(rows16, [], rows8=False)
        looked_up = torch.empty(len(ids), rows16.cols)
        library.sd_embed(ctypes.byref(entry), ids.data_ptr(), len(ids), looked_up.data_ptr())
        assert torch.equal(looked_up, rows8.dequantize()[ids])
    for fmt, count in (("q4_1", 24), ("q8_0", 32)):
        with pytest.raises(ConfigError, match="multiple of 16 rows"):
            PackedLinear.quantize(torch.randn(count, 64), fmt).interleave_rows16()


def test_a_layer_in_8_row_groups_is_not_paired_later():
    """An entry made for a layer in 8-row groups keeps reading it: a later entry under a
    library with pair tiles leaves the layer as it is (found in review: it paired the bytes
    in place, and the first entry, still Q4_1X8, read them wrongly)."""
    generator = torch.Generator().manual_seed(13)
    layer = quantized(torch.randn(32, 128, generator=generator) * 0.05, "q4_1x8")
    x = torch.randn(3, 128, generator=generator)
    before = kernel_linear(layer, x)
    linear_entry(layer, [])  # rows8=True: would regroup a layer still in GGUF's rows
    assert layer.layout == "rows8" and torch.equal(kernel_linear(layer, x), before)
    paired = PackedLinear.from_blocks("q4_1", *layer.blocks())
    linear_entry(paired, [])
    assert paired.layout == ("rows16" if kernels.load().sd_pairs16() else "rows8")
    assert torch.equal(kernel_linear(paired, x), before)


def test_models_pair_the_int4_layers_where_the_kernels_have_pair_tiles(tmp_path, monkeypatch):
    """The q4_1 layers (16k rows) are paired where the library has the 512-bit tiles
    (sd_pairs16), kept in 8-row groups elsewhere; the q8_0 head stays in 8-row groups. Both
    layouts give the same logits."""
    path = tmp_path / "m"
    save_tiny_model(path, "llama", seed=4, num_layers=2)
    native = kernels.load()
    paired = load_native(path, torch.bfloat16, "q4_1", "kernels")
    expected = "rows16" if native.sd_pairs16() else "rows8"
    layer = paired.layers[0]
    for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert linear.layout == (expected if linear.rows % 16 == 0 else "rows8"), (linear.rows, linear.layout)
    assert paired.weights.lm_head.layout != "rows16"  # q8_0: never paired

    class WithoutPairs:  # the same library, saying it has no pair tiles
        def __getattr__(self, name):
            return (lambda: 0) if name == "sd_pairs16" else getattr(native, name)

    monkeypatch.setattr(kernels, "load", lambda: WithoutPairs())
    grouped = load_native(path, torch.bfloat16, "q4_1", "kernels")
    monkeypatch.undo()
    assert all(linear.layout in ("rows8", "rows") for linear in (grouped.layers[0].qkv, grouped.layers[0].gate_up))
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    for runtime in (paired, grouped):
        runtime.reset(16)
    assert torch.equal(paired(ids), grouped(ids))


def kernel_model(tmp_path, fmt="q4_1", dtype=torch.bfloat16, seed=3, prefill_chunk=256):
    path = tmp_path / f"m{seed}"
    if not path.exists():
        save_tiny_model(path, "llama", seed=seed, num_layers=2)
    return load_native(path, dtype, fmt, "kernels", prefill_chunk=prefill_chunk)


def test_lazy_logits_rows_are_the_full_pass_rows(tmp_path):
    """Logits computed row by row on demand (greedy verification's) are the full head
    pass's, bit for bit, for a chain and a tree; only the rows asked for are computed."""
    runtime = kernel_model(tmp_path, "q4_1", torch.bfloat16)
    prompt, block = torch.tensor([[5, 9, 11, 5, 9, 11, 7]]), torch.tensor([[4, 8, 15, 16, 23]])
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    for kwargs in ({}, {"positions": torch.tensor([7, 8, 8, 9, 9]), "tree_mask": mask}):
        results = []
        for lazy in (False, True):
            runtime.reset(32)
            runtime(prompt)
            results.append(runtime(block, lazy_logits=lazy, **kwargs))
        full, lazy = results
        assert isinstance(full, torch.Tensor) and lazy.shape == full.shape and lazy.computed == 0
        assert torch.equal(lazy.row(0, 3), full[0, 3]) and lazy.computed == 1
        assert torch.equal(torch.stack([lazy.row(0, t) for t in range(5)])[None], full) and lazy.computed == 5


@pytest.mark.parametrize("fmt, dtype", [("q4_1", torch.bfloat16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_scored_row_is_bitwise_independent_of_what_else_is_scored(tmp_path, fmt, dtype):
    """The logits of a token scored alone equal its logits scored first among T = 2..64
    tokens, and the logits of T tokens scored one by one equal those scored together, at
    contexts below and across the attention's 256-key chunks."""
    runtime = kernel_model(tmp_path, fmt, dtype)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 97, (1, 180), generator=generator)
    runtime.reset(256)
    for context in (3, 100):
        runtime.rollback(0)
        runtime(tokens[:, :context])
        alone = runtime(tokens[:, context : context + 1])
        runtime.rollback(context)
        for count in (2, 5, 8, 17, 64):
            together = runtime(tokens[:, context : context + count])
            runtime.rollback(context)
            assert torch.equal(together[:, :1], alone), (context, count)
        together = runtime(tokens[:, context : context + 16])
        runtime.rollback(context)
        one_by_one = torch.cat([runtime(tokens[:, context + i : context + i + 1]) for i in range(16)], dim=1)
        runtime.rollback(context)
        assert torch.equal(one_by_one, together), context


def long_context_model(path, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2):
    """One layer, 1,024 positions; head_dim = hidden_size / num_heads (256 / 4: the real
    model's 64; 384 / 6 with 2 KV heads: also its 3 query heads per KV head)."""
    import json

    save_tiny_model(path, "llama", seed=5, num_layers=1, hidden_size=hidden_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("hidden_size, num_heads", [(64, 4), (256, 4), (384, 6)])
def test_long_context_rows_are_invariant_across_key_chunks(tmp_path, hidden_size, num_heads):
    """At head_dim 16 and at 64 (the real model's, whose value sums stay in registers), with
    2 and 3 query heads per KV head (3: SmolLM2's; one row's three heads take the direct
    path's value passes of 16 elements on AVX2, rows together the tiles)."""
    path = long_context_model(tmp_path / "long", hidden_size, num_heads)
    runtime = load_native(path, torch.bfloat16, "q8_0", "kernels")
    tokens = torch.randint(0, 97, (1, 700), generator=torch.Generator().manual_seed(6))
    runtime.reset(720)
    runtime(tokens[:, :600])  # 600 keys: three chunks of 256
    alone = runtime(tokens[:, 600:601])
    runtime.rollback(600)
    together = runtime(tokens[:, 600:664])
    assert torch.equal(together[:, :1], alone)
    # every row, not only the first: rows scored together share the tiles of the chunks
    # they all see whole (in groups of 48 query heads: 24 rows here, 16 with 3 heads per KV
    # head), one by one they do not
    runtime.rollback(600)
    one_by_one = torch.cat([runtime(tokens[:, 600 + i : 601 + i]) for i in range(64)], dim=1)
    assert torch.equal(one_by_one, together)
    for count in (2, 3):  # 4-9 query heads per chunk: the direct path with 32 registers, else the tiles
        runtime.rollback(600)
        assert torch.equal(runtime(tokens[:, 600 : 600 + count]), one_by_one[:, :count]), count


def test_tree_node_equals_the_same_token_in_a_chain(tmp_path):
    """A node's logits in a tree (with a sibling branch scored beside it) equal the same
    path scored as a plain chain: attention reduces over a row's visible keys in order."""
    runtime = kernel_model(tmp_path)
    prefix = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([[10, 11, 12, 13]])  # r, a1, a2, b1: branches (r, a1, a2) and (r, b1)
    positions = torch.tensor([9, 10, 11, 10])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    runtime.reset(32)
    runtime(prefix)
    tree = runtime(tokens, positions=positions, tree_mask=mask)
    runtime.rollback(9)
    chain_b = runtime(tokens[:, [0, 3]])
    runtime.rollback(9)
    chain_a = runtime(tokens[:, :3])
    assert torch.equal(tree[:, 3], chain_b[:, 1]) and torch.equal(tree[:, :3], chain_a)


def test_chunked_prefill_equals_one_pass(tmp_path):
    tokens = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(8))
    results = []
    for chunk in (7, 64, 256):
        runtime = kernel_model(tmp_path, prefill_chunk=chunk)
        runtime.reset(160)
        results.append(runtime(tokens, last_only=True))
        assert runtime.length == 150
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


def test_long_context_attention_agrees_with_the_torch_backend(tmp_path):
    """bf16 cache, head_dim 64, 600 keys (three chunks) and a tree: the kernels' attention
    against torch's scaled_dot_product_attention on the same bf16 weights and cache."""
    path = long_context_model(tmp_path / "long", 256)
    tokens = torch.randint(0, 97, (1, 604), generator=torch.Generator().manual_seed(7))
    positions = torch.tensor([600, 601, 601, 602])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    outputs = {}
    for backend in ("kernels", "torch"):
        runtime = load_native(path, torch.bfloat16, "bf16", backend)
        runtime.reset(620)
        runtime(tokens[:, :600])
        outputs[backend] = (runtime(tokens[:, 600:604], positions=positions, tree_mask=mask).float(),
                            runtime.rollback(600) or runtime(tokens[:, 600:601]).float())
    for kernels_logits, torch_logits in zip(outputs["kernels"], outputs["torch"]):
        scale = torch_logits.abs().max().item()
        # bf16 rounding gives about 3% of the largest logit here; a wrong key, value or head
        # in the kernels gives more than 100%
        assert (kernels_logits - torch_logits).abs().max().item() < 0.1 * scale, scale


def _llama(path, **shape):
    """A one-layer random Llama of the given shape (head_dim may differ from hidden / heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, num_hidden_layers=1, initializer_range=0.05, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    LlamaForCausalLM(config).float().save_pretrained(path)
    return path


@pytest.mark.parametrize("case", ["wide heads", "many kv heads"])
def test_shapes_whose_scratch_a_fixed_size_overflowed(tmp_path, case):
    """Found in review (AddressSanitizer): o's input, heads x head_dim, was quantized into
    codes sized for max(hidden, intermediate) (4 x 64 against 64: T = 65 corrupted the heap),
    and a row's attention partials, kv_heads x key chunks, into a fixed 4,096 items (512 KV
    heads beyond 2,048 tokens; 32 KV heads beyond 32,768). Each now agrees with torch."""
    if case == "wide heads":
        path = _llama(tmp_path / "m", hidden_size=64, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
        weights, steps = "q8_0", (65,)
    else:
        path = _llama(tmp_path / "m", hidden_size=512, intermediate_size=64, num_attention_heads=512,
                      num_key_value_heads=512, head_dim=8, max_position_embeddings=4096)
        weights, steps = "fp32", (2048, 60)  # 2,108 keys: 9 chunks of 512 KV heads, 4,608 items
    ids = torch.randint(0, 97, (1, sum(steps)), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for backend in ("kernels", "torch"):
        runtime = load_native(path, torch.float32, weights, backend)
        runtime.reset(sum(steps) + 8)
        outputs[backend] = [runtime(part) for part in ids.split(list(steps), dim=1)][-1]
        if backend == "kernels":
            model, buffers = runtime.kernels.model, runtime.kernels.buffers
            assert buffers["xq"].shape[1] >= 4 * 64 and model.partial_items >= 512 * 9 * (case != "wide heads")
    scale = outputs["torch"].abs().max().item()
    tolerance = 0.05 * scale if weights == "q8_0" else 1e-4  # Q8_0 activations against fp32
    assert (outputs["kernels"] - outputs["torch"]).abs().max().item() < tolerance


def test_an_eagle_head_the_kernels_cannot_pack_drafts_through_torch(tmp_path):
    """Found in review: a head whose o input (1 head x 80) is not a multiple of the kernels'
    32-wide blocks raised ConfigError while its proposer was built, where Medusa's heads
    fall back to torch."""
    from specdecode.proposers.eagle import EagleProposer
    from specdecode.proposers.eagle_head import EagleConfig, EagleHead

    path = _llama(tmp_path / "m", hidden_size=64, intermediate_size=64, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=80, max_position_embeddings=256)
    runtime = load_native(path, torch.float32, "fp32", "kernels")
    head = EagleHead(EagleConfig.for_target(runtime.cfg, 60))
    proposer = EagleProposer(head, lambda ids: runtime.weights.embed_rows(ids).float())
    assert proposer.layer is None and not proposer.kernels
    plain = SpeculativeEngine(runtime).generate([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    spec = SpeculativeEngine(runtime, proposer=proposer, k=2).generate([5, 6, 7], SamplingParams(max_new_tokens=6,
                                                                                                 ignore_eos=True))
    assert spec.token_ids == plain.token_ids


def test_a_tree_mask_of_another_shape_is_refused(tmp_path):
    """Found in review: the kernels read mask[t T + j] for every t, j < T whatever the mask's
    shape (a [2, 2] mask for 4 tokens read memory past it and gave different logits run to
    run), and a row that saw no key was NaN. Both backends refuse them by name."""
    path = save_tiny_model(tmp_path / "m", "llama", seed=2, num_layers=1)
    for backend in ("kernels", "torch"):
        runtime = load_native(path, torch.float32, "fp32", backend)
        runtime.reset(16)
        runtime(torch.tensor([[5, 6, 7, 8]]))
        for mask in (torch.ones(2, 2, dtype=torch.bool), torch.ones(8, 4, dtype=torch.bool),
                     torch.zeros(4, 4, dtype=torch.bool)):
            with pytest.raises(SpecDecodeError, match=r"must be \[4, 4\] with each token seeing itself"):
                runtime(torch.tensor([[9, 10, 11, 12]]), tree_mask=mask)


def test_a_pass_of_no_tokens_is_refused_by_name(tmp_path):
    """Found in review: zero new tokens failed deep inside, differently on each backend (a
    NumPy reduction of nothing, torch.cat of an empty list)."""
    path = save_tiny_model(tmp_path / "m", "llama", seed=2, num_layers=1)
    for backend in ("kernels", "torch"):
        runtime = load_native(path, torch.float32, "fp32", backend)
        runtime.reset(16, batch=2)
        for call in (lambda: runtime(torch.zeros(1, 0, dtype=torch.long)),
                     lambda: runtime.forward_rows(torch.zeros(1, 0, dtype=torch.long), [0], [0]),
                     lambda: runtime.forward_rows(torch.zeros(0, 2, dtype=torch.long), [], [])):
            with pytest.raises(SpecDecodeError, match="at least one row and one new token"):
                call()


def test_kernels_agree_with_the_torch_backend(tmp_path):
    path = save_tiny_model(tmp_path / "ref", "llama", seed=9, num_layers=2)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for backend in ("kernels", "torch"):
        runtime = load_native(path, torch.float32, "fp32", backend)
        runtime.reset(32)
        outputs[backend] = runtime(ids)
    torch.testing.assert_close(outputs["kernels"], outputs["torch"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["q4_1", "bf16"])
def test_greedy_speculation_is_bit_for_bit_plain_decoding_in_bf16(tmp_path, fmt):
    """With the kernels (exact), greedy speculative output equals plain decoding in bf16
    and 4-bit weights too, for every drafter and k, on prompts with and without repeats."""
    root = tmp_path
    target = kernel_model(root, fmt, torch.bfloat16, seed=21)
    draft = kernel_model(root, fmt, torch.bfloat16, seed=22)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeEngine(target)
    rng = random.Random(0)
    accepted = 0
    for proposer in (NgramProposer(), DraftModelProposer(draft), DraftModelProposer(target.layer_skip_view(2))):
        for k in (1, 3, 6):
            engine = SpeculativeEngine(target, proposer=proposer, k=k)
            for _ in range(3):
                base = [rng.randrange(3, 97) for _ in range(rng.randint(2, 6))]
                prompt = (base * rng.randint(1, 4))[:30]
                result = engine.generate(prompt, params)
                assert result.token_ids == plain.generate(prompt, params).token_ids, (proposer.name, k, prompt)
                accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_vnni_build_equals_the_avx2_build(monkeypatch):
    """Where the CPU has AVX-512 VNNI, the int8 and int4 products use vpdpbusd; their integer
    sums are exact, so every row equals, bit for bit, what the AVX2-only build computes."""
    if kernels.load().sd_simd() != 3:
        pytest.skip("this CPU has no AVX-512 VNNI")
    native, avx2 = kernels.load(), kernels.load_build("haswell")
    assert avx2.sd_simd() == 2
    generator = torch.Generator().manual_seed(17)
    for fmt in ("q4_1x8", "q8_0x8", "q4_1x16"):
        layer = quantized(torch.randn(grouped_rows(fmt, 72), 320, generator=generator) * 0.05, fmt)
        layer.qweight[:8] = -128 if fmt == "q8_0x8" else 255  # the first 8 rows' codes at their extremes
        x = torch.randn(38, 320, generator=generator)
        x[0] = x[0].sign() * 4.0  # every activation code at +-127
        outputs = []
        for library in (native, avx2):
            monkeypatch.setattr(kernels, "load", lambda library=library: library)
            outputs.append([kernel_linear(layer, x[:rows]) for rows in (1, 2, 3, 4, 5, 38)])
        for vnni, plain in zip(*outputs):
            assert torch.equal(vnni, plain), fmt


def test_backend_choice_without_kernels(monkeypatch, tiny_llama_dir):
    """No compiler: the torch backend takes over for dense weights; int4, --exact and
    --backend kernels say why they cannot run."""
    from specdecode import factory

    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no C++ compiler found")
    model = factory.load_model(tiny_llama_dir, torch.float32)
    assert model.runtime.backend == "torch" and not model.runtime.exact
    for kwargs in ({"weights": "int4"}, {"exact": True}, {"backend": "kernels"}):
        with pytest.raises(ConfigError, match="no C.. compiler found"):
            factory.load_model(tiny_llama_dir, torch.float32, **kwargs)
    with pytest.raises(ConfigError, match="not batch invariant"):
        factory.load_model(tiny_llama_dir, torch.float32, backend="torch", exact=True)


@pytest.mark.parametrize("march", [None, "x86-64"])
def test_a_nan_activation_gives_nan_in_every_format(monkeypatch, march):
    """Found in review: the block maximum of the activation quantization drops a NaN, and
    Q8_0 never reads the block sum that carries it, so a NaN in a block came out of a Q8_0
    layer as finite numbers (always on the portable build, for a NaN in a block's first 24
    entries on AVX2), where the torch backend gives NaN."""
    if march is not None:
        if __import__("platform").machine() not in ("x86_64", "AMD64"):
            pytest.skip("the portable build is checked on x86-64")
        library = kernels.load_build(march)
        monkeypatch.setattr(kernels, "load", lambda: library)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 64, generator=generator)
    for fmt in FORMATS:
        layer = quantized(weight, fmt)
        for position in (0, 5, 31, 40):
            x = torch.randn(2, 64, generator=generator)
            x[0, position] = float("nan")
            out = kernel_linear(layer, x)
            assert out[0].isnan().all() and not out[1].isnan().any(), (fmt, position)


def test_portable_build_without_avx2(monkeypatch, tmp_path):
    """The scalar code a CPU without AVX2/FMA/F16C gets: the same formats against their
    references, batch invariance, and greedy speculation equal to plain decoding."""
    if not __import__("platform").machine() in ("x86_64", "AMD64"):
        pytest.skip("the portable build is checked on x86-64")
    scalar = kernels.load_build("x86-64")
    assert scalar.sd_simd() == 0
    monkeypatch.setattr(kernels, "load", lambda: scalar)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 128, generator=generator)
    for fmt in FORMATS:
        layer = quantized(torch.randn(48 if fmt.endswith("x16") else 40, 128, generator=generator) * 0.05, fmt)
        out = kernel_linear(layer, x).double()
        reference = x.double() @ layer.dequantize().double().T if fmt in ("fp32", "bf16") else quantized_reference(layer, x)
        assert (out - reference).abs().max() < 1e-5 * reference.abs().max(), fmt
        assert torch.equal(kernel_linear(layer, x[:1]), kernel_linear(layer, x)[:1])
    runtime = kernel_model(tmp_path, "q4_1", torch.bfloat16, seed=31)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9]
    plain = SpeculativeEngine(runtime).generate(prompt, params).token_ids
    for proposer in (NgramProposer(), DraftModelProposer(runtime.layer_skip_view(1))):
        assert SpeculativeEngine(runtime, proposer=proposer, k=3).generate(prompt, params).token_ids == plain


def test_a_damaged_kernel_library_is_built_again(tmp_path, monkeypatch):
    """Found in review: a library cut short or overwritten from outside raised OSError from
    ctypes (not the KernelsUnavailable the torch fallback catches), and was reused for ever.
    It is built again once; if that does not load either, the kernels are unavailable."""
    import shutil

    good = kernels.build()
    version = ctypes.CDLL(str(good)).sd_version()
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(b"not a library")
    rebuilt = tmp_path / "rebuilt.so"
    shutil.copy(good, rebuilt)
    calls = []

    def fake_build(force: bool = False, march: str | None = None):
        calls.append(force)
        return rebuilt if force else damaged

    monkeypatch.setattr(kernels, "build", fake_build)
    kernels.load_build.cache_clear()
    try:
        assert kernels.load_build("test-march").sd_version() == version and calls == [False, True]
        rebuilt = tmp_path / "still-damaged.so"  # a new file: the loaded one stays mapped
        rebuilt.write_bytes(b"still not a library")
        kernels.load_build.cache_clear()
        with pytest.raises(kernels.KernelsUnavailable, match="do not load"):
            kernels.load_build("test-march")
    finally:
        kernels.load_build.cache_clear()


def test_a_build_may_take_extensions_away_and_nothing_else():
    """SPECDECODE_KERNELS_MARCH is an instruction set's name, then options that take an
    extension away: those reach the compiler after -march; any other option, or no name, is
    refused before a compiler runs, naming what is wrong."""
    assert kernels._march_options("native") == ["-march=native"]
    assert kernels._march_options(" native  -mno-avx512bw ") == ["-march=native", "-mno-avx512bw"]
    with pytest.raises(kernels.KernelsUnavailable, match="-O0 -fno-omit"):
        kernels.build(march="native -mno-avx512bw -O0 -fno-omit")
    with pytest.raises(kernels.KernelsUnavailable, match="name is empty"):
        kernels.build(march="  ")


def test_a_cache_that_cannot_be_written_means_no_kernels_not_a_crash(tmp_path, monkeypatch):
    """Found in review: a read-only cache, or a file where its folder should be, raised an
    OSError out of the backend choice instead of falling back to the torch backend."""
    from specdecode import kernels

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(blocker / "cache"))
    with pytest.raises(kernels.KernelsUnavailable, match="cannot be built in specdecode's cache"):
        kernels.build(force=True)


def test_a_compiler_that_fails_without_a_word_is_named_with_its_status(tmp_path, monkeypatch):
    """Found in review: a compiler that failed and printed nothing gave "building the CPU
    kernels failed:" and an empty reason."""
    from specdecode import kernels

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(kernels.KernelsUnavailable, match="failed:\nfalse exited with status 1 and printed nothing"):
        kernels.build(force=True)


def test_the_kernels_refuse_what_they_would_read_or_write_out_of_bounds(tmp_path):
    """Found in review, through the Python API (the command line checks both earlier): a
    prefill chunk over 512 rows overflowed the attention's key lists (a segfault with 600),
    and a token id outside the vocabulary read past the embedding (garbage logits, or a
    segfault)."""
    with pytest.raises(SpecDecodeError, match="prefill_chunk must be in 1..512 on the kernels backend, got 600"):
        kernel_model(tmp_path, prefill_chunk=600)
    runtime = kernel_model(tmp_path)
    runtime.reset(8)
    with pytest.raises(SpecDecodeError, match=r"token ids must lie in 0..96, got 5..200"):
        runtime(torch.tensor([[5, 200]]))
    runtime.reset(8)
    with pytest.raises(SpecDecodeError, match=r"token ids must lie in 0..96, got -1..5"):
        runtime(torch.tensor([[-1, 5]]))
    runtime.reset(8)
    assert runtime(torch.tensor([[5, 96]])).shape[-1] == 97


def test_a_failed_build_is_not_tried_again_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """Found in review: a build that failed ran the compiler again (seconds) on every
    load() of the process, and an interrupted build left its half-written library behind."""
    calls = []

    def failing(march):
        calls.append(march)
        raise kernels.KernelsUnavailable("building the CPU kernels failed: test")

    monkeypatch.setattr(kernels, "load_build", failing)
    monkeypatch.setattr(kernels, "_FAILED", {})
    for _ in range(3):
        with pytest.raises(kernels.KernelsUnavailable, match="failed: test"):
            kernels.load()
    assert len(calls) == 1
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels.subprocess, "run", interrupted)
    monkeypatch.setattr(kernels, "_build_key", lambda compiler, march: "key")
    with pytest.raises(KeyboardInterrupt):
        kernels.build(force=True)
    assert list((tmp_path / "kernels" / "key").iterdir()) == []


def test_cache_files_keep_the_mode_a_plain_write_gives_them(tmp_path, monkeypatch):
    """Found in review: the built library and every cache file came out of tempfile as
    0600/0700, so a second user of a shared cache could not load the kernels (EACCES) and
    lost int8/int4/--exact; they now have the mode the umask gives a plain write."""
    import os
    import subprocess

    from specdecode.models.loading import write_atomic

    mask = os.umask(0o022)
    try:
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
        monkeypatch.setattr(kernels, "_build_key", lambda compiler, march: "key")

        def compiled(command, **kwargs):  # the compiler writes into the staging file as it is
            with open(command[-1], "wb") as library:
                library.write(b"\x7fELF")
            return subprocess.CompletedProcess(command, 0, "", "")

        monkeypatch.setattr(kernels.subprocess, "run", compiled)
        library = kernels.build(force=True)
        assert library.stat().st_mode & 0o777 == 0o755
        write_atomic(tmp_path / "record.json", "{}")
        assert (tmp_path / "record.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)


def test_saved_stores_and_heads_are_readable_by_the_other_users_of_a_cache(tmp_path):
    """Found in review: safetensors writes its files 0600 whatever the umask, so a token
    store, a head or a converted model in a shared cache was unreadable to other users."""
    import os

    from specdecode.proposers.eagle_head import EagleConfig, EagleHead
    from specdecode.proposers.suffix import TokenStore

    mask = os.umask(0o022)
    try:
        TokenStore([[1, 2, 3, 1, 2]], vocab_size=97).save(tmp_path / "store", {})
        EagleHead(EagleConfig(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8,
                              target_vocab_size=97, draft_vocab_size=97, capture_layers=(0,), rms_norm_eps=1e-6,
                              rope_theta=10000.0)).save(tmp_path / "head")
    finally:
        os.umask(mask)
    for path in (tmp_path / "store" / "tokens.safetensors", tmp_path / "head" / "model.safetensors"):
        assert path.stat().st_mode & 0o777 == 0o644, path
