"""Model sources: HF directories, GGUF conversion and its cache, and clear errors."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from specdecode.models import loading
from specdecode.models.loading import ModelNotFoundError, resolve_model


def test_hf_directory_resolves(tiny_llama_dir):
    source = resolve_model(str(tiny_llama_dir))
    assert source.native and source.config["vocab_size"] == 97


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_an_empty_model_name_is_refused_as_empty(tmp_path, monkeypatch):
    """Found in review: "" was the working directory ("the directory exists but has no config.json")."""
    monkeypatch.chdir(tmp_path)
    for name in ("", "  "):
        with pytest.raises(ModelNotFoundError, match="model name is empty"):
            resolve_model(name)


def test_non_gguf_file_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unreadable_gguf_gets_a_clear_error(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotFoundError, match="transformers cannot read this GGUF"):
        resolve_model(str(tmp_path / "broken.gguf"))


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "a"))
    assert loading.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_dir() == tmp_path / "xdg" / "specdecode"


def test_conversion_is_checked_and_rebuilt(tmp_path):
    """A manifest with sha256s validates the cached conversion; corruption invalidates it."""
    target = tmp_path / "conv"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    manifest = {"version": loading.CONVERSION_VERSION, "source_sha256": "abc",
                "files": {"model.safetensors": loading.sha256_file(target / "model.safetensors")}}
    (target / loading.MANIFEST).write_text(json.dumps(manifest))
    assert loading._conversion_valid(target, "abc")
    assert not loading._conversion_valid(target, "other-source")
    (target / "model.safetensors").write_bytes(b"weights, truncated or flipped")
    assert not loading._conversion_valid(target, "abc")
    (target / "model.safetensors").unlink()
    assert not loading._conversion_valid(target, "abc")


def test_concurrent_conversions_of_one_gguf_convert_once(monkeypatch, tmp_path):
    """Processes resolving the same GGUF at once (pytest-xdist workers, two servers) convert
    it once: the others wait for the lock and read the result. Before, each converted and
    removed the directory another had just finished and was reading. A killed converter's
    staging directory is cleared under the lock."""
    import threading
    import time

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model[q4].gguf"  # glob's brackets in the name: the sweep escapes them
    gguf.write_bytes(b"a stand-in GGUF")
    sha = loading.sha256_file(gguf)
    stale = tmp_path / "cache" / "models" / f".convert-model[q4]-{sha[:16]}-killed"
    stale.mkdir(parents=True)
    conversions = []

    def fake_convert(gguf_path, source_sha, target):
        conversions.append(target)
        time.sleep(0.3)  # long enough for every other thread to find no valid conversion
        target.mkdir(parents=True, exist_ok=True)
        (target / "model.safetensors").write_bytes(b"weights")
        (target / "config.json").write_text("{}")
        (target / loading.MANIFEST).write_text(json.dumps({
            "version": loading.CONVERSION_VERSION, "source_sha256": source_sha,
            "files": {"model.safetensors": loading.sha256_file(target / "model.safetensors")}}))

    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    results, errors = [], []

    def resolve():
        try:
            results.append(loading._from_gguf(gguf, "model[q4]"))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=resolve) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 4
    assert len(conversions) == 1
    assert not stale.exists()


@pytest.mark.slow
def test_default_model_converts_once_and_loads(monkeypatch, tmp_path):
    """Cold conversion into an empty cache, then a warm load, then repair of a corrupt file."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    source = resolve_model("default")
    assert source.config["num_hidden_layers"] == 30 and source.config["vocab_size"] == 49152
    weights = source.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model("default").path == source.path and weights.stat().st_mtime_ns == stamp
    with open(weights, "r+b") as handle:  # corrupt one byte
        handle.seek(1000)
        handle.write(b"\x00" if handle.read(1) != b"\x00" else b"\x01")
    repaired = resolve_model("default")
    source_sha = loading.sha256_file(loading.default_gguf_path())
    assert loading._conversion_valid(repaired.path, source_sha)
    # the config is checked too (it was outside the manifest: a damaged one was read as is);
    # a damaged file of any kind takes the rebuild just tested, so validity is checked alone
    manifest = json.loads((repaired.path / loading.MANIFEST).read_text())
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(manifest["files"])
    (repaired.path / "config.json").write_text('{"num_hidden_layers": 3}')
    assert not loading._conversion_valid(repaired.path, source_sha)


def test_the_default_model_is_known_by_every_name_and_by_its_gguf(tmp_path):
    """Found in review: `--model smollm2` or the default GGUF's own path lost the drafters
    shipped for it (the check compared the name with "default")."""
    from specdecode.models.loading import ModelSource

    gguf = loading.default_gguf_path()
    for name in ("default", "smollm2", "SmolLM2-135M-Instruct"):
        assert ModelSource(name, tmp_path, {}).is_default
    assert ModelSource(str(gguf), tmp_path, {}, gguf=gguf).is_default
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert not ModelSource(str(other), tmp_path, {}, gguf=other).is_default
    assert not ModelSource(str(tmp_path), tmp_path, {}).is_default


def test_weights_auto_times_a_short_context_model_within_its_context(tiny_llama_dir):
    """--weights auto times each format at 256 tokens of context, or at what a shorter
    model holds (a 256-position model was refused before it decoded anything)."""
    import torch

    from specdecode.factory import load_model

    model = load_model(str(tiny_llama_dir), torch.bfloat16)  # the CLI's default dtype: formats compete
    model.runtime.reset(8)
    assert model.runtime.max_positions <= 256 and model.runtime(torch.tensor([[1, 2, 3]])).shape[-2] == 3


def _tiny_gguf(arch: str, root, qtype: str = "Q8_0", types: dict[str, str] | None = None, tokenizer: bool = False,
               intermediate: int = 128, drop: str | None = None, extra: dict | None = None):
    """A 2-layer ``arch`` model written as llama.cpp writes it (q/k rows reordered for its
    llama architecture only), every linear in ``qtype`` (the embedding and the untied head
    too, as llama.cpp's Q4_1 file type leaves them) unless ``types`` names another for a
    tensor (its GGUF name without .weight and block: "attn_v"); returns (path, transformers
    model). ``tokenizer``: with a byte tokenizer's metadata, so the file loads as a model;
    ``intermediate``: the MLP's width (the input width of ffn_down); ``drop``: a tensor
    left out (its GGUF name); ``extra``: GGUF name -> array, tensors written besides."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=97, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  initializer_range=0.2, tie_word_embeddings=False)
    state = {k: v.numpy() for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    root.mkdir(parents=True)
    path = root / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_block_count(2)
    writer.add_feed_forward_length(intermediate)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(97)
    if tokenizer:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(94)])
        writer.add_token_scores([0.0] * 97)
        writer.add_token_types([2, 3, 3] + [6] * 94)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    def linear(name, array):
        if name == drop:
            return
        kind = getattr(gguf.GGMLQuantizationType, (types or {}).get(name.split(".")[-2], qtype))
        writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), kind), raw_dtype=kind)

    def reorder(array, heads):  # llama.cpp's q/k row order for its llama architecture
        return array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)

    linear("token_embd.weight", state["model.embed_tokens.weight"])
    linear("output.weight", state["lm_head.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(2):
        ours, theirs = f"model.layers.{i}.", f"blk.{i}."
        q, k = state[ours + "self_attn.q_proj.weight"], state[ours + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = reorder(q, 4), reorder(k, 2)
        linear(theirs + "attn_q.weight", q)
        linear(theirs + "attn_k.weight", k)
        for gguf_name, name in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                                ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                                ("ffn_down", "mlp.down_proj")):
            linear(theirs + gguf_name + ".weight", state[ours + name + ".weight"])
        if arch == "qwen2":
            for part in "qkv":
                writer.add_tensor(theirs + f"attn_{part}.bias", state[ours + f"self_attn.{part}_proj.bias"])
        writer.add_tensor(theirs + "attn_norm.weight", state[ours + "input_layernorm.weight"])
        writer.add_tensor(theirs + "ffn_norm.weight", state[ours + "post_attention_layernorm.weight"])
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, dtype=torch.float32)
    return path, reference


def _converted(reference, directory):
    """The transformers model ``reference`` saved as the conversion directory of its GGUF
    (safetensors and config.json), as loading a GGUF makes one."""
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(directory / "model.safetensors"))
    config = reference.config.to_dict()
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config, default=str))
    return directory


@pytest.mark.parametrize("arch, qtype", [("llama", "Q8_0"), ("qwen2", "Q8_0"), ("llama", "Q4_1")])
def test_linears_carried_from_a_gguf_keep_the_checkpoints_row_order(tmp_path, arch, qtype):
    """Found in review: the q/k rows read straight from a GGUF (int8/int4) were put back
    from llama.cpp's order for every architecture; it reorders them for llama only, so a
    Qwen2 GGUF's q/k were scrambled (logits off by 9.8, argmax agreeing on 10%). Every
    tensor is carried from the GGUF as it is (found in review: the test passed with nothing
    carried, Q8_0 quantizing back to itself; and int4 quantized a Q4_1 embedding and
    output head to Q8_0 again)."""
    import torch

    from specdecode.models.llama import load_native

    path, reference = _tiny_gguf(arch, tmp_path / "gguf", qtype)
    converted = _converted(reference, tmp_path / "converted")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    fmt = qtype.lower()
    runtime = load_native(converted, torch.float32, fmt, "torch", path)
    carried = runtime.weights.carried
    assert len(carried) == 2 + 2 * 7 and set(carried.values()) == {f"exact ({fmt})"}, carried
    runtime.reset(40)
    assert (runtime(ids) - expected).abs().max() < 1e-3


def test_a_gguf_that_scales_rope_is_refused_by_name(tmp_path, monkeypatch):
    """Found in review: transformers' GGUF reader drops RoPE scaling (and the rope_freqs
    factors of Llama 3.1 and later), so the conversion computed positions unscaled."""
    import gguf
    import numpy as np

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "scaled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, 8).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError, match="scales RoPE .*llama.rope.scaling.factor = 4.0.*rope_freqs"):
        resolve_model(str(path))
    older = tmp_path / "scale-linear.gguf"  # the older key, which llama.cpp still reads (found in review)
    writer = gguf.GGUFWriter(str(older), "llama")
    writer.add_block_count(1)
    writer.add_float32("llama.rope.scale_linear", 4.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError, match="scales RoPE .*llama.rope.scale_linear = 4.0"):
        resolve_model(str(older))


def test_a_fused_projection_of_mixed_gguf_block_types_loads_as_int4(tmp_path):
    """Found in review: a Q8_0 attn_v beside Q4_1 q and k (what llama.cpp's Q4_K_M writes
    where a width is no multiple of 256, SmolLM2's among them) failed --weights int4 with
    "only layers of one format ... can be fused", naming no tensor. The 4-bit parts are
    quantized to Q8_0 (which holds their values closely), and the load says so."""
    import torch

    from specdecode.models.llama import load_native

    path, reference = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", types={"attn_v": "Q8_0"})
    converted = _converted(reference, tmp_path / "converted")
    runtime = load_native(converted, torch.float32, "q4_1", "torch", path)
    carried = runtime.weights.carried
    assert carried["blk.0.attn_v.weight"] == "exact (q8_0)" and carried["blk.0.ffn_up.weight"] == "exact (q4_1)"
    assert carried["blk.0.attn_q.weight"] == "requantized (q8_0): fused with q8_0 parts"
    assert runtime.weights.layers[0].qkv.fmt == "q8_0" and runtime.weights.layers[0].o.fmt == "q4_1"
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    runtime.reset(40)
    # q and k rounded to 8 bits: 4% of the largest logit here (to 4 bits, v: 25%)
    assert (runtime(ids) - expected).abs().max() < 0.08 * expected.abs().max()
    from specdecode import kernels

    if kernels.available():  # the kernels take the layer's projections in two formats too
        fast = load_native(converted, torch.float32, "q4_1", "kernels", path)
        fast.reset(40)
        assert (fast(ids) - expected).abs().max() < 0.3 * expected.abs().max()  # and 8-bit activations


def test_a_fused_part_goes_to_q8_0_from_the_ggufs_own_values(tmp_path):
    """Found in review: a Q5_0 q/k beside a Q8_0 v went Q5_0 -> Q4_1 -> Q8_0 under --weights
    int4, keeping the 4-bit error at 8-bit cost; the part is now quantized from the GGUF's
    values, as quantizing them to Q8_0 directly gives."""
    import torch

    from specdecode.models.llama import load_native
    from specdecode.models.quant import PackedLinear

    path, reference = _tiny_gguf("llama", tmp_path / "gguf", "Q5_0", types={"attn_v": "Q8_0"})
    runtime = load_native(_converted(reference, tmp_path / "converted"), torch.float32, "q4_1", "torch", path)
    q_proj = reference.model.layers[0].self_attn.q_proj.weight.detach()
    loaded = runtime.weights.layers[0].qkv.dequantize()[:q_proj.shape[0]]
    assert torch.equal(loaded, PackedLinear.quantize(q_proj, "q8_0").dequantize())


@pytest.mark.parametrize("qtype, candidates", [("Q4_1", ["q4_1", "q8_0", "bf16"]), ("Q4_0", ["q4_1", "q8_0", "bf16"]),
                                               ("Q8_0", ["q8_0", "bf16"]), ("F16", ["q8_0", "bf16"])])
def test_weights_auto_offers_int4_for_a_4bit_gguf_only(tmp_path, qtype, candidates):
    """Found in review: every GGUF had int4 among --weights auto's candidates, so an F16
    GGUF was quantized to 4 bits unasked; a GGUF is 4-bit when its layers are."""
    from specdecode.factory import auto_candidates
    from specdecode.models.loading import ModelSource

    path, _ = _tiny_gguf("llama", tmp_path / "gguf", qtype)
    source = ModelSource(str(path), tmp_path / "converted", {}, gguf=path)
    assert auto_candidates(source) == candidates


def test_weights_auto_does_not_cut_a_k_quant_gguf_to_int4(tmp_path, monkeypatch):
    """Found in review: Q4_K counted as 4-bit, so --weights auto offered (and on speed
    chose) int4 for a Q4_K_M file, quantizing its Q4_K layers a second time and its Q6_K
    ones from 6 bits to 4. int4 is offered only where it carries the blocks exactly."""
    from types import SimpleNamespace

    from specdecode.factory import auto_candidates
    from specdecode.models import loading
    from specdecode.models.loading import ModelSource

    q4_k, q6_k, q4_0 = 12, 14, 2

    def index_of(types):
        return lambda gguf, path: {f"blk.{i}.{part}.weight": SimpleNamespace(tensor_type=kind, shape=(64, 64))
                                   for i, kind in enumerate(types) for part in ("attn_q", "ffn_down")}

    source = ModelSource(str(tmp_path / "m.gguf"), tmp_path / "converted", {}, gguf=tmp_path / "m.gguf")
    monkeypatch.setattr(loading, "gguf_tensor_index", index_of([q4_k, q4_k, q6_k]))
    assert auto_candidates(source) == ["q8_0", "bf16"]
    monkeypatch.setattr(loading, "gguf_tensor_index", index_of([q4_0, q4_0, q6_k]))
    assert auto_candidates(source) == ["q4_1", "q8_0", "bf16"]


def test_file_digests_are_remembered_by_stat_and_read_again_after_a_change(tmp_path, monkeypatch):
    """Every load hashed the default GGUF and its 0.5 GB conversion (0.7 s here). Digests
    are now remembered with the file's stat; a changed or replaced file gets its new
    digest, and a file changed in the last seconds is not remembered (a same-size rewrite
    within one clock tick keeps its times)."""
    import hashlib
    import os

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    memo_file = tmp_path / "cache" / loading.DIGESTS
    file = tmp_path / "weights.bin"
    file.write_bytes(b"a" * 100)
    assert loading.sha256_file(file) == hashlib.sha256(b"a" * 100).hexdigest()
    assert not memo_file.exists()  # just written: not remembered
    monkeypatch.setattr(loading, "MEMO_SETTLED_NS", -1)  # every file settled, for the rest of the test
    assert loading.sha256_file(file) == hashlib.sha256(b"a" * 100).hexdigest()
    assert json.loads(memo_file.read_text())[str(file.resolve())]["sha256"] == hashlib.sha256(b"a" * 100).hexdigest()
    memo_file.write_text(memo_file.read_text().replace(hashlib.sha256(b"a" * 100).hexdigest(), "remembered"))
    assert loading.sha256_file(file) == "remembered"  # read from the memo, not from the file
    file.write_bytes(b"a" * 99)  # truncated
    assert loading.sha256_file(file) == hashlib.sha256(b"a" * 99).hexdigest()
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"b" * 99)
    os.utime(replacement, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns))  # the same size and mtime
    os.replace(replacement, file)  # but another inode
    assert loading.sha256_file(file) == hashlib.sha256(b"b" * 99).hexdigest()
    # a file system without ctime: a same-size copy with the old times is still told apart by its ends
    stamp = loading._file_stamp(file)
    file.write_bytes(b"c" * 99)
    assert loading._file_stamp(file)[5] != stamp[5]
    memo_file.write_text("not json")
    assert loading.sha256_file(file) == hashlib.sha256(b"c" * 99).hexdigest()  # a damaged memo is rebuilt


@pytest.mark.slow
def test_a_gguf_conversions_tokenizer_loads_as_autotokenizer_would_without_its_imports():
    """The default model's tokenizer is read as the TokenizersBackend its conversion saved,
    skipping AutoTokenizer's import of the model type's configuration (2 s a start): the
    same class, the same ids, the same chat template."""
    from transformers import AutoTokenizer

    source = resolve_model("default")
    fast, auto = loading.load_tokenizer(source), AutoTokenizer.from_pretrained(source.path)
    assert type(fast) is type(auto)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld!\n\tdef f(): pass"}]
    assert fast.apply_chat_template(messages, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, add_generation_prompt=True)
    text = "Ünïcode, emoji 🙂, code `x = [i ** 2 for i in range(10)]` and <|im_end|> a special token"
    assert fast(text)["input_ids"] == auto(text)["input_ids"]
    assert fast.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert fast.eos_token_id == auto.eos_token_id and fast.all_special_ids == auto.all_special_ids


def test_the_checkpoints_own_safetensors_files_are_read_and_a_tensor_twice_is_refused(tmp_path):
    """Found in review: every *.safetensors in the directory was merged, the last file read
    winning a name held twice, so a leftover file of another model gave another model's
    answers with no error (transformers reads the index, else model.safetensors). Now the
    index's files are read, else model.safetensors; a tensor in two files read is refused."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from conftest import save_tiny_model
    from specdecode.config import SpecDecodeError
    from specdecode.models.llama import load_native

    original = save_tiny_model(tmp_path / "a", seed=3)
    other = save_tiny_model(tmp_path / "b", seed=4)
    ids = torch.tensor([[5, 6, 7, 8]])

    def logits(path):
        runtime = load_native(path, torch.float32)
        runtime.reset(8)
        return runtime(ids)

    expected = logits(original)
    stray = tmp_path / "stray"
    shutil.copytree(original, stray)
    shutil.copy(other / "model.safetensors", stray / "zz-old.safetensors")
    assert torch.equal(logits(stray), expected)  # model.safetensors alone
    (stray / "model.safetensors").rename(stray / "part-1.safetensors")  # no model.safetensors, no index
    with pytest.raises(SpecDecodeError, match="is in more than one safetensors file"):
        load_native(stray, torch.float32)
    tensors = load_file(stray / "part-1.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:3]}, stray / "part-1.safetensors")
    save_file({n: tensors[n] for n in names[3:]}, stray / "part-2.safetensors")
    index = {"weight_map": {n: ("part-1.safetensors" if i < 3 else "part-2.safetensors") for i, n in enumerate(names)}}
    (stray / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(logits(stray), expected)  # the index's two shards, not zz-old
    index["weight_map"][names[0]] = "part-3.safetensors"
    (stray / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SpecDecodeError, match="names part-3.safetensors"):
        load_native(stray, torch.float32)


def test_a_cache_that_cannot_be_written_is_named_before_a_conversion(monkeypatch, tmp_path):
    """Found in review: a GGUF converted into a cache that cannot be written ended in a
    NotADirectoryError traceback, after transformers had de-quantized the whole model."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "a-file" / "cache"))
    (tmp_path / "model.gguf").write_bytes(b"not read: the cache is checked first")
    with pytest.raises(loading.SpecDecodeError, match="cannot write the model cache .*SPECDECODE_CACHE"):
        resolve_model(str(tmp_path / "model.gguf"))


def test_a_shape_the_kernels_cannot_take_runs_on_torch_by_default(tmp_path, capsys):
    """Found in review: with the default flags a Llama whose head_dim is 12 failed ("none of
    the weight formats loads this model") although the torch backend runs it exactly; only
    a flag that needs the kernels is refused now, naming --backend torch."""
    import torch

    from conftest import save_tiny_model
    from specdecode.config import ConfigError
    from specdecode.factory import load_model

    path = save_tiny_model(tmp_path / "m", seed=1, num_layers=1, hidden_size=48, num_heads=4, num_kv_heads=2)
    model = load_model(str(path), torch.float32)
    assert model.runtime.backend == "torch" and "running on torch" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="use --backend torch"):
        load_model(str(path), torch.float32, weights="int8")


def test_a_gguf_conversion_parses_the_file_once(tmp_path, monkeypatch):
    """Found while timing the test suite: converting the default GGUF took 31 s on a Zen 3,
    14 of them parsing the same file's metadata five times (transformers' config, tokenizer
    and weights, our RoPE check, the tensor index) and gguf's tensor-name map built again for
    every module. One parse and one map now; gguf's names are put back afterwards, and the
    tensor index is written into the conversion (listed in its manifest)."""
    import gguf

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", tokenizer=True)
    parses, maps = [], []
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counting_reader(file, mode="r"):
        parses.append(os.path.realpath(file))
        return real_reader(file, mode)

    def counting_map(arch, n_blocks):
        maps.append((arch, n_blocks))
        return real_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    source = resolve_model(str(path))
    assert parses == [os.path.realpath(path)] and len(maps) == 1
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is counting_map
    manifest = json.loads((source.path / loading.MANIFEST).read_text())
    assert loading.GGUF_INDEX in manifest["files"]
    assert set(loading.gguf_tensor_index(path, source.path)) == {t.name for t in real_reader(str(path)).tensors}
    assert len(parses) == 1  # the index was read from the conversion, not from the file again


@pytest.mark.parametrize("fault", ["missing", "unmapped"])
def test_a_gguf_whose_tensors_do_not_match_its_model_is_refused_by_name(tmp_path, monkeypatch, fault):
    """Found in review: transformers converted a GGUF that lacks a tensor with that tensor
    initialised at random, and dropped a tensor it does not map (a llama file's attn_q.bias,
    which llama.cpp applies), each with a line on stderr only: the conversion was cached
    and every later load computed wrong logits. Both are refused, naming the tensor."""
    import numpy as np

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    if fault == "missing":
        path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q8_0", tokenizer=True, drop="blk.1.ffn_down.weight")
        named = "missing keys: model.layers.1.mlp.down_proj.weight"
    else:
        bias = np.full(64, 3.0, dtype=np.float32)
        path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q8_0", tokenizer=True, extra={"blk.0.attn_q.bias": bias})
        named = "tensors the model does not use: blk.0.attn_q.bias"
    with pytest.raises(ModelNotFoundError, match=f"does not match the model its metadata describes.*{named}"):
        resolve_model(str(path))
    assert not list((tmp_path / "cache" / "models").glob("tiny-llama-*/config.json"))  # nothing cached


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_memory_prices_a_ggufs_layers_as_int4_carries_them(tmp_path, qtype):
    """Found in review: `memory --weights int4` priced every layer at 4 bits, but a GGUF's
    Q8_0 layers keep their 8 bits under int4, so an 8-bit file's weights read 32% low."""
    import torch

    from specdecode.analysis.memory import deployment_memory
    from specdecode.factory import load_model

    path, _ = _tiny_gguf("llama", tmp_path / "gguf", qtype, tokenizer=True)
    estimate = deployment_memory(str(path), None, "bf16", 1, 64, 0, None, "int4")["models"]["target"]["weights"]
    weights = load_model(str(path), torch.bfloat16, weights="int4").runtime.weights
    loaded = sum(t.numel() * t.element_size() for t in [*weights.parameters(), *weights.buffers()])
    assert abs(estimate - loaded) < 0.1 * loaded


@pytest.mark.parametrize("types", [{"attn_v": "Q8_0"}, {"ffn_up": "Q8_0"}, {"output": "F16"}, {"output": "Q8_0"},
                                   {"token_embd": "F16"}])
def test_memory_follows_the_loaders_formats_per_fused_group_and_table(tmp_path, types):
    """Found in review: a fused q/k/v or gate/up group with one Q8_0 part is 8-bit whole as
    loaded, but only that part was priced at 8 bits (6% low on SmolLM2 with a Q8_0 attn_v);
    a 4-bit embedding's format was taken for an untied head too (an F16 or Q8_0 head is
    8-bit as loaded); int8 of a 4-bit file left out the fp32 pass of the tensors quantized
    again."""
    import torch

    from specdecode.analysis.memory import deployment_memory
    from specdecode.factory import load_model

    path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", types=types, tokenizer=True)
    estimate = deployment_memory(str(path), None, "bf16", 1, 64, 0, None, "int4")["models"]["target"]
    weights = load_model(str(path), torch.bfloat16, weights="int4").runtime.weights
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*weights.parameters(), *weights.buffers()]}
    loaded = sum(storages.values())
    assert abs(estimate["weights"] - loaded) < 0.015 * loaded, (estimate["weights"], loaded)
    int8 = deployment_memory(str(path), None, "bf16", 1, 64, 0, None, "int8")["models"]["target"]
    assert int8["load"] == 4 * 128 * 64  # fp32 of the largest tensor quantized again: a gate or up projection


@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_memory_prices_int4_layers_of_an_odd_number_of_blocks_at_8_bits(tmp_path, source):
    """Found in review: under int4 the loader holds a layer whose input width is an odd
    number of 32-blocks in Q8_0, but `specdecode memory` priced it at 4 bits (31% low on a
    checkpoint 96 wide with an MLP of 160)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdecode.analysis.memory import deployment_memory
    from specdecode.factory import load_model

    if source == "checkpoint":
        torch.manual_seed(0)
        path = tmp_path / "m"
        LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                                     tie_word_embeddings=False)).save_pretrained(path)
    else:
        path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", tokenizer=True, intermediate=96)
    estimate = deployment_memory(str(path), None, "fp32", 1, 64, 0, None, "int4")["models"]["target"]["weights"]
    weights = load_model(str(path), torch.float32, weights="int4").runtime.weights
    assert any(layer.fmt == "q8_0" for layer in (weights.layers[0].o, weights.layers[0].down))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*weights.parameters(), *weights.buffers()]}
    loaded = sum(storages.values())
    assert abs(estimate - loaded) < 0.03 * loaded, (estimate, loaded)


def _one_tensor_gguf(path, rows: int, cols: int, kind_name: str):
    import gguf
    import numpy as np

    from specdecode.models.quant import GGUFTensor

    kind = getattr(gguf.GGMLQuantizationType, kind_name)
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (t,) = gguf.GGUFReader(str(path)).tensors
    return GGUFTensor(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "fp32", "bf16"])
def test_a_gguf_tensor_quantized_again_a_few_rows_at_a_time_is_the_same_bits(tmp_path, monkeypatch, fmt):
    """A tensor quantized again from a GGUF goes a few rows at a time (found in review: the
    whole tensor at once held about 12 bytes a parameter); each row is quantized alone, so
    the bits are those of the whole tensor at once."""
    from specdecode.models import quant

    tensor = _one_tensor_gguf(tmp_path / "t.gguf", 40, 128, "Q5_0")
    whole, how = quant.from_gguf(tensor, tmp_path / "t.gguf", fmt)
    monkeypatch.setattr(quant, "REQUANTIZE_VALUES", 3 * 128)  # 3 rows a time: 14 parts, the last of 1 row
    parts, _ = quant.from_gguf(tensor, tmp_path / "t.gguf", fmt)
    assert how == "requantized" and parts.fmt == whole.fmt == fmt
    for name in ("weight", "qweight", "scales", "mins"):
        a, b = getattr(whole, name, None), getattr(parts, name, None)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset")
def test_quantizing_a_gguf_tensor_again_holds_less_than_its_fp32_size(tmp_path):
    """`specdecode memory` counts a tensor quantized again at its fp32 size while loading;
    the load held three times that (a second fp32 copy, the gguf library's and the
    quantizer's temporaries). Measured as the peak RSS above the start (Linux)."""
    from specdecode.models.loading import transients_mapped
    from specdecode.models.quant import from_gguf

    rows, cols = 4096, 2048
    tensor = _one_tensor_gguf(tmp_path / "t.gguf", rows, cols, "Q5_0")

    def status(field):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

    with transients_mapped():
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # VmHWM back to VmRSS
        start = status("VmRSS:")
        layer, _ = from_gguf(tensor, tmp_path / "t.gguf", "q8_0")
        peak = status("VmHWM:") - start
    assert layer.fmt == "q8_0" and peak < 4 * rows * cols, peak / 2**20


def test_a_quantized_gguf_loaded_as_bf16_says_its_values_were_rounded(tmp_path, capsys):
    """Found in review: --weights bf16 rounded a Q4_1 file's values (79% of them) without a
    word, where every other second quantization is logged."""
    import torch

    from specdecode.factory import load_model

    path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", tokenizer=True)
    load_model(str(path), torch.bfloat16, weights="int4")
    assert "rounded to bf16" not in capsys.readouterr().err
    load_model(str(path), torch.bfloat16, weights="bf16")
    assert "16 GGUF tensors are stored in a format bf16 cannot hold exactly" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_after_loading_freed_temporaries_stay_in_the_heap(monkeypatch):
    """Loading holds glibc's mmap threshold low (its temporaries leave no holes resident),
    then sets it high again. Found in review: the trim threshold stayed at 128 KiB, so after
    loading every freed 4 MiB temporary went back to the system and the next step faulted
    its 1,024 pages in again. A step's temporaries now stay in the heap, as before."""
    import resource

    from specdecode.models.loading import transients_mapped

    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    with transients_mapped():
        kept = []
        for i in range(20):  # a load: large temporaries freed, small pieces kept
            temporary = torch.randn(1_000_000 + 150_000 * i)
            kept.append(temporary[:1000].clone())
            del temporary
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):  # a step's two temporaries of 4 MiB
        first = torch.empty(1 << 20)
        first.fill_(1.0)
        second = first * 2
        del first, second
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 200 * 1024 // 4, faults  # every allocation faulting in its pages again: 204,800


def test_the_checkpoint_mark_follows_every_shard(tmp_path):
    """The key under which --weights auto keeps its choice changes when any shard of a
    sharded checkpoint does, not only the first (found in review)."""
    from specdecode.factory import checkpoint_mark

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 64)
    second = tmp_path / "model-00002-of-00002.safetensors"
    second.write_bytes(b"b" * 64)
    before = checkpoint_mark(tmp_path)
    second.write_bytes(b"b" * 96)
    assert checkpoint_mark(tmp_path) != before
    before = checkpoint_mark(tmp_path)
    second.write_bytes(b"c" * 96)  # the same size, saved again
    os.utime(second, ns=(1, 1))
    assert checkpoint_mark(tmp_path) != before
    (tmp_path / "model-00003-of-00003.safetensors").symlink_to(tmp_path / "gone")  # a broken link is no shard
    assert checkpoint_mark(tmp_path).count(":") == 2 + 2  # two hashes, one later shard (size and time)


def test_cache_files_are_written_whole_with_the_mode_a_plain_write_gives(tmp_path):
    """write_atomic's temporary (mkstemp: 0600) is given 0666 less the umask before it is
    renamed into place, so a cache shared by several users stays readable to them; a write
    that fails leaves no temporary behind."""
    old = os.umask(0o027)
    try:
        loading.write_atomic(tmp_path / "cache" / "record.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "cache" / "record.json").read_text() == "{}"
    assert (tmp_path / "cache" / "record.json").stat().st_mode & 0o777 == 0o640
    (tmp_path / "cache" / "busy").mkdir()
    (tmp_path / "cache" / "busy" / "file").write_text("")
    with pytest.raises(OSError):  # a non-empty directory cannot be replaced by a file
        loading.write_atomic(tmp_path / "cache" / "busy", "{}")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["busy", "record.json"]


def test_a_cache_file_that_cannot_be_saved_is_said_on_stderr_not_raised(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    loading.save_cache(tmp_path / "a-file" / "index.json", "{}", "the GGUF's tensor index")
    assert "the GGUF's tensor index not saved to" in capsys.readouterr().err


def test_the_cache_defaults_to_the_users_dot_cache(monkeypatch, tmp_path):
    """Neither SPECDECODE_CACHE nor XDG_CACHE_HOME set (or set empty): ~/.cache/specdecode."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (None, ""):
        for name in ("SPECDECODE_CACHE", "XDG_CACHE_HOME"):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert loading.cache_dir() == tmp_path / ".cache" / "specdecode"


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelNotFoundError, match="does not hold a JSON object"):
        resolve_model(str(tmp_path))


def test_a_model_path_under_home_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama"}')
    assert resolve_model("~/ckpt").path == tmp_path / "ckpt"


def test_a_gguf_file_is_known_by_its_suffix_in_any_case(monkeypatch, tmp_path):
    """MODEL.GGUF is a GGUF, as model.gguf is (not "a file, but not a .gguf file")."""
    monkeypatch.setattr(loading, "_from_gguf", lambda path, name: ("converted", path))
    for name in ("model.gguf", "MODEL.GGUF", "model.Gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
        assert resolve_model(str(tmp_path / name)) == ("converted", tmp_path / name)


def test_every_native_architecture_runs_natively(tmp_path):
    for model_type, native in (("llama", True), ("mistral", True), ("qwen2", True), ("gpt2", False)):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert resolve_model(str(tmp_path / model_type)).native is native, model_type


def test_a_large_files_stamp_samples_its_last_mib_too(tmp_path):
    """Where no ctime tells a rewrite apart, a change in the last MiB of a large file moves
    its stamp (the first MiB alone would keep it)."""
    data = bytearray(3 * loading.STAMP_SAMPLE)
    file = tmp_path / "weights.bin"
    file.write_bytes(data)
    before = loading._file_stamp(file)
    data[-1] = 1
    file.write_bytes(data)
    assert loading._file_stamp(file)[5] != before[5]


def test_the_digest_memo_forgets_files_that_are_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "MEMO_SETTLED_NS", -1)
    first, second = tmp_path / "first.bin", tmp_path / "second.bin"
    first.write_bytes(b"a")
    second.write_bytes(b"b")
    loading.sha256_file(first)
    first.unlink()
    loading.sha256_file(second)
    assert list(json.loads((tmp_path / "cache" / loading.DIGESTS).read_text())) == [str(second.resolve())]


def test_a_gguf_whose_rope_scaling_is_none_or_one_loads_and_a_scaling_type_alone_is_refused(tmp_path):
    """Scaling type "none", a factor of 1 or a scale_linear of 1 scale nothing: such a file
    is converted. A scaling type other than "none" is refused by name, factor or not."""
    import gguf

    def write(name, fill):
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(1)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def unscaled(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1.0)
        writer.add_float32("llama.rope.scale_linear", 1.0)

    loading._refuse_scaled_rope(write("unscaled.gguf", unscaled))  # nothing raised
    yarn = write("yarn.gguf", lambda writer: writer.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(ModelNotFoundError, match="scales RoPE .*llama.rope.scaling.type = yarn"):
        loading._refuse_scaled_rope(yarn)


def test_a_conversion_of_an_older_version_or_with_an_empty_or_corrupt_manifest_is_rebuilt(tmp_path):
    """Only a manifest of this CONVERSION_VERSION that lists the files validates a cached
    conversion (version 1 converted RoPE-scaled GGUFs unscaled); a corrupt one is invalid,
    not an error."""
    target = tmp_path / "conv"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    files = {"model.safetensors": loading.sha256_file(target / "model.safetensors")}

    def manifest(**fields):
        (target / loading.MANIFEST).write_text(json.dumps(
            {"version": loading.CONVERSION_VERSION, "source_sha256": "abc", "files": files} | fields))

    manifest()
    assert loading._conversion_valid(target, "abc")
    manifest(version=loading.CONVERSION_VERSION - 1)
    assert not loading._conversion_valid(target, "abc")
    manifest(files={})
    assert not loading._conversion_valid(target, "abc")
    (target / loading.MANIFEST).write_text('{"version": 2, "files"')
    assert not loading._conversion_valid(target, "abc")
    # valid JSON of another shape, or bytes that are not UTF-8: damage, rebuilt, not a traceback
    for damage in ("[]", "null", '"text"', json.dumps({"version": loading.CONVERSION_VERSION, "source_sha256": "abc",
                                                      "files": list(files)})):
        (target / loading.MANIFEST).write_text(damage)
        assert not loading._conversion_valid(target, "abc"), damage
    manifest(files={"model.safetensors": 7})
    assert not loading._conversion_valid(target, "abc")
    (target / loading.MANIFEST).write_bytes(b"\xff\xfe{")
    assert not loading._conversion_valid(target, "abc")


def test_a_ggufs_tensor_index_is_kept_in_its_cache_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a.weight", np.zeros((4, 32), dtype=np.float32))
    writer.add_tensor("b.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "conversion"
    cache.mkdir()
    index = loading.gguf_tensor_index(path, cache)
    assert set(index) == {"a.weight", "b.weight"} and index["a.weight"].shape == (32, 4)
    assert (cache / loading.GGUF_INDEX).is_file()
    reads = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args: reads.append(args) or reader(*args))
    assert loading.gguf_tensor_index(path, cache) == index and not reads  # from the cache, the file not parsed
    for damage in (b"not json", b"[1]", b'[{"name": "a.weight"}]', b"\xff\xfe["):  # the last: not UTF-8
        (cache / loading.GGUF_INDEX).write_bytes(damage)
        assert loading.gguf_tensor_index(path, cache) == index
        assert json.loads((cache / loading.GGUF_INDEX).read_text())[0]["name"] == "a.weight"  # written again
    assert len(reads) == 4


def test_a_tokenizer_with_its_own_code_is_not_read_as_the_saved_generic_class(tmp_path):
    """The TokenizersBackend shortcut is taken only for a tokenizer_config.json without an
    auto_map (a tokenizer of its own code goes through AutoTokenizer)."""
    config = {"tokenizer_class": "TokenizersBackend"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert loading._saved_tokenizer_class(tmp_path) == "TokenizersBackend"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"auto_map": {"AutoTokenizer": ["t.T", None]}}))
    assert loading._saved_tokenizer_class(tmp_path) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_loading_sets_glibcs_thresholds_and_leaves_a_users_own_tuning_alone(monkeypatch):
    """While loading: the mmap threshold at 128 KiB; after: 32 MiB, and the trim threshold
    at 64 MiB (found in review: left at 128 KiB, freed temporaries went back to the system
    every step). The test above sees this only when the heap is fresh; these are the calls."""
    import ctypes

    calls = []

    class Libc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    with loading.transients_mapped():
        assert calls == [(m_mmap_threshold, 128 * 1024)]
    assert calls[1:] == [(m_mmap_threshold, 32 << 20), (m_trim_threshold, 64 << 20)]
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "1000000"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")):
        calls.clear()
        with monkeypatch.context() as patch:
            patch.setenv(name, value)
            with loading.transients_mapped():
                pass
        assert calls == []


def test_int8_and_int4_quantize_each_block_of_32_as_llama_cpp_does():
    """Found by a mutation audit: a Q8_0 scale of max|w| / 128, a Q4_1 scale of (max - min)
    / 16, codes rounded toward zero, or computed against the scale before its fp16 rounding,
    and a byte count without the minima all passed (the tests bounded the layers' total
    error, or compared a load with quantize itself). Q8_0: d = fp16(max|w| / 127), codes the nearest integers to w / d;
    Q4_1: m = fp16(min), d = (max - m) / 15 in fp16, codes nearest to (w - m) / d in
    0..15, byte j of a block holding weight j (low nibble) and j + 16 (high)."""
    from specdecode.config import ConfigError
    from specdecode.models.quant import PackedLinear

    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    blocks = weight.reshape(8, 4, 32)
    q8 = PackedLinear.quantize(weight, "q8_0")
    scales = q8.scales.float()
    assert torch.equal(q8.scales, (blocks.abs().amax(-1) / 127.0).to(torch.float16))
    codes = q8.qweight.reshape(8, 4, 32).float()
    assert (codes - blocks / scales[..., None]).abs().max() <= 0.5 + 1e-4
    assert (q8.dequantize() - weight).abs().reshape(8, 4, 32).amax(-1).le(scales * (0.5 + 1e-4)).all()

    q4 = PackedLinear.quantize(weight, "q4_1")
    mins, scales = q4.mins.float(), q4.scales.float()
    assert torch.equal(q4.mins, blocks.amin(-1).to(torch.float16))
    range_15 = (blocks.amax(-1) - mins) / 15
    assert ((scales - range_15).abs() <= range_15 * 2**-10).all()  # that in fp16
    packed = q4.qweight.reshape(8, 4, 16)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # GGUF's nibble order, written out
    assert (codes - (blocks - mins[..., None]) / scales[..., None]).abs().max() <= 0.5 + 1e-3
    assert torch.equal(q4.dequantize(), (codes * scales[..., None] + mins[..., None]).reshape(8, 128))
    # what a forward pass reads (the cost model prices layers by it): codes, fp16 scales (and minima)
    assert (q8.nbytes, q4.nbytes) == (8 * 128 + 8 * 4 * 2, 8 * 64 + 2 * 8 * 4 * 2)
    # the kernels read Q4_1 in pairs of blocks (64 columns), every block format in blocks of 32
    with pytest.raises(ConfigError, match="q4_1 needs an input width that is a multiple of 64, got 96"):
        PackedLinear.quantize(torch.randn(8, 96), "q4_1")
    with pytest.raises(ConfigError, match="q8_0 needs an input width that is a multiple of 32, got 48"):
        PackedLinear.quantize(torch.randn(8, 48), "q8_0")


def test_int4_holds_a_layer_of_an_odd_number_of_blocks_in_8_bits(tmp_path):
    """Found in review: --weights int4 refused any model with an input width that is no
    multiple of 64 (the kernels read Q4_1 blocks in pairs), even for a tensor the GGUF stores
    in Q8_0, which needs 32. Such a layer (here ffn_down, 96 wide) is held in Q8_0 instead,
    from the GGUF's values or the checkpoint's, and the load log says so; the rest stays 4-bit."""
    import torch

    from specdecode import kernels
    from specdecode.models.llama import load_native

    path, reference = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", intermediate=96)
    converted = _converted(reference, tmp_path / "converted")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    for gguf_path in (path, None):
        backends = ("torch", "kernels") if kernels.available() else ("torch",)
        for backend in backends:
            runtime = load_native(converted, torch.float32, "q4_1", backend, gguf_path)
            layer = runtime.weights.layers[0]
            assert (layer.down.fmt, layer.gate_up.fmt, layer.qkv.fmt) == ("q8_0", "q4_1", "q4_1")
            if gguf_path is not None:
                carried = runtime.weights.carried
                assert carried["blk.0.ffn_down.weight"] == "requantized (q8_0)"
                assert carried["blk.0.ffn_up.weight"] == "exact (q4_1)"
            runtime.reset(40)
            # the GGUF's 4-bit values (or the checkpoint's own) to 8 bits: close to the reference
            assert (runtime(ids) - expected).abs().max() < 0.3 * expected.abs().max(), (gguf_path, backend)


def test_gguf_blocks_are_carried_with_the_values_the_gguf_library_reads(tmp_path):
    """Found by a mutation audit: nothing checked a Q4_0 tensor's values (its minimum is
    -8 scale: -7 passed), nor that an F16 tensor loaded as bf16 is said to be rounded. Each
    tensor read from a GGUF dequantizes to the values gguf-py reads from it, in the format
    and with the word ("exact" or "requantized") the loader logs; a Q8_0 tensor keeps its
    8 bits under int4."""
    import gguf
    import numpy as np

    from specdecode.models.quant import from_gguf

    array = (np.random.default_rng(6).standard_normal((16, 64)) * 0.05).astype(np.float32)
    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    kinds = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16")
    for kind in kinds:
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        writer.add_tensor(kind, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = loading.gguf_tensor_index(path)
    cases = [("Q4_0", "q4_1", "q4_1", "exact"), ("Q4_1", "q4_1", "q4_1", "exact"), ("Q8_0", "q4_1", "q8_0", "exact"),
             ("Q8_0", "q8_0", "q8_0", "exact"), ("F16", "fp32", "fp32", "exact"), ("F16", "bf16", "bf16", "requantized"),
             ("BF16", "bf16", "bf16", "exact")]
    for kind, asked, fmt, how in cases:
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype).astype(np.float32))
        layer, carried = from_gguf(index[kind], path, asked)
        assert (layer.fmt, carried) == (fmt, how), (kind, asked)
        if how == "exact":
            assert torch.equal(layer.dequantize(), expected.reshape(16, 64)), (kind, asked)


def test_selected_and_fused_layers_keep_their_biases():
    """Found by a mutation audit (the loader's own calls pass no bias, so nothing held it):
    rows_selected dropped to the whole bias, or concat filling a part without a bias with
    ones, passed. A layer of selected rows computes those rows' outputs; a fused layer, its
    parts' outputs side by side (zero where a part has no bias), in every format."""
    from specdecode.models.quant import PackedLinear

    generator = torch.Generator().manual_seed(8)
    weight, bias = torch.randn(16, 64, generator=generator), torch.randn(16, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    picked = torch.tensor([5, 0, 15, 5])
    for fmt in ("fp32", "q8_0", "q4_1"):
        layer = PackedLinear.quantize(weight, fmt, bias)
        assert torch.allclose(layer.rows_selected(picked)(x), layer(x)[:, picked], rtol=1e-5, atol=1e-5), fmt
        plain = PackedLinear.quantize(weight[:8], fmt)
        fused = PackedLinear.concat([layer, plain])
        assert torch.allclose(fused(x), torch.cat([layer(x), plain(x)], dim=1), rtol=1e-5, atol=1e-5), fmt


@pytest.mark.parametrize("types, int4_load", [
    ({}, 0),  # every tensor carried as its Q4_1 blocks: nothing passes through fp32
    ({"attn_v": "Q8_0"}, 4 * 64 * 64),  # q and k quantized again to 8 bits beside it: the q projection's fp32
    ({"output": "F16"}, 4 * 97 * 64),  # an F16 head quantized to 8 bits; the 4-bit embedding is carried
])
def test_memory_counts_the_fp32_pass_of_a_tensor_int4_quantizes_again(tmp_path, types, int4_load):
    """Under int4, a 4-bit tensor of a fused group with an 8-bit part is quantized again (it
    passes through fp32), and a 4-bit embedding or head is carried as it is (it does not).
    Found by a mutation audit: only int8's loading transient was checked."""
    from specdecode.analysis.memory import deployment_memory

    path, _ = _tiny_gguf("llama", tmp_path / "gguf", "Q4_1", types=types, tokenizer=True)
    assert deployment_memory(str(path), None, "bf16", 1, 64, 0, None, "int4")["models"]["target"]["load"] == int4_load


def test_a_shape_the_kernels_cannot_take_refuses_a_weight_format_torch_would_not_store(tmp_path):
    """On torch the weights are stored in --dtype: --weights bf16 under --dtype fp32 for a
    model the kernels cannot run is refused (naming --backend torch), not run in fp32."""
    import torch

    from conftest import save_tiny_model
    from specdecode.config import ConfigError
    from specdecode.factory import load_model

    path = save_tiny_model(tmp_path / "m", seed=1, num_layers=1, hidden_size=48, num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match="use --backend torch"):
        load_model(str(path), torch.float32, weights="bf16")
    assert load_model(str(path), torch.float32, weights="fp32").runtime.backend == "torch"


def test_weights_auto_never_offers_int4_for_a_checkpoint_that_is_not_a_gguf(tmp_path):
    """A safetensors checkpoint is never cut below 8 bits unasked: --weights auto times
    q8_0 and bf16 only."""
    from conftest import save_tiny_model
    from specdecode.factory import auto_candidates
    from specdecode.models.loading import resolve_model

    assert auto_candidates(resolve_model(str(save_tiny_model(tmp_path / "m", seed=1, num_layers=1)))) == ["q8_0", "bf16"]


def test_a_ggufs_carried_qkv_keep_the_checkpoints_biases_and_a_mistral_conversion_has_its_rows_put_back(tmp_path):
    """Found by a mutation audit: transformers initialises a Qwen2's q/k/v biases at zero,
    so the carried test above passed with the biases dropped from the fused q/k/v read from
    the GGUF; and no test loaded a GGUF whose conversion is a Mistral (written by llama.cpp
    as its llama architecture, q/k rows reordered), so undoing the reorder for llama only
    went unnoticed."""
    import torch

    from specdecode.models.llama import load_native

    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    path, reference = _tiny_gguf("qwen2", tmp_path / "qwen2", "Q8_0")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        expected = reference(ids).logits
    runtime = load_native(_converted(reference, tmp_path / "qwen2-converted"), torch.float32, "q8_0", "torch", path)
    assert runtime.weights.carried["blk.0.attn_q.weight"] == "exact (q8_0)"
    runtime.reset(40)
    assert (runtime(ids) - expected).abs().max() < 1e-3

    path, reference = _tiny_gguf("llama", tmp_path / "mistral", "Q8_0")
    with torch.no_grad():
        expected = reference(ids).logits
    converted = _converted(reference, tmp_path / "mistral-converted")
    config = json.loads((converted / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (converted / "config.json").write_text(json.dumps(config))
    runtime = load_native(converted, torch.float32, "q8_0", "torch", path)
    assert runtime.cfg.model_type == "mistral" and runtime.weights.carried["blk.0.attn_k.weight"] == "exact (q8_0)"
    runtime.reset(40)
    assert (runtime(ids) - expected).abs().max() < 1e-3


def test_a_gguf_tensor_unlike_what_config_json_implies_is_refused(tmp_path):
    """Found by a mutation audit: tensors carried from a GGUF are checked against the
    config's shapes as safetensors ones are, but no test gave a config that does not
    describe the GGUF's tensors (the kernels would read past them)."""
    import torch

    from specdecode.config import SpecDecodeError
    from specdecode.models.llama import load_native

    path, reference = _tiny_gguf("llama", tmp_path / "gguf", "Q8_0")
    converted = _converted(reference, tmp_path / "converted")
    config = json.loads((converted / "config.json").read_text())
    (converted / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(SpecDecodeError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], "
                                              r"but config\.json implies \[256, 64\]"):
        load_native(converted, torch.float32, "q8_0", "torch", path)
