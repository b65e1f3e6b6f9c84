"""Greedy speculative decoding is token-identical to plain decoding (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import SamplingParams
from specdecode.control.policies import CostAwareK, CostModel
from specdecode.cost.profile import CostProfile
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)


def random_prompt(rng: random.Random, vocab: int = 97) -> list[int]:
    """Prompts with repeated spans, so n-gram lookup finds matches and gets some wrong."""
    base = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]
    return (base * rng.randint(1, 4) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 6))])[:40]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny targets (different seeds) and two draft models for them."""
    root = tmp_path_factory.mktemp("greedy")
    targets = [load_model(save_tiny_model(root / f"t{s}", seed=s, num_layers=3), torch.float32) for s in (10, 11, 12)]
    drafts = [load_model(save_tiny_model(root / f"d{s}", seed=s, num_layers=1), torch.float32) for s in (20, 21)]
    return targets, drafts


def proposers(target, drafts):
    yield NgramProposer((3, 2, 1))
    yield NgramProposer((1,))
    for draft in drafts:
        yield DraftModelProposer(draft.runtime)
    yield DraftModelProposer(target.runtime.layer_skip_view(1))
    # the full target as its own draft: every draft accepted, so the draft cache must be
    # resynchronised after full acceptance (the last draft token was never run through it)
    yield DraftModelProposer(target.runtime.layer_skip_view(3))


def test_speculative_equals_plain_on_tiny_models(models):
    targets, drafts = models
    rng = random.Random(0)
    checked = accepted = 0
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        for proposer in proposers(target, drafts):
            for k in (1, 2, 4, 7):
                engine = SpeculativeEngine(target.runtime, proposer=proposer, k=k)
                for _ in range(3):
                    prompt = random_prompt(rng)
                    expected = plain.generate(prompt, GREEDY).token_ids
                    result = engine.generate(prompt, GREEDY)
                    assert result.token_ids == expected, (proposer.name, k, prompt)
                    checked += 1
                    accepted += result.stats.accepted_tokens
    assert checked == 3 * 6 * 4 * 3
    assert accepted > 0  # the comparison exercised accepted drafts, not only bonus tokens


def test_full_acceptance_keeps_draft_cache_in_sync(models):
    targets, _ = models
    target = targets[0]
    proposer = DraftModelProposer(target.runtime.layer_skip_view(3))
    engine = SpeculativeEngine(target.runtime, proposer=proposer, k=4)
    prompt = [5, 6, 7, 8]
    result = engine.generate(prompt, GREEDY)
    assert result.token_ids == SpeculativeEngine(target.runtime).generate(prompt, GREEDY).token_ids
    # identical draft and target: every draft is accepted, 5 tokens per pass
    assert result.stats.alpha == 1.0
    assert result.stats.tau == pytest.approx(40 / result.stats.target_forwards)
    # draft cache holds exactly the committed tokens it has seen, no stale tail
    assert proposer.cached[: proposer.runtime.length] == (prompt + result.token_ids)[: proposer.runtime.length]


def test_greedy_verification_computes_the_head_up_to_the_first_rejection(models):
    """On the CPU kernels the target's logits are computed row by row as greedy
    verification reads them: accepted + 1 rows per drafting step, none past a rejection,
    and the output is still plain decoding's."""
    targets, drafts = models
    target = targets[0]
    assert target.runtime.lazy_logits
    stack = target.runtime.kernels
    for proposer in (DraftModelProposer(drafts[0].runtime), NgramProposer((1,))):
        engine = SpeculativeEngine(target.runtime, proposer=proposer, k=4)
        prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
        before = stack.head_rows
        result = engine.generate(prompt, GREEDY)
        rows, steps = stack.head_rows - before, result.stats.drafted_per_position[0]
        assert result.token_ids == SpeculativeEngine(target.runtime).generate(prompt, GREEDY).token_ids
        assert steps > 0 and rows == result.stats.accepted_tokens + steps
        assert result.stats.rejections > 0 and rows < result.stats.draft_tokens + steps
    # the k policy is told, per request, that greedy steps pay the head only for rows read
    profile = CostProfile("m", "fp32", "cpu", 1, contexts=[100], sizes=[1, 2], step_ms=[[10, 11]],
                          drafters={"ngram": 0.0}, head_ms=1.0)
    policy = CostAwareK(CostModel(profile, "ngram"), k_max=3)
    engine = SpeculativeEngine(target.runtime, proposer=NgramProposer(), k=policy)
    engine.generate(prompt, GREEDY)
    assert policy.costs.lazy_head
    engine.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=8, seed=1))
    assert not policy.costs.lazy_head
    # where one pass of the head over every row costs what one row on demand does (a head
    # bound by reading its weights), the policy asks for the full pass and the engine obeys
    for full_ms, computed in (([1.0, 2.0], True), ([1.0, 1.0], False)):
        profile = CostProfile("m", "fp32", "cpu", 1, contexts=[100], sizes=[1, 2], step_ms=[[10, 11]],
                              drafters={"ngram": 0.0}, head_ms=1.0, head_next_ms=1.0, head_sizes=[1, 2],
                              head_full_ms=full_ms)
        engine = SpeculativeEngine(target.runtime, proposer=NgramProposer((1,)), k=CostAwareK(CostModel(profile, "ngram"), k_max=1))
        before = stack.head_rows
        result = engine.generate(prompt, GREEDY)
        assert result.stats.drafted_per_position[0] > 0 and (stack.head_rows > before) == computed
        assert result.token_ids == SpeculativeEngine(target.runtime).generate(prompt, GREEDY).token_ids


def test_native_plain_matches_transformers_generate(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    prompt = [5, 17, 33, 5, 17]
    reference = hf.generate(
        torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()
    ours = SpeculativeEngine(load_model(tiny_llama_dir, torch.float32).runtime).generate(
        prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)
    )
    assert ours.token_ids == reference


def test_transformers_adapter_greedy_equality(tiny_llama_dir, tiny_draft_dir):
    target = load_model(tiny_llama_dir, torch.float32, runtime="hf")
    draft = load_model(tiny_draft_dir, torch.float32, runtime="hf")
    plain = SpeculativeEngine(target.runtime)
    for proposer in (NgramProposer(), DraftModelProposer(draft.runtime)):
        engine = SpeculativeEngine(target.runtime, proposer=proposer, k=3)
        for prompt in ([4, 5, 6, 4, 5], [9, 9, 9, 10, 11, 12, 9, 9]):
            assert engine.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY).token_ids


def test_other_architecture_goes_through_transformers(tmp_path):
    """A GPT-2 checkpoint has no native runtime: 'auto' picks the adapter, speculation holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdecode.config import ConfigError
    from specdecode.models.hf import HFRuntime

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  initializer_range=0.2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    target = load_model(tmp_path / "gpt2", torch.float32)
    assert isinstance(target.runtime, HFRuntime) and target.runtime.max_positions == 128
    plain = SpeculativeEngine(target.runtime)
    engine = SpeculativeEngine(target.runtime, proposer=NgramProposer(), k=4)
    for prompt in ([4, 5, 6, 4, 5], [9, 10, 11, 9, 10, 11, 9]):
        assert engine.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY).token_ids
    # --k auto through the adapter: the cost profile is measured on the transformers model
    from specdecode.config import EngineConfig, SpeculativeConfig
    from specdecode.factory import build_engine

    auto = build_engine(EngineConfig(model=str(tmp_path / "gpt2"), dtype="fp32"), SpeculativeConfig(method="ngram"),
                        target=target)
    for prompt in ([4, 5, 6, 4, 5], [9, 10, 11, 9, 10, 11, 9]):
        assert auto.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY).token_ids
    with pytest.raises(ConfigError, match="native runtime supports llama, mistral and qwen2, not 'gpt2'"):
        load_model(tmp_path / "gpt2", torch.float32, runtime="native")
