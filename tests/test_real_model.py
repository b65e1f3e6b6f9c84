"""The real SmolLM2-135M-Instruct (embedded default): greedy equality and CLI, fp32.

Marked slow: the first run converts the GGUF (~20 s); later runs read the cache.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from specdecode.config import SamplingParams, SpeculativeConfig, EngineConfig
from specdecode.factory import build_engine, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarize in one sentence: The bicycle lane network was completed in April. Cyclists on the main bridge rose from 2,100 to 3,400 per day.",
    "Write a Python function that returns the squares of a list of numbers.",
    "What is the capital of Japan?",
]


@pytest.fixture(scope="module")
def real_fp32(tmp_path_factory):
    # share the user's conversion cache when there is one (CI converts once per run)
    os.environ.setdefault("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    return load_model("default", torch.float32)


@pytest.fixture(scope="module")
def real_fp32_profile(real_fp32):
    """A measured cost profile of the real fp32 model, cached where --k auto reads it: two
    contexts, the sizes a chain of up to 7 drafts scores, three rounds. The full table (4
    contexts up to 64 rows, 7 rounds) took about two minutes of the suite on the torch
    backend; `specdecode profile` and the bench measure that."""
    from specdecode.cost.profile import CostProfile, machine_id, measure_target, save_profile, step_bytes
    from specdecode.factory import model_key

    contexts, sizes, table = measure_target(real_fp32.runtime, contexts=(100, 600), sizes=(1, 2, 3, 4, 5, 6, 8),
                                            repeats=3, progress=False)
    weight_bytes, kv_bytes = step_bytes(real_fp32.runtime)
    profile = CostProfile(model_key(real_fp32), "fp32", machine_id(), torch.get_num_threads(), contexts, sizes,
                          table, weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes)
    save_profile(profile, model_key(real_fp32))
    return profile


@pytest.mark.parametrize("method, draft, k, width", [("ngram", None, 5, 1), ("draft", "self:8", 4, 1), ("ngram", None, 1, 1),
                                                    ("eagle", None, 3, 1), ("eagle", None, 6, 3), ("suffix", None, 4, 1),
                                                    ("medusa", None, 3, 1)])
def test_real_model_greedy_equality(real_fp32, method, draft, k, width):
    """fp32 (torch backend) and, for the shipped EAGLE head, chains and dynamic trees; the
    shipped Medusa heads' chains."""
    config = EngineConfig(dtype="fp32")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_fp32)
    spec = SpeculativeConfig(method=method, draft=draft, k=k, tree_width=width)
    engine = build_engine(config, spec, target=real_fp32)
    params = SamplingParams(max_new_tokens=48)
    accepted = 0
    for prompt in PROMPTS:
        ids = plain.encode(prompt)
        expected = plain.generate(ids, params)
        result = engine.generate(ids, params)
        assert result.token_ids == expected.token_ids, prompt
        assert result.text == expected.text
        accepted += result.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("k, width", [(3, 1), (6, 3)])
def test_shipped_eagle_head_is_exact_on_the_default_runtime_and_drafts_well(k, width):
    """The default runtime (kernels, --exact): output bit for bit plain decoding, and the
    head's first drafts are accepted far more often than an untrained drafter's on prompts it never saw."""
    config = EngineConfig()
    target = load_model("default", torch.bfloat16)
    plain = build_engine(config, SpeculativeConfig(method="none"), target=target)
    engine = build_engine(config, SpeculativeConfig(method="eagle", k=k, tree_width=width), target=target)
    params = SamplingParams(max_new_tokens=64)
    first = drafted = 0
    for prompt in PROMPTS:
        ids = plain.encode(prompt)
        result = engine.generate(ids, params)
        assert result.token_ids == plain.generate(ids, params).token_ids, prompt
        first += result.stats.accepted_per_position[0]
        drafted += result.stats.drafted_per_position[0]
    assert first / drafted > 0.15, (first, drafted)  # held out: 36%; untrained drafters: 0-2%


def test_shipped_store_drafts_where_prompt_lookup_cannot(real_fp32):
    """The target's own phrasing, from answers to other prompts: on a question whose answer
    repeats little of the prompt, the store's drafts are accepted where prompt lookup has
    no match of two tokens or more to draft from."""
    from specdecode.proposers.ngram import NgramProposer
    from specdecode.proposers.suffix import SuffixProposer

    config = EngineConfig(dtype="fp32")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_fp32)
    store = build_engine(config, SpeculativeConfig(method="suffix", k=3), target=real_fp32).proposer.store
    ids = plain.encode("Give three tips for staying focused while studying.")
    answer = plain.generate(ids, SamplingParams(max_new_tokens=64)).token_ids
    hits = {"store": [0, 0], "lookup": [0, 0]}
    for i in range(len(answer) - 1):
        context = ids + answer[:i]
        for name, proposer in (("store", SuffixProposer(store, (3, 2))), ("lookup", NgramProposer((3, 2)))):
            draft = proposer.propose(context, 1, None, None).draft_ids.tolist()
            hits[name][0] += bool(draft) and draft[0] == answer[i]
            hits[name][1] += bool(draft)
    assert hits["store"][1] > hits["lookup"][1] and hits["store"][0] > 2 * hits["lookup"][0], hits
    assert hits["store"][0] / hits["store"][1] > 0.1, hits  # 8 of 40 when written; untrained drafters: 0-2%


def test_real_model_first_answer_is_sensible(real_fp32):
    engine = build_engine(EngineConfig(dtype="fp32"), SpeculativeConfig(method="none"), target=real_fp32)
    result = engine.generate(engine.encode("What is the capital of France?"), SamplingParams(max_new_tokens=12))
    assert "Paris" in result.text


def test_cli_generate_json(capsys):
    from specdecode.cli import main

    # a fixed k and weight format: --k auto's profile and --weights auto's timing (minutes here)
    # are covered on tiny models and by make demo
    code = main(["generate", "Count from one to five in words.", "--method", "ngram", "--max-new-tokens", "16", "--json",
                 "--compare", "--dtype", "fp32", "--k", "4", "--weights", "int4"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0
    assert record["identical_to_plain"] is True
    assert record["stats"]["new_tokens"] > 0 and record["text"]
    assert set(record["stats"]) >= {"alpha", "tau", "draft_tokens", "accepted_tokens", "acceptance_per_position", "tokens_per_s"}


def test_cli_reports_bad_input_cleanly(capsys):
    from specdecode.cli import main

    assert main(["generate", "hi", "--model", "/nowhere/model"]) == 2
    assert "error: model '/nowhere/model' not found" in capsys.readouterr().err
    assert main(["generate", "hi", "--k", "0"]) == 2
    assert "k (draft tokens per step) must be 'auto' or an integer in 1..512, got 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--k", "many"]) == 2
    assert "k must be 'auto' or an integer >= 1, got 'many'" in capsys.readouterr().err


def test_cli_train_data_answers_with_the_targets_own_greedy_decoding(tmp_path, capsys):
    from specdecode.cli import main

    out = tmp_path / "data"
    code = main(["train", "data", "--prompts", "2", "--max-new-tokens", "12", "--corpus-tokens", "600",
                 "--out", str(out), "--weights", "int4", "--dtype", "fp32"])
    assert code == 0, capsys.readouterr().err
    assert "answers: 4 for 2 prompts" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [r["row"] for r in records] == [0, 1, 0, 1] and records[1]["temperature"] == 0.8
    greedy = records[0]
    engine = build_engine(EngineConfig(dtype="fp32", weights="int4"), SpeculativeConfig(method="none"))
    plain = engine.generate(greedy["prompt_ids"], SamplingParams(max_new_tokens=12)).token_ids
    assert greedy["answer_ids"] == plain
    corpus = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert sum(len(c["ids"]) for c in corpus) >= 600 and corpus[0]["source"].endswith(".py")
    # bad input: a clear error, not a traceback
    assert main(["train", "data", "--prompts", "0", "--out", str(out)]) == 2
    assert "--prompts >= 1" in capsys.readouterr().err


def test_bench_writes_records(tmp_path, capsys):
    from specdecode.cli import main

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["Name three colours.", "And three more."]}) + "\n"
        + json.dumps({"prompt": "Repeat exactly: alpha beta gamma alpha beta gamma", "category": "copy"}) + "\n"
    )
    out = tmp_path / "r.json"
    # one weight format: timing the formats (--weights auto) took about two of this test's three minutes;
    # the default dtype's: the cost profile of the default-dtype tests serves here, measured once
    assert main(["bench", "--prompts", str(prompts), "--methods", "none,ngram", "--max-new-tokens", "16", "--out", str(out),
                 "--dtype", "bf16", "--weights", "int4"]) == 0
    payload = json.loads(out.read_text())
    assert len(payload["records"]) == 6  # both turns of the conversation, and the prompt
    turns = {r.get("turn") for r in payload["records"] if r["question_id"] == 1}
    assert turns == {1, 2}
    for record in payload["records"]:
        assert set(record) >= {"question_id", "category", "method", "new_tokens", "seconds", "tokens_per_s", "alpha", "tau", "identical_to_plain"}
        assert record["identical_to_plain"]
    assert "overall" in payload["summary"] and "speedup" in capsys.readouterr().out
    profile = payload["config"]["cost_profile"]  # the profile the policies decided by
    assert profile["runtime"] and set(profile["v"]) == {"2", "4", "8"} and all(v > 0 for v in profile["v"].values())
    assert out.with_suffix(".png").stat().st_size > 10_000  # the speedup/acceptance picture


@pytest.mark.parametrize("policy", ["cost", "threshold"])
def test_real_model_adaptive_k_is_lossless(real_fp32, real_fp32_profile, policy):
    """--k auto (cost-aware, measured profile of the real model) and the threshold rule:
    token-identical to plain decoding in fp32, on a copyable prompt and on open text."""
    from specdecode.control.policies import CostAwareK, ThresholdK

    config = EngineConfig(dtype="fp32")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_fp32)
    engine = build_engine(config, SpeculativeConfig(method="ngram", k="auto", k_policy=policy), target=real_fp32)
    assert isinstance(engine.policy, CostAwareK if policy == "cost" else ThresholdK)
    params = SamplingParams(max_new_tokens=64)
    chosen = []
    # the summary copies a little; the repetition copies throughout. In fp32 three rows cost
    # 1.3-1.5 single steps on a Zen 4 (two, 1.05-1.1), so a second draft pays only where the
    # first is nearly always right: without the repetition this failed in 1 of 4 full runs
    repeat = ("Repeat the following sentence exactly, twice: The bicycle lane network was completed in "
              "April, and cyclists on the main bridge rose from 2,100 to 3,400 per day.")
    for prompt in PROMPTS + [repeat, "Write a short poem about the sea at night."]:
        ids = plain.encode(prompt)
        assert engine.generate(ids, params).token_ids == plain.generate(ids, params).token_ids, prompt
        chosen += engine.policy.chosen
    assert max(chosen) >= 2  # it did speculate


def test_real_model_memory_counts_its_parameters(real_fp32):
    from specdecode.analysis.memory import resolve_shape

    weights = real_fp32.runtime.weights
    counted = sum(p.numel() for name, p in weights.named_parameters())
    assert resolve_shape("default").parameters == counted == 134_515_008


def test_real_model_check(capsys):
    from specdecode.cli import main

    # the runtime of the bench test and the default-dtype tests: one cost profile serves them
    # all (--weights auto's timing of the formats took 12 s more)
    assert main(["check", "default", "self:4", "--dtype", "bf16", "--weights", "int4"]) == 0
    out = capsys.readouterr().out
    assert "verdict: COMPATIBLE" in out and "calibration (greedy, 9 prompts): per-trial alpha" in out
    assert "cost profile (kernels backend, q4_1 weights, bfloat16 KV cache)" in out  # --weights reached the target
    # the untrained first-4-layer drafter accepts ~1% of drafts: plain decoding must win
    assert "speculation does not pay with this pair on this machine" in out


@pytest.fixture(scope="module")
def real_int4(real_fp32):
    return load_model("default", torch.bfloat16, weights="int4")


def test_int4_carries_the_gguf_blocks_exactly(real_fp32, real_int4):
    """--weights int4 holds the GGUF's own Q4_1 blocks (q and k rows un-permuted) and its Q8_0
    embedding: de-quantized they equal, bit for bit, the fp32 weights transformers
    de-quantizes from the same file."""
    carried = real_int4.runtime.weights.carried
    assert carried["blk.0.attn_q.weight"] == "exact (q4_1)" and carried["token_embd.weight"] == "exact (q8_0)"
    assert all(how.startswith("exact") for how in carried.values())
    dense, packed = real_fp32.runtime.weights, real_int4.runtime.weights
    for index in (0, 17, 29):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(packed.layers[index], name).dequantize(), getattr(dense.layers[index], name).weight)
    assert torch.equal(packed.embed.dequantize(), dense.embed.weight)


def test_real_model_rows_are_bitwise_batch_invariant(real_int4):
    """The default kernels: a row alone equals the same row within T = 2..64 at contexts up
    to 1,500 tokens (six key chunks)."""
    runtime = real_int4.runtime
    assert runtime.exact
    tokens = torch.randint(0, 49152, (1, 1600), generator=torch.Generator().manual_seed(0))
    runtime.reset(1600)
    for context in (5, 300, 1500):
        runtime.rollback(0)
        runtime(tokens[:, :context], last_only=True)
        alone = runtime(tokens[:, context : context + 1])
        runtime.rollback(context)
        for count in (2, 9, 33, 64):
            together = runtime(tokens[:, context : context + count])
            runtime.rollback(context)
            assert torch.equal(together[:, :1], alone), (context, count)


@pytest.mark.parametrize("method, draft, k", [("ngram", None, "auto"), ("ngram", None, 4), ("draft", "self:8", 3),
                                             ("suffix", None, "auto"), ("suffix", None, 4)])
def test_real_model_greedy_equality_in_the_default_dtype(real_int4, method, draft, k):
    """bf16 KV cache and 4-bit weights, exact: speculative output identical to plain."""
    config = EngineConfig(dtype="bf16", weights="int4")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_int4)
    engine = build_engine(config, SpeculativeConfig(method=method, draft=draft, k=k), target=real_int4)
    params = SamplingParams(max_new_tokens=48)
    for prompt in PROMPTS:
        ids = plain.encode(prompt)
        assert engine.generate(ids, params).token_ids == plain.generate(ids, params).token_ids, prompt


@pytest.mark.parametrize("method, k", [("suffix", "auto"), ("ngram", 3)])
def test_real_model_seeded_sampling_equals_plain_sampling(real_int4, method, k):
    """Sampling (temperature 0.7, top-p 0.9) with a deterministic drafter, in the default
    dtype: the target's own draws, one uniform per position, verify the drafts, and the
    kernels score each row the same whatever is beside it, so a seeded request's tokens
    are plain sampling's, whatever k the policy chose at each step."""
    config = EngineConfig(dtype="bf16", weights="int4")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_int4)
    engine = build_engine(config, SpeculativeConfig(method=method, k=k), target=real_int4)
    accepted = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = plain.encode(prompt)
        params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=48, seed=seed)
        result = engine.generate(ids, params)
        assert result.token_ids == plain.generate(ids, params).token_ids, prompt
        accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_weight_format_error_against_fp32(real_fp32):
    """The error each format adds, against fp32 weights on the same kernels (logits of a
    48-token prompt; figures in docs/performance.md). int8 and int4 also quantize the
    activations per block of 32 (as llama.cpp does for these formats), so int4 differs
    from fp32 even though its weights are the fp32 weights exactly."""
    from specdecode.models.llama import load_native

    path = real_fp32.source.path
    text = ("The history of the bicycle begins in the early 19th century, when inventors in Germany and France "
            "built the first machines. Over the following decades the frame, the wheels and the brakes changed "
            "many times: wooden frames gave way to iron and then steel, solid tyres to pneumatic ones, and the chain "
            "drive made the safety bicycle the standard design. By 1900 millions of people rode to work, and clubs "
            "organised races across the country")
    ids = torch.tensor([real_fp32.tokenizer(text)["input_ids"]])  # 91 tokens
    logits = {}
    for fmt in ("fp32", "bf16", "q8_0", "q4_1"):
        runtime = load_native(path, torch.float32 if fmt == "fp32" else torch.bfloat16, fmt, "kernels")
        runtime.reset(128)
        logits[fmt] = runtime(ids).float()[0]
    reference = logits["fp32"]
    # Quantizing activations makes these figures move with the order of float sums: a change
    # of ~1e-6 flips a rounding here and there, and int4's top-1 agreement with fp32 measured
    # 0.83-0.97 over 30 tokens across kernel versions whose fp32 logits differ by 3e-6
    # (0.88-0.92 over these 91). A broken format agrees on next to nothing. int4 errs about
    # as much as int8 since its minimum multiplies the quantized activations' sum (0.40 mean,
    # 92% top-1 before, with the exact sum; 0.19 and 97% since, over this prompt and a code one)
    for fmt, mean_error, agreement in (("bf16", 0.1, 0.95), ("q8_0", 0.6, 0.9), ("q4_1", 0.3, 0.9)):
        error = (logits[fmt] - reference).abs().mean().item()
        same = (logits[fmt].argmax(-1) == reference.argmax(-1)).float().mean().item()
        assert error < mean_error and same >= agreement, (fmt, error, same)


@pytest.mark.parametrize("weights,repeats", [("int4", 1), ("int4", 60), ("int8", 1)])
def test_memory_estimate_matches_the_peak_rss_of_a_run(weights, repeats):
    """specdecode memory's total (process, weights, KV cache, scratch, loading) against the
    peak resident memory of a `specdecode generate` process, on a short and a long prompt.
    int8 re-quantizes every Q4_1 tensor of the default file: its freed temporaries held
    60-90 MB resident beside the weights (13-20% over) until loading mapped them."""
    import subprocess
    import sys

    from specdecode import kernels
    from specdecode.analysis.memory import deployment_memory, process_baseline

    load_model("default", torch.bfloat16, weights="int4")  # convert, index and build once, outside the measured run
    kernels.build()
    process_baseline()  # measured (and cached) before the ballast below
    # The child must report its own peak, not this process's: a parent holding 1 GiB more
    # than the run itself (as pytest does after the other real-model tests) must not count.
    ballast = bytearray(2**30)
    ballast[::4096] = b"\1" * len(range(0, 2**30, 4096))
    prompt = " ".join(["The committee met on Tuesday to review the budget for the new library wing."] * repeats)
    script = "import sys; from specdecode.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", script, "generate", prompt, "--weights", weights, "--method", "none",
               "--max-new-tokens", "32", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    del ballast
    record = json.loads(result.stdout)
    context = record["stats"]["prompt_tokens"] + 32 + 1
    estimate = deployment_memory("default", None, "bf16", context=context, k=0, weights=weights, process=True)["total"]
    measured = record["peak_rss_mb"] * 2**20
    # the issue asks for 15%; held to 10% (int4 -0.4% / +4.2%, int8 -1.3% when written; int8 read
    # -13.7% before loading mapped its temporaries)
    assert abs(estimate / measured - 1) < 0.10, (context, estimate / 2**20, measured / 2**20, result.stderr[-2000:])


@pytest.mark.parametrize("method", ["ngram", "eagle", "suffix"])
def test_batched_engine_on_the_real_model_equals_each_request_alone(method):
    """The default runtime (kernels, int4, bf16 cache): requests decoded together with
    prompt lookup or the shipped head's chains give bit for bit each one's plain output,
    a prompt started from a cached prefix included."""
    from specdecode.factory import build_proposer
    from specdecode.proposers.eagle import EagleProposer
    from specdecode.proposers.ngram import NgramProposer
    from specdecode.serve.batch import BatchEngine

    config = EngineConfig()
    target = load_model("default", torch.bfloat16)
    plain = build_engine(config, SpeculativeConfig(method="none"), target=target)
    params = SamplingParams(max_new_tokens=40)
    prompts = [plain.encode(p) for p in PROMPTS + ["Write a JSON object describing a cat named Tom, aged 3."]]
    expected = [plain.generate(ids, params).token_ids for ids in prompts]
    if method == "eagle":
        template = build_proposer(SpeculativeConfig(method="eagle", tree_width=1), target, config)

        def make_drafter():  # as the server makes them: each row's head layer on the kernels
            return EagleProposer(template.head, template.embed_rows)
    elif method == "suffix":
        from specdecode.proposers.suffix import SuffixProposer

        store = build_proposer(SpeculativeConfig(method="suffix"), target, config).store

        def make_drafter():  # as the server makes them: the shipped store shared by every row
            return SuffixProposer(store)
    else:
        make_drafter = NgramProposer
    batch_target = load_model("default", torch.bfloat16)  # its own cache rows
    engine = BatchEngine(batch_target.runtime, batch_target.tokenizer, batch_target.eos_token_ids, max_num_seqs=3,
                         max_model_len=512, make_drafter=make_drafter, make_policy=lambda: 3)
    sequences = [engine.add(ids, params) for ids in prompts]
    engine.run()
    assert [s.generated for s in sequences] == expected
    assert sum(s.stats.accepted_tokens for s in sequences) > 0
    assert method != "eagle" or all(s.proposer.layer is not None for s in sequences)
    # the chat template's system prompt is prefilled once: the second and third requests
    # wait a step for the first's entries, the fourth finds them in a finished row (EAGLE
    # rows prefill in full)
    cached = [s.cached_tokens for s in sequences]
    assert cached[0] == 0 and (min(cached[1:]) > 0 if method != "eagle" else max(cached) == 0), cached
