"""Engine behaviour: stops, streaming, seeds, sampling end to end, and bad input."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from scipy.stats import chisquare

from conftest import save_tiny_model
from specdecode.config import ConfigError, EngineConfig, SamplingParams, SpeculativeConfig
from specdecode.engine import PromptError, SpeculativeEngine
from specdecode.factory import VocabularyMismatchError, build_proposer, load_model
from specdecode.models.loading import ModelNotFoundError
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer


@pytest.fixture(scope="module")
def text_model(tiny_text_model_dir):
    return load_model(tiny_text_model_dir, torch.float32)


def engines(model):
    yield SpeculativeEngine(model.runtime, model.tokenizer)
    yield SpeculativeEngine(model.runtime, model.tokenizer, NgramProposer(), k=4)
    yield SpeculativeEngine(model.runtime, model.tokenizer, DraftModelProposer(model.runtime.layer_skip_view(2)), k=4)


def test_stop_string_trims_accepted_drafts(text_model):
    plain = SpeculativeEngine(text_model.runtime, text_model.tokenizer)
    prompt = text_model.tokenizer("abcabcabc")["input_ids"]
    free = plain.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert len(free.text) == 30
    stop = free.text[12:15]  # a string the greedy output is known to contain
    cut = free.text[: free.text.find(stop)]
    for engine in engines(text_model):
        streamed = []
        result = engine.generate(
            prompt, SamplingParams(max_new_tokens=30, stop=(stop,), ignore_eos=True), on_text=streamed.append
        )
        assert result.text == cut, engine.method
        assert "".join(streamed) == cut  # nothing streamed past the stop, not even a prefix of it
        assert result.finish_reason == "stop"
        # the token that completed the stop string is the last one kept
        assert len(result.token_ids) == free.text.find(stop) + len(stop)


def test_eos_stops_and_is_not_emitted(text_model):
    plain = SpeculativeEngine(text_model.runtime, text_model.tokenizer)
    prompt = [5, 6, 7]
    free = plain.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True)).token_ids
    eos = free[6]
    for engine in engines(text_model):
        engine.eos_token_ids = frozenset({eos})
        result = engine.generate(prompt, SamplingParams(max_new_tokens=20))
        assert result.token_ids == free[: free.index(eos)] and result.finish_reason == "stop"


def test_max_new_tokens_is_exact(text_model):
    for engine in engines(text_model):
        for limit in (1, 2, 7):
            result = engine.generate([5, 6, 5, 6, 5], SamplingParams(max_new_tokens=limit, ignore_eos=True))
            assert len(result.token_ids) == limit and result.finish_reason == "length"


def test_seed_reproduces_sampled_output(text_model):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=25, seed=42, ignore_eos=True)
    for engine in engines(text_model):
        first = engine.generate([5, 6, 7, 8], params).token_ids
        assert engine.generate([5, 6, 7, 8], params).token_ids == first
    other = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=25, seed=43, ignore_eos=True)
    assert engine.generate([5, 6, 7, 8], other).token_ids != first


def test_engine_sampling_matches_target_distribution(tmp_path):
    """End to end through the engine: draft model, k=2, temperature 1.0, vocabulary 6.

    The joint distribution of the first two generated tokens is compared with the target's
    exact chain-rule probabilities computed from its logits.
    """
    target = load_model(save_tiny_model(tmp_path / "t", seed=30, vocab_size=6, init_std=0.6), torch.float32)
    draft = load_model(save_tiny_model(tmp_path / "d", seed=31, vocab_size=6, init_std=0.6), torch.float32)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)
    engine = SpeculativeEngine(target.runtime, proposer=DraftModelProposer(draft.runtime), k=2)
    prompt, runs, vocab = [3, 4], 3000, 6
    counts = torch.zeros(vocab * vocab)
    accepted = 0
    for seed in range(runs):
        result = engine.generate(prompt, dataclasses.replace(params, seed=seed))
        counts[result.token_ids[0] * vocab + result.token_ids[1]] += 1
        accepted += result.stats.accepted_tokens
    runtime = target.runtime
    runtime.reset(8)
    first = runtime(torch.tensor([prompt]))[0, -1].softmax(-1).double()  # [V]
    expected = torch.zeros(vocab, vocab, dtype=torch.float64)
    for y1 in range(vocab):
        runtime.reset(8)
        expected[y1] = first[y1] * runtime(torch.tensor([prompt + [y1]]))[0, -1].softmax(-1).double()
    expected = (expected / expected.sum()).flatten() * runs
    assert 0 < accepted < 2 * runs
    _, p_value = chisquare(counts.double().numpy(), expected.numpy())
    assert p_value > 1e-3, p_value


def test_unknown_model_path_names_what_was_tried():
    with pytest.raises(ModelNotFoundError, match=r"model '/no/such/model' not found: tried a built-in name"):
        load_model("/no/such/model", torch.float32)


def test_vocabulary_mismatch_is_refused(tmp_path, tiny_llama_dir):
    target = load_model(tiny_llama_dir, torch.float32)
    small = save_tiny_model(tmp_path / "other-vocab", seed=2, vocab_size=50)
    spec = SpeculativeConfig(method="draft", draft=str(small))
    with pytest.raises(VocabularyMismatchError, match="vocabulary mismatch: target .* has 97 tokens, draft .* has 50"):
        build_proposer(spec, target, EngineConfig(dtype="fp32"))


def test_k_below_one_is_refused(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"k \(draft tokens per step\) must be 'auto' or an integer >= 1, got 0"):
        SpeculativeConfig(method="ngram", k=0)
    runtime = load_model(tiny_llama_dir, torch.float32).runtime
    with pytest.raises(ConfigError, match="must be >= 1, got -2"):
        SpeculativeEngine(runtime, proposer=NgramProposer(), k=-2)


def test_empty_prompt_is_refused(text_model):
    engine = SpeculativeEngine(text_model.runtime, text_model.tokenizer)
    with pytest.raises(PromptError, match="prompt is empty"):
        engine.encode("   ")
    with pytest.raises(PromptError, match="prompt is empty"):
        engine.generate([], SamplingParams())


def test_prompt_longer_than_context_is_refused(text_model):
    engine = SpeculativeEngine(text_model.runtime, text_model.tokenizer)
    with pytest.raises(PromptError, match="prompt has 300 tokens but the model's context is 256 tokens"):
        engine.generate([5] * 300, SamplingParams())


def test_generation_stops_at_the_context_limit(text_model):
    engine = SpeculativeEngine(text_model.runtime, text_model.tokenizer, NgramProposer(), k=5)
    result = engine.generate([5, 6] * 120, SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert result.finish_reason == "length" and 240 + len(result.token_ids) == 256


def test_bad_sampling_and_draft_flags():
    with pytest.raises(ConfigError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpeculativeConfig(method="draft")
