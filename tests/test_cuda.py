"""The same engine on a GPU (--device cuda: torch backend). Skipped where torch sees no GPU;
CI has none. Where one is lent, run: pytest tests/test_cuda.py"""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import SamplingParams
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def test_cuda_greedy_speculation_equals_plain_and_the_cpu(tmp_path):
    path = save_tiny_model(tmp_path / "t", seed=10, num_layers=3)
    gpu = load_model(path, torch.float32, device="cuda")
    cpu = load_model(path, torch.float32, backend="torch")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5]
    plain = SpeculativeEngine(gpu.runtime).generate(prompt, params).token_ids
    assert gpu.runtime.backend == "torch" and gpu.runtime.k_cache.device.type == "cuda"
    assert plain == SpeculativeEngine(cpu.runtime).generate(prompt, params).token_ids
    for proposer in (NgramProposer(), DraftModelProposer(gpu.runtime.layer_skip_view(1))):
        assert SpeculativeEngine(gpu.runtime, proposer=proposer, k=4).generate(prompt, params).token_ids == plain


def test_cuda_sampling_is_seeded(tmp_path):
    path = save_tiny_model(tmp_path / "t", seed=11, num_layers=2)
    gpu = load_model(path, torch.float32, device="cuda")
    engine = SpeculativeEngine(gpu.runtime, proposer=DraftModelProposer(gpu.runtime.layer_skip_view(1)), k=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=20, seed=3, ignore_eos=True)
    assert engine.generate([5, 6, 7], params).token_ids == engine.generate([5, 6, 7], params).token_ids


def test_cuda_bf16_leaves_the_cpu_packing_out(tmp_path):
    """bf16 weights are prepacked for oneDNN on the CPU only: a packed copy left behind on
    the CPU made every projection of a bf16 model on the GPU fail."""
    path = save_tiny_model(tmp_path / "t", seed=12, num_layers=2)
    gpu = load_model(path, torch.bfloat16, device="cuda")
    weights = gpu.runtime.weights
    assert all(getattr(linear, "packed_weight", None) is None
               for layer in weights.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
    engine = SpeculativeEngine(gpu.runtime, proposer=NgramProposer(), k=3)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert len(engine.generate([5, 9, 11, 5, 9, 11], params).token_ids) == 12
