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


@pytest.mark.parametrize("method, draft, k", [("ngram", None, 5), ("draft", "self:8", 4), ("ngram", None, 1)])
def test_real_model_greedy_equality(real_fp32, method, draft, k):
    config = EngineConfig(dtype="fp32")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_fp32)
    engine = build_engine(config, SpeculativeConfig(method=method, draft=draft, k=k), target=real_fp32)
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


def test_real_model_first_answer_is_sensible(real_fp32):
    engine = build_engine(EngineConfig(dtype="fp32"), SpeculativeConfig(method="none"), target=real_fp32)
    result = engine.generate(engine.encode("What is the capital of France?"), SamplingParams(max_new_tokens=12))
    assert "Paris" in result.text


def test_cli_generate_json(capsys):
    from specdecode.cli import main

    code = main(["generate", "Count from one to five in words.", "--method", "ngram", "--max-new-tokens", "16", "--json", "--compare", "--dtype", "fp32"])
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
    assert "k (draft tokens per step) must be 'auto' or an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["generate", "hi", "--k", "many"]) == 2
    assert "k must be 'auto' or an integer >= 1, got 'many'" in capsys.readouterr().err


def test_bench_writes_records(tmp_path, capsys):
    from specdecode.cli import main

    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["Name three colours.", "ignored"]}) + "\n"
        + json.dumps({"prompt": "Repeat exactly: alpha beta gamma alpha beta gamma", "category": "copy"}) + "\n"
    )
    out = tmp_path / "r.json"
    assert main(["bench", "--prompts", str(prompts), "--methods", "none,ngram", "--max-new-tokens", "16", "--out", str(out), "--dtype", "fp32"]) == 0
    payload = json.loads(out.read_text())
    assert len(payload["records"]) == 4
    for record in payload["records"]:
        assert set(record) >= {"question_id", "category", "method", "new_tokens", "seconds", "tokens_per_s", "alpha", "tau", "identical_to_plain"}
        assert record["identical_to_plain"]
    assert "overall" in payload["summary"] and "speedup" in capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 10_000  # the speedup/acceptance picture


@pytest.mark.parametrize("policy", ["cost", "threshold"])
def test_real_model_adaptive_k_is_lossless(real_fp32, policy):
    """--k auto (cost-aware, measured profile of the real model) and the threshold rule:
    token-identical to plain decoding in fp32, on a copyable prompt and on open text."""
    from specdecode.control.policies import CostAwareK, ThresholdK

    config = EngineConfig(dtype="fp32")
    plain = build_engine(config, SpeculativeConfig(method="none"), target=real_fp32)
    engine = build_engine(config, SpeculativeConfig(method="ngram", k="auto", k_policy=policy), target=real_fp32)
    assert isinstance(engine.policy, CostAwareK if policy == "cost" else ThresholdK)
    params = SamplingParams(max_new_tokens=64)
    chosen = []
    for prompt in PROMPTS + ["Write a short poem about the sea at night."]:
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

    assert main(["check", "default", "self:4", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "verdict: COMPATIBLE" in out and "calibration (greedy, 3 prompts): per-trial alpha" in out
    # the untrained first-4-layer drafter accepts ~1% of drafts: plain decoding must win
    assert "speculation does not pay with this pair on this machine" in out
