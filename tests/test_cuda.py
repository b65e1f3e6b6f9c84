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
    assert gpu.runtime.describe() != cpu.runtime.describe()  # it keys the cost profile
    hf_gpu = load_model(path, torch.float32, runtime="hf", device="cuda")  # the transformers runtime too
    assert hf_gpu.runtime.describe() != load_model(path, torch.float32, runtime="hf").runtime.describe()
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


def eagle_on(device: str, tmp_path, attach=None) -> None:
    """EAGLE chains, dynamic trees and merged trees through the factory on ``device``:
    greedy equal to plain, seeded sampling repeatable (written for the GPU; runs anywhere).
    ``attach(runtime)`` gives the target graphs where the device does not."""
    from specdecode.config import SpeculativeConfig
    from specdecode.factory import build_proposer
    from test_eagle import random_head

    target = load_model(save_tiny_model(tmp_path / "t", seed=13, num_layers=3), torch.float32, backend="torch",
                        device=device)
    if attach is not None:
        attach(target.runtime)
    random_head(target, seed=0).save(tmp_path / "head")
    prompt = [5, 9, 11, 5, 9, 11, 5]
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=20, seed=3, ignore_eos=True)
    plain = SpeculativeEngine(target.runtime).generate(prompt, greedy).token_ids
    drafted = 0
    for method, width in (("eagle", 1), ("eagle", 3), ("tree", 3)):
        spec = SpeculativeConfig(method=method, draft=str(tmp_path / "head"), tree_width=width)
        engine = SpeculativeEngine(target.runtime, proposer=build_proposer(spec, target, None), k=4)
        result = engine.generate(prompt, greedy)
        assert result.token_ids == plain, (method, width)
        drafted += result.stats.draft_tokens
        assert engine.generate(prompt, sampled).token_ids == engine.generate(prompt, sampled).token_ids
    assert drafted > 0


def test_cuda_eagle_chains_and_trees(tmp_path):
    eagle_on("cuda", tmp_path)


def batch_on(device: str, tmp_path, prepare=None):
    """The serving engine on ``device``: concurrent greedy requests, plain and with prompt
    lookup, each equal to its output alone; seeded sampled rows with a sampling drafter
    (the request's generator on the device) repeatable. ``prepare(runtime)`` runs before
    (tests/test_cuda_graphs.py gives the CPU runtime graphs); returns the runtime."""
    import random

    from specdecode.models.llama import load_native
    from specdecode.serve.batch import BatchEngine

    path = save_tiny_model(tmp_path / "b", seed=14, num_layers=2)
    runtime = load_native(path, torch.float32, "fp32", "torch", prefill_chunk=16, device=device)
    if prepare is not None:
        prepare(runtime)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randint(2, 6))] * rng.randint(1, 4) for _ in range(8)]
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    alone = [SpeculativeEngine(runtime).generate(p, greedy).token_ids for p in prompts]
    engine = BatchEngine(runtime, max_num_seqs=4, max_model_len=128, make_drafter=NgramProposer,
                         make_policy=lambda: 3)
    sequences = [engine.add(p, greedy, speculate=i % 2 == 0) for i, p in enumerate(prompts)]
    engine.run()
    assert [s.generated for s in sequences] == alone
    sampled = SamplingParams(temperature=0.9, max_new_tokens=16, seed=5, ignore_eos=True)

    def run_sampled() -> list[list[int]]:
        engine = BatchEngine(runtime, max_num_seqs=4, max_model_len=128,
                             make_drafter=lambda: DraftModelProposer(runtime.layer_skip_view(1)), make_policy=lambda: 2)
        rows = [engine.add(p, sampled) for p in prompts[:3]]
        engine.run()
        return [s.generated for s in rows]

    assert run_sampled() == run_sampled()
    return runtime


def test_cuda_batch_engine(tmp_path):
    batch_on("cuda", tmp_path)


def test_cuda_bandwidth_is_the_gpus():
    """The profile's T = 1 bound reads the weights where they are: on the GPU, its memory
    (an H200 read ~4 TB/s; the host behind it 172 GB/s)."""
    from specdecode.cost.profile import measure_bandwidth

    assert measure_bandwidth(device="cuda") > 2 * measure_bandwidth(device="cpu")


def graphs_on(device: str, tmp_path, attach=None) -> None:
    """Small steps replay recorded CUDA graphs by default on the GPU (models/cuda_graphs.py):
    each replay computes the eager step's logits (chains, a tree, after a new cache), greedy
    output equals the eager runtime's (fp32), with and without speculation, and bf16 runs
    through them too. ``attach(runtime)`` gives a runtime graphs where the device does not
    (tests/test_cuda_graphs.py runs this on the CPU with a stand-in recorder)."""
    path = save_tiny_model(tmp_path / "t", seed=15, num_layers=3)
    graphed = load_model(path, torch.float32, backend="torch", device=device).runtime
    eager = load_model(path, torch.float32, backend="torch", device=device, cuda_graphs=False).runtime
    if attach is not None:
        attach(graphed)
    assert graphed.graphs is not None and eager.graphs is None
    if device == "cuda":
        assert "CUDA graphs" in graphed.describe() and "CUDA graphs" not in eager.describe()
    prompt = torch.tensor([[5, 9, 11, 5, 9, 11, 5]])
    for runtime in (graphed, eager):
        runtime.reset(64)
        runtime(prompt)
    for step in ([[7]], [[8, 9, 10]], [[11]], [[12]]):
        ids = torch.tensor(step)
        torch.testing.assert_close(graphed(ids), eager(ids), rtol=1e-5, atol=1e-5)
    assert graphed.graphs.captures == 1 and graphed.graphs.replays == 2  # a shape is recorded on its second call
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = SpeculativeEngine(eager).generate(prompt[0].tolist(), params).token_ids
    assert SpeculativeEngine(graphed).generate(prompt[0].tolist(), params).token_ids == plain
    for proposer in (NgramProposer(), DraftModelProposer(graphed.layer_skip_view(1))):
        engine = SpeculativeEngine(graphed, proposer=proposer, k=4)
        assert engine.generate(prompt[0].tolist(), params).token_ids == plain
    for runtime in (graphed, eager):  # a new cache drops the graphs and their pool; recording starts over
        runtime.reset(200, batch=2)
        runtime.reset(200)
    assert not graphed.graphs.graphs
    captures = graphed.graphs.captures
    for step in ([[7]], [[8]], [[9]], [[10]]):  # (the shape was recorded before: once eagerly, then again)
        torch.testing.assert_close(graphed(torch.tensor(step)), eager(torch.tensor(step)), rtol=1e-5, atol=1e-5)
    assert not graphed.graphs.disabled and graphed.graphs.captures == captures + 1
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for _ in range(3):  # a tree replayed from its second call
        ids = torch.tensor([[13, 14, 15, 16]])
        outputs = [runtime(ids, positions=runtime.length + torch.tensor([0, 1, 1, 2]), tree_mask=tree)
                   for runtime in (graphed, eager)]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
        for runtime in (graphed, eager):
            runtime.compact(torch.tensor([runtime.length - 4, runtime.length - 2]), runtime.length - 4)
    assert graphed.graphs.captures == captures + 2 and not graphed.graphs.disabled
    bf16 = load_model(path, torch.bfloat16, backend="torch", device=device).runtime
    if attach is not None:
        attach(bf16)
    engine = SpeculativeEngine(bf16, proposer=NgramProposer(), k=3)
    assert len(engine.generate(prompt[0].tolist(), params).token_ids) == 30 and bf16.graphs.replays > 0


def test_cuda_graphs_replay_what_the_eager_steps_compute(tmp_path):
    graphs_on("cuda", tmp_path)
