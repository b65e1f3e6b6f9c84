"""Medusa heads: the last layer's output as a capture, proposals that are the heads' own
guesses at the right position, lossless decoding with random heads, files and errors."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import save_tiny_model
from specdecode.config import ConfigError, SamplingParams, SpecDecodeError, SpeculativeConfig
from specdecode.engine import SpeculativeEngine
from specdecode.factory import VocabularyMismatchError, build_engine, build_proposer, load_model
from specdecode.config import EngineConfig
from specdecode.proposers.medusa import MedusaConfig, MedusaHeads, MedusaProposer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)


def with_a_random_final_norm(directory, seed: int):
    """The checkpoint with its final norm's weights drawn in [0.5, 1.5) (transformers leaves
    them all 1, so heads that skipped the norm's weights passed every test: a review)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    tensors["model.norm.weight"] = 0.5 + torch.rand(tensors["model.norm.weight"].shape, generator=generator)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    return [load_model(with_a_random_final_norm(save_tiny_model(root / f"t{s}", seed=s, num_layers=3), s),
                       torch.float32, backend=backend)
            for s, backend in ((40, "torch"), (41, "kernels"))]


def random_heads(target, seed: int, heads: int = 3, draft_vocab: int = 60, std: float = 0.3) -> MedusaHeads:
    cfg = target.runtime.cfg
    torch.manual_seed(seed)
    medusa = MedusaHeads(MedusaConfig(cfg.hidden_size, heads, cfg.vocab_size, draft_vocab, cfg.rms_norm_eps))
    if std:
        torch.nn.init.normal_(medusa.blocks.weight, std=std)
        torch.nn.init.normal_(medusa.blocks.bias, std=std)
    medusa.set_draft_vocab(torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values)
    weights = target.runtime.weights
    return medusa.bind(weights.norm, weights.lm_head.dequantize())


def last_layer_states(target, tokens: list[int]) -> torch.Tensor:
    """The target's last-layer output at every position of ``tokens``, from one fresh pass."""
    runtime = target.runtime
    runtime.reset(len(tokens) + 1)
    _, features = runtime(torch.tensor([tokens]), capture=(runtime.num_layers,))
    return features[0]


def test_the_last_layers_output_is_a_capture_that_gives_the_logits(targets):
    """Capture index L (the layer count) is the last layer's output: the target's final norm
    and output head on it give the target's logits, on the torch and the kernel backend."""
    for target in targets:
        runtime = target.runtime
        tokens = [5, 17, 33, 8, 61, 12]
        runtime.reset(len(tokens))
        logits, features = runtime(torch.tensor([tokens]), capture=(0, runtime.num_layers))
        final = features[0, :, runtime.cfg.hidden_size:]
        heads = random_heads(target, 0, draft_vocab=runtime.vocab_size, std=0.0)
        heads.set_draft_vocab(torch.arange(runtime.vocab_size))
        heads.bind(runtime.weights.norm, runtime.weights.lm_head.dequantize())
        rebuilt = heads.normalise(final) @ heads.rows.T
        assert torch.allclose(rebuilt, logits[0].float(), atol=2e-3, rtol=1e-3), runtime.backend
        assert not torch.equal(final, features[0, :, : runtime.cfg.hidden_size])
        runtime.reset(4)
        with pytest.raises(SpecDecodeError, match="capture layers must lie in 0..3"):
            runtime(torch.tensor([[1, 2]]), capture=(runtime.num_layers + 1,))


def test_untrained_heads_guess_the_targets_own_next_token(targets):
    """A block starts at zero, so every head's guess from position n-2 is the target's own
    argmax there: the proposal reads the state of the right position."""
    target = targets[0]
    heads = random_heads(target, 0, draft_vocab=target.runtime.vocab_size, std=0.0)
    proposer = MedusaProposer(heads, target.runtime.num_layers, kernels=False)
    committed = [7, 21, 40, 9, 13, 77]
    states = last_layer_states(target, committed[:-1])
    proposer.start(committed, 16)
    proposer.observe(0, states, committed)
    runtime = target.runtime
    runtime.reset(len(committed))
    expected = int(runtime(torch.tensor([committed[:-1]]))[0, -1].argmax())
    assert proposer.propose(committed, 3, GREEDY, None).draft_ids.tolist() == [expected] * 3
    # a committed sequence that moved on without the heads being told: no stale guesses
    assert proposer.propose(committed + [5], 3, GREEDY, None).num_tokens == 0


def test_each_head_is_a_residual_silu_block_on_the_targets_normed_state(targets):
    """The drafts by the module docstring's definition, computed here from the raw weights:
    head i guesses argmax over the draft rows of y = x + SiLU(W_i x + b_i), x the target's
    final RMSNorm of the last state. A mutation audit: dropping the SiLU passed (the other
    tests compare the proposer with ``heads.states``). k = 0 drafts nothing."""
    target = targets[0]
    weights = target.runtime.weights
    heads = random_heads(target, 2)
    proposer = MedusaProposer(heads, target.runtime.num_layers, kernels=False)
    hidden, eps = target.runtime.cfg.hidden_size, target.runtime.cfg.rms_norm_eps
    rows = weights.lm_head.dequantize().float()[heads.d2t]
    for committed in ([7, 21, 40, 9, 13, 77], [5, 17, 33, 8, 61, 12, 90, 4]):
        state = last_layer_states(target, committed[:-1])
        proposer.start(committed, 32)
        proposer.observe(0, state, committed)
        x = state[-1].float()
        x = weights.norm.float() * x / torch.sqrt(x.pow(2).mean() + eps)
        expected = []
        for i in range(3):
            w, b = heads.blocks.weight[i * hidden : (i + 1) * hidden], heads.blocks.bias[i * hidden : (i + 1) * hidden]
            y = x + torch.nn.functional.silu(w @ x + b)
            expected.append(int(heads.d2t[int((rows @ y).argmax())]))
        assert proposer.propose(committed, 3, GREEDY, None).draft_ids.tolist() == expected, committed
        assert proposer.propose(committed, 0, GREEDY, None).num_tokens == 0


class Recording(MedusaProposer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def propose(self, tokens, k, params, generator):
        proposal = super().propose(tokens, k, params, generator)
        self.seen.append((list(tokens), k, proposal.draft_ids.tolist()))
        return proposal


def test_medusa_greedy_equals_plain_and_drafts_the_heads_own_guesses(targets):
    """Lossless with random heads (both backends, k 1..4 with 3 heads), and every proposal
    equals the heads applied to a fresh pass's state at position n-2 (a stale state would
    keep the output lossless but ruin acceptance, so the drafts themselves are checked)."""
    rng = random.Random(0)
    checked = drafted = 0
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        for seed in range(3):
            heads = random_heads(target, seed)
            proposer = Recording(heads, target.runtime.num_layers, kernels=False)
            for k in (1, 2, 4):
                engine = SpeculativeEngine(target.runtime, proposer=proposer, k=k)
                prompt = [rng.randrange(3, 97) for _ in range(rng.randint(2, 12))]
                proposer.seen.clear()
                result = engine.generate(prompt, GREEDY)
                assert result.token_ids == plain.generate(prompt, GREEDY).token_ids, (seed, k, prompt)
                checked += 1
                drafted += result.stats.draft_tokens
                for tokens, asked, drafts in proposer.seen[:4]:
                    state = last_layer_states(target, tokens[:-1])[-1]
                    guesses = heads.logits(heads.states(heads.normalise(state), min(asked, 3))).argmax(-1)
                    assert drafts == heads.d2t[guesses].tolist(), (seed, k)
                assert all(len(drafts) == min(asked, 3) for _, asked, drafts in proposer.seen)
    assert checked == 18 and drafted > 0


def test_kernel_drafts_agree_with_torch_drafts(targets):
    """Q8_0 blocks and rows on the kernels draft (nearly always) what fp32 torch drafts."""
    target = targets[1]
    same = total = 0
    for seed in range(4):
        heads = random_heads(target, seed)
        fast = MedusaProposer(heads, target.runtime.num_layers)
        assert heads.fast is not None
        slow = MedusaProposer(random_heads(target, seed), target.runtime.num_layers, kernels=False)
        for length in range(3, 12):
            committed = [(seed * 7 + 3 * i) % 90 + 3 for i in range(length)]
            states = last_layer_states(target, committed[:-1])
            for proposer in (fast, slow):
                proposer.start(committed, 40)
                proposer.observe(0, states, committed)
            a = fast.propose(committed, 3, GREEDY, None).draft_ids.tolist()
            b = slow.propose(committed, 3, GREEDY, None).draft_ids.tolist()
            same += sum(x == y for x, y in zip(a, b))
            total += 3
    assert same >= 0.9 * total, (same, total)


def test_fewer_drafts_than_heads_are_the_first_heads_guesses(targets):
    """k below the number of heads drafts the first k heads' guesses, on torch and on the
    kernels (a review: taking the last k heads passed, the other tests comparing the
    proposer with the same slicing, or at k = the head count only)."""
    for target in targets:
        for kernels in (False, True):
            heads = random_heads(target, 5, heads=3)
            proposer = MedusaProposer(heads, target.runtime.num_layers, kernels=kernels)
            for length in (4, 7, 11):
                committed = [(5 * i + 3) % 90 + 3 for i in range(length)]
                proposer.start(committed, 40)
                proposer.observe(0, last_layer_states(target, committed[:-1]), committed)
                every = proposer.propose(committed, 3, GREEDY, None).draft_ids.tolist()
                assert len(set(every)) > 1  # the heads guess differently: a wrong slice shows
                for k in (1, 2):
                    assert proposer.propose(committed, k, GREEDY, None).draft_ids.tolist() == every[:k], (k, kernels)


def test_seeded_sampling_with_medusa_draws_plain_samplings_tokens(targets):
    """Deterministic drafts are verified by the target's own draws: a seeded request's
    tokens are exactly plain sampling's for that seed."""
    for target in targets:
        plain = SpeculativeEngine(target.runtime)
        proposer = MedusaProposer(random_heads(target, 5), target.runtime.num_layers, kernels=False)
        engine = SpeculativeEngine(target.runtime, proposer=proposer, k=3)
        drafted = 0
        for seed in range(4):
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=24, ignore_eos=True)
            result = engine.generate([4, 9, 16, 25], params)
            assert result.token_ids == plain.generate([4, 9, 16, 25], params).token_ids, seed
            drafted += result.stats.draft_tokens
        assert drafted > 0


def test_heads_files_round_trip_and_bad_heads_are_refused(targets, tmp_path):
    target = targets[0]
    heads = random_heads(target, 2)
    heads.save(tmp_path / "heads", {"note": "test"})
    loaded = MedusaHeads.load(tmp_path / "heads")
    assert torch.equal(loaded.d2t, heads.d2t)
    assert torch.equal(loaded.blocks.weight, heads.blocks.weight.to(torch.bfloat16).float())
    # through the factory: bound to the target, drafting, lossless
    spec = SpeculativeConfig(method="medusa", k=3, draft=str(tmp_path / "heads"))
    proposer = build_proposer(spec, target, EngineConfig(dtype="fp32"))
    assert isinstance(proposer, MedusaProposer) and proposer.capture == (target.runtime.num_layers,)
    engine = SpeculativeEngine(target.runtime, proposer=proposer, k=3)
    assert engine.generate([3, 4, 5], GREEDY).token_ids == SpeculativeEngine(target.runtime).generate([3, 4, 5], GREEDY).token_ids
    with pytest.raises(ConfigError, match="Medusa heads not found: .*nowhere is not a directory"):
        build_proposer(SpeculativeConfig(method="medusa", draft=str(tmp_path / "nowhere")), target, EngineConfig())
    with pytest.raises(ConfigError, match="Medusa heads: this model needs --head HEADS_DIR .*shipped only for the default model"):
        build_proposer(SpeculativeConfig(method="medusa"), target, EngineConfig())
    # heads of another vocabulary
    other = load_model(save_tiny_model(tmp_path / "other", seed=3, vocab_size=120), torch.float32)
    with pytest.raises(VocabularyMismatchError, match="trained for a target with 97 tokens"):
        build_proposer(spec, other, EngineConfig(dtype="fp32"))
    # not Medusa heads: an EAGLE head's directory, or no files
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text('{"architecture": "specdecode-eagle3"}')
    (tmp_path / "eagle" / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecDecodeError, match="holds 'specdecode-eagle3', not Medusa heads"):
        MedusaHeads.load(tmp_path / "eagle")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="is not a Medusa head directory"):
        MedusaHeads.load(tmp_path / "empty")


def test_medusa_through_build_engine_with_k_auto(targets, tmp_path):
    """The whole path a user takes: the cost profile times the heads, acceptance is
    calibrated, k is chosen per step, and the output is plain decoding's."""
    target = targets[1]
    random_heads(target, 7, std=0.05).save(tmp_path / "heads")
    engine = build_engine(EngineConfig(dtype="fp32"), SpeculativeConfig(method="medusa", draft=str(tmp_path / "heads")),
                          target=target)
    plain = SpeculativeEngine(target.runtime)
    for prompt in ([5, 6, 7, 8], [40, 41, 42, 40, 41, 42, 40]):
        assert engine.generate(prompt, GREEDY).token_ids == plain.generate(prompt, GREEDY).token_ids
    assert engine.drafter.startswith("medusa:")


def test_check_understands_medusa_heads(targets, tmp_path):
    from specdecode.analysis.compat import check_static, head_kind

    target = targets[0]
    random_heads(target, 1).save(tmp_path / "heads", {"target": "some-other-model"})
    target_dir = str(target.source.path)
    for draft in (str(tmp_path / "heads"), f"medusa:{tmp_path / 'heads'}"):
        assert head_kind(draft) == "medusa"
        result = check_static(target_dir, draft)
        assert result.compatible and "3 Medusa heads" in str(result.lines), result.lines
        assert ("trained for", "WARN") in [(name, status) for name, status, _ in result.lines]
    other = load_model(save_tiny_model(tmp_path / "wide", seed=2, hidden_size=32), torch.float32)
    bad = check_static(str(other.source.path), str(tmp_path / "heads"))
    assert not bad.compatible and "head 64, target 32" in str(bad.lines)
    assert not check_static(target_dir, f"medusa:{tmp_path / 'nothing'}").compatible


def test_k_is_capped_at_the_number_of_heads(targets, tmp_path):
    """Found in review: k above the head count drafted fewer tokens than the policy priced
    (positions never observed kept their prior), and the profile divided one pass's time
    by the k asked rather than the drafts made."""
    from specdecode.cost.profile import measure_drafter

    target = targets[1]
    random_heads(target, 3, heads=2).save(tmp_path / "two")
    draft = str(tmp_path / "two")
    with pytest.raises(ConfigError, match="drafts at most 2 tokens a step"):
        build_engine(EngineConfig(dtype="fp32"), SpeculativeConfig(method="medusa", k=3, draft=draft), target=target)
    engine = build_engine(EngineConfig(dtype="fp32"), SpeculativeConfig(method="medusa", draft=draft), target=target)
    assert engine.policy.k_max == 2
    engine.generate([5, 6, 7, 5, 6, 7], GREEDY)
    assert max(engine.policy.chosen) <= 2

    class Counting(MedusaProposer):
        asked = []

        def propose(self, tokens, k, params, generator):
            self.asked.append(k)
            return super().propose(tokens, k, params, generator)

    # found in review: the threshold rule raised k_max back to 2 (and k_min to 2) for one head
    random_heads(target, 3, heads=1).save(tmp_path / "one")
    spec = SpeculativeConfig(method="medusa", draft=str(tmp_path / "one"), k_policy="threshold")
    engine = build_engine(EngineConfig(dtype="fp32"), spec, target=target)
    engine.generate([5, 6, 7, 5, 6, 7], GREEDY)
    assert engine.policy.k_max == 1 and max(engine.policy.chosen) == 1

    proposer = Counting(random_heads(target, 3, heads=2), target.runtime.num_layers)
    assert measure_drafter(proposer, 64, target.runtime.vocab_size, repeats=2) > 0
    assert set(Counting.asked) == {2}


def test_a_new_draft_vocabulary_must_be_bound_before_drafting(targets):
    """Found in review: set_draft_vocab after bind kept the old vocabulary's output rows,
    so the heads drafted through the wrong rows (lossless, but other tokens than they
    meant). Drafting through unbound heads is refused by name; bound again, the logits are
    the new rows'."""
    target = targets[0]
    heads = random_heads(target, 5)
    state = torch.randn(1, target.runtime.cfg.hidden_size)
    heads.logits(state)
    new_vocab = torch.randperm(target.runtime.vocab_size)[:60].sort().values
    heads.set_draft_vocab(new_vocab)
    for call in (lambda: heads.logits(state), heads.use_kernels):
        with pytest.raises(SpecDecodeError, match="not bound to their target's output head"):
            call()
    weights = target.runtime.weights
    output = weights.lm_head.dequantize().float()
    heads.bind(weights.norm, output)
    assert torch.allclose(heads.logits(state), state @ output[new_vocab].T)
    # a proposer built before the vocabulary was reordered drafts the same token once the
    # heads are bound again (the rows follow the vocabulary; a stale id list would not)
    proposer = MedusaProposer(random_heads(target, 5), target.runtime.num_layers, kernels=False)
    committed = [7, 21, 40, 9, 13, 77]
    proposer.start(committed, 16)
    proposer.observe(0, last_layer_states(target, committed[:-1]), committed)
    first = proposer.propose(committed, 1, GREEDY, None).draft_ids.tolist()
    proposer.heads.set_draft_vocab(torch.roll(proposer.heads.d2t, 1))
    proposer.heads.bind(weights.norm, output)
    assert proposer.propose(committed, 1, GREEDY, None).draft_ids.tolist() == first


@pytest.mark.parametrize("index", [0, 1])
def test_medusa_rows_start_from_a_cached_prefix_and_keep_their_outputs(targets, index):
    """Medusa reads only the latest position's state, so a served sequence may start from
    a cached prompt prefix (it prefilled the whole prompt before): the same prompt asked
    again and a longer one sharing its start reuse the cached entries, the heads still
    draft, and every output equals the output with prefix caching off."""
    from specdecode.serve.batch import BatchEngine

    target = targets[index]
    heads = random_heads(target, 6, std=0.05)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    shared = [5, 6, 7, 8, 40, 41, 42, 40, 41, 42, 9, 10, 11, 12]
    prompts = [shared, shared, shared + [13, 14, 15]]
    results = []
    for caching in (False, True):
        target.runtime.reset(64, batch=2)
        engine = BatchEngine(target.runtime, max_num_seqs=1, max_model_len=64,
                             make_drafter=lambda: Recording(heads, target.runtime.num_layers),
                             make_policy=lambda: 3)
        engine.prefix_caching = caching
        sequences = [engine.add(prompt, params) for prompt in prompts]
        engine.run()
        results.append(sequences)
    off, on = results
    assert [s.generated for s in on] == [s.generated for s in off]
    assert [s.cached_tokens for s in off] == [0, 0, 0]
    assert on[0].cached_tokens == 0 and on[1].cached_tokens > 0 and on[2].cached_tokens >= len(shared) - 1
    assert all(s.stats.draft_tokens > 0 for s in on)
    # a prompt that was prefilled (in full, or past its cached prefix) hands the heads its
    # last state, so the first step drafts k (found in review: with the prompt's states
    # withheld every request lost its first drafts, and the test above still passed)
    for sequence in (*off, on[0], on[2]):
        tokens, k, drafts = sequence.proposer.seen[0]
        assert tokens == sequence.prompt_ids and len(drafts) == 3


def test_check_and_serve_refuse_k_above_the_heads_before_calibrating(targets, tmp_path, monkeypatch):
    """Found in review: `check --k 5` on 3 heads lowered k to 3 and reported that k's
    figures as the answer; `serve` refused it only after calibrating the drafter (minutes
    on a real model). Both now refuse it first, as generate does."""
    from specdecode import factory
    from specdecode.analysis.compat import calibrate
    from specdecode.serve.server import drafter_entry

    target = targets[1]
    random_heads(target, 4).save(tmp_path / "heads")
    draft = str(tmp_path / "heads")

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before refusing k")

    monkeypatch.setattr(factory, "build_policy", no_calibration)
    monkeypatch.setattr(factory, "calibration_runs", no_calibration)
    with pytest.raises(ConfigError, match="--k 5: medusa drafts at most 3 tokens a step"):
        calibrate(str(target.source.path), draft, dtype="fp32", k=5)
    with pytest.raises(ConfigError, match="num_speculative_tokens 4: method 'medusa' drafts at most 3"):
        drafter_entry(SpeculativeConfig(method="medusa", k=4, draft=draft), target, EngineConfig(dtype="fp32"))


def test_check_shows_the_static_checks_before_refusing_k(targets, tmp_path, capsys):
    """Found in review: `check TARGET HEADS --k 5` printed only the error, not the checks
    that hold."""
    from specdecode.cli import main

    target = targets[1]
    random_heads(target, 4).save(tmp_path / "heads")
    assert main(["check", str(target.source.path), str(tmp_path / "heads"), "--dtype", "fp32", "--k", "5"]) == 2
    captured = capsys.readouterr()
    assert "verdict: COMPATIBLE" in captured.out and "drafts at most 3 tokens a step" in captured.err


def test_bad_heads_configs_are_refused_by_name(targets, tmp_path):
    import json

    target = targets[0]
    random_heads(target, 1).save(tmp_path / "heads")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    for field, value in (("draft_vocab_size", 0), ("draft_vocab_size", 500), ("num_heads", 0), ("num_heads", True)):
        (tmp_path / "heads" / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(SpecDecodeError, match=f"{tmp_path / 'heads'}/config.json does not describe Medusa heads"):
            MedusaHeads.load(tmp_path / "heads")
    # found in review: these loaded, and the first draft ended in a traceback (or crashed the load)
    for eps in (None, "1e-5", -1.0, True):
        (tmp_path / "heads" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": eps}))
        with pytest.raises(SpecDecodeError, match="rms_norm_eps must be a number in"):
            MedusaHeads.load(tmp_path / "heads")
    (tmp_path / "heads" / "config.json").write_text("[]")
    with pytest.raises(SpecDecodeError, match="does not describe Medusa heads: not a JSON object"):
        MedusaHeads.load(tmp_path / "heads")
    (tmp_path / "heads" / "config.json").write_bytes(b"\xff\xfe{}")  # UTF-16's mark (PowerShell's >): a traceback before
    with pytest.raises(SpecDecodeError, match="config.json is not valid JSON"):
        MedusaHeads.load(tmp_path / "heads")
    # an EAGLE command pointed at Medusa heads says what they are
    from specdecode.proposers.eagle_head import EagleHead

    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="holds Medusa heads, not an EAGLE head: use them with --method medusa"):
        EagleHead.load(tmp_path / "heads")


def test_heads_of_a_width_the_kernels_cannot_pack_draft_through_torch(tmp_path):
    """Found in review: a target of hidden size 48 (not a multiple of 32) decodes on the
    torch backend, but packing its heads for the kernels raised instead of falling back."""
    target = load_model(save_tiny_model(tmp_path / "t", seed=7, num_layers=2, hidden_size=48), torch.float32,
                        backend="torch")
    random_heads(target, 2, heads=2).save(tmp_path / "heads")
    spec = SpeculativeConfig(method="medusa", k=2, draft=str(tmp_path / "heads"))
    engine = build_engine(EngineConfig(dtype="fp32"), spec, target=target)
    plain = SpeculativeEngine(target.runtime)
    assert engine.generate([3, 4, 5], GREEDY).token_ids == plain.generate([3, 4, 5], GREEDY).token_ids


def test_check_calibrates_heads_at_the_most_they_draft_by_default(targets, tmp_path, monkeypatch):
    """Found in review: check's --k defaulted to 5, so `specdecode check default medusa`
    failed on the shipped heads (3); without --k the calibration takes as many as they draft."""
    from specdecode import factory
    from specdecode.analysis.compat import calibrate

    target = targets[1]
    random_heads(target, 4).save(tmp_path / "heads")
    seen = []
    monkeypatch.setattr(factory, "calibration_runs", lambda loaded, proposer, k, **kw: seen.append(k) or [])
    calibrate(str(target.source.path), str(tmp_path / "heads"), dtype="fp32")
    calibrate(str(target.source.path), "ngram", dtype="fp32")
    assert seen == [3, 5]


def test_a_head_drafter_on_a_target_that_cannot_give_its_states_is_refused_up_front(targets, tmp_path):
    """Heads read the target's layer states: a transformers target (no capture) and a target
    shallower than the heads' layer are refused when the engine is built or the request
    added, naming the drafter (found in review: a TypeError at the first prefill, and a
    mid-request error that named no drafter)."""
    from specdecode.serve.batch import BatchEngine

    target = targets[0]
    heads = random_heads(target, 0)
    hf = load_model(save_tiny_model(tmp_path / "hf", seed=40, num_layers=3), torch.float32, runtime="hf")
    with pytest.raises(SpecDecodeError, match="medusa drafter reads the target's layer states, which transformers"):
        SpeculativeEngine(hf.runtime, proposer=MedusaProposer(heads, 3, kernels=False), k=3)
    with pytest.raises(SpecDecodeError, match=r"layer states \[5\], but the target has 3 layers"):
        SpeculativeEngine(target.runtime, proposer=MedusaProposer(heads, 5, kernels=False), k=3)
    engine = BatchEngine(target.runtime, max_num_seqs=1, max_model_len=32)
    with pytest.raises(SpecDecodeError, match="but the target has 3 layers"):
        engine.add([5, 6, 7], GREEDY, proposer=MedusaProposer(heads, 5, kernels=False), policy=2)
    assert not engine.waiting and not engine.running


def test_serve_takes_a_k_of_as_many_heads_as_there_are(targets, tmp_path, monkeypatch):
    """num_speculative_tokens equal to the heads (one draft per head) is served, one more is
    refused. Found by a mutation audit: only k above the heads was tried."""
    from specdecode import factory
    from specdecode.serve.server import drafter_entry

    target = targets[1]
    random_heads(target, 4).save(tmp_path / "heads")
    draft = str(tmp_path / "heads")
    monkeypatch.setattr(factory, "build_policy", lambda *args, **kwargs: None)  # no calibration
    make_proposer, make_policy, _ = drafter_entry(SpeculativeConfig(method="medusa", k=3, draft=draft), target,
                                                  EngineConfig(dtype="fp32"))
    assert make_policy(None).k == 3 and make_policy(2).k == 2 and make_proposer().max_drafts == 3
