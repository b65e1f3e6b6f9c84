"""bench: peers warmed up like our engines, divergences reported with their margin."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import save_chat_model, save_tiny_model
from specdecode import kernels
from specdecode.bench.runner import run_records, summarize, warm_up
from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model
from specdecode.proposers.ngram import NgramProposer

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")


class CountingPeer:
    """A stand-in peer that records its calls and returns a fixed continuation."""

    def __init__(self, tokens):
        self.calls, self.tokens = [], tokens

    def generate(self, prompt_ids, max_new_tokens):
        self.calls.append((list(prompt_ids), max_new_tokens))
        return self.tokens[:max_new_tokens], 0.01


def test_peers_are_warmed_up_before_measurement(tiny_llama_dir):
    """Every method, the transformers baseline included, runs once before timing starts
    (a cold first call would be charged allocation and kernel warm-up)."""
    model = load_model(tiny_llama_dir, torch.float32)
    peer = CountingPeer([5, 6, 7])
    engines = {"none": SpeculativeEngine(model.runtime), "hf": peer}
    warm_up(engines, list(range(3, 30)), SamplingParams(max_new_tokens=4))
    assert len(peer.calls) == 1


def test_warm_up_sizes_the_caches_so_no_measured_run_allocates_one(tiny_llama_dir):
    """Found in review: warm-up ran 8 tokens of a 16-token prompt, so the first measured run
    that needed a larger cache allocated it inside its timing (the speculative run of
    `generate --compare` always). With the run's capacity, the caches are sized before."""
    model = load_model(tiny_llama_dir, torch.float32)
    runtime = model.runtime
    engines = {"none": SpeculativeEngine(runtime), "ngram": SpeculativeEngine(runtime, proposer=NgramProposer(), k=4)}
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    long_prompt = [3 + i % 50 for i in range(120)]
    warm_up(engines, long_prompt, params, len(long_prompt) + 20 + 16)
    cache = runtime.k_cache
    for engine in engines.values():
        engine.generate(long_prompt, params)
        assert runtime.k_cache is cache


def test_divergent_outputs_carry_the_margin_at_their_first_difference(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.float32)
    plain = SpeculativeEngine(model.runtime)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = [4, 8, 15, 16, 23, 42]
    reference = plain.generate(prompt, params).token_ids
    wrong = reference[:2] + [(reference[2] + 1) % 97] + reference[3:]
    engines = {"none": plain, "ngram": SpeculativeEngine(model.runtime, proposer=NgramProposer(), k=3),
               "hf": CountingPeer(wrong)}
    records = run_records(engines, [{"question_id": "q", "category": "c", "prompt": "x"}], [prompt], params, ())
    by_method = {r["method"]: r for r in records}
    assert by_method["ngram"]["identical_to_plain"] and "first_divergence" not in by_method["ngram"]
    divergence = by_method["hf"]["first_divergence"]
    logits = plain.next_token_logits(prompt + reference[:2])
    top = logits.topk(2).values
    assert divergence["position"] == 2 and divergence["reference_token"] == reference[2]
    assert divergence["top2_margin"] == pytest.approx(float(top[0] - top[1]))
    summary = summarize(records)
    assert summary["overall"]["hf"]["divergent"] == 1
    assert summary["overall"]["none"]["aggregate_tokens_per_s"] > 0
    assert by_method["ngram"]["draft_passes"] == by_method["ngram"]["draft_tokens"]  # analyze prices passes
    json.dumps(records)  # records stay JSON-serialisable
    # one output a prefix of the other (one side ended at EOS there): a divergence too, found
    # in review (it was left out of the count of outputs not identical)
    ended = plain.first_divergence(prompt, reference, reference[:3])
    top = plain.next_token_logits(prompt + reference[:3]).topk(2).values
    assert ended["position"] == 3 and ended["other_token"] is None and ended["reference_token"] == reference[3]
    assert ended["top2_margin"] == pytest.approx(float(top[0] - top[1]))
    assert plain.first_divergence(prompt, reference, list(reference)) is None


def test_a_sampled_output_that_differs_says_where_and_how_probable_each_token_was(tiny_llama_dir):
    """Found in review: only greedy runs recorded their first divergence, so a seeded sampled
    run of a drafter that does not sample (whose output is plain sampling's) that differed
    was reported nowhere, and the summary's `divergent` said 0 beside `same` below 100%."""
    from specdecode.verify.sampling import logits_to_probs

    model = load_model(tiny_llama_dir, torch.float32)
    plain = SpeculativeEngine(model.runtime)
    params = SamplingParams(temperature=0.9, top_k=20, seed=3, max_new_tokens=6, ignore_eos=True)
    prompt = [4, 8, 15, 16, 23, 42]
    from specdecode.bench.runner import request_seed

    reference = plain.generate(prompt, dataclasses.replace(params, seed=request_seed(3, "q", 1))).token_ids
    wrong = reference[:2] + [(reference[2] + 1) % 97] + reference[3:]
    engines = {"none": plain, "ngram": SpeculativeEngine(model.runtime, proposer=NgramProposer(), k=3),
               "hf": CountingPeer(wrong)}
    records = run_records(engines, [{"question_id": "q", "category": "c", "prompt": "x"}], [prompt], params, ())
    by_method = {r["method"]: r for r in records}
    assert by_method["ngram"]["identical_to_plain"]  # seeded lookup: plain sampling's tokens
    divergence = by_method["hf"]["first_divergence"]
    assert divergence["position"] == 2
    probs = logits_to_probs(plain.next_token_logits(prompt + reference[:2]), params)
    assert divergence["probabilities"] == {"reference": pytest.approx(float(probs[reference[2]])),
                                           "other": pytest.approx(float(probs[wrong[2]]))}
    assert summarize(records)["overall"]["hf"]["divergent"] == 1


def test_bench_serve_percentiles_are_vllms():
    """Linear interpolation between ranks, as numpy and `vllm bench serve` take them (nearest
    rank gave 3 and 4 for the p50 and p99 of [1, 2, 3, 4])."""
    from specdecode.bench.serve import percentile

    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1, 2, 3, 4, 5, 6], 99) == pytest.approx(5.95)
    assert percentile([], 50) is None


def test_bench_serve_reports_no_latency_for_a_level_with_no_successful_request(capsys):
    """Found in review: a level whose requests all failed printed 0 ms TTFT, TPOT, ITL and
    E2E (a perfect latency), in the JSON too."""
    from specdecode.bench.serve import print_table, summarize as latency

    row = {"mode": "plain", "concurrency": 2, "request_rate": None, "requests": 4, "failed": 4,
           "request_throughput": 0.0, "output_throughput": 0.0, "acceptance_rate": None,
           **{name: latency([]) for name in ("ttft", "tpot", "itl", "e2e")}}
    assert row["ttft"] == {"mean": None, "p50": None, "p99": None}
    print_table([row])
    line = capsys.readouterr().out.splitlines()[1]
    assert "0ms" not in line and "0.0ms" not in line and "0.00s" not in line and line.count("-") >= 6


def test_bench_serve_plots_a_request_rate_run(monkeypatch, tmp_path):
    """Found in review: the figure drew concurrency levels only, so a --request-rate run
    (no concurrency) saved two empty plots."""
    import matplotlib.figure

    from specdecode.bench.serve import plot

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda figure, *args, **kwargs: drawn.extend(len(axis.lines) for axis in figure.axes))
    rows = [{"mode": mode, "concurrency": None, "request_rate": rate, "output_throughput": 10.0 * rate,
             "tpot": {"p50": 0.01}} for mode in ("spec", "plain") for rate in (1.0, 4.0)]
    plot(rows, tmp_path / "rate.png")
    assert drawn == [2, 2]  # a line per mode in each panel


def test_bench_serve_sends_every_category_in_turn(monkeypatch):
    """Found in review: the suite is stored category by category and bench-serve sent its
    first N prompts, so 16 requests were 10 code and 6 JSON prompts and every served ratio
    leant on the tasks lookup drafts best. The categories now take turns."""
    from collections import Counter

    import httpx

    import specdecode.bench.serve as serve_bench
    from specdecode.prompts import categories_in_turn, load_prompts

    prompts = load_prompts(None)
    category = {p["prompt"]: p["category"] for p in prompts}
    sent = []

    async def level(url, model, chosen, max_tokens, mode, concurrency, rate, seed):
        if max_tokens != 16:  # not the untimed warm-up
            sent.append(Counter(category[messages[-1]["content"]] for messages in chosen))
        zero = {"mean": 0, "p50": 0, "p99": 0}
        return {"mode": mode, "concurrency": concurrency, "request_rate": rate, "requests": len(chosen), "failed": 0,
                "errors": [], "wall_seconds": 1, "request_throughput": 1, "output_throughput": 1, "output_tokens": 1,
                "ttft": zero, "tpot": zero, "itl": zero, "e2e": zero, "acceptance_rate": None,
                "mean_acceptance_length": None}

    monkeypatch.setattr(serve_bench, "run_level", level)
    monkeypatch.setattr(serve_bench, "wait_for_audits", lambda url: {"audit_requests_total": 0,
                                                                     "audit_mismatches_total": 0})
    monkeypatch.setattr(httpx, "post", lambda *args, **kwargs: type("Reply", (), {"status_code": 200})())
    serve_bench.bench_serve(prompts, [1], None, 16, 128, ["spec", "plain"], "http://x", [], None, model="m")
    categories = len({p["category"] for p in prompts})
    assert len(sent) == 2 and all(len(counts) == categories and max(counts.values()) == 2 for counts in sent), sent
    assert [p["prompt"] for p in categories_in_turn(prompts)][:2] == [prompts[0]["prompt"],
                                                                                   prompts[10]["prompt"]]


class FlakyEngine(SpeculativeEngine):
    """Changes one token on every second call, as a runtime that is not batch invariant
    can when adaptive k scores a different number of rows on a repeat."""

    calls = 0

    def generate(self, *args, **kwargs):
        result = super().generate(*args, **kwargs)
        FlakyEngine.calls += 1
        if FlakyEngine.calls % 2 == 0:
            result.token_ids[-1] = (result.token_ids[-1] + 1) % 97
        return result


@pytest.mark.parametrize("backend, adaptive", [("torch", True), ("torch", False),
                                              pytest.param("kernels", True, marks=needs_kernels)])
def test_greedy_repeats_may_differ_only_where_the_runtime_is_not_batch_invariant(tiny_llama_dir, backend,
                                                                                 adaptive):
    """Found on a GPU: bench --repeats 2 --device cuda stopped at the first prompt whose
    greedy repeats differed, though the torch backend promises no batch invariance (a
    near-tie flips when adaptive k scores another number of rows). There the record says
    repeats_identical: false. On the kernels (--exact), and wherever every repeat scores
    the same rows (a fixed k), a difference is still a bug."""
    from specdecode.control.policies import ThresholdK

    model = load_model(tiny_llama_dir, torch.float32, backend=backend)
    assert model.runtime.exact == (backend == "kernels")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    k = ThresholdK(start_k=3, k_max=3) if adaptive else 3
    FlakyEngine.calls = 0  # the second run of the request changes a token
    engines = {"none": SpeculativeEngine(model.runtime),
               "ngram": FlakyEngine(model.runtime, proposer=NgramProposer(), k=k)}
    prompts = [{"question_id": "q", "category": "c", "prompt": "x"}]
    if backend == "kernels" or not adaptive:
        with pytest.raises(SpecDecodeError, match="ngram decoded different tokens on repeats of q"):
            run_records(engines, prompts, [[4, 8, 15, 16, 23, 42]], params, (), repeats=2)
    else:
        records = run_records(engines, prompts, [[4, 8, 15, 16, 23, 42]], params, (), repeats=2)
        by_method = {r["method"]: r for r in records}
        assert by_method["ngram"]["repeats_identical"] is False
        assert "repeats_identical" not in by_method["none"]


def test_fixed_tree_budgets_are_fixed_k_and_a_category_without_timings_is_no_sweep():
    """Found in review: 'eagle@6x3' was classed as adaptive (no sweep over fixed trees), and a
    category whose best fixed speedup was 0 (plain made no token) divided by it."""
    from specdecode.bench.runner import is_fixed_k, k_sweep

    assert is_fixed_k("eagle@6x3") and is_fixed_k("ngram@3") and not is_fixed_k("eagle@autox3")
    assert not is_fixed_k("ngram")
    row = {"speedup": 0.0, "identical_to_plain": 1.0}
    assert k_sweep({"code": {"eagle@2x3": row, "eagle@auto": row}}, ["eagle@2x3", "eagle@auto"]) == {}
    good = {"code": {"eagle@2x3": {"speedup": 1.2, "identical_to_plain": 1.0},
                     "eagle@auto": {"speedup": 1.1, "identical_to_plain": 1.0}}}
    assert k_sweep(good, ["eagle@2x3", "eagle@auto"])["eagle"]["code"]["best_fixed"] == "eagle@2x3"


def test_bench_refuses_greedy_peers_beside_sampled_decoding(capsys):
    """Found in review: hf and llamacpp always decode greedily, and were compared with
    sampled plain decoding under --temperature 1.0."""
    from specdecode.cli import main

    assert main(["bench", "--methods", "none,hf", "--temperature", "1.0", "--model", "/nowhere/model"]) == 2
    assert "hf decode greedily here; compare them at --temperature 0" in capsys.readouterr().err


def test_a_conversation_decodes_each_turn_after_its_own_replies(tiny_text_model_dir, capsys):
    """Spec-Bench's MT-bench questions have two turns: turn 2 is decoded after turn 1 and
    the model's own answer to it. Each engine continues its own conversation; a reply that
    differed from plain decoding's leaves its later turns on another context, reported as
    such (not as a divergence with a margin). Before, every turn after the first was dropped."""
    from specdecode.bench.runner import needed_context, turn_encoder
    from specdecode.config import EngineConfig

    model = load_model(tiny_text_model_dir, torch.float32)
    follow_up = turn_encoder(model, EngineConfig(model=str(tiny_text_model_dir), dtype="fp32", chat_template=False))
    plain = SpeculativeEngine(model.runtime, model.tokenizer)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    turns = ["abcabcabc", "xyzxyz"]
    prompts = [{"question_id": 7, "category": "chat", "prompt": turns[0], "turns": turns},
               {"question_id": 8, "category": "chat", "prompt": "qwerty", "turns": ["qwerty"]}]
    encoded = [plain.encode(p["prompt"], False) for p in prompts]
    reply = plain.generate(encoded[0], params).token_ids
    second = follow_up(turns, [reply])
    text = model.tokenizer.decode(reply, skip_special_tokens=True)
    assert second == plain.encode(f"abcabcabc\n\n{text}\n\nxyzxyz", False)
    peer = CountingPeer([5, 6, 7, 8, 9, 10])
    engines = {"none": plain, "ngram": SpeculativeEngine(model.runtime, proposer=NgramProposer(), k=3), "hf": peer}
    records = run_records(engines, prompts, encoded, params, (), follow_up=follow_up)
    assert [(r["question_id"], r["turn"], r["method"]) for r in records] == [
        (q, t, m) for q, t in ((7, 1), (7, 2), (8, 1)) for m in ("none", "ngram", "hf")]
    by_key = {(r["question_id"], r["turn"], r["method"]): r for r in records}
    assert by_key[(7, 2, "none")]["prompt_tokens"] == len(second)
    assert by_key[(7, 2, "ngram")]["identical_to_plain"] and "context_differs" not in by_key[(7, 2, "ngram")]
    assert peer.calls[1][0] == follow_up(turns, [[5, 6, 7, 8, 9, 10]])  # its own reply, not plain's
    assert "first_divergence" in by_key[(7, 1, "hf")]
    late = by_key[(7, 2, "hf")]
    assert late["context_differs"] and not late["identical_to_plain"] and "first_divergence" not in late
    summary = summarize(records)
    assert summary["chat"]["ngram"]["prompts"] == 3 and summary["chat"]["ngram"]["identical_to_plain"] == 1.0
    assert summary["chat"]["ngram"]["speedup"] > 0  # each turn paired with plain's same turn
    assert needed_context(encoded, params, model, prompts, follow_up) >= len(second) + params.max_new_tokens
    with pytest.raises(SpecDecodeError, match="several turns"):
        run_records(engines, prompts, encoded, params, ())
    # a system prompt comes first, in every turn (found in review: it was dropped)
    assert follow_up(turns, [reply], "Be brief.") == plain.encode(f"Be brief.\n\nabcabcabc\n\n{text}\n\nxyzxyz", False)
    # a conversation whose next turn would not fit the model's context ends there, counted
    # (found in review: the run died mid-way and every record was lost)
    engines = {"none": plain, "ngram": SpeculativeEngine(model.runtime, proposer=NgramProposer(), k=3)}
    short = run_records(engines, prompts, encoded, params, (), follow_up=follow_up, max_context=len(second))
    assert [(r["question_id"], r["turn"]) for r in short] == [(7, 1), (7, 1), (8, 1), (8, 1)]
    assert "1 conversation(s) ended where the next turn would not fit the model's context" in capsys.readouterr().err


def test_bench_runs_every_turn_of_a_prompt_file(tiny_text_model_dir, tmp_path):
    from specdecode.cli import main

    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["abab abab", "cdcd"]}) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_text_model_dir), "--dtype", "fp32", "--prompts", str(prompts),
                 "--methods", "ngram", "--max-new-tokens", "5", "--no-chat-template", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert sorted((r["turn"], r["method"]) for r in records) == [(1, "ngram"), (1, "none"), (2, "ngram"), (2, "none")]
    assert all(r["identical_to_plain"] for r in records)
    # the share of steps that ran plain is read from the steps, not the policy's choices
    # (found in review: a step whose lookup found nothing counted as drafting)
    prompts.write_text(json.dumps({"prompt": "q w e r t y", "category": "other"}) + "\n")
    assert main(["bench", "--model", str(tiny_text_model_dir), "--dtype", "fp32", "--prompts", str(prompts),
                 "--methods", "ngram", "--max-new-tokens", "8", "--no-chat-template", "--out", str(out)]) == 0
    records += json.loads(out.read_text())["records"]
    for record in records:
        if record["method"] == "ngram" and record["plain_steps_share"] is not None:
            steps = record["steps_by_drafted"]
            assert record["plain_steps_share"] == pytest.approx(steps.get("0", 0) / sum(steps.values()))


def test_the_transformers_peer_decodes_greedily_whatever_the_generation_config_says(tiny_llama_dir, tmp_path):
    """Found in review: generate() merged the checkpoint's generation_config.json into the
    call, so a repetition penalty there (Qwen2.5-Instruct ships one) changed the peer's
    "greedy" tokens and its timing."""
    import shutil

    from specdecode.bench.peers import HFPeer

    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9]
    clean = HFPeer(tiny_llama_dir, (2,)).generate(prompt, 24)[0]
    penalised = tmp_path / "penalised"
    shutil.copytree(tiny_llama_dir, penalised)
    config = json.loads((penalised / "generation_config.json").read_text()) if (
        penalised / "generation_config.json").exists() else {}
    config.update(repetition_penalty=1.3, no_repeat_ngram_size=2, do_sample=True, temperature=0.7)
    (penalised / "generation_config.json").write_text(json.dumps(config))
    assert HFPeer(penalised, (2,)).generate(prompt, 24)[0] == clean


@pytest.mark.slow
def test_the_llamacpp_peer_stops_at_the_end_of_its_context():
    """Found in review: where prompt + max new tokens passed the context, our engine stopped
    there ("length") and the llama.cpp peer failed inside llama_decode, ending the bench."""
    pytest.importorskip("llama_cpp")
    from specdecode.bench.peers import LlamaCppPeer
    from specdecode.models.loading import default_gguf_path

    peer = LlamaCppPeer(default_gguf_path(), 64, ())
    tokens, _ = peer.generate([1000 + i for i in range(54)], 100)
    assert len(tokens) == 10


def test_bench_serve_runs_a_mode_named_twice_once(monkeypatch):
    """Found in review: `--modes spec,spec,plain` ran spec twice per round and the summary
    kept only the last of the two."""
    import specdecode.bench.serve as serve_bench
    from specdecode.cli import main

    seen = []
    monkeypatch.setattr(serve_bench, "bench_serve", lambda prompts, levels, rate, count, tokens, modes, *rest, **kw:
                        seen.append(modes))
    assert main(["bench-serve", "--url", "http://x", "--modes", "spec,spec,plain"]) == 0
    assert seen == [["spec", "plain"]]


def test_speedups_pair_only_turns_that_ran_plain_decodings_prompt():
    """Found in review: a turn after a reply that differed from plain's ran on another
    prompt (here 400 tokens longer) and was still divided by plain's tok/s: 0.90x
    reported where the one same-prompt pair was 1.2x."""
    from specdecode.bench.runner import summarize

    def record(method, turn, tokens_per_s, **extra):
        return dict(question_id="mt-1", category="writing", method=method, turn=turn, tokens_per_s=tokens_per_s,
                    new_tokens=100, seconds=100 / tokens_per_s, identical_to_plain=method == "none",
                    prompt_tokens=50, **extra)

    records = [record("none", 1, 100.0), record("draft", 1, 120.0), record("none", 2, 100.0),
               record("draft", 2, 60.0, context_differs=True)]
    assert summarize(records)["overall"]["draft"]["speedup"] == pytest.approx(1.2)
    # a run that drew EOS first made no token: no ratio, as in analyze (found in review: a
    # 0.0 in the median)
    records = [record("none", 1, 100.0), record("draft", 1, 120.0), record("none", 2, 100.0),
               record("draft", 2, 1.0)]
    records[-1].update(tokens_per_s=0.0, new_tokens=0, seconds=0.01)
    assert summarize(records)["overall"]["draft"]["speedup"] == pytest.approx(1.2)
    assert summarize(records)["overall"]["draft"]["tokens_per_s"] == 120.0  # nor a rate (found in review: 60.0)
    # the share of plain steps and the mean k pool the prompts' steps, as analyze does (found
    # in review: a mean over prompts weighed 10 passes as 1,000)
    records = [record("none", 1, 100.0), record("draft", 1, 120.0, target_forwards=10, plain_steps_share=1.0,
                                                k_chosen_mean=0.0),
               record("none", 2, 100.0), record("draft", 2, 120.0, target_forwards=90, plain_steps_share=0.0,
                                                k_chosen_mean=2.0)]
    overall = summarize(records)["overall"]["draft"]
    assert overall["plain_steps_share"] == pytest.approx(0.1) and overall["k_chosen_mean"] == pytest.approx(1.8)


def test_a_method_with_no_prompt_timed_against_plain_has_no_speedup(capsys):
    """Found in review: with no prompt paired with plain decoding (here the one turn ran after
    another reply than plain's), the median of no ratios was 0.0: "0.00x" in the table and
    "-100%" against the best fixed k in the sweep, where analyze said 1.00x."""
    from specdecode.bench.runner import k_sweep, print_k_sweep, print_summary

    def record(method, tokens_per_s, **extra):
        return dict(question_id="mt-1", category="writing", method=method, turn=2, tokens_per_s=tokens_per_s,
                    new_tokens=50, seconds=50 / tokens_per_s, identical_to_plain=method == "none", prompt_tokens=10,
                    **extra)

    methods = ["none", "ngram@3", "ngram@auto"]
    summary = summarize([record("none", 100.0), record("ngram@3", 120.0),
                         record("ngram@auto", 130.0, context_differs=True)])
    assert summary["writing"]["ngram@auto"]["speedup"] is None
    assert summary["writing"]["ngram@3"]["speedup"] == pytest.approx(1.2)
    sweep = k_sweep(summary, methods)
    assert "ngram@auto" not in sweep["ngram"]["writing"]  # nothing to compare, rather than -100%
    print_summary(summary, methods)
    print_k_sweep(sweep)
    out = capsys.readouterr().out
    assert "0.00x" not in out and "-100%" not in out
    json.dumps(summary)


def test_a_prompt_category_named_overall_is_refused(tmp_path):
    """Found in review: the reports' row over every category is keyed 'overall', so a
    category of that name was counted twice in it (n, medians, aggregate tok/s)."""
    from specdecode.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"category": "overall", "prompt": "hi"}) + "\n")
    with pytest.raises(SpecDecodeError, match="overall"):
        load_prompts(str(path))


def test_prompt_files_with_a_byte_order_mark_or_raw_line_separators_in_strings_load(tmp_path):
    """Found in review: a JSONL line holding U+2028, U+2029 or U+0085 raw inside a string
    (valid JSON; ``json.dumps(ensure_ascii=False)`` writes it so) was cut there and refused,
    and a file (JSONL or a JSON array) starting with a UTF-8 byte-order mark was refused."""
    from specdecode.prompts import load_prompts

    records = [{"category": "qa", "prompt": f"one{sep}two"} for sep in ("\u2028", "\u2029", "\u0085")]
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in records), encoding="utf-8")
    assert [p["prompt"] for p in load_prompts(str(jsonl))] == [r["prompt"] for r in records]
    for name, text in (("bom.jsonl", json.dumps(records[0]) + "\n"), ("bom.json", json.dumps(records))):
        path = tmp_path / name
        path.write_text("\ufeff" + text, encoding="utf-8")
        assert load_prompts(str(path))[0]["prompt"] == records[0]["prompt"]


def test_a_sampled_bench_draws_alike_for_every_method_and_a_bare_method_under_k_is_fixed(tmp_path, capsys):
    """Found in review: sampling without --seed let every method draw its own seed, so plain
    and prompt lookup sampled different texts ("same 0%", speedups over different lengths);
    and a bare method under --k 4 was compared as an adaptive policy in the k sweep."""
    from specdecode.bench.runner import is_fixed_k, k_sweep
    from specdecode.cli import main

    model = save_chat_model(tmp_path / "chat", seed=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"abcabc abcabc {i}", "category": "c"}) + "\n" for i in range(3)))
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(model), "--dtype", "fp32", "--prompts", str(prompts), "--methods", "ngram@3",
                 "--max-new-tokens", "12", "--temperature", "1.0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert isinstance(result["config"]["seed"], int)
    assert result["summary"]["overall"]["ngram@3"]["identical_to_plain"] == 1.0  # the target's own draws verify
    assert is_fixed_k("ngram", 4) and is_fixed_k("ngram", "4") and not is_fixed_k("ngram") and is_fixed_k("ngram@3")
    summary = {"c": {m: {"speedup": s, "identical_to_plain": 1.0} for m, s in (("ngram@3", 1.1), ("ngram", 1.2))}}
    assert k_sweep(summary, ["ngram@3", "ngram"], 4) == {}  # two fixed k: nothing adaptive to compare
    assert "ngram" in k_sweep(summary, ["ngram@3", "ngram"])["ngram"]["c"]


def test_the_transformers_peer_stops_at_the_context_and_attends_every_prompt_token(tmp_path):
    """Found in review: the peer decoded past the model's positions (40 tokens against our
    10), and without an attention mask transformers read pad id 0 (a model naming no EOS) in
    the prompt as padding and masked those tokens out."""
    from specdecode.bench.peers import HFPeer

    path = save_tiny_model(tmp_path / "m", seed=12)
    ours = SpeculativeEngine(load_model(path, torch.float32, backend="torch").runtime)
    prompt = [1, 5, 0, 9, 13, 0, 5, 9, 13]
    expected = ours.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    assert HFPeer(path, (), max_positions=256).generate(prompt, 12)[0] == expected
    long_prompt = [(i * 7) % 90 + 3 for i in range(250)]
    assert len(HFPeer(path, (), max_positions=256).generate(long_prompt, 40)[0]) == 6
    assert len(ours.generate(long_prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids) == 6


def test_a_sampled_requests_seed_depends_on_the_prompt_and_turn_as_recorded():
    """Found in review: one seed for every prompt gave a drafter that samples the same draws
    on each; and the rule written into the JSON must be the one the code computes."""
    import hashlib

    from specdecode.bench.runner import SEED_RULE, request_seed

    assert request_seed(7, "q1", 2) == int.from_bytes(hashlib.sha256(b"7|q1|2").digest()[:8], "little") >> 2
    assert "[:8], 'little') >> 2" in SEED_RULE
    seeds = {request_seed(7, f"q{i}", turn) for i in range(50) for turn in (1, 2)}
    assert len(seeds) == 100 and all(0 <= s < 2 ** 62 for s in seeds)


class _Clock:
    """A stand-in for bench-serve's ``time``: perf_counter reads ``now``, set by the fake server."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def __getattr__(self, name):
        import time

        return getattr(time, name)


def _fake_server(clock, streams, metrics=""):
    """An httpx transport answering chat requests with the next of ``streams``: each a list
    of (time, SSE payload) read at that time, or an int status code; /metrics with ``metrics``."""
    import httpx

    pending = list(streams)

    class Stream(httpx.AsyncByteStream):
        def __init__(self, events):
            self.events = events

        async def __aiter__(self):
            for at, payload in self.events:
                clock.now = at
                yield f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()

    def handler(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        events = pending.pop(0)
        if isinstance(events, int):
            return httpx.Response(events, json={"error": {"message": "queue full"}})
        return httpx.Response(200, stream=Stream(events), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _chat_stream(start, times, tokens):
    """A role-only first chunk at ``start``, one content chunk at each of ``times``, then the
    usage chunk and [DONE] at the last time."""
    events = [(start, {"choices": [{"delta": {"role": "assistant"}}]})]
    events += [(t, {"choices": [{"delta": {"content": "x"}}]}) for t in times]
    return events + [(times[-1], {"choices": [], "usage": {"completion_tokens": tokens}}), (times[-1], "[DONE]")]


def test_bench_serve_figures_from_a_stream_of_known_timings(monkeypatch):
    """TTFT at the first content (not the role-only chunk), ITL between contents, TPOT as
    vLLM's (e2e - TTFT) / (tokens - 1), E2E and output tokens of the successful requests
    only, throughput over the level's wall time, p99 by linear interpolation (a review: each
    of these could change without a test failing)."""
    import asyncio

    import httpx

    from specdecode.bench import serve as serve_bench

    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    # the last request fails after its usage chunk: its tokens do not count
    broken = _chat_stream(2.0, [2.0], 3)[:-1] + [(2.0, {"error": {"message": "internal error"}})]
    transport = _fake_server(clock, [_chat_stream(0.1, [0.3, 0.5, 0.9], 5), 503,
                                     _chat_stream(1.0, [1.2, 1.3, 1.4, 2.0], 9), broken])
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real_client(transport=transport, **kwargs))
    row = asyncio.run(serve_bench.run_level("http://bench", "m", ["a", "b", "c", "d"], 9, "spec", 1, None, 0))
    assert row["requests"] == 4 and row["failed"] == 2 and "HTTP 503" in row["errors"][0]
    assert row["output_tokens"] == 5 + 9
    assert row["wall_seconds"] == pytest.approx(2.0)
    assert row["output_throughput"] == pytest.approx(14 / 2.0)
    # one client: the 503 is sent when the first stream ends (0.9 s), the third request then
    assert row["ttft"]["mean"] == pytest.approx(0.3)  # 0.3 - 0 and 1.2 - 0.9, not the role-only chunks
    assert row["e2e"]["mean"] == pytest.approx((0.9 + 1.1) / 2)  # the 503 not among them
    assert row["tpot"]["mean"] == pytest.approx(((0.9 - 0.3) / 4 + (2.0 - 1.2) / 8) / 2)
    gaps = [0.2, 0.4, 0.1, 0.1, 0.6]
    assert row["itl"]["p50"] == pytest.approx(0.2)
    assert row["itl"]["p99"] == pytest.approx(float(np.percentile(gaps, 99)))
    assert row["itl"]["p99"] != pytest.approx(float(np.percentile(gaps, 98)))


def test_bench_serve_sleeps_between_poisson_arrivals_only(monkeypatch):
    """No gap after the last arrival: it stretched the level's wall time (found in review)."""
    import asyncio

    import httpx

    from specdecode.bench import serve as serve_bench

    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    transport = _fake_server(clock, [_chat_stream(0.0, [0.1, 0.2], 2) for _ in range(3)])
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real_client(transport=transport, **kwargs))
    sleeps = []

    async def no_sleep(seconds):
        sleeps.append(seconds)

    monkeypatch.setattr(serve_bench.asyncio, "sleep", no_sleep)
    row = asyncio.run(serve_bench.run_level("http://bench", "m", ["a", "b", "c"], 2, "spec", None, 5.0, 0))
    assert row["requests"] == 3 and row["failed"] == 0 and len(sleeps) == 2


def test_bench_serve_ratios_leave_out_rounds_with_failures_or_a_plain_row_that_drafted(capsys):
    """A round where some requests failed, or where the "plain" server drafted (one that
    ignores ``speculative``), says nothing of spec against plain: it is left out of the
    ratios and named (found in review: both entered the median)."""
    from specdecode.bench.serve import print_summary, ratio_summary

    def row(round_, mode, tok_s, failed=0, drafts=0.0):
        return {"round": round_, "mode": mode, "concurrency": 1, "request_rate": None, "requests": 8,
                "failed": failed, "output_throughput": tok_s, "drafts": drafts}

    rows = [row(0, "spec", 130.0), row(0, "plain", 100.0),
            row(1, "spec", 200.0, failed=5), row(1, "plain", 100.0, failed=1),
            row(2, "spec", 120.0), row(2, "plain", 118.0, drafts=40.0)]
    wider = [{**r, "concurrency": 4, "output_throughput": 2 * r["output_throughput"], "failed": 0, "drafts": 0.0}
             for r in rows]
    one, four = ratio_summary(rows + wider)
    assert one["spec_over_plain"] == {"median": pytest.approx(1.3), "min": pytest.approx(1.3),
                                      "max": pytest.approx(1.3), "rounds": 1}
    assert one["spec_tok_s"] == 125.0  # of 130 and 120: the failed round's 200 is in no median
    assert [(left["round"], left["mode"]) for left in one["left_out"]] == [(1, "spec"), (1, "plain"), (2, "plain")]
    # at concurrency 4 every row is fit: spec/plain uses every round; plain/plain@1 only round 0
    assert four["spec_over_plain"]["rounds"] == 3 and four["plain_over_lowest"]["rounds"] == 1
    assert [(left["round"], left["level"]) for left in four["left_out"]] == [(1, 1), (2, 1)]
    print_summary([one, four], 3)
    out = capsys.readouterr().out
    assert "round 1 left out of the ratios: spec: 5 of 8 requests failed" in out
    assert "round 1 left out of the ratios: plain: 1 of 8 requests failed" in out
    assert "round 2 left out of the ratios: plain: the server drafted 40 times" in out
    assert "round 2 left out of the ratios at level 1: plain: the server drafted 40 times" in out


# -- records and summaries (a mutation audit: no test failed on these mutants) --------
def test_a_method_that_takes_no_k_is_refused_one():
    """'none@3' ran plain decoding under another label and 'hf@2' ignored its k."""
    from specdecode.bench.runner import parse_method

    for spec in ("none@3", "hf@2"):
        with pytest.raises(SpecDecodeError, match=f"'{spec}': {spec.partition('@')[0]} takes no k"):
            parse_method(spec)


def test_needed_context_holds_the_drafts_margin_and_each_later_turns_reply():
    """The longest prompt + the output budget + 16 for drafts; a conversation's later turns
    each add a reply of the budget and TURN_MARGIN (16); never beyond the model's context."""
    from types import SimpleNamespace

    from specdecode.bench.runner import needed_context

    target = SimpleNamespace(runtime=SimpleNamespace(max_positions=1000))
    params = SamplingParams(max_new_tokens=50)
    assert needed_context([[1] * 30, [1] * 10], params, target) == 30 + 50 + 16
    prompts = [{"prompt": "a"}, {"prompt": "a", "turns": ["a", "b", "c"]}]
    follow_up = lambda turns, replies, system=None: [0] * (20 * len(turns))  # noqa: E731
    # the conversation: 60 tokens of its three turns, and two replies of 50 + 16
    assert needed_context([[1] * 30, [1] * 10], params, target, prompts, follow_up) == 60 + 2 * 66 + 50 + 16
    target.runtime.max_positions = 200
    assert needed_context([[1] * 30, [1] * 10], params, target, prompts, follow_up) == 200


class TimedPeer:
    """A stand-in peer returning fixed tokens in the given times, one per call."""

    def __init__(self, tokens, seconds):
        self.tokens, self.seconds = tokens, list(seconds)

    def generate(self, prompt_ids, max_new_tokens):
        return self.tokens[:max_new_tokens], self.seconds.pop(0)


def test_records_rate_tokens_per_second_and_keep_every_repeats_time(tiny_llama_dir):
    """tokens_per_s is new tokens over seconds (not ms); with repeats the fastest run is the
    record and repeat_seconds lists each run's own time."""
    from specdecode.control.policies import ThresholdK

    model = load_model(tiny_llama_dir, torch.float32)
    adaptive = SpeculativeEngine(model.runtime, proposer=NgramProposer(), k=ThresholdK(start_k=2, k_max=3))
    engines = {"none": SpeculativeEngine(model.runtime), "ngram@auto": adaptive,
               "hf": TimedPeer([5, 6, 7], [0.04, 0.02])}
    records = run_records(engines, [{"question_id": "q", "category": "c", "prompt": "x"}], [[4, 8, 15, 4, 8, 15]],
                          SamplingParams(max_new_tokens=3, ignore_eos=True), (), repeats=2)
    by_method = {r["method"]: r for r in records}
    peer = by_method["hf"]
    assert peer["seconds"] == 0.02 and peer["repeat_seconds"] == [0.04, 0.02]
    assert peer["tokens_per_s"] == pytest.approx(3 / 0.02)
    chosen = adaptive.policy.chosen  # the last repeat's choices (greedy repeats decode alike)
    assert chosen and by_method["ngram@auto"]["k_chosen_mean"] == pytest.approx(sum(chosen) / len(chosen))


class ScriptedPeer:
    """A stand-in peer returning the next of ``outputs`` on each call."""

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def generate(self, prompt_ids, max_new_tokens):
        return self.outputs.pop(0)[:max_new_tokens], 0.01


def test_a_later_turn_on_another_context_is_not_identical_even_where_its_tokens_are(tiny_text_model_dir):
    """A turn decoded after another reply than plain's ran on another prompt: it is not
    identical to plain, even where its tokens happen to be plain's for that turn."""
    from specdecode.bench.runner import turn_encoder
    from specdecode.config import EngineConfig

    model = load_model(tiny_text_model_dir, torch.float32)
    follow_up = turn_encoder(model, EngineConfig(model=str(tiny_text_model_dir), dtype="fp32", chat_template=False))
    plain = SpeculativeEngine(model.runtime, model.tokenizer)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    turns = ["abcabc", "xyzxyz"]
    first = plain.encode(turns[0], False)
    reply = plain.generate(first, params).token_ids
    second = plain.generate(follow_up(turns, [reply]), params).token_ids
    other = [(t + 1) % 97 for t in reply]
    engines = {"none": plain, "hf": ScriptedPeer([other, second])}
    prompts = [{"question_id": 1, "category": "chat", "prompt": turns[0], "turns": turns}]
    records = run_records(engines, prompts, [first], params, (), follow_up=follow_up)
    late = next(r for r in records if r["method"] == "hf" and r["turn"] == 2)
    assert late["context_differs"] and late["identical_to_plain"] is False


def test_summary_pools_tokens_passes_and_prompts():
    """Aggregate tok/s is all tokens over all seconds; tau counts passes that ended early;
    drafts per pass are pooled over passes; same is the share of prompts; the divergence
    margins' median and max; no alpha where nothing was drafted."""

    def record(method, question, new_tokens, seconds, **extra):
        return dict(question_id=question, category="c", method=method, tokens_per_s=new_tokens / seconds,
                    new_tokens=new_tokens, seconds=seconds, identical_to_plain=extra.pop("same", True), **extra)

    records = [record("none", q, 10, 0.1) for q in "abcd"] + [
        record("ngram", "a", 10, 1.0, draft_tokens=6, accepted_tokens=3, target_forwards=4, ended_early=1),
        record("ngram", "b", 100, 0.5, draft_tokens=6, accepted_tokens=3, target_forwards=4, same=False,
               first_divergence={"top2_margin": 0.1}),
        record("ngram", "c", 20, 1.0, draft_tokens=0, accepted_tokens=0, target_forwards=20, same=False,
               first_divergence={"top2_margin": 0.2}),
        record("ngram", "d", 30, 1.5, draft_tokens=4, accepted_tokens=4, target_forwards=4, same=False,
               first_divergence={"top2_margin": 0.9}),
    ]
    summary = summarize(records)["overall"]
    row = summary["ngram"]
    assert row["aggregate_tokens_per_s"] == pytest.approx(160 / 4.0)  # not the mean of the rates (62.5)
    assert row["alpha"] == pytest.approx(10 / 16) and row["tau"] == pytest.approx((10 + 32 - 1) / 32)
    assert row["drafts_per_pass"] == pytest.approx(16 / 32)
    assert row["identical_to_plain"] == pytest.approx(1 / 4)
    assert row["divergent"] == 3 and row["divergence_margin_median"] == 0.2 and row["divergence_margin_max"] == 0.9
    assert summary["none"]["alpha"] is None  # printed "-", not 0.00


@needs_kernels
def test_sampled_repeats_of_adaptive_k_may_differ_on_a_batch_invariant_runtime(tiny_llama_dir):
    """Only greedy repeats must agree on the kernels: sampled draws follow the drafts, which
    adaptive k changes between repeats; the record says repeats_identical: false."""
    from specdecode.control.policies import ThresholdK

    model = load_model(tiny_llama_dir, torch.float32, backend="kernels")
    assert model.runtime.exact
    FlakyEngine.calls = 0
    engines = {"none": SpeculativeEngine(model.runtime),
               "ngram": FlakyEngine(model.runtime, proposer=NgramProposer(), k=ThresholdK(start_k=3, k_max=3))}
    params = SamplingParams(temperature=0.9, seed=3, max_new_tokens=6, ignore_eos=True)
    records = run_records(engines, [{"question_id": "q", "category": "c", "prompt": "x"}], [[4, 8, 15, 16, 23, 42]],
                          params, (), repeats=2)
    assert {r["method"]: r for r in records}["ngram"]["repeats_identical"] is False


def test_bench_json_records_the_repeats_and_the_seed_rule_of_a_sampled_run(tmp_path):
    from specdecode.bench.runner import SEED_RULE
    from specdecode.cli import main

    model = save_chat_model(tmp_path / "chat", seed=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abcabc abcabc", "category": "c"}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(model), "--dtype", "fp32", "--prompts", str(prompts), "--methods", "ngram@3",
                 "--max-new-tokens", "4", "--temperature", "1.0", "--seed", "5", "--repeats", "2",
                 "--out", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["repeats"] == 2 and config["seed"] == 5 and config["seed_rule"] == SEED_RULE


# -- bench-serve and peers (a mutation audit: no test failed on these mutants) ---------
def test_bench_serve_table_prints_latencies_in_ms_and_e2e_in_seconds(capsys):
    """TTFT, TPOT and ITL cells in milliseconds, the E2E cell in seconds, as the header says."""
    from specdecode.bench.serve import print_table

    figures = {"mean": None, "p50": 0.25, "p99": 0.5}
    row = {"mode": "spec", "concurrency": 1, "request_rate": None, "requests": 2, "failed": 0,
           "request_throughput": 1.0, "output_throughput": 10.0, "acceptance_rate": 0.5, "mean_acceptance_length": 2.0,
           "ttft": figures, "tpot": figures, "itl": figures, "e2e": {"mean": None, "p50": 1.5, "p99": 2.0}}
    print_table([row])
    line = capsys.readouterr().out.splitlines()[1]
    assert "250ms" in line and "500ms" in line and "1.50s" in line and "1500" not in line


def test_bench_serve_counts_a_stream_without_usage_as_failed_and_requests_per_second_of_successes(monkeypatch):
    """A stream that ends without its usage chunk failed (ignore_eos: every request that ran
    reports tokens); request throughput counts the successful requests only."""
    import asyncio

    import httpx

    from specdecode.bench import serve as serve_bench

    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    no_usage = [(t, payload) for t, payload in _chat_stream(1.0, [1.5], 2) if "usage" not in str(payload)]
    transport = _fake_server(clock, [_chat_stream(0.0, [0.5, 1.0], 2), no_usage, _chat_stream(1.5, [2.0], 1)])
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real_client(transport=transport, **kwargs))
    row = asyncio.run(serve_bench.run_level("http://bench", "m", ["a", "b", "c"], 2, "spec", 1, None, 0))
    assert row["requests"] == 3 and row["failed"] == 1 and "usage" in row["errors"][0]
    assert row["wall_seconds"] == pytest.approx(2.0) and row["output_tokens"] == 3
    assert row["request_throughput"] == pytest.approx(2 / 2.0)


def test_bench_serve_level_whose_requests_all_failed_has_no_throughput(monkeypatch):
    """Every request refused: no output or request throughput (None, not 0.0 tok/s, which
    would enter the ratios as a measured zero)."""
    import asyncio

    import httpx

    from specdecode.bench import serve as serve_bench

    clock = _Clock()
    monkeypatch.setattr(serve_bench, "time", clock)
    transport = _fake_server(clock, [503, 503])
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: real_client(transport=transport, **kwargs))
    ticks = iter(range(100))
    monkeypatch.setattr(clock, "perf_counter", lambda: float(next(ticks)), raising=False)  # 1 s per reading
    row = asyncio.run(serve_bench.run_level("http://bench", "m", ["a", "b"], 2, "plain", 1, None, 0))
    assert row["requests"] == 2 and row["failed"] == 2 and row["output_tokens"] == 0
    assert row["output_throughput"] is None and row["request_throughput"] is None


def test_bench_serve_scrape_sums_each_counter_over_its_labels():
    """Series of one counter under several labels (task categories, positions) add up; the
    Prometheus prefix is dropped and comments skipped."""
    from specdecode.bench.serve import scrape

    text = "\n".join([
        "# HELP specdecode:spec_decode_num_drafts_total drafts",
        'specdecode:spec_decode_num_drafts_total{model_name="m",category="code"} 3.0',
        'specdecode:spec_decode_num_drafts_total{model_name="m",category="chat"} 4.0',
        'specdecode:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0",category="code"} 2.0',
        'specdecode:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0",category="chat"} 5.0',
        'specdecode:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1",category="chat"} 1.0',
    ])
    totals = scrape(text)
    assert totals["spec_decode_num_drafts_total"] == 7.0
    assert totals["per_pos/0"] == 7.0 and totals["per_pos/1"] == 1.0 and totals["replicas"] == ""


def _bench_serve_with_fake_levels(monkeypatch, tmp_path, levels, rate, num_prompts, modes, rounds=1, audits=0):
    """bench_serve against stand-ins for run_level and the audit wait; returns the calls to
    run_level as (mode, requests, max_tokens, concurrency) and the JSON written."""
    import httpx

    from specdecode.bench import serve as serve_bench

    calls = []

    async def run_level(url, model, prompts, max_tokens, mode, concurrency, rate, seed):
        calls.append((mode, len(prompts), max_tokens, concurrency))
        tok_s = 130.0 if mode == "spec" else 100.0
        return {"mode": mode, "concurrency": concurrency, "request_rate": rate, "requests": len(prompts), "failed": 0,
                "errors": [], "wall_seconds": 1.0, "request_throughput": 1.0, "output_throughput": tok_s,
                "output_tokens": 1, **{name: serve_bench.summarize([0.1]) for name in ("ttft", "tpot", "itl", "e2e")},
                "acceptance_rate": None, "mean_acceptance_length": None, "drafts": 0.0}

    monkeypatch.setattr(serve_bench, "run_level", run_level)
    monkeypatch.setattr(serve_bench, "wait_for_audits", lambda url: {"audit_requests_total": audits,
                                                                     "audit_mismatches_total": 1 if audits else 0})
    monkeypatch.setattr(httpx, "post", lambda *args, **kwargs: httpx.Response(200))
    monkeypatch.setattr(serve_bench, "plot", lambda rows, path: None)
    out = tmp_path / "b.json"
    serve_bench.bench_serve([{"prompt": "a"}, {"prompt": "b"}], levels, rate, num_prompts, 32, modes, "http://x", [],
                            out, model="m", rounds=rounds)
    return calls, json.loads(out.read_text())


def test_bench_serve_sends_at_least_a_request_per_client_of_a_level(monkeypatch, tmp_path):
    """A level wider than --num-prompts still sends one request per client (fewer would
    leave clients idle and measure a narrower level)."""
    calls, _ = _bench_serve_with_fake_levels(monkeypatch, tmp_path, [1, 4], None, 2, ["spec"])
    assert calls == [("spec", 4, 16, 4), ("spec", 2, 32, 1), ("spec", 4, 32, 4)]


def test_bench_serve_warms_a_rate_run_up_with_every_request_at_once(monkeypatch, tmp_path):
    """A --request-rate run's arrivals can hold all its requests at once: the warm-up sends
    as many as --num-prompts, concurrently."""
    calls, saved = _bench_serve_with_fake_levels(monkeypatch, tmp_path, [1], 2.0, 6, ["plain"])
    assert calls == [("plain", 6, 16, 6), ("plain", 6, 32, None)]
    assert saved["rows"][0]["request_rate"] == 2.0


def test_bench_serve_prints_and_writes_the_ratio_summary_and_the_audit(monkeypatch, tmp_path, capsys):
    """One round of two modes: the summary (spec/plain) is printed and written to the JSON
    beside the rows, and the audit's counts are printed and saved."""
    _, saved = _bench_serve_with_fake_levels(monkeypatch, tmp_path, [1], None, 2, ["spec", "plain"], audits=3)
    out = capsys.readouterr().out
    assert "1.30x [1.30, 1.30]" in out
    assert "audit: 3 requests re-decoded plainly, 1 differed" in out
    assert saved["summary"][0]["spec_over_plain"]["median"] == pytest.approx(1.3)
    assert saved["audit"] == {"audit_requests_total": 3, "audit_mismatches_total": 1}
    assert [row["mode"] for row in saved["rows"]] == ["spec", "plain"]


def test_an_unknown_peer_is_refused():
    """`build_peer` names the peers it knows rather than return nothing."""
    from specdecode.bench.peers import build_peer

    with pytest.raises(SpecDecodeError, match="unknown peer 'vllm'"):
        build_peer("vllm", None, 64)


def test_the_transformers_peer_stops_at_the_eos_ids_it_is_given(tiny_llama_dir):
    """A token the tiny model emits, named as EOS, ends the peer's output just before its
    first occurrence, whichever of several EOS ids comes first (no fast test's model
    emitted its own EOS, so a peer that ran on past it passed every test)."""
    from specdecode.bench.peers import HFPeer

    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9]
    free = HFPeer(tiny_llama_dir, ()).generate(prompt, 24)[0]
    assert len(free) == 24
    stop = next(i for i in range(1, 24) if free[i] not in free[:i])  # a token first seen past the start
    unused = next(token for token in range(3, 1000) if token not in free)
    cut = HFPeer(tiny_llama_dir, (unused, free[stop])).generate(prompt, 24)[0]
    assert cut == free[:stop]


def test_categories_take_turns_to_the_last_prompt_of_the_largest():
    """Categories of unequal sizes: each round takes the next prompt of every category that
    has one left, and no prompt is dropped (a mutation audit: stopping at the smallest
    category's size passed, as the built-in suite's categories are all of 10)."""
    from specdecode.prompts import categories_in_turn

    prompts = [{"category": c, "prompt": f"{c}{n}"} for c, n in
               [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("c", 2)]] + [{"prompt": "g1"}]
    assert [p["prompt"] for p in categories_in_turn(prompts)] == ["a1", "b1", "c1", "g1", "a2", "c2", "a3"]
    assert categories_in_turn([]) == []


def test_the_bench_plot_draws_each_methods_speedups_and_mean_acceptance_per_position(monkeypatch, tmp_path):
    """Found in a mutation audit: the bench plot was tested only for writing a file. Its left
    panel has one bar per category and method (plain decoding left out) at the summary's
    speedup, none where nothing was timed; its right panel one line per method, the mean
    over prompts of each prompt's acceptance at draft positions 1, 2, ..."""
    import math

    import matplotlib.figure

    from specdecode.bench.plots import plot_bench

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    summary = {"json": {"none": {"speedup": 1.0}, "ngram": {"speedup": 1.5}, "suffix": {"speedup": None}},
               "code": {"none": {"speedup": 1.0}, "ngram": {"speedup": 0.9}, "suffix": {"speedup": 1.25}},
               "overall": {"none": {"speedup": 1.0}, "ngram": {"speedup": 1.2}, "suffix": {"speedup": 1.3}},
               "translation": {"none": {"speedup": 1.0}, "ngram": {"speedup": 2.0}, "suffix": {"speedup": 1.1}}}
    records = [{"method": "ngram", "acceptance_per_position": [0.5, 0.25]},
               {"method": "ngram", "acceptance_per_position": [1.0]},
               {"method": "suffix", "acceptance_per_position": [0.2, 0.4, 0.6]},
               {"method": "none", "acceptance_per_position": [0.9]}]
    plot_bench(summary, records, tmp_path / "bench.png")
    (figure,) = figures
    left, right = figure.axes
    heights = [patch.get_height() for patch in left.patches]
    assert heights[:4] == [0.9, 1.5, 2.0, 1.2]  # ngram: code, json, translation, overall last
    assert heights[4] == 1.25 and math.isnan(heights[5]) and heights[6:] == [1.1, 1.3]  # suffix
    centres = [patch.get_x() + patch.get_width() / 2 for patch in left.patches]
    assert centres == pytest.approx([0, 1, 2, 3, 0.4, 1.4, 2.4, 3.4])  # each method's bars beside the last's
    assert [label.get_text() for label in left.get_xticklabels()] == ["code", "json", "translation", "overall"]
    lines = {line.get_label(): line for line in right.lines}
    assert set(lines) == {"ngram", "suffix"}
    assert list(lines["ngram"].get_xdata()) == [1, 2] and list(lines["ngram"].get_ydata()) == [0.75, 0.25]
    assert list(lines["suffix"].get_xdata()) == [1, 2, 3]
    assert list(lines["suffix"].get_ydata()) == pytest.approx([0.2, 0.4, 0.6])
    assert right.get_xlim() == (0.5, 3.5)


def test_the_bench_plot_labels_its_axes_and_marks_plain_decoding_at_1(monkeypatch, tmp_path):
    """Found in a mutation audit: the bench plot's axes were not checked. The speedup panel
    has a dashed line at plain decoding's 1.0, a tick under the middle of each category's
    group of bars, a legend naming the methods; the acceptance panel spans 0-1 with a tick
    at each drafted position. With no acceptance at all it shows position 1 alone, no legend."""
    import matplotlib.figure

    from specdecode.bench.plots import plot_bench

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    summary = {"code": {"none": {"speedup": 1.0}, "ngram": {"speedup": 1.5}, "suffix": {"speedup": 0.9}},
               "overall": {"none": {"speedup": 1.0}, "ngram": {"speedup": 1.2}, "suffix": {"speedup": 1.3}}}
    records = [{"method": "ngram", "acceptance_per_position": [0.5, 0.25]},
               {"method": "suffix", "acceptance_per_position": [0.2, 0.4, 0.6]}]
    plot_bench(summary, records, tmp_path / "bench.png")
    left, right = figures[-1].axes
    (reference,) = left.lines
    assert list(reference.get_ydata()) == [1.0, 1.0] and reference.get_linestyle() == "--"
    assert list(left.get_xticks()) == pytest.approx([0.2, 1.2])  # bars at 0, 0.4 and 1, 1.4
    assert [text.get_text() for text in left.get_legend().get_texts()] == ["ngram", "suffix"]
    assert left.get_ylabel() == "median speedup vs plain (tokens/s ratio)"
    assert right.get_xlabel() == "draft position" and right.get_ylabel() == "acceptance rate (mean over prompts)"
    assert right.get_ylim() == (0, 1) and list(right.get_xticks()) == [1, 2, 3]
    assert [text.get_text() for text in right.get_legend().get_texts()] == ["ngram", "suffix"]

    plot_bench(summary, [{"method": "ngram", "acceptance_per_position": []}], tmp_path / "bench.png")
    left, right = figures[-1].axes
    assert not right.lines and right.get_legend() is None
    assert right.get_xlim() == (0.5, 1.5) and list(right.get_xticks()) == [1]
