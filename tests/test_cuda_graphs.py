"""The CUDA-graph step (models/cuda_graphs.py), checked on the CPU.

A graph replays one recorded step with the same shapes and addresses, so two things can
go wrong without a GPU in sight: the context-independent step it records
(``NativeRuntime._forward_static``) may compute something else than the eager step, and
the bookkeeping around it (static inputs copied in, outputs copied out, the length, one
graph per shape, graphs dropped with their cache) may be off. Both are tested here with a
recorder that replays by running the recorded step again; tests/test_cuda.py records real
graphs where a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import SamplingParams
from specdecode.engine import SpeculativeEngine
from specdecode.models.cuda_graphs import CudaGraphs
from specdecode.models.llama import load_native
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer


class Rerun:
    """A stand-in for a recorded graph: ``replay`` runs the step again and writes its
    results into the first run's output tensors, as a graph writes into its own."""

    def __init__(self, step):
        self.step = step
        out = step()
        self.outputs = out if isinstance(out, tuple) else (out,)

    def replay(self):
        out = self.step()
        for mine, new in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            mine.copy_(new)


@pytest.fixture
def rerun(monkeypatch):
    monkeypatch.setattr(CudaGraphs, "_record", lambda self, step: (lambda g: (g, g.outputs))(Rerun(step)))


def runtime_pair(tmp_path, seed=30, layers=3, attentions=("sdpa", "matmul")):
    path = save_tiny_model(tmp_path / "t", seed=seed, num_layers=layers)
    eager = load_native(path, torch.float32, "fp32", "torch", prefill_chunk=32)
    graphed = load_native(path, torch.float32, "fp32", "torch", prefill_chunk=32)
    assert graphed.graphs is None  # on the CPU: graphs are for CUDA devices
    graphed.graphs = CudaGraphs(graphed, max_tokens=16, record_after=0, attentions=attentions)
    return eager, graphed


@pytest.mark.parametrize("attentions", [("sdpa",), ("matmul",), ("sdpa", "matmul")])
def test_static_step_computes_the_eager_step(tmp_path, rerun, attentions):
    """Chains, single tokens, trees with explicit positions, features and hidden states:
    the same logits, cache entries and length as the eager path, at several lengths, with
    either attention recorded (and with both, the one the timing kept)."""
    eager, graphed = runtime_pair(tmp_path, attentions=attentions)
    generator = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for runtime in (eager, graphed):
        runtime.reset(64)
    prompt = torch.randint(3, 90, (1, 20), generator=generator)
    for runtime in (eager, graphed):  # longer than max_tokens: both run it eagerly
        runtime(prompt)
    assert graphed.graphs.captures == 0
    steps = [
        dict(num=1, kwargs=dict(last_only=True)),
        dict(num=5, kwargs=dict(return_hidden=True, capture=(0, 2, 3))),
        dict(num=1, kwargs=dict(last_only=True)),
        dict(num=4, kwargs=dict(tree_mask=tree, positions=None, capture=(1,))),
        dict(num=1, kwargs=dict(last_only=True)),
    ]
    for step in steps:
        ids = torch.randint(3, 90, (1, step["num"]), generator=generator)
        kwargs = dict(step["kwargs"])
        if "positions" in kwargs:
            kwargs["positions"] = eager.length + torch.tensor([0, 1, 1, 2])
        out_eager, out_graphed = eager(ids, **kwargs), graphed(ids, **kwargs)
        assert type(out_eager) is type(out_graphed)
        for a, b in zip(out_eager if isinstance(out_eager, tuple) else (out_eager,),
                        out_graphed if isinstance(out_graphed, tuple) else (out_graphed,)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert eager.length == graphed.length
        if "tree_mask" in kwargs:  # keep the tree's path 0 -> 2 -> 3, as the engine does
            start = eager.length - 4
            for runtime in (eager, graphed):
                runtime.compact(torch.tensor([start, start + 2, start + 3]), start)
    length = eager.length
    torch.testing.assert_close(eager.k_cache[..., :length, :], graphed.k_cache[..., :length, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager.v_cache[..., :length, :], graphed.v_cache[..., :length, :], rtol=1e-5, atol=1e-5)
    assert graphed.graphs.captures == 3 and graphed.graphs.replays == 5  # T=1 captured once, replayed 3 times
    assert all(set(seconds) == set(attentions) for seconds in graphed.graphs.choices.values())


def test_graph_outputs_are_copies_and_graphs_follow_their_cache(tmp_path, rerun):
    eager, graphed = runtime_pair(tmp_path, seed=31)
    graphed.reset(40)
    graphed(torch.tensor([[5, 6, 7]]))
    first = graphed(torch.tensor([[8]]))
    kept = first.clone()
    graphed(torch.tensor([[9]]))  # the same graph again: its output tensor is overwritten
    assert torch.equal(first, kept)
    assert graphed.graphs.captures == 2
    graphed.reset(200)  # within the capacity a runtime with graphs allocates (all 256 here): the graphs stay
    assert graphed.capacity == 256
    graphed(torch.tensor([[5, 6, 7]]))
    assert graphed.graphs.captures == 2
    graphed.reset(200, batch=2)  # a new cache: graphs recorded over the old one are dropped
    graphed.reset(200)
    assert graphed(torch.tensor([[5, 6, 7]])).shape[1] == 3
    assert graphed.graphs.captures == 3 and len(graphed.graphs.graphs) == 1
    graphed.graphs.max_graphs = 2
    for count in (1, 2, 4):
        graphed(torch.arange(5, 5 + count)[None])
    assert len(graphed.graphs.graphs) == 2 and graphed.graphs.captures == 6


def test_greedy_speculation_through_graphs_equals_eager_plain(tmp_path, rerun):
    """The engine's steps through the graph path: plain, prompt lookup and a layer-skip
    draft (its own runtime view, graphed too) give the eager plain output."""
    eager, graphed = runtime_pair(tmp_path, seed=32)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9]
    plain = SpeculativeEngine(eager).generate(prompt, params).token_ids
    assert SpeculativeEngine(graphed).generate(prompt, params).token_ids == plain
    draft = graphed.layer_skip_view(1)
    draft.graphs = CudaGraphs(draft, max_tokens=16)  # the default: recorded on a shape's second call
    for proposer, k in ((NgramProposer(), 4), (DraftModelProposer(draft), 3)):
        engine = SpeculativeEngine(graphed, proposer=proposer, k=k)
        result = engine.generate(prompt, params)
        assert result.token_ids == plain
        assert result.stats.draft_tokens > 0
    assert graphed.graphs.replays > 0 and draft.graphs.replays > 0


def test_prefill_runs_eagerly_whatever_its_length(tmp_path, rerun):
    """Found in review: a prompt's last prefill chunk (last_only over its few tokens) was
    recorded like a decode step. Each prompt length is a shape of its own and seldom comes
    back, so the recordings cost several eager steps each and crowded the kept graphs."""
    eager, graphed = runtime_pair(tmp_path, seed=39)
    for runtime in (eager, graphed):
        runtime.reset(64, batch=2)
    for count in (3, 3, 3, 5, 5):  # the same short prompt lengths again and again
        for row in (0, 1):
            ids = torch.arange(5, 5 + count)[None]
            for runtime in (eager, graphed):
                out = runtime.forward_rows(ids, [row], [0], last_only=True)
            torch.testing.assert_close(out, eager.forward_rows(ids, [row], [0], last_only=True))
    graphed.reset(64)
    for _ in range(3):
        graphed.reset(64)
        graphed(torch.tensor([[5, 6, 7, 8]]), last_only=True)  # the single-sequence prompt
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0
    graphed(torch.tensor([[9]]), last_only=True)  # a decode step (one token) is recorded as ever
    assert graphed.graphs.captures == 1
    # and so is a draft model's catch-up after a fully accepted step: its last draft and the
    # bonus token, last_only (found in review: sent eagerly by the first version of this rule)
    for _ in range(3):
        graphed(torch.tensor([[10, 11]]), last_only=True)
    assert graphed.graphs.captures == 2 and graphed.graphs.replays == 4  # (a recording replays once)


def test_a_shape_is_recorded_on_its_second_call(tmp_path, rerun):
    """A shape met once (a short prompt's length) runs eagerly; the second call of a shape
    records it, and later calls replay it."""
    _, graphed = runtime_pair(tmp_path, seed=33)
    graphed.graphs = CudaGraphs(graphed, max_tokens=16)
    graphed.reset(40)
    for ids in ([[5, 6, 7, 8, 9]], [[10]], [[11]], [[12]], [[13]]):
        graphed(torch.tensor(ids))
    assert graphed.graphs.captures == 1 and graphed.graphs.replays == 3
    assert graphed.length == 9


def test_a_step_that_cannot_be_recorded_runs_eagerly_from_then_on(tmp_path, monkeypatch, capsys):
    eager, graphed = runtime_pair(tmp_path, seed=34)

    def refuse(self, step):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(CudaGraphs, "_record", refuse)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9]
    assert SpeculativeEngine(graphed).generate(prompt, params).token_ids == \
        SpeculativeEngine(eager).generate(prompt, params).token_ids
    assert graphed.graphs.disabled and not graphed.graphs.graphs
    assert graphed.describe() == eager.describe()  # (the profile's key does not move mid-session)
    assert "recording a CUDA graph failed (operation not permitted when stream is capturing)" in capsys.readouterr().err


@pytest.mark.parametrize("faster", ["sdpa", "matmul"])
def test_each_shape_keeps_the_attention_its_replays_time_faster(tmp_path, monkeypatch, rerun, faster):
    """Both attentions are recorded per shape and timed; the faster is replayed from then
    on, and the profile reads the choice per T."""
    monkeypatch.setattr(CudaGraphs, "_time", lambda self, graph: 1.0 if graph.step.__defaults__[0] == faster else 2.0)
    eager, graphed = runtime_pair(tmp_path, seed=35)
    kept = []
    monkeypatch.setattr(type(graphed), "_forward_static", (lambda original: lambda self, *args: (
        kept.append(args[-1]), original(self, *args))[1])(type(graphed)._forward_static))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5]
    plain = SpeculativeEngine(eager).generate(prompt, params).token_ids
    assert SpeculativeEngine(graphed, proposer=NgramProposer(), k=3).generate(prompt, params).token_ids == plain
    sizes = graphed.graphs.attention_by_size()
    assert sizes and set(sizes.values()) == {faster}
    # each shape is recorded once with each attention; every replay runs the faster one
    graphs, slower = graphed.graphs, {"sdpa": "matmul", "matmul": "sdpa"}[faster]
    assert graphs.replays > graphs.captures > 0
    assert kept.count(slower) == graphs.captures and kept.count(faster) == graphs.captures + graphs.replays


def test_the_profile_shows_and_keeps_the_attention_each_recording_kept():
    from specdecode.cli import format_profile
    from specdecode.cost.profile import CostProfile

    profile = CostProfile("m", "bf16", "gpu", 16, contexts=[100], sizes=[1, 2], step_ms=[[2.4, 2.6]],
                          graph_attention={"1": "sdpa", "2": "matmul"})
    assert "T=1 sdpa, T=2 matmul" in format_profile(profile, "tiny")
    assert CostProfile.from_dict(profile.to_dict()).graph_attention == {"1": "sdpa", "2": "matmul"}
    with pytest.raises(ValueError):
        CostProfile.from_dict({**profile.to_dict(), "graph_attention": {"1": 3}})
    assert "CUDA graphs" not in format_profile(CostProfile("m", "bf16", "cpu", 2, contexts=[100], sizes=[1],
                                                           step_ms=[[3.0]]), "tiny")


def test_tree_steps_of_one_shape_replay_each_trees_mask_and_positions(tmp_path, rerun):
    """Token trees of one size with different shapes and depths replay one graph: each
    replay reads its own tree mask and positions (found in review: a graph that kept the
    first tree's passed every other test)."""
    eager, graphed = runtime_pair(tmp_path, seed=36)
    graphed.graphs.record_after = 1
    generator = torch.Generator().manual_seed(1)
    trees = [([0, 1, 1, 2], [-1, 0, 0, 1]), ([0, 1, 2, 3], [-1, 0, 1, 2]), ([0, 1, 1, 1], [-1, 0, 0, 0]),
             ([0, 1, 2, 2], [-1, 0, 1, 1])]
    for runtime in (eager, graphed):
        runtime.reset(64)
        runtime(torch.tensor([[5, 6, 7, 8, 9]]))
    for depths, parents in trees:
        mask = torch.eye(4, dtype=torch.bool)
        for node, parent in enumerate(parents):
            while parent >= 0:
                mask[node, parent] = True
                parent = parents[parent]
        ids = torch.randint(3, 90, (1, 4), generator=generator)
        outputs = [runtime(ids, positions=runtime.length + torch.tensor(depths), tree_mask=mask, return_hidden=True)
                   for runtime in (eager, graphed)]
        for a, b in zip(*outputs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        start = eager.length - 4
        for runtime in (eager, graphed):  # keep the root and its first child
            runtime.compact(start + torch.tensor([0, 1]), start)
    assert graphed.graphs.captures == 1 and graphed.graphs.replays == 3


def test_matmul_attention_is_sdpa_with_fp32_scores():
    """Grouped heads, scale and mask as scaled_dot_product_attention; in bf16 its scores are
    computed in fp32 (found in review: rounded to bf16 first, the error against exact
    attention reached 0.075 where |q.k| reached 300, against SDPA's 0.008)."""
    from specdecode.models.llama import matmul_attention, sdpa_attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 64, generator=generator) * 3
    keys = torch.randn(2, 3, 300, 64, generator=generator) * 3
    values = torch.randn(2, 3, 300, 64, generator=generator)
    mask = torch.rand(4, 300, generator=generator) < 0.7
    mask[:, 0] = True
    exact = sdpa_attention(q.double(), keys.double(), values.double(), mask)
    torch.testing.assert_close(matmul_attention(q, keys, values, mask).double(), exact, rtol=1e-5, atol=1e-5)
    rounded = [t.bfloat16() for t in (q, keys, values)]
    exact = sdpa_attention(*[t.double() for t in rounded], mask)
    assert (matmul_attention(*rounded, mask).double() - exact).abs().max() < 0.02


def test_a_new_cache_drops_the_graphs_at_once(tmp_path, rerun):
    """A serving engine's reset to its batch rows leaves the single-row graphs unused for
    good: they go when the cache does, not at a next single-row step (found in review)."""
    _, graphed = runtime_pair(tmp_path, seed=37)
    graphed.reset(40)
    graphed(torch.tensor([[5]]))
    assert graphed.graphs.graphs
    graphed.reset(40, batch=3)
    assert not graphed.graphs.graphs and graphed.graphs.pool is None


def test_the_router_keys_its_state_apart_without_cuda_graphs():
    from specdecode.config import EngineConfig
    from specdecode.control.router import router_state_path

    paths = {router_state_path("default", EngineConfig(device="cuda", cuda_graphs=graphs)) for graphs in (True, False)}
    assert len(paths) == 2
    assert router_state_path("default", EngineConfig()) == router_state_path("default", EngineConfig(cuda_graphs=False))


@pytest.mark.parametrize("attentions", [("sdpa",), ("matmul",)])
def test_batched_rows_replay_what_the_eager_rows_compute(tmp_path, rerun, attentions):
    """The serving engine's step (forward_rows) through graphs: rows at their own lengths,
    in any order of cache rows, the same shape replayed with other rows and starts, logits
    and features as the eager step, the same cache entries."""
    eager, graphed = runtime_pair(tmp_path, seed=38, attentions=attentions)
    generator = torch.Generator().manual_seed(2)
    lengths = [0, 0, 0, 0]
    for runtime in (eager, graphed):
        runtime.reset(64, batch=4)
    for row, count in enumerate((7, 3, 12, 5)):  # prompts, one row at a time (eagerly: longer than max_tokens)
        ids = torch.randint(3, 90, (1, count), generator=generator)
        for runtime in (eager, graphed):
            runtime.forward_rows(ids, [row], [0])
        lengths[row] = count
    steps = [([0, 1, 2, 3], 1, {}), ([2, 0, 3, 1], 1, {}), ([1, 3], 3, dict(capture=(0, 2))), ([3, 1], 3, dict(capture=(0, 2))),
             ([1, 3], 3, {}), ([0, 2], 2, dict(last_only=True)), ([2, 0], 2, dict(last_only=True)), ([0, 2], 2, {}),
             ([0, 1, 2, 3], 1, {})]  # a shape with other options is another graph (found in review)
    for rows, num_new, kwargs in steps:
        ids = torch.randint(3, 90, (len(rows), num_new), generator=generator)
        starts = [lengths[row] for row in rows]
        outputs = [runtime.forward_rows(ids, rows, starts, **kwargs) for runtime in (eager, graphed)]
        for a, b in zip(*[out if isinstance(out, tuple) else (out,) for out in outputs]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # (fp32 sums over more, masked, slots)
        for row in rows:
            lengths[row] += num_new
    for row, length in enumerate(lengths):
        torch.testing.assert_close(eager.k_cache[:, row, :, :length], graphed.k_cache[:, row, :, :length],
                                   rtol=1e-5, atol=1e-5)
    assert graphed.graphs.captures == 9 and graphed.graphs.replays == 13  # the four prompts too (record_after 0)


def test_the_batch_engine_through_graphs_equals_each_request_alone(tmp_path, rerun):
    """The serving engine's check (tests/test_cuda.py: greedy rows, plain and with prompt
    lookup, each equal to the request alone; seeded sampled rows repeatable) on a runtime
    whose steps go through graphs, batched and single."""
    from test_cuda import batch_on

    runtime = batch_on("cpu", tmp_path, prepare=lambda runtime: setattr(runtime, "graphs", CudaGraphs(runtime)))
    assert any(key[0] == "rows" for key in runtime.graphs.graphs) and runtime.graphs.replays > 0


def test_recorded_steps_attend_over_a_bucket_that_holds_the_context(tmp_path, rerun):
    """A recorded step attends over a power-of-two span of the cache from 256 that holds
    its longest row, not the whole cache (found in review: graphed batched steps cost time
    in proportion to --max-model-len); the span is part of the shape's key."""
    import json

    path = save_tiny_model(tmp_path / "t", seed=40, num_layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    eager, graphed = (load_native(path, torch.float32, "fp32", "torch", prefill_chunk=64) for _ in range(2))
    graphed.graphs = CudaGraphs(graphed, record_after=0)
    generator = torch.Generator().manual_seed(3)
    for runtime in (eager, graphed):
        runtime.reset(1500)
    assert graphed.capacity == 2048  # a runtime with graphs allocates room to grow
    assert [graphed.graph_span(end) for end in (1, 256, 257, 700, 1400)] == [256, 256, 512, 1024, 2048]
    prompt = torch.randint(3, 90, (1, 250), generator=generator)
    for runtime in (eager, graphed):
        runtime(prompt)  # longer than a chunk: eagerly
    for num_new in (1, 8, 1):  # ends 251 (span 256), 259 and 260 (512)
        ids = torch.randint(3, 90, (1, num_new), generator=generator)
        torch.testing.assert_close(eager(ids), graphed(ids), rtol=1e-4, atol=1e-4)
    spans = {key[3] for key in graphed.graphs.graphs if key[0] == "sequence"}
    assert spans == {256, 512}
    for runtime in (eager, graphed):
        runtime.reset(1500, batch=2)
        runtime.forward_rows(torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(4)), [0], [0])
        for begin in range(0, 700, 100):
            runtime.forward_rows(torch.randint(3, 90, (1, 100), generator=torch.Generator().manual_seed(begin)),
                                 [1], [begin])
    ids = torch.randint(3, 90, (2, 3), generator=generator)
    torch.testing.assert_close(eager.forward_rows(ids, [0, 1], [200, 700]), graphed.forward_rows(ids, [0, 1], [200, 700]),
                               rtol=1e-4, atol=1e-4)
    assert ("rows", 2, 3, 1024, False, ()) in graphed.graphs.graphs


def test_the_gpu_check_of_graphs_holds_on_the_cpu(tmp_path, rerun):
    """tests/test_cuda.py's check of the recorded steps (counts of recordings and replays
    included), run here with the stand-in recorder, so that a lease's few minutes do not
    go to a test's own slips."""
    from test_cuda import graphs_on

    graphs_on("cpu", tmp_path, attach=lambda runtime: setattr(runtime, "graphs", CudaGraphs(runtime)))


def test_eagle_chains_and_trees_through_graphs(tmp_path, rerun):
    """EAGLE's target steps capture layer inputs (features) and score trees: through the
    graphs they run, and greedy output equals plain decoding (tests/test_cuda.py's check)."""
    from test_cuda import eagle_on

    attached = []
    eagle_on("cpu", tmp_path, attach=lambda runtime: attached.append(CudaGraphs(runtime)) or
             setattr(runtime, "graphs", attached[-1]))
    graphs = attached[0]
    assert graphs.replays > 0 and any(key[-1] for key in graphs.graphs)  # a step that captured features
    assert any(key[0] == "sequence" and key[5] for key in graphs.graphs)  # a tree step
    # (a random head's drafts are seldom accepted, so the output leans on the root's logits:
    # the nodes' own logits through a recorded tree step are checked by graphs_on and
    # test_static_step_computes_the_eager_step; found in review)


def test_a_batched_engine_allocates_the_slots_it_asks_for(tmp_path, rerun):
    """A single sequence's cache gets room to grow under graphs; a batched engine's rows,
    allocated once at max_model_len, do not (found in review: up to 2x the slots that
    `specdecode memory` counts)."""
    import json

    from specdecode.serve.batch import BatchEngine

    path = save_tiny_model(tmp_path / "t", seed=41, num_layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    runtime = load_native(path, torch.float32, "fp32", "torch", prefill_chunk=64)
    runtime.graphs = CudaGraphs(runtime)
    runtime.reset(300)
    assert runtime.capacity == 2048
    runtime.reset(3000)
    assert runtime.capacity == 4096
    BatchEngine(runtime, max_num_seqs=2, max_model_len=3000)
    assert runtime.capacity == 3000
