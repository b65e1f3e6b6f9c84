"""The native runtime against transformers on the same weights, and its KV-cache rules."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import SpecDecodeError
from specdecode.models.llama import load_native

# fp32, same weights, different op order (fused projections, SDPA): differences are
# rounding only. Logits of these tiny models have magnitude ~1-10.
LOGITS_ATOL = 1e-4


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path, model_type):
    model_dir = save_tiny_model(tmp_path / model_type, model_type, seed=3)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0))
    runtime = load_native(model_dir, torch.float32)
    runtime.reset(64, batch=2)
    ours = runtime(ids)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)
    if model_type == "qwen2":
        assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
        assert runtime.weights.layers[0].qkv.bias is not None


def _randomize_norms(model_dir) -> None:
    """Norm weights (and any biases) other than transformers' initial ones: with every norm
    weight at 1, loading a norm into the wrong place, or not at all, went unnoticed."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(11)
    for name, tensor in tensors.items():
        if tensor.dim() == 1:
            tensors[name] = 1.0 + 0.3 * torch.randn(tensor.shape, generator=generator) if "norm" in name else \
                0.1 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_logits_match_transformers_with_every_norm_its_own(tmp_path, model_type):
    """Found in review: the tiny checkpoints kept every RMSNorm weight at 1, so the test
    above passed with the layers' norms replaced by ones."""
    model_dir = save_tiny_model(tmp_path / model_type, model_type, seed=4)
    _randomize_norms(model_dir)
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(1))
    for backend in ("torch", "kernels"):
        runtime = load_native(model_dir, torch.float32, backend=backend)
        runtime.reset(64)
        torch.testing.assert_close(runtime(ids), hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)


def test_configs_read_as_transformers_reads_them(tmp_path):
    """Found in review, each loaded without a word and computed other logits than
    transformers (7-10 apart): a Mistral window with use_sliding_window false (Mistral
    slides whatever that key says); rope_parameters read over rope_scaling (transformers
    takes rope_scaling); an index over a model.safetensors beside it (transformers loads the
    file); longrope's top-level original_max_position_embeddings (transformers reads it over
    the inner one) slipped past the refusal of a switching table."""
    import shutil

    from transformers import AutoModelForCausalLM

    mistral = save_tiny_model(tmp_path / "mistral", "mistral", seed=5)
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "sliding_window": 16, "use_sliding_window": False}))
    with pytest.raises(SpecDecodeError, match="sliding attention window"):
        load_native(mistral, torch.float32)

    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(2))
    scaled = save_tiny_model(tmp_path / "scaled", seed=6)
    config = json.loads((scaled / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (scaled / "config.json").write_text(json.dumps(config))
    runtime = load_native(scaled, torch.float32, backend="torch")
    runtime.reset(64)
    torch.testing.assert_close(runtime(ids), hf_logits(scaled, ids), atol=LOGITS_ATOL, rtol=0)

    beside = save_tiny_model(tmp_path / "a", seed=7)
    other = save_tiny_model(tmp_path / "b", seed=8)
    AutoModelForCausalLM.from_pretrained(other).save_pretrained(other, max_shard_size="20KB")
    for name in (p.name for p in other.iterdir() if p.name.startswith("model-") or p.name.endswith("index.json")):
        shutil.copy(other / name, beside / name)
    runtime = load_native(beside, torch.float32, backend="torch")
    runtime.reset(64)
    torch.testing.assert_close(runtime(ids), hf_logits(beside, ids), atol=LOGITS_ATOL, rtol=0)

    longrope = save_tiny_model(tmp_path / "longrope", seed=9)
    config = json.loads((longrope / "config.json").read_text())
    config.pop("rope_theta", None)
    config["original_max_position_embeddings"] = 64
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    (longrope / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="past 64 positions"):
        load_native(longrope, torch.float32)


def test_incremental_equals_full_prefix(tiny_llama_dir):
    """Prefill + one-token steps produce the same logits as one pass over everything."""
    runtime = load_native(tiny_llama_dir, torch.float32)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    runtime.reset(64)
    full = runtime(ids)
    runtime.reset(64)
    steps = [runtime(ids[:, :8])]
    steps += [runtime(ids[:, i : i + 1]) for i in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("kernels", [False, True])
def test_a_larger_cache_replaces_the_old_one_instead_of_joining_it(tiny_llama_dir, monkeypatch, kernels):
    """reset() to a larger capacity frees the old cache before allocating the new one, so
    the peak is the new cache, not old + new (found in review: both were held)."""
    import weakref

    from specdecode.models import llama

    runtime = load_native(tiny_llama_dir, torch.float32, backend="kernels" if kernels else "torch")
    runtime.reset(16)
    old = [weakref.ref(runtime.k_cache), weakref.ref(runtime.v_cache)]
    live_at_allocation = []
    zeros = torch.zeros

    def recording_zeros(*args, **kwargs):
        live_at_allocation.append(sum(ref() is not None for ref in old))
        return zeros(*args, **kwargs)

    monkeypatch.setattr(llama.torch, "zeros", recording_zeros)
    runtime.reset(64)
    monkeypatch.undo()
    assert live_at_allocation == [0, 0]
    assert runtime.capacity == 64
    runtime(torch.tensor([[1, 2, 3]]))  # the new cache is bound and used
    assert runtime.length == 3

    # the values' allocation fails: no cache is kept, a step is refused, the next reset makes one
    calls = []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(llama.torch, "zeros", failing_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        runtime.reset(128)
    monkeypatch.undo()
    assert runtime.capacity == 0 and runtime.k_cache is None and runtime.v_cache is None
    with pytest.raises(SpecDecodeError, match="exceeds the KV cache capacity 0"):
        runtime(torch.tensor([[1, 2]]))
    runtime.reset(16)
    expected = load_native(tiny_llama_dir, torch.float32, backend="kernels" if kernels else "torch")
    expected.reset(16)
    assert torch.equal(runtime(torch.tensor([[1, 2, 3]])), expected(torch.tensor([[1, 2, 3]])))


def test_rollback_is_pointer_move_and_overwrites(tiny_llama_dir):
    runtime = load_native(tiny_llama_dir, torch.float32)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    runtime.reset(64)
    runtime(ids[:, :8])
    k_before = runtime.k_cache.data_ptr()
    runtime(torch.tensor([[5, 6, 7]]))  # drafts that get rejected
    runtime.rollback(8)
    assert runtime.length == 8 and runtime.k_cache.data_ptr() == k_before
    after_rollback = runtime(ids[:, 8:12])
    runtime.reset(64)
    reference = runtime(ids)[:, 8:12]
    torch.testing.assert_close(after_rollback, reference, atol=LOGITS_ATOL, rtol=0)


def test_tree_mask_and_compact(tiny_llama_dir):
    """Two branches scored in one pass equal each branch scored alone; compaction keeps one."""
    runtime = load_native(tiny_llama_dir, torch.float32)
    prefix = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    # tree over new tokens: root r, then branch a (a1, a2) and branch b (b1)
    tokens = torch.tensor([[10, 11, 12, 13]])  # r, a1, a2, b1
    positions = torch.tensor([6, 7, 8, 7])
    tree_mask = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool
    )
    runtime.reset(64)
    runtime(prefix)
    tree_logits = runtime(tokens, positions=positions, tree_mask=tree_mask)
    runtime.compact(torch.tensor([6, 9]), start=6)  # keep r, b1
    after = runtime(torch.tensor([[14]]))

    runtime.reset(64)
    branch_a = runtime(torch.cat([prefix, tokens[:, :3]], dim=1))[:, 6:]
    runtime.reset(64)
    branch_b = runtime(torch.cat([prefix, tokens[:, [0, 3]], torch.tensor([[14]])], dim=1))[:, 6:]
    torch.testing.assert_close(tree_logits[:, :3], branch_a, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(tree_logits[:, 3], branch_b[:, 1], atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(after[:, 0], branch_b[:, 2], atol=LOGITS_ATOL, rtol=0)


def test_hidden_states_and_last_only(tiny_llama_dir):
    runtime = load_native(tiny_llama_dir, torch.float32)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    runtime.reset(32)
    logits, hidden = runtime(ids, return_hidden=True)
    assert hidden.shape == (1, 9, 64)
    torch.testing.assert_close(runtime.weights.lm_head(hidden), logits)
    runtime.reset(32)
    last = runtime(ids, last_only=True)
    torch.testing.assert_close(last[:, 0], logits[:, -1], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_captured_layer_inputs_match_transformers_hidden_states(tiny_llama_dir, backend):
    """What an EAGLE head reads: the residual stream entering chosen layers, for every new
    token, across prefill chunks and with last_only."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(7))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ...]
    runtime = load_native(tiny_llama_dir, torch.float32, backend=backend, prefill_chunk=4)
    runtime.reset(32)
    logits, features = runtime(ids, last_only=True, capture=(1, 0))
    assert logits.shape == (1, 1, 97) and features.shape == (1, 11, 128)
    torch.testing.assert_close(features, torch.cat([reference[1], reference[0]], dim=-1), atol=1e-4, rtol=0)
    runtime.reset(32)
    logits, hidden, features = runtime(ids, return_hidden=True, capture=(1,))
    assert hidden.shape == (1, 11, 64) and features.shape == (1, 11, 64)
    # index L (2 here) is the last layer's output: the final norm of it is the hidden state
    runtime.reset(32)
    _, hidden, features = runtime(ids, return_hidden=True, capture=(2,))
    normed = features * torch.rsqrt(features.pow(2).mean(-1, keepdim=True) + runtime.cfg.rms_norm_eps)
    torch.testing.assert_close(normed * runtime.weights.norm, hidden.float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(SpecDecodeError, match=r"capture layers must lie in 0..2"):
        runtime(ids[:, :1], capture=(3,))


def test_layer_skip_view_shares_weights(tiny_llama_dir):
    runtime = load_native(tiny_llama_dir, torch.float32)
    view = runtime.layer_skip_view(1)
    assert view.layers[0] is runtime.layers[0] and len(view.layers) == 1
    view.reset(16)
    runtime.reset(16)
    ids = torch.tensor([[3, 4, 5]])
    assert view(ids).shape == runtime(ids).shape
    assert view.k_cache.data_ptr() != runtime.k_cache.data_ptr()


def test_bf16_runtime_stays_close_to_fp32_reference(tiny_llama_dir):
    """bf16 (prepacked oneDNN weights where available) against transformers in fp32.
    bf16 keeps 8 bits of mantissa: relative error ~0.4% per op, so a loose bound."""
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    runtime = load_native(tiny_llama_dir, torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # packed on the CPU (never on a GPU: test_cuda)
        assert getattr(runtime.weights.layers[0].qkv, "packed_weight", None) is not None
    runtime.reset(32)
    ours = runtime(ids).float()
    reference = hf_logits(tiny_llama_dir, ids)
    assert (ours - reference).abs().max() < 0.05 * reference.abs().max()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("flag, name", [("attention_bias", "o_proj.bias"), ("mlp_bias", "mlp_bias")])
def test_checkpoint_tensors_the_runtime_does_not_implement_are_refused(tmp_path, flag, name):
    """A Llama checkpoint with attention_bias (which adds an o_proj bias) or mlp_bias must not
    load and silently compute wrong logits: the load is refused, naming what is unsupported."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.config import SpecDecodeError

    config = AutoConfig.for_model("llama", vocab_size=97, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, **{flag: True})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(SpecDecodeError, match=name.replace(".", r"\.")):
        load_native(tmp_path, torch.float32)


def test_unknown_checkpoint_tensor_is_named(tmp_path, tiny_llama_dir):
    """Any tensor left unused is refused by name (here an extra one added to a checkpoint)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdecode.config import SpecDecodeError

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, tmp_path / "m" / "model.safetensors")
    with pytest.raises(SpecDecodeError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_native(tmp_path / "m", torch.float32)


@pytest.mark.parametrize("key, value, name", [("intermediate_size", 256, "gate_proj.weight"),
                                              ("vocab_size", 300, "embed_tokens.weight"),
                                              ("num_key_value_heads", 4, "k_proj.weight")])
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, tiny_llama_dir, key, value, name):
    """config.json edited so that it no longer matches the checkpoint's tensors: the kernels
    had computed garbage without an error (found in review); the load is refused, naming the
    tensor and both shapes."""
    import shutil

    from specdecode.config import SpecDecodeError

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config[key] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    for backend in ("torch", "kernels"):
        with pytest.raises(SpecDecodeError, match=rf"{name.replace('.', '[.]')}' has shape .* config.json implies"):
            load_native(tmp_path / "m", torch.float32, backend=backend)


def test_bf16_weights_are_packed_for_the_cpu_at_load(tiny_llama_dir, monkeypatch):
    """load_native packs dense bf16 weights for oneDNN (a model bound for a GPU is moved
    there unpacked: test_cuda), whether or not this CPU's oneDNN takes bf16."""
    from specdecode.models.llama import LlamaWeights

    packed = []
    monkeypatch.setattr(LlamaWeights, "pack_for_cpu", lambda self: packed.append(self.device.type))
    load_native(tiny_llama_dir, torch.bfloat16)
    load_native(tiny_llama_dir, torch.float32)
    load_native(tiny_llama_dir, torch.bfloat16, "q8_0")
    assert packed == ["cpu"]  # once: bf16 dense only


def test_the_transformers_runtime_rolls_back_past_a_sliding_window():
    """Found in review: the native runtime sends sliding-window models to --runtime hf, whose
    cache then refused the first rollback past the window (a rejected draft) once the
    sequence was longer than it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.models.hf import HFRuntime

    torch.manual_seed(0)
    config = AutoConfig.for_model("mistral", vocab_size=97, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, sliding_window=16)
    runtime = HFRuntime(AutoModelForCausalLM.from_config(config).eval())
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    runtime.reset(64)
    straight = runtime(ids)[0, -1]
    runtime.reset(64)
    runtime(ids[:, :20])
    runtime(torch.tensor([[5, 6, 7]]))  # drafts, rejected
    runtime.rollback(20)
    assert torch.allclose(runtime(ids[:, 20:])[0, -1], straight, atol=1e-5)



def test_the_transformers_runtime_refuses_to_roll_back_a_recurrent_state(tiny_llama_dir):
    """Found in review: transformers' crop cuts a Mamba layer's state not at all (a TypeError
    from inside) and Qwen3-Next's linear attention only in part (greedy speculative output
    differed from plain, silently). A hybrid model (Bamba) is refused a speculative engine
    at once; plain decoding never rolls back and runs, with the positions generate() passes
    (found in review: without them Bamba's every step sat at position 0, output wrong)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.config import SamplingParams, SpecDecodeError
    from specdecode.engine import SpeculativeEngine
    from specdecode.models.hf import HFRuntime
    from specdecode.proposers.ngram import NgramProposer

    torch.manual_seed(0)
    config = AutoConfig.for_model("bamba", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  initializer_range=0.2, attn_layer_indices=[1], mamba_d_state=8, mamba_n_heads=8,
                                  mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=16)
    model = AutoModelForCausalLM.from_config(config).eval()
    runtime = HFRuntime(model)
    prompt, params = [5, 9, 14, 3, 7, 5, 9, 14, 3, 7, 5, 9, 14], SamplingParams(max_new_tokens=6, ignore_eos=True)
    expected = list(prompt)
    with torch.inference_mode():
        for _ in range(6):  # the whole sequence each time, no cache
            expected.append(int(model(input_ids=torch.tensor([expected]), use_cache=False).logits[0, -1].argmax()))
    assert SpeculativeEngine(runtime).generate(prompt, params).token_ids == expected[len(prompt):]
    assert runtime.rolls_back is False
    with pytest.raises(SpecDecodeError, match="keeps a recurrent state"):
        SpeculativeEngine(runtime, proposer=NgramProposer((2, 1)), k=4)
    # as a draft model beside a target that rolls back: refused before any request, naming the
    # draft (found in review: it failed at its first rejection, saying "use --method none")
    from specdecode.factory import load_model
    from specdecode.proposers.draft_model import DraftModelProposer

    target = load_model(tiny_llama_dir, torch.float32).runtime
    with pytest.raises(SpecDecodeError, match="the draft model .*bamba.* cannot draft"):
        SpeculativeEngine(target, proposer=DraftModelProposer(runtime), k=3)


def test_a_llama_family_model_the_native_runtime_cannot_compute_goes_through_transformers(tmp_path, capsys):
    """Found in review: a sliding-window Mistral (and the other configs refused with "use
    --runtime hf") could not be a draft model, whose runtime is always auto, nor go through
    `check`. With --runtime auto and no native-only flag it now loads through transformers,
    says so, and drafts token-identically to plain decoding."""
    from specdecode.config import ConfigError, EngineConfig, SamplingParams, SpeculativeConfig
    from specdecode.engine import SpeculativeEngine
    from specdecode.factory import build_proposer, load_model
    from specdecode.models.hf import HFRuntime

    mistral = save_tiny_model(tmp_path / "mistral", "mistral", seed=5)
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    loaded = load_model(str(mistral), torch.float32)
    assert isinstance(loaded.runtime, HFRuntime)
    assert "sliding attention window (8)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="runs through transformers"):
        load_model(str(mistral), torch.float32, weights="int8")
    target = load_model(str(save_tiny_model(tmp_path / "llama", "llama", seed=6)), torch.float32, backend="torch")
    proposer = build_proposer(SpeculativeConfig(method="draft", draft=str(mistral), k=3), target,
                              EngineConfig(model="x", dtype="fp32", backend="torch"))
    assert isinstance(proposer.runtime, HFRuntime)
    prompt, params = [5, 9, 14, 3, 7, 5, 9, 14, 3, 7, 5, 9, 14], SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = SpeculativeEngine(target.runtime).generate(prompt, params).token_ids
    assert SpeculativeEngine(target.runtime, proposer=proposer, k=3).generate(prompt, params).token_ids == plain


@pytest.mark.parametrize("model_type, sizes", [
    ("mamba", dict(hidden_size=32, state_size=8, num_hidden_layers=2)),  # its state in cache_params
    ("openai-gpt", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64)),  # no cache at all
])
def test_the_transformers_runtime_refuses_a_model_that_takes_no_cache(model_type, sizes):
    """Found in review: the cache went into the forward's **kwargs unread, every pass saw only
    its own tokens, and plain greedy output was silently wrong from the first token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.models.hf import HFRuntime

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=97, **sizes))
    with pytest.raises(SpecDecodeError, match="takes no past_key_values"):
        HFRuntime(model)


def test_the_transformers_runtime_reads_the_vocabulary_and_context_where_configs_keep_them():
    """Found in review: a Gemma 3 (multimodal) config keeps its vocabulary in its text config
    (an AttributeError traceback), and MPT its context as max_seq_len (read as 2,048, so a
    long prompt failed inside transformers instead of with a context-length error)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config

    from specdecode.config import SamplingParams
    from specdecode.engine import ContextLengthError, SpeculativeEngine
    from specdecode.models.hf import HFRuntime

    gemma = Gemma3Config(text_config=dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          max_position_embeddings=128),
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=28, patch_size=14),
                         mm_tokens_per_image=4, image_token_index=96, boi_token_index=94, eoi_token_index=95)
    runtime = HFRuntime(AutoModelForCausalLM.from_config(gemma))
    assert (runtime.vocab_size, runtime.max_positions) == (97, 128)
    # a context key set to 0 (here one MPT does not read) says nothing: the next key is taken
    mpt = AutoConfig.for_model("mpt", vocab_size=97, d_model=32, n_heads=2, n_layers=1, max_seq_len=32,
                               expansion_ratio=2, max_position_embeddings=0)
    runtime = HFRuntime(AutoModelForCausalLM.from_config(mpt))
    assert runtime.max_positions == 32
    with pytest.raises(ContextLengthError, match="context is 32 tokens"):
        SpeculativeEngine(runtime).generate(list(range(3, 43)), SamplingParams(max_new_tokens=4))


def test_a_longrope_model_past_its_original_context_and_a_stored_head_unlike_a_tied_one_are_refused(tmp_path):
    """Found in review: longrope's factors switch past the original context and the native
    runtime's single table did not (logits off by 8.8 at 200 tokens); a checkpoint whose
    config ties the head to the embedding but stores another lm_head computed with the
    embedding, where transformers uses the stored head (logits off by 34)."""
    import json

    from safetensors.torch import load_file, save_file

    from specdecode.config import SpecDecodeError
    from specdecode.models.llama import load_native

    path = save_tiny_model(tmp_path / "longrope", seed=1)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="'longrope' changes its factors past 64 positions"):
        load_native(path, torch.float32)

    tied = save_tiny_model(tmp_path / "tied", seed=2)
    tensors = load_file(str(tied / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecDecodeError, match="stores an lm_head.weight that differs"):
        load_native(tied, torch.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # stored, and equal: fine
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    load_native(tied, torch.float32)


def test_the_transformers_runtime_refuses_a_checkpoint_that_does_not_match_its_config(tmp_path):
    """Found in review: transformers initialises a missing tensor at random and drops an
    unexpected one (a line on stderr), so `--runtime hf` loaded a checkpoint whose config
    had lost its attention bias and computed logits 6.9 off. Both are refused by name."""
    from safetensors.torch import load_file, save_file

    from specdecode.factory import load_model
    from specdecode.models.loading import ModelNotFoundError

    path = save_tiny_model(tmp_path / "missing")
    load_model(str(path), torch.float32, "hf")  # the whole checkpoint loads
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError, match=r"missing keys: model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(path), torch.float32, "hf")
    for name in [name for name in tensors if name.startswith("model.layers.0.")][:5]:  # 6 missing: 4 named
        del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError, match=r"missing keys: (model\.layers\.[01]\.[a-z_.]+, ){3}"
                                                 r"model\.layers\.[01]\.[a-z_.]+ \(\+2 more\)\)$"):
        load_model(str(path), torch.float32, "hf")
    path = save_tiny_model(tmp_path / "extra")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(tensors["model.norm.weight"].shape)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text()).get("attention_bias") in (None, False)
    with pytest.raises(ModelNotFoundError, match=r"unexpected keys: model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_model(str(path), torch.float32, "hf")


def test_a_checkpoint_tensor_that_is_not_floating_point_is_refused(tmp_path):
    """Found in review: an int8 (or fp8) tensor under an ordinary name was cast to the
    runtime's dtype and loaded."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecDecodeError, match="'model.norm.weight' is stored as I8"):
        load_native(path, torch.float32)


def test_a_mistral_config_without_a_window_key_has_transformers_window(tmp_path):
    """transformers reads a Mistral config without `sliding_window` as a 4,096-token window;
    the native runtime loaded it as full attention (found in review), so the two parted
    beyond 4,096 tokens. It is refused as any window is; an explicit null still loads."""
    path = save_tiny_model(tmp_path / "mistral", "mistral", seed=4)
    load_native(path, torch.float32)  # "sliding_window": null
    config = json.loads((path / "config.json").read_text())
    del config["sliding_window"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match=r"sliding attention window \(4096\)"):
        load_native(path, torch.float32)


@pytest.mark.parametrize("rope, problem", [
    ({"rope_type": "linear"}, "RoPE parameters .* are not usable"),
    ({"rope_type": "linear", "factor": "2"}, "factor must be a positive number, got '2'"),
    ({"rope_type": "linear", "factor": 0}, "factor must be a positive number, got 0"),
    ([1, 2], "rope_scaling must be an object"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    # transformers' strict checks raise huggingface_hub's own error, no ValueError (a traceback before)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "64"}, "RoPE parameters .* are not usable"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1", "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, "RoPE parameters .* are not usable"),
])
def test_malformed_or_partial_rope_parameters_are_refused_by_name(tmp_path, rope, problem):
    """Found in review: a RoPE type without its factor, or a factor given as a string, ended
    in a KeyError or TypeError from transformers; a factor of 0 loaded and gave NaN logits;
    RoPE on half of each head built a table half as wide as the kernels read (past its end)."""
    path = save_tiny_model(tmp_path / "model", seed=1)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match=problem):
        load_native(path, torch.float32)


def test_a_config_without_a_context_length_gets_transformers_default_for_its_type():
    """Found in review: 2,048 positions for every type, where transformers gives a Qwen2
    config 32,768 and a Mistral one 131,072 (longer prompts refused on the native path only)."""
    from transformers import AutoConfig

    from specdecode.models.llama import LlamaConfig

    for model_type in ("llama", "mistral", "qwen2"):
        config = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=None).to_dict()
        expected = config.pop("max_position_embeddings")
        assert LlamaConfig.from_hf(config).max_positions == expected, model_type
        config["max_position_embeddings"] = None  # null: the default too (found in review: None)
        assert LlamaConfig.from_hf(config).max_positions == expected, model_type


def test_query_heads_not_a_multiple_of_the_kv_heads_are_refused_by_name(tmp_path):
    """Found in review: 4 query heads over 3 KV heads (weights shaped to match) ended in a
    torch RuntimeError traceback, after the kernels' refusal had named other limits."""
    from specdecode.models.llama import LlamaConfig

    config = json.loads((save_tiny_model(tmp_path / "model", seed=1) / "config.json").read_text())
    with pytest.raises(SpecDecodeError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        LlamaConfig.from_hf({**config, "num_key_value_heads": 3})


def test_a_checkpoint_of_bin_files_goes_through_transformers_under_runtime_auto(tmp_path):
    """Found in review: --runtime auto timed both formats on the native runtime, then failed
    naming safetensors, where --runtime hf loaded the checkpoint exactly."""
    from safetensors.torch import load_file

    from specdecode.factory import load_model

    path = save_tiny_model(tmp_path / "model", seed=2)
    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    loaded = load_model(str(path), torch.float32)
    assert type(loaded.runtime).__name__ != "NativeRuntime"
    reference = load_model(str(path), torch.float32, runtime="hf")
    ids = torch.tensor([[3, 5, 7, 9]])
    loaded.runtime.reset(8)
    reference.runtime.reset(8)
    assert torch.equal(loaded.runtime(ids), reference.runtime(ids))


def test_a_config_naming_fewer_layers_than_the_checkpoint_holds_says_so(tmp_path):
    """Found in review: the leftover layers were blamed on "an o_proj or MLP bias", with the
    advice --runtime hf, which refuses the checkpoint too."""
    path = save_tiny_model(tmp_path / "model", seed=1, num_layers=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(SpecDecodeError, match="holds layers up to 2 but its config.json names num_hidden_layers 2"):
        load_native(path, torch.float32)


def test_config_options_transformers_ignores_or_defaults_are_read_as_it_reads_them():
    """Found by a mutation audit: a Qwen2 window with use_sliding_window false (every real
    Qwen2 config) and a Mistral attention_bias (transformers' Mistral has no attention
    biases) load; an activation other than SiLU, or a top-level partial_rotary_factor, is
    refused; a config that leaves out rms_norm_eps, tie_word_embeddings or its RoPE
    parameters gets transformers' defaults for them."""
    from transformers import AutoConfig

    from specdecode.models.llama import LlamaConfig, NativeUnsupported

    def config(model_type, **extra):
        return {**AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       sliding_window=None).to_dict(), **extra}

    qwen2 = LlamaConfig.from_hf(config("qwen2", sliding_window=4096, use_sliding_window=False))
    assert qwen2.qkv_bias
    with pytest.raises(NativeUnsupported, match=r"sliding attention window \(4096\)"):
        LlamaConfig.from_hf(config("qwen2", sliding_window=4096, use_sliding_window=True,
                                   layer_types=["full_attention", "sliding_attention"]))
    assert not LlamaConfig.from_hf(config("mistral", attention_bias=True)).qkv_bias
    with pytest.raises(NativeUnsupported, match="hidden_act 'silu' only, got 'gelu'"):
        LlamaConfig.from_hf(config("llama", hidden_act="gelu"))
    # transformers moves a top-level partial_rotary_factor into the RoPE parameters
    with pytest.raises(NativeUnsupported, match="partial_rotary_factor 0.5"):
        LlamaConfig.from_hf(config("llama", partial_rotary_factor=0.5))
    for model_type in ("llama", "mistral", "qwen2"):
        defaults = AutoConfig.for_model(model_type)
        bare = config(model_type)
        for key in ("rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta"):
            bare.pop(key, None)
        cfg = LlamaConfig.from_hf(bare)
        assert (cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.rope) == (
            defaults.rms_norm_eps, defaults.tie_word_embeddings, defaults.rope_parameters), model_type


def _edited_tiny_model(path, seed, **config_changes):
    """A tiny Llama checkpoint whose config.json is then edited (None: the key removed)."""
    save_tiny_model(path, seed=seed)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    for key, value in config_changes.items():
        config.pop(key, None)
        if value is not None:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes", [
    # the older key "type" for the RoPE type
    {"rope_scaling": {"type": "linear", "factor": 4.0}},
    # yarn scales cos and sin by its attention factor (0.1 ln(factor) + 1)
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    # longrope up to (not past) its original context: its short factors throughout
    {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 256, "short_factor": [1.5] * 8,
                      "long_factor": [3.0] * 8}},
    # an eps large enough to move the logits, the final norm's too
    {"rms_norm_eps": 0.5},
], ids=["legacy-type-key", "yarn", "longrope-at-its-original-context", "rms-norm-eps"])
def test_rope_variants_and_norm_eps_compute_what_transformers_computes(tmp_path, changes):
    """Found by a mutation audit: each of these loaded, but nothing compared its logits
    with transformers' (a legacy "type" key read as default RoPE, yarn's cos/sin scaling
    dropped, a longrope model exactly at its original context refused, or the final norm
    given another eps all went unnoticed)."""
    path = _edited_tiny_model(tmp_path / "model", seed=12, **changes)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    runtime = load_native(path, torch.float32, backend="torch")
    runtime.reset(64)
    torch.testing.assert_close(runtime(ids), hf_logits(path, ids), atol=LOGITS_ATOL, rtol=0)


def test_a_head_dim_other_than_hidden_over_heads_is_read_and_computed(tmp_path):
    """Found by a mutation audit: every tiny model had head_dim = hidden_size / heads, so a
    config's own head_dim (Qwen3-style wide heads) went unchecked, as did the o_proj shape
    ([hidden, heads * head_dim]) that the loader expects."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=64, initializer_range=0.2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    runtime = load_native(tmp_path, torch.float32, backend="torch")
    assert runtime.cfg.head_dim == 32 and runtime.k_cache is None
    runtime.reset(16)
    assert runtime.k_cache.shape[-1] == 32
    torch.testing.assert_close(runtime(ids), hf_logits(tmp_path, ids), atol=LOGITS_ATOL, rtol=0)


def test_a_stored_rotary_inv_freq_buffer_is_skipped(tmp_path, tiny_llama_dir):
    """Found by a mutation audit: older checkpoints store each layer's
    rotary_emb.inv_freq buffer; it is not a parameter, and the load takes no notice of it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    for i in range(2):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, tmp_path / "m" / "model.safetensors")
    ids = torch.tensor([[3, 4, 5, 6]])
    runtime, reference = load_native(tmp_path / "m", torch.float32), load_native(tiny_llama_dir, torch.float32)
    runtime.reset(8)
    reference.reset(8)
    assert torch.equal(runtime(ids), reference(ids))


def test_a_two_token_pass_is_causal_and_a_pass_may_fill_the_cache_to_its_last_slot(tiny_llama_dir):
    """Found by a mutation audit: no test scored exactly two new tokens in one pass (a
    one-draft verification), whose first token must not see the second; nor filled a cache
    to its last slot; nor asked reset() for more slots than the model has positions."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(8))
    runtime.reset(16)
    full = runtime(ids)  # all 16 slots
    assert runtime.length == runtime.capacity == 16
    runtime.reset(16)
    runtime(ids[:, :5])
    torch.testing.assert_close(runtime(ids[:, 5:7]), full[:, 5:7], atol=LOGITS_ATOL, rtol=0)
    runtime.reset(1000)
    assert runtime.capacity == runtime.max_positions == 256


def test_a_layer_skip_view_needs_at_least_one_layer(tiny_llama_dir):
    """Found by a mutation audit: NativeRuntime's own check of the layer count (the CLI
    refuses self:0 before it) was untested; a view of no layers would score the embedding."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    for layers in (0, 3):
        with pytest.raises(SpecDecodeError, match=rf"layer count must be in 1..2, got {layers}"):
            runtime.layer_skip_view(layers)


def test_a_token_tree_wider_than_a_prefill_chunk_is_refused_by_name(tiny_llama_dir):
    """Found by a mutation audit: a tree is one pass under one [T, T] mask and cannot be cut
    into chunks; without the refusal the torch backend failed inside with a shape error."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch", prefill_chunk=2)
    runtime.reset(16)
    runtime(torch.tensor([[3, 4, 5]]))  # a chain longer than a chunk runs in chunks
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with pytest.raises(SpecDecodeError, match="a token tree of 3 nodes exceeds prefill_chunk = 2"):
        runtime(torch.tensor([[6, 7, 8]]), positions=torch.tensor([3, 4, 4]), tree_mask=tree_mask)
    assert runtime.length == 3


def test_one_token_steps_of_a_qwen2_add_its_qkv_biases(tmp_path):
    """Found by a mutation audit: a single new token goes through torch.mv (not F.linear),
    which adds the bias itself; every Qwen2 test scored several tokens at once, so a decode
    step without the q/k/v biases went unnoticed."""
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2", seed=4)
    _randomize_norms(model_dir)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(9))
    runtime = load_native(model_dir, torch.float32, backend="torch")
    runtime.reset(16)
    steps = torch.cat([runtime(ids[:, i : i + 1]) for i in range(ids.shape[1])], dim=1)
    torch.testing.assert_close(steps, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)


def test_bf16_weights_packed_for_the_cpu_keep_their_biases(tmp_path):
    """Found by a mutation audit: the oneDNN-packed bf16 projections (pack_for_cpu) take the
    bias in their own call; only Llama was run packed, so a Qwen2's q/k/v biases could be
    dropped there unnoticed. Packed and plain bf16 weights compute the same logits."""
    from specdecode.models.llama import LlamaWeights, NativeRuntime

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU's oneDNN takes no bf16: nothing is packed")
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2", seed=4)
    _randomize_norms(model_dir)
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(9))
    packed = load_native(model_dir, torch.bfloat16)
    assert packed.weights.layers[0].qkv.packed_weight is not None and packed.weights.layers[0].qkv.bias is not None
    config = json.loads((model_dir / "config.json").read_text())
    plain = NativeRuntime(LlamaWeights.from_pretrained(model_dir, config, torch.bfloat16))
    assert getattr(plain.weights.layers[0].qkv, "packed_weight", None) is None
    for runtime in (packed, plain):
        runtime.reset(16)
    # identical here; a few bf16 steps apart at most elsewhere (a dropped bias moved them by 1.8)
    torch.testing.assert_close(packed(ids).float(), plain(ids).float(), atol=0.25, rtol=0)


def test_explicit_positions_over_several_prefill_chunks_are_cut_with_the_tokens(tiny_llama_dir):
    """Found by a mutation audit: positions given for a pass longer than a prefill chunk
    (no tree) were never run; each chunk takes its own slice of them."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch", prefill_chunk=2)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(10))
    runtime.reset(8)
    implicit = runtime(ids)
    runtime.reset(8)
    torch.testing.assert_close(runtime(ids, positions=torch.arange(5)), implicit, atol=0, rtol=0)


def test_a_reset_to_another_batch_size_makes_a_cache_of_that_many_rows(tiny_llama_dir):
    """Found by a mutation audit: a runtime reset to more rows at the same capacity (a
    single-sequence engine's runtime then taken by a batched one) kept its one-row cache."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    ids = torch.randint(0, 97, (2, 4), generator=torch.Generator().manual_seed(11))
    runtime.reset(16)
    single = runtime(ids[:1])
    runtime.reset(16, batch=2)
    assert runtime.k_cache.shape[1] == runtime.v_cache.shape[1] == 2
    both = runtime(ids)
    torch.testing.assert_close(both[:1], single, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_a_pass_with_another_row_count_than_the_cache_is_refused_by_name(tiny_llama_dir, backend):
    """Found in review: one row through a cache reset for two failed in the torch backend
    with a matmul shape error (the kernels refused it by name); and two rows through a
    one-row cache."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend=backend)
    runtime.reset(16, batch=2)
    with pytest.raises(SpecDecodeError, match="batch of 1 rows, but the cache was reset for 2"):
        runtime(torch.tensor([[3, 4]]))
    runtime.reset(16)
    with pytest.raises(SpecDecodeError, match="batch of 2 rows, but the cache was reset for 1"):
        runtime(torch.tensor([[3, 4], [5, 6]]))
    assert runtime.length == 0
    runtime(torch.tensor([[3, 4]]))
    assert runtime.length == 2


def test_a_prefill_chunk_of_zero_and_a_row_starting_before_slot_zero_are_refused(tiny_llama_dir):
    """Found by a mutation audit: neither refusal was tested; without them a chunk of 0
    failed inside range(), and a negative start wrapped round to the cache's last slots and
    the RoPE table's last positions, computing logits without an error."""
    from specdecode.config import ConfigError
    from specdecode.models.llama import NativeRuntime

    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    with pytest.raises(ConfigError, match="prefill_chunk must be >= 1, got 0"):
        NativeRuntime(runtime.weights, prefill_chunk=0)
    runtime.reset(16, batch=2)
    with pytest.raises(SpecDecodeError, match="exceeds the KV cache capacity"):
        runtime.forward_rows(torch.tensor([[3, 4]]), [1], [-1])
    with pytest.raises(ValueError, match="cannot roll back to -1"):
        runtime.rollback(-1)


def test_a_whole_row_may_be_copied_and_a_negative_capture_layer_is_refused(tiny_llama_dir):
    """Found by a mutation audit: copy_prefix of a row's every slot (length = capacity)
    and the lower bound of the capture layers were untested."""
    runtime = load_native(tiny_llama_dir, torch.float32, backend="torch")
    runtime.reset(8, batch=2)
    runtime.forward_rows(torch.arange(3, 11)[None], [0], [0])
    runtime.copy_prefix(0, 1, 8)
    assert torch.equal(runtime.k_cache[:, 1], runtime.k_cache[:, 0])
    assert torch.equal(runtime.v_cache[:, 1], runtime.v_cache[:, 0])
    with pytest.raises(SpecDecodeError, match="cannot copy 9 slots"):
        runtime.copy_prefix(0, 1, 9)
    runtime.reset(8)
    with pytest.raises(SpecDecodeError, match=r"capture layers must lie in 0..2, got \(-1,\)"):
        runtime(torch.tensor([[3, 4]]), capture=(-1,))


def test_a_qwen2_that_slides_with_no_window_named_is_refused_as_transformers_gives_it_one(tmp_path):
    """Qwen2Config gives use_sliding_window = true without a sliding_window a 4,096-token
    window on its upper layers; the native runtime read it as full attention and loaded it
    (the runtimes would part beyond 4,096 tokens; found in a mutation audit). Without
    use_sliding_window the absent window stays off, as in transformers."""
    qwen = save_tiny_model(tmp_path / "qwen2", "qwen2", seed=3)
    config = json.loads((qwen / "config.json").read_text())
    config.pop("sliding_window", None)
    (qwen / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    load_native(qwen, torch.float32, backend="torch")
    config.pop("layer_types", None)  # Qwen2Config computes them from max_window_layers
    (qwen / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "max_window_layers": 1}))
    with pytest.raises(SpecDecodeError, match=r"sliding attention window \(4096\)"):
        load_native(qwen, torch.float32)


@pytest.mark.parametrize("layers", [{"max_window_layers": 2}, {"layer_types": ["full_attention"] * 2}])
def test_a_qwen2_whose_window_reaches_no_layer_loads_as_full_attention(tmp_path, layers):
    """Qwen2 slides only the layers from max_window_layers (default 28) up, or those its
    layer_types name: with use_sliding_window and a window of 4 over 2 layers of full
    attention, transformers attends to all 13 tokens, and so must the native runtime (it
    refused every Qwen2 with use_sliding_window). One sliding layer is still refused."""
    qwen = save_tiny_model(tmp_path / "qwen2", "qwen2", seed=3)
    config = json.loads((qwen / "config.json").read_text())
    config.pop("layer_types", None)
    (qwen / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 4,
                                                  **layers}))
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(4))
    runtime = load_native(qwen, torch.float32, backend="torch")
    runtime.reset(64)
    torch.testing.assert_close(runtime(ids), hf_logits(qwen, ids), atol=LOGITS_ATOL, rtol=0)
    sliding = {"max_window_layers": 1} if "max_window_layers" in layers else {
        "layer_types": ["full_attention", "sliding_attention"]}
    (qwen / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 4,
                                                  **sliding}))
    with pytest.raises(SpecDecodeError, match=r"sliding attention window \(4\)"):
        load_native(qwen, torch.float32)


def test_the_transformers_runtime_keeps_the_native_runtimes_interface(tiny_llama_dir):
    """Found in a mutation audit, untested: the transformers adapter's own guards and output
    shapes. ``last_only`` gives one row of logits (and of hidden states), the cache holds at
    most the model's context whatever capacity is asked, a pass past it and a rollback past
    the length are refused, and so are explicit positions (chains only); a rollback cuts the
    cache so the next pass continues from the kept tokens."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.hf import HFRuntime

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    runtime = HFRuntime(model)
    assert runtime.max_positions == 256
    runtime.reset(10_000)
    assert runtime.capacity == 256
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    logits, hidden = runtime(ids[:, :8], last_only=True, return_hidden=True)
    assert logits.shape == (1, 1, 97) and hidden.shape == (1, 1, 64) and runtime.length == 8
    full = hf_logits(tiny_llama_dir, ids)
    torch.testing.assert_close(logits[0, 0], full[0, 7], atol=LOGITS_ATOL, rtol=0)
    with pytest.raises(ValueError, match="cannot roll back to 9; cache holds 8"):
        runtime.rollback(9)
    with pytest.raises(SpecDecodeError, match="chain drafts only"):
        runtime(ids[:, 8:9], positions=torch.tensor([8]))
    assert runtime.length == 8
    runtime(ids[:, 8:11])  # three drafts, then two of them rejected
    runtime.rollback(9)
    torch.testing.assert_close(runtime(ids[:, 9:12]), full[:, 9:12], atol=LOGITS_ATOL, rtol=0)
    with pytest.raises(SpecDecodeError, match="sequence of 257 tokens exceeds the context 256"):
        runtime(torch.zeros(1, 245, dtype=torch.int64))


def _tiny_gpt2():
    """A GPT-2: learned absolute positions, so a wrong position changes the logits (rope
    models see only relative positions, and a shift of all of them changes nothing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                  initializer_range=0.2, bos_token_id=1, eos_token_id=1)
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_transformers_runtime_reads_a_missing_context_as_2048_and_refuses_a_missing_vocabulary():
    """Found in a mutation audit, untested: a config that names no context length is taken
    as 2,048 tokens, and one that names no vocabulary size is refused by name (not a
    None vocabulary that fails later)."""
    from specdecode.models.hf import HFRuntime

    model = _tiny_gpt2()
    # past the config's own checks (a None is refused when set): no context key at all
    # (max_position_embeddings is n_positions' alias), then no vocabulary either
    model.config.__dict__["n_positions"] = None
    assert HFRuntime(model).max_positions == 2048
    model.config.__dict__["vocab_size"] = None
    with pytest.raises(SpecDecodeError, match="gpt2's config names no vocabulary size"):
        HFRuntime(model)


def test_the_transformers_runtime_passes_each_token_its_absolute_position():
    """Found in a mutation audit: the positions given to the model were checked only on a
    rope model (Llama), where shifting all of them by one changes no logit. On GPT-2 the
    logits of a prompt fed in parts, with a rolled-back draft between, are those of the
    whole sequence in one uncached pass."""
    from specdecode.models.hf import HFRuntime

    model = _tiny_gpt2()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits
    runtime = HFRuntime(model)
    runtime.reset(64)
    torch.testing.assert_close(runtime(ids[:, :6]), full[:, :6], atol=LOGITS_ATOL, rtol=0)
    runtime(torch.tensor([[1, 2]]))  # drafts, rejected
    runtime.rollback(6)
    torch.testing.assert_close(runtime(ids[:, 6:]), full[:, 6:], atol=LOGITS_ATOL, rtol=0)


def test_the_transformers_runtime_fills_its_context_exactly_and_refuses_a_tree_mask():
    """Found in a mutation audit, untested: a sequence of exactly the capacity fits (the
    next token does not), and a tree mask is refused as explicit positions are (the
    adapter runs chain drafts only)."""
    from specdecode.models.hf import HFRuntime

    runtime = HFRuntime(_tiny_gpt2())
    runtime.reset(8)
    with pytest.raises(SpecDecodeError, match="chain drafts only"):
        runtime(torch.tensor([[1, 2]]), tree_mask=torch.ones(2, 2, dtype=torch.bool))
    assert runtime.length == 0
    runtime(torch.arange(1, 9)[None])
    assert runtime.length == 8
    with pytest.raises(SpecDecodeError, match="sequence of 9 tokens exceeds the context 8"):
        runtime(torch.tensor([[3]]))


def test_the_transformers_runtime_returns_the_same_hidden_states_as_the_native_runtime(tiny_llama_dir):
    """Found in a mutation audit: only the shape of the hidden states was checked. They are
    the last layer's, normalised, as the native runtime returns them: for every token, and
    for the last one alone with ``last_only``."""
    from transformers import AutoModelForCausalLM

    from specdecode.models.hf import HFRuntime

    runtime = HFRuntime(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32))
    native = load_native(tiny_llama_dir, torch.float32)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(11))
    runtime.reset(16)
    native.reset(16)
    _, hidden = runtime(ids[:, :4], return_hidden=True)
    _, expected = native(ids[:, :4], return_hidden=True)
    assert hidden.shape == (1, 4, 64)
    torch.testing.assert_close(hidden, expected, atol=LOGITS_ATOL, rtol=0)
    _, hidden = runtime(ids[:, 4:], last_only=True, return_hidden=True)
    _, expected = native(ids[:, 4:], return_hidden=True)
    torch.testing.assert_close(hidden, expected[:, -1:], atol=LOGITS_ATOL, rtol=0)


def test_the_transformers_runtime_refuses_a_rollback_into_a_recurrent_state():
    """Found in a mutation audit, untested: the runtime itself refuses to cut a recurrent
    state back (not only the engine, before it drafts); a rollback to the current length
    cuts nothing and is taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.models.hf import HFRuntime

    torch.manual_seed(0)
    config = AutoConfig.for_model("bamba", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  attn_layer_indices=[1], mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16,
                                  mamba_n_groups=1, mamba_chunk_size=16)
    runtime = HFRuntime(AutoModelForCausalLM.from_config(config).eval())
    runtime.reset(32)
    runtime(torch.tensor([[5, 9, 14, 3, 7]]))
    runtime.rollback(5)
    with pytest.raises(SpecDecodeError, match="bamba keeps a recurrent state that cannot be rolled back"):
        runtime.rollback(3)
    assert runtime.length == 5


def test_the_transformers_runtime_loads_the_weights_in_the_dtype_asked(tiny_llama_dir):
    """Found in a mutation audit, untested: --runtime hf loads the checkpoint in --dtype (the
    tiny checkpoint is stored in fp32), names it bare in the profile key, and does not claim
    batch invariance (``exact``: repeats under adaptive k may differ)."""
    from specdecode.factory import load_model

    runtime = load_model(tiny_llama_dir, torch.bfloat16, runtime="hf").runtime
    assert runtime.dtype == torch.bfloat16 and next(runtime.model.parameters()).dtype == torch.bfloat16
    assert runtime.weight_format == "bfloat16" and runtime.describe() == "transformers, bfloat16"
    assert runtime.exact is False
