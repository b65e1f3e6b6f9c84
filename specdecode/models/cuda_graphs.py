"""CUDA graphs for the torch backend's small steps (decode, verification, token trees,
and the serving engine's batched steps).

On a GPU, a step of a 135M-parameter model is bound by launching its ~450 small kernels
from Python one by one, not by memory or arithmetic (docs/performance.md, "GPU": a T = 1
step took 13-14 ms at every context, about 165x what reading the weights takes there). A
CUDA graph records one step's kernels once and replays them with a single launch.

A graph replays fixed shapes and fixed addresses, so the step it records must not depend
on the exact context length: ``NativeRuntime._forward_static`` attends over a span of the
cache under a mask built on the device from the start slot (a 0-dim tensor), writes the new
keys and values with ``index_copy_`` at slots computed the same way, and gathers RoPE
rows by position; the batched engine's step (``_forward_rows_static``) does the same per
row, with each row's cache row and start as device tensors. The slots attended over are a
bucket (a power of two from 256, ``NativeRuntime.graph_span``) that holds the longest row:
part of the shape's key, so a step costs about what its context does, not the cache. Each
(rows, new tokens, span, options) shape gets its own graph, recorded on
the second call of that shape with that call's real inputs and replayed from then on (a
shape met once, such as a short prompt's length, runs eagerly: recording costs several
eager steps); the inputs are copied into the graph's static buffers before each replay and its outputs are copied out
after it (a caller may keep them past the next step). Steps of more than ``max_tokens``
tokens run eagerly: one launch per kernel matters little there. So do a prompt's prefill
chunks of any length (``last_only`` over more than ``MAX_CATCH_UP`` tokens): each length is
a shape of its own and seldom comes back, so recording them crowded the ``max_graphs``
kept for nothing (found in review: 317 recordings for 138 replays in a simulated serving
mix). A draft model's catch-up after a fully accepted step (its last draft and the bonus
token, ``last_only``) is a decode step and stays recorded.

The attention inside a recorded step is chosen by measurement, per shape, on the machine
at hand: each shape is recorded once with torch's scaled_dot_product_attention and once
with two batched products and a softmax (``llama.ATTENTIONS``), each recording is timed
over a few replays, and the faster is kept (``choices``). On an H200 the first took 121 us
a layer for T = 2 over a 4,065-slot cache (cuDNN's kernel), so that scoring 2 tokens cost
2.5 single steps and no drafter could pay.

Graphs are kept per cache: a cache reallocated (``reset`` to a larger capacity or
another row count) drops them. At most ``max_graphs`` are kept, least recently used
first out; they share one memory pool.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

DEFAULT_MAX_TOKENS = 64  # new tokens of a single sequence's step: the largest token tree
DEFAULT_MAX_ROW_TOKENS = 128  # rows x new tokens of a batched step: 8 rows of k + 1 = 16
DEFAULT_MAX_GRAPHS = 64
DEFAULT_RECORD_AFTER = 1  # eager calls of a shape before it is recorded
TIMED_REPLAYS = 3  # per candidate attention, when a shape is recorded
MAX_SEEN = 4096  # shapes counted before the count starts over
MAX_CATCH_UP = 2  # last_only tokens of a decode step: a draft model's last draft and the bonus


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: dict  # name -> the static buffer a replay reads, filled before each one
    outputs: tuple  # the graph's output tensors, overwritten by each replay


class CudaGraphs:
    """Captured steps of one ``NativeRuntime`` on a CUDA device."""

    def __init__(self, runtime, max_tokens: int = DEFAULT_MAX_TOKENS, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 record_after: int = DEFAULT_RECORD_AFTER, attentions: tuple[str, ...] = ("sdpa", "matmul"),
                 max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS):
        self.runtime = runtime
        self.max_row_tokens = max_row_tokens
        self.attentions = attentions
        self.choices: dict[tuple, dict[str, float]] = {}  # shape -> seconds a replay, per attention timed
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.record_after = record_after
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: dict[tuple, int] = {}  # eager calls per shape not yet recorded
        self.pool = None
        self.cache_key = None
        self.disabled = False  # a recording failed: every step runs eagerly
        self.captures = 0  # graphs captured so far (a test and the profile read it)
        self.replays = 0

    def accepts(self, batch: int, num_new: int, rows: bool, last_only: bool = False) -> bool:
        """Whether a step of ``batch`` x ``num_new`` tokens is recorded (``rows``: a
        batched engine's step); longer ones, and prefill (``last_only`` over more than a
        draft model's catch-up), run eagerly."""
        if last_only and num_new > MAX_CATCH_UP:
            return False
        return batch * num_new <= (self.max_row_tokens if rows else self.max_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor | None, tree_mask: torch.Tensor | None,
            last_only: bool, return_hidden: bool, capture: tuple[int, ...]):
        """What ``NativeRuntime.forward`` returns for these inputs, through a graph (the
        runtime's length advances as there), or None where the caller should run the step
        eagerly: a shape met fewer than ``record_after`` times before."""
        runtime = self.runtime
        batch, num_new = input_ids.shape
        span = runtime.graph_span(runtime.length + num_new)
        key = ("sequence", batch, num_new, span, positions is not None, tree_mask is not None, last_only,
               return_hidden, tuple(capture))

        def record():
            device = runtime.device
            inputs = {"ids": input_ids.to(device=device, dtype=torch.long).clone(),
                      "start": torch.tensor(runtime.length, dtype=torch.long, device=device),
                      "tree": (torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_() if tree_mask is None
                               else tree_mask.to(device=device, dtype=torch.bool).clone())}
            if positions is not None:
                inputs["positions"] = positions.to(device=device, dtype=torch.long).clone()

            def step(attention):
                return runtime._forward_static(inputs["ids"], inputs.get("positions"), inputs["start"], inputs["tree"],
                                               span, last_only, return_hidden, capture, attention)
            return inputs, step

        def fill(inputs):
            inputs["ids"].copy_(input_ids)
            inputs["start"].fill_(runtime.length)
            if positions is not None:
                inputs["positions"].copy_(positions)
            if tree_mask is not None:
                inputs["tree"].copy_(tree_mask)

        outputs = self._run(key, record, fill)
        if outputs is not None:
            runtime.length += num_new
        return outputs

    def run_rows(self, input_ids: torch.Tensor, cache_rows: list[int], starts: list[int], last_only: bool,
                 capture: tuple[int, ...]):
        """What ``NativeRuntime.forward_rows`` returns for these inputs (the batched
        engine's step: row b continues cache row ``cache_rows[b]`` after ``starts[b]``
        tokens), through a graph, or None as for ``run``."""
        runtime = self.runtime
        rows, num_new = input_ids.shape
        span = runtime.graph_span(max(starts) + num_new)
        key = ("rows", rows, num_new, span, last_only, tuple(capture))

        def record():
            device = runtime.device
            inputs = {"ids": input_ids.to(device=device, dtype=torch.long).clone(),
                      "rows": torch.tensor(cache_rows, dtype=torch.long, device=device),
                      "starts": torch.tensor(starts, dtype=torch.long, device=device)}

            def step(attention):
                logits, _, features = runtime._forward_rows_static(inputs["ids"], inputs["rows"], inputs["starts"], span,
                                                                   last_only, capture, attention)
                return (logits, features) if capture else logits
            return inputs, step

        def fill(inputs):
            inputs["ids"].copy_(input_ids)
            inputs["rows"].copy_(torch.tensor(cache_rows, dtype=torch.long))
            inputs["starts"].copy_(torch.tensor(starts, dtype=torch.long))

        return self._run(key, record, fill)

    def _run(self, key, record, fill):
        """Replay ``key``'s graph with inputs ``fill`` writes into its buffers, recording it
        first (``record() -> (inputs, step(attention))``) on the shape's due call; None
        where the step should run eagerly. Returns copies of the graph's outputs."""
        if self.disabled:
            return None
        runtime = self.runtime
        cache = (runtime.k_cache.data_ptr(), runtime.v_cache.data_ptr(), tuple(runtime.k_cache.shape))
        if cache != self.cache_key:  # a new cache: the graphs read and write the old one's memory
            self.drop()
            self.cache_key = cache
        entry = self.graphs.get(key)
        if entry is None:
            seen = self.seen.get(key, 0)
            if seen < self.record_after:
                if len(self.seen) >= MAX_SEEN:
                    self.seen.clear()
                self.seen[key] = seen + 1
                return None
            self.seen.pop(key, None)
            try:
                entry = self._capture(key, *record())
            except RuntimeError as error:  # an operation the device cannot record: run eagerly from now on
                print(f"specdecode: recording a CUDA graph failed ({str(error).splitlines()[0]}); "
                      "running every step without graphs", file=sys.stderr, flush=True)
                self.disabled = True
                self.drop()
                return None
        else:
            self.graphs.move_to_end(key)
        fill(entry.inputs)
        entry.graph.replay()
        self.replays += 1
        outputs = tuple(out.clone() for out in entry.outputs)
        return outputs if len(outputs) > 1 else outputs[0]

    def drop(self) -> None:
        """Forget every graph (their cache is gone, or going) and their memory pool, which
        goes with the last of them: recording into its handle afterwards failed an assertion
        in torch's allocator (on an H200, 2026-11-27)."""
        self.graphs.clear()
        self.pool = None
        self.cache_key = None

    def attention_by_size(self) -> dict[str, str]:
        """The attention kept per number of new tokens of a single sequence's step, as
        {"T": name} (the last shape of each T recorded), for the cost profile to show."""
        chosen = {}
        for key, seconds in self.choices.items():
            if key[0] == "sequence":
                chosen[str(key[2])] = min(seconds, key=seconds.get)  # (the longest span of each T measured last)
        return dict(sorted(chosen.items(), key=lambda item: int(item[0])))

    def _capture(self, key, inputs: dict, step) -> _Graph:
        """Record ``step(attention)`` with each candidate attention, keep the one whose
        replays time faster (each replay writes the same cache entries as the step it
        stands for), and return it."""
        recorded, error = {}, None
        for attention in self.attentions:
            try:
                recorded[attention] = self._record(lambda attention=attention: step(attention))
            except RuntimeError as failed:  # the other may still record
                error = failed
        if not recorded:
            raise error
        seconds = {attention: self._time(graph) for attention, (graph, _) in recorded.items()}
        self.choices[key] = seconds
        graph, outputs = recorded[min(seconds, key=seconds.get)]
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        entry = _Graph(graph, inputs, outputs)
        self.graphs[key] = entry
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry

    def _record(self, step):
        """(graph, its outputs) for ``step``: warmed up on a side stream (kernel choice,
        workspaces; the warm-up writes the cache entries the replay will), then recorded."""
        device = self.runtime.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = step()
        self.pool = graph.pool()
        return graph, outputs

    def _time(self, graph) -> float:
        """Seconds a replay of ``graph`` takes: the median of a few, the device synchronised."""
        synchronize = torch.cuda.synchronize if self.runtime.device.type == "cuda" else (lambda: None)
        times = []
        for _ in range(TIMED_REPLAYS):
            synchronize()
            started = time.perf_counter()
            graph.replay()
            synchronize()
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]
