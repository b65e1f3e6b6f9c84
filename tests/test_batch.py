"""The batched engine: ragged rows in one target pass, each request's output the same as
its output alone."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import save_tiny_model
from specdecode import kernels
from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.control.policies import FixedK
from specdecode.engine import PromptError, SpeculativeEngine
from specdecode.models.llama import load_native
from specdecode.proposers.ngram import NgramProposer
from specdecode.serve.app import usage
from specdecode.serve.batch import BatchEngine

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")
BACKENDS = ["torch", pytest.param("kernels", marks=needs_kernels)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("batch"), "llama", seed=7, num_layers=2)


def runtime_for(model_dir, backend, fmt=None, dtype=torch.float32, prefill_chunk=256):
    fmt = fmt or ("fp32" if dtype == torch.float32 else "bf16")
    return load_native(model_dir, dtype, fmt, backend, prefill_chunk=prefill_chunk)


def random_prompt(rng: random.Random, vocab: int = 97) -> list[int]:
    base = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))]
    return (base * rng.randint(1, 5) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 9))])[:60]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_at_different_lengths_match_each_row_alone(model_dir, backend):
    """forward_rows: rows of different lengths (and cache rows in any order) scored
    together give each row's logits scored alone; bitwise on the kernels."""
    runtime = runtime_for(model_dir, backend)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=generator) for n in (5, 40, 17)]
    news = torch.randint(3, 97, (3, 4), generator=generator)
    alone = []
    for prompt, new in zip(prompts, news):
        runtime.reset(128)
        runtime(prompt[None])
        alone.append(runtime(new[None])[0])
    runtime.reset(128, batch=4)
    rows = [2, 0, 3]
    for row, prompt in zip(rows, prompts):
        runtime.forward_rows(prompt[None], [row], [0])
    together = runtime.forward_rows(news, rows, [len(p) for p in prompts])
    for i in range(3):
        if backend == "kernels":
            assert torch.equal(together[i], alone[i]), i
        else:
            torch.testing.assert_close(together[i], alone[i], rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("fmt, dtype", [("q4_1", torch.bfloat16), ("fp32", torch.float32)])
def test_padding_and_neighbours_never_change_a_row_bitwise(model_dir, fmt, dtype):
    """A row scored with 1..6 real tokens, padded to 8 beside other rows, equals the same
    tokens scored alone bit for bit (the invariance --exact promises, now across rows)."""
    runtime = runtime_for(model_dir, "kernels", fmt, dtype)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 97, (30,), generator=generator)
    others = torch.randint(3, 97, (2, 50), generator=generator)
    runtime.reset(128, batch=3)
    runtime.forward_rows(prompt[None], [1], [0])
    runtime.forward_rows(others, [0, 2], [0, 0])
    for real in range(1, 7):
        new = torch.randint(3, 97, (real,), generator=generator)
        alone = runtime.forward_rows(new[None], [1], [30])
        padded = torch.cat([new, new[-1:].expand(8 - real)])
        inputs = torch.stack([torch.randint(3, 97, (8,), generator=generator), padded,
                              torch.randint(3, 97, (8,), generator=generator)])
        together = runtime.forward_rows(inputs, [0, 1, 2], [50, 30, 50])
        assert torch.equal(together[1, :real], alone[0]), real


def test_forward_rows_refuses_bad_rows(model_dir):
    runtime = runtime_for(model_dir, "torch")
    runtime.reset(32, batch=2)
    with pytest.raises(SpecDecodeError, match="distinct"):
        runtime.forward_rows(torch.zeros(2, 1, dtype=torch.int64), [0, 0], [0, 0])
    with pytest.raises(SpecDecodeError, match="capacity"):
        runtime.forward_rows(torch.zeros(1, 4, dtype=torch.int64), [1], [30])


def alone_outputs(runtime, prompts, params, proposer_k):
    outputs = []
    for prompt, p in zip(prompts, params):
        proposer, k = proposer_k
        engine = SpeculativeEngine(runtime, None, proposer() if proposer else None, k)
        outputs.append(engine.generate(prompt, p).token_ids)
    return outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [0, 3])
def test_greedy_batch_outputs_equal_each_request_alone(model_dir, backend, k):
    """Many concurrent requests of mixed lengths and budgets, arriving while others run,
    some decoded plainly and some with prompt lookup: every output equals the request's
    output from the single-sequence engine."""
    rng = random.Random(k)
    prompts = [random_prompt(rng) for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    runtime = runtime_for(model_dir, backend)
    expected = alone_outputs(runtime, prompts, params, (NgramProposer if k else None, k or 1))
    batch_runtime = runtime_for(model_dir, backend, prefill_chunk=16)  # long prompts take several chunks
    engine = BatchEngine(batch_runtime, max_num_seqs=5, max_model_len=128,
                         make_drafter=(lambda: NgramProposer()) if k else None, make_policy=lambda: k)
    sequences = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        sequences.append(engine.add(prompt, p, speculate=i % 3 != 0))
        if i % 2:
            engine.step()  # arrivals interleave with steps
    engine.run()
    assert [s.generated for s in sequences] == expected
    assert all(s.finish_reason == "length" for s in sequences)
    if k:
        assert sum(s.stats.draft_tokens for s in sequences) > 0
        assert sum(s.stats.accepted_tokens for s in sequences) > 0
    assert sorted(engine.free_rows) == list(range(5))


@pytest.mark.parametrize("fails_in", ["propose", "start"])
def test_a_drafter_that_fails_costs_its_request_the_speculation_not_the_batch(model_dir, fails_in, caplog):
    """Found in review: a drafter's exception for one row failed the whole step, so every
    running request failed with it. Now that row decodes on without speculation (drafts
    are only proposals: its output is the same) and the others are untouched."""
    rng = random.Random(7)
    prompts = [random_prompt(rng) for _ in range(3)]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True) for _ in prompts]
    runtime = runtime_for(model_dir, "torch")
    expected = alone_outputs(runtime, prompts, params, (NgramProposer, 3))

    class Failing(NgramProposer):
        calls = 0

        def __getattribute__(self, name):
            if name == fails_in:
                type(self).calls += 1
                if type(self).calls >= (1 if fails_in == "start" else 3):
                    raise RuntimeError("a drafter bug")
            return super().__getattribute__(name)

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=3, max_model_len=128,
                         make_drafter=NgramProposer, make_policy=lambda: 3)
    sequences = [engine.add(prompts[0], params[0], proposer=Failing(), policy=3)]
    sequences += [engine.add(prompt, p) for prompt, p in zip(prompts[1:], params[1:])]
    engine.run()
    assert [s.generated for s in sequences] == expected
    assert all(s.finish_reason == "length" and s.error is None for s in sequences)
    assert sequences[0].proposer is None and "decodes without speculation" in caplog.text
    assert all(s.stats.draft_tokens > 0 for s in sequences[1:])
    # a k policy's failure in learning from a step is its row's too (found in review: every row's)

    class FailingPolicy(FixedK):
        def observe(self, drafted, accepted):
            raise RuntimeError("a policy bug")

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=3, max_model_len=128,
                         make_drafter=NgramProposer, make_policy=lambda: 3)
    sequences = [engine.add(prompts[0], params[0], proposer=NgramProposer(), policy=FailingPolicy(3))]
    sequences += [engine.add(prompt, p) for prompt, p in zip(prompts[1:], params[1:])]
    engine.run()
    assert [s.generated for s in sequences] == expected and sequences[0].policy is None
    assert all(s.finish_reason == "length" and s.error is None for s in sequences)


@needs_kernels
def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(model_dir):
    """A seeded sampled request draws the same tokens alone and among others (its own
    generator; bitwise-independent rows)."""
    rng = random.Random(5)
    prompts = [random_prompt(rng) for _ in range(6)]
    sampled = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=25, seed=11, ignore_eos=True)

    def run(batch):
        engine = BatchEngine(runtime_for(model_dir, "kernels", "q4_1", torch.bfloat16), max_num_seqs=6,
                             max_model_len=128, make_drafter=NgramProposer, make_policy=lambda: 2)
        target = engine.add(prompts[0], sampled)
        for prompt in prompts[1:batch]:
            engine.add(prompt, SamplingParams(temperature=1.0, max_new_tokens=30, seed=rng.randrange(99), ignore_eos=True))
        engine.run()
        return target.generated

    assert run(1) == run(6)


def test_a_row_near_its_context_limit_cuts_no_other_rows_drafts(model_dir, tmp_path):
    """Found in review: every row's k was cut to the smallest room of the batch, so beside a
    request near the context limit a seeded sampled request with a draft model (drafts drawn,
    verified by rejection with its own generator) drafted fewer tokens and drew other
    tokens than alone. A row the batch's padding would carry past its cache passes alone."""
    from specdecode.proposers.draft_model import DraftModelProposer

    draft_dir = save_tiny_model(tmp_path / "draft", "llama", seed=8, num_layers=1)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    sampled = SamplingParams(temperature=0.9, top_k=30, seed=3, max_new_tokens=40, ignore_eos=True)

    def run(neighbours: bool):
        engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=80)
        draft = DraftModelProposer(runtime_for(draft_dir, "torch"))
        if neighbours:  # a seeded sampled row first: the drafts draw with their own row's generator
            engine.add([9, 8, 7, 6], SamplingParams(temperature=1.0, seed=77, max_new_tokens=40, ignore_eos=True),
                       speculate=False)
        target = engine.add(prompt, sampled, proposer=draft, policy=FixedK(4))
        if neighbours:  # plain requests, each scored within 2 tokens of the limit
            for j in range(30):
                engine.add([3 + (i + j) % 90 for i in range(78)], SamplingParams(max_new_tokens=40, ignore_eos=True),
                           speculate=False)
        engine.run()
        return target.generated, target.stats.draft_tokens

    beside, alone = run(True), run(False)
    assert beside == alone and alone[1] > 0


def test_stop_eos_abort_and_bad_prompts(tmp_path, model_dir):
    from conftest import save_char_tokenizer

    tokenizer = save_char_tokenizer(tmp_path / "tok")
    runtime = runtime_for(model_dir, "torch")
    plain = SpeculativeEngine(runtime, tokenizer)
    prompt = tokenizer("abcabcabc")["input_ids"]
    reference = plain.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop = reference.text[3:5]
    eos_token = reference.token_ids[6]
    engine = BatchEngine(runtime_for(model_dir, "torch"), tokenizer, eos_token_ids=(eos_token,),
                         max_num_seqs=2, max_model_len=64)
    stopped = engine.add(prompt, SamplingParams(max_new_tokens=20, stop=(stop,), ignore_eos=True))
    eos = engine.add(prompt, SamplingParams(max_new_tokens=20))
    aborted = engine.add(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.abort(aborted)
    engine.run()
    assert stopped.finish_reason == "stop" and stopped.text == reference.text[: reference.text.find(stop)]
    assert eos.finish_reason == "stop"
    assert eos.generated == reference.token_ids[: reference.token_ids.index(eos_token)]
    # completion tokens count the EOS that ended a request (vLLM's and OpenAI's usage), not a stop string's end
    assert eos.ended_at_eos and eos.output_tokens == len(eos.generated) + 1
    assert not stopped.ended_at_eos and stopped.output_tokens == len(stopped.generated)
    assert usage([eos, stopped])["completion_tokens"] == len(eos.generated) + 1 + len(stopped.generated)
    assert aborted.finish_reason == "abort" and aborted.generated == []
    with pytest.raises(PromptError, match="context is 64 tokens"):
        engine.add(list(range(3, 70)), SamplingParams())
    with pytest.raises(PromptError, match="empty"):
        engine.add([], SamplingParams())


def test_listener_sees_every_token_once(model_dir):
    seen = []
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64,
                         make_drafter=NgramProposer, make_policy=lambda: 4)
    sequence = engine.add([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_new_tokens=17, ignore_eos=True),
                          listener=lambda s, out: seen.append(out), method="ngram")
    assert sequence.method == "ngram"  # set before the engine thread can see the sequence
    engine.run()
    assert [t for out in seen for t in out.token_ids] == sequence.generated
    assert [out.finish_reason for out in seen][-1] == "length"
    assert all(out.finish_reason is None for out in seen[:-1])


@needs_kernels
@pytest.mark.parametrize("vocab", [97, 6])
@pytest.mark.parametrize("plain_steps", [False, True])
def test_eagle_rows_draft_exactly_what_they_draft_alone(model_dir, tmp_path, plain_steps, vocab):
    """Each row's EAGLE drafter is fed its own rows of the target's captured features
    (prefill chunks included): its drafts, acceptance per position and output equal the
    single-sequence engine's for the same head and k, whatever runs beside it. With plain
    steps between the drafted ones, the head is fed on those too (found in review: no test
    would notice if it were not; it would draft nothing after its first plain step). Over
    6 tokens a random head's drafts are often accepted, several deep: over 97 none were, and
    the accepted path's states handed to the head in another order passed (a mutation audit)."""
    from test_eagle import Alternating, random_head
    from specdecode.factory import load_model
    from specdecode.proposers.eagle import EagleProposer

    if vocab != 97:
        model_dir = save_tiny_model(tmp_path / "peaked", seed=33, vocab_size=vocab, num_layers=2, init_std=0.3)
    target = load_model(str(model_dir), torch.float32, backend="kernels")
    head = random_head(target, 3, draft_vocab=min(90, vocab))
    weights = target.runtime.weights

    class Recording(EagleProposer):
        def propose(self, tokens, k, params, generator):
            proposal = super().propose(tokens, k, params, generator)
            self.log.append(proposal.draft_ids.tolist())
            return proposal

    def drafter():
        proposer = Recording(head, lambda ids: weights.embed_rows(ids).float())
        proposer.log = []
        return proposer

    rng = random.Random(9)
    prompts = [random_prompt(rng, vocab) for _ in range(6)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = []
    for prompt in prompts:
        proposer = drafter()
        policy = Alternating(3) if plain_steps else 3
        result = SpeculativeEngine(target.runtime, proposer=proposer, k=policy).generate(prompt, params)
        alone.append((result.token_ids, proposer.log, result.stats.accepted_per_position))
    engine = BatchEngine(runtime_for(model_dir, "kernels", prefill_chunk=8), max_num_seqs=4, max_model_len=128,
                         make_drafter=drafter, make_policy=lambda: Alternating(3) if plain_steps else 3)
    sequences = [engine.add(prompt, params) for prompt in prompts]
    engine.run()
    together = [(s.generated, s.proposer.log, s.stats.accepted_per_position) for s in sequences]
    assert together == alone  # the same drafts at every step, not only the same output
    drafted = [len(d) for _, log, _ in alone for d in log]
    assert sum(drafted) >= 50 * (1 if plain_steps else 2)  # the drafters did draft
    assert sum(n > 0 for n in drafted) >= 0.9 * len(drafted)  # on (nearly) every step they were asked to
    if vocab < 90:
        deep = sum(n for _, _, positions in alone for n in positions[1:])
        assert deep > 5, [positions for _, _, positions in alone]


def test_an_eagle_row_that_drafts_nothing_keeps_only_its_own_states(tmp_path):
    """Found in review: a row whose k is 0 never flushes its head's deferred observations,
    and each was a view into the step's whole capture (every row's draft positions), so the
    row kept all of it alive, step after step: 34x its own states' bytes at 4 rows."""
    from test_eagle import random_head
    from specdecode.factory import load_model
    from specdecode.proposers.eagle import EagleProposer

    # six layers: the head's capture layers distinct and sorted, the case where the
    # runtime's capture is handed on as views rather than copied
    target = load_model(str(save_tiny_model(tmp_path / "six", seed=30, num_layers=6, init_std=0.3)),
                        torch.float32, backend="torch")
    head = random_head(target, 3)
    weights = target.runtime.weights

    class Never(FixedK):
        def choose(self, context):
            return 0

    def drafter():
        return EagleProposer(head, lambda ids: weights.embed_rows(ids).float())

    engine = BatchEngine(target.runtime, max_num_seqs=4, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    idle = engine.add([5, 9, 14, 22], params, proposer=drafter(), policy=Never(4))
    for i in range(3):
        engine.add([5, 9, 14, 23 + i], params, proposer=drafter(), policy=FixedK(8))
    for _ in range(30):
        engine.step()
    pending = idle.proposer.pending
    assert len(pending) >= 25  # its states wait for a proposal that never comes
    held = {f.untyped_storage().data_ptr(): f.untyped_storage().nbytes() for f, _ in pending}
    own = sum(f.numel() * f.element_size() for f, _ in pending)
    assert sum(held.values()) <= own, (sum(held.values()), own)


class _Tau(FixedK):
    """A policy that always wants k drafts and expects tau(k) = 1 + rate * k."""

    def __init__(self, k, rate, probing=False):
        super().__init__(k)
        self.rate, self.probing = rate, probing

    def tau(self, k):
        return 1.0 + self.rate * k


def test_batch_cap_drafts_only_when_the_batched_step_pays(model_dir):
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=4, max_model_len=64)
    rows = [engine.add([5, 6, 7], SamplingParams(max_new_tokens=20), proposer=NgramProposer(), policy=_Tau(4, 0.9))
            for _ in range(3)]
    engine.batch_cost = lambda rows, width, context: float(rows * width)  # compute bound: every token costs the same
    assert engine._batch_cap(rows, [4, 4, 4]) == [0, 0, 0]
    engine.batch_cost = lambda rows, width, context: 100.0 + rows * width  # overhead bound: drafts are nearly free
    assert engine._batch_cap(rows, [4, 4, 4]) == [4, 4, 4]
    engine.batch_cost = lambda rows, width, context: 2.0 + rows * width  # in between: a short shared cap (2 here)
    caps = engine._batch_cap(rows, [4, 2, 4])
    assert caps == [2, 2, 2]
    fixed = engine.add([5, 6], SamplingParams(), proposer=NgramProposer(), policy=3)  # a fixed k is kept
    probing = engine.add([5, 6], SamplingParams(), proposer=NgramProposer(), policy=_Tau(1, 0.0, probing=True))
    engine.batch_cost = lambda rows, width, context: float(rows * width)
    # the fixed row pads the step to 4 tokens anyway, so drafting up to 3 costs the others nothing
    assert engine._batch_cap(rows + [fixed, probing], [4, 4, 4, 3, 1]) == [3, 3, 3, 3, 1]
    # a probe widens every row: it goes through on one batched step in probe_every only
    engine.steps = 1
    assert engine._batch_cap(rows + [probing], [4, 4, 4, 1]) == [0, 0, 0, 0]
    engine.steps = engine.probe_every
    assert engine._batch_cap(rows + [probing], [4, 4, 4, 1]) == [1, 1, 1, 1]


def test_rows_the_cap_keeps_plain_skip_their_k_choice_between_rechecks(model_dir):
    """Under load, once the shared cap has let no adaptive row draft for recheck_every
    steps, those rows' labels and k choices are skipped except on every recheck_every-th
    step; when drafting pays again, the next recheck finds it. Outputs are unchanged."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [4, 4, 4, 4, 11]]
    expected = alone_outputs(runtime_for(model_dir, "torch"), prompts, [params] * 3, (None, 1))

    class Counting(_Tau):
        choices = 0

        def choose(self, context):
            Counting.choices += 1
            return super().choose(context)

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=4, max_model_len=96)
    engine.batch_cost = lambda rows, width, context: float(rows * width)  # drafting never pays for a batch
    rows = [engine.add(p, params, proposer=NgramProposer(), policy=Counting(3, 0.5)) for p in prompts]
    while not all(r.prefill_done for r in rows):  # one prompt chunk a step; a row alone may draft
        engine.step()
    drafted, Counting.choices = sum(r.stats.draft_tokens for r in rows), 0
    for _ in range(24):
        engine.step()
    assert Counting.choices < 3 * 24 / 2, Counting.choices  # most steps skipped the choice for all three rows
    assert Counting.choices >= 3 * 2  # but not the rechecks
    assert sum(r.stats.draft_tokens for r in rows) == drafted
    engine.batch_cost = lambda rows, width, context: 100.0 + rows * width  # now drafts are nearly free
    for _ in range(engine.recheck_every + 1):
        engine.step()
    assert sum(r.stats.draft_tokens for r in rows) > drafted  # (> 0 held with no recheck: found in review)
    engine.run()
    assert [r.generated for r in rows] == expected


def test_task_schedule_admits_the_running_rows_task_first(model_dir):
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    engine.schedule = "task"
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first = engine.add([5, 6, 7], params, task_type="code")
    engine.step()  # admits `first` (fcfs when nothing runs)
    creative = engine.add([8, 9], params, task_type="creative")
    code = engine.add([10, 11], params, task_type="code")
    engine.step()
    assert code.cache_row is not None and creative.cache_row is None
    engine.run()
    assert first.finished and code.finished and creative.finished
    running = engine.add([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True), task_type="code")
    engine.step()
    waited = engine.add([8, 9], params, task_type="creative")
    engine.add([10, 11], params, task_type="code")
    engine.max_wait_seconds = 0.0  # every waiting request is now overdue: arrival order wins
    with engine.lock:
        assert engine.waiting[engine._next_waiting()] is waited
    assert running.cache_row is not None


@needs_kernels
def test_a_request_waiting_for_a_shared_prefix_does_not_hold_up_those_behind_it(model_dir):
    """Found in review: a request waiting for a prefix another prompt is prefilling stopped
    every admission, so a one-token prompt behind it, with a row free throughout, waited
    out a long prompt's whole prefill. It now takes a free row at once; the waiting one
    keeps a row, still copies the prefix, and every output is its output alone."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 97) for _ in range(20)]
    long_prompt = [rng.randrange(3, 97) for _ in range(150)]
    first, second = (shared + [rng.randrange(3, 97) for _ in range(5)] for _ in range(2))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [long_prompt, first, second, [5]]
    expected = alone_outputs(runtime_for(model_dir, "kernels"), prompts, [params] * 4, (None, 1))
    engine = BatchEngine(runtime_for(model_dir, "kernels", prefill_chunk=8), max_num_seqs=4, max_model_len=200)
    sequences = [engine.add(prompt, params) for prompt in prompts]
    engine.step()
    assert sequences[3].generated  # the one-token prompt decodes at the first step
    engine.run()
    assert [s.generated for s in sequences] == expected
    assert sequences[2].cached_tokens == 20  # it waited for the shared prefix, and copied it
    assert sorted(engine.free_rows) == [0, 1, 2, 3]


def test_batch_time_comes_from_the_measured_batch_table():
    from specdecode.cost.profile import CostProfile

    profile = CostProfile("m", "bf16", "x", 2, contexts=[100, 600], sizes=[1, 2, 4], step_ms=[[10, 12, 16], [20, 22, 26]])
    assert profile.batch_time_ms(3, 2, 100) == profile.time_ms(6, 100)  # no table: rows x width tokens
    profile.batch_rows, profile.batch_widths, profile.batch_context = [1, 2, 4], [1, 2], 100
    profile.batch_ms = [[10, 12], [14, 18], [22, 30]]
    assert profile.batch_time_ms(2, 2, 100) == 18
    assert profile.batch_time_ms(3, 1, 100) == 18  # halfway between 2 and 4 rows
    assert profile.batch_time_ms(8, 1, 100) == 22 + (22 - 14) / 2 * 4  # beyond the table: the last slope
    # at a longer context every row pays the single-sequence difference: 4 rows x (20 - 10) ms
    assert profile.batch_time_ms(4, 1, 600) == 22 + 4 * 10


def run_batch(runtime, requests, prefix_caching, max_num_seqs=3, make_drafter=None, k=0, prefill_threads=None,
              decode_threads=None):
    """``requests``: (prompt, params, steps to run before the next arrives). Returns the
    engine and the sequences after it has drained."""
    engine = BatchEngine(runtime, max_num_seqs=max_num_seqs, max_model_len=160, make_drafter=make_drafter,
                         make_policy=lambda: k)
    engine.prefix_caching = prefix_caching
    engine.prefill_threads = prefill_threads
    engine.decode_threads = decode_threads
    sequences = []
    for prompt, params, steps in requests:
        sequences.append(engine.add(prompt, params))
        for _ in range(steps):
            engine.step()
    engine.run()
    return engine, sequences


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("backend, fmt, dtype", [("torch", "fp32", torch.float32),
                                                 pytest.param("kernels", "fp32", torch.float32, marks=needs_kernels),
                                                 pytest.param("kernels", "q4_1", torch.bfloat16, marks=needs_kernels)])
def test_prefix_cache_reuses_shared_prompts_without_changing_outputs(model_dir, backend, fmt, dtype, k):
    """Prompts sharing a system prefix, one prompt asked again, the next turn of a finished
    conversation, and a prompt whose prefix is still running in another row: each starts
    from the cached prefix (a free row taken as it is, or entries copied from a free or a
    running row into another), and every output, greedy or seeded sampling, equals the
    output with prefix caching off. With prompt lookup drafting 3 tokens a step, the
    reused histories were written by speculative steps, whose slots past the committed
    tokens hold rejected drafts."""
    rng = random.Random(3)
    system = [rng.randrange(3, 97) for _ in range(20)]
    tail = lambda n: [rng.randrange(3, 97) for _ in range(n)]  # noqa: E731
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=12, seed=5, ignore_eos=True)
    first, second = system + tail(9), system + tail(5)
    runtime = lambda: runtime_for(model_dir, backend, fmt, dtype, prefill_chunk=8)  # noqa: E731
    drafting = {"make_drafter": NgramProposer if k else None, "k": k}
    _, (alone,) = run_batch(runtime(), [(first, greedy, 0)], False, **drafting)
    third = first + alone.generated + tail(4)  # the next turn of the first conversation
    fourth = second[:22] + [3 if second[22] != 3 else 4] + tail(3)
    requests = [(first, greedy, 40),  # finishes: its row keeps first + its answer
                (second, greedy, 2),  # 20 tokens copied from that free row into an empty one
                (first, sampled, 2),  # all of first but its last token, copied again
                (third, greedy, 0),  # extends the free row's whole history: the row is taken
                (fourth, greedy, 0)]  # 22 tokens copied from second's row, still running
    _, cold = run_batch(runtime(), requests, False, max_num_seqs=4, **drafting)
    engine, warm = run_batch(runtime(), requests, True, max_num_seqs=4, **drafting)
    assert cold[0].generated == alone.generated
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert all(s.cached_tokens == 0 for s in cold)
    assert [s.cached_tokens for s in warm] == [0, 20, len(first) - 1, len(first) + len(alone.generated) - 1, 22]
    assert engine.prefix_hits == sum(s.cached_tokens for s in warm)
    assert engine.prefix_queries == sum(len(r[0]) for r in requests)
    if k:
        assert sum(s.stats.draft_tokens for s in warm) > 0


def test_a_prefix_cache_reset_forgets_free_and_running_rows(model_dir):
    """After reset_prefix_cache no prompt reuses what was cached: neither a free row's
    history, nor a row running at the reset (while it runs, nor after it finishes)."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first, second = list(range(5, 25)), list(range(30, 60))
    engine = BatchEngine(runtime_for(model_dir, "torch", prefill_chunk=8), max_num_seqs=3, max_model_len=128)
    engine.add(first, params)
    engine.run()
    running = engine.add(second, params)
    engine.step()
    engine.reset_prefix_cache()
    again = [engine.add(first, params), engine.add(second[:20] + [3], params)]
    engine.run()
    assert not running.share_prefix and [s.cached_tokens for s in again] == [0, 0]
    last = engine.add(second, params)
    engine.run()
    # 20 from the request admitted after the reset, not 29 from the row running at it
    assert last.cached_tokens == 20 and last.generated == running.generated
    final = engine.add(second, params)
    engine.run()
    assert final.cached_tokens == len(second) - 1  # rows written after the reset serve again
    assert engine.prefix_hits == 20 + len(second) - 1


def test_prefix_cache_stands_aside_for_hidden_state_drafters_and_foreign_writes(model_dir):
    """A drafter that reads the target's hidden states needs them for every prompt
    position, so its sequence prefills in full; a cache that someone else reset or wrote
    is not trusted."""

    class Capturing(NgramProposer):
        capture = (0,)

        def observe(self, start, features, tokens):
            pass

    runtime = runtime_for(model_dir, "torch")
    prompt = list(range(5, 30))
    engine, (a, b) = run_batch(runtime, [(prompt, SamplingParams(max_new_tokens=4), 40),
                                         (prompt, SamplingParams(max_new_tokens=4), 0)], True,
                               make_drafter=Capturing, k=2)
    assert a.cached_tokens == b.cached_tokens == 0
    # no lookup, no query (found in review: every admitted prompt counted as looked up, a
    # server with caching off too, so the hit rate read from the counters was wrong)
    assert a.looked_up == b.looked_up == 0 and engine.prefix_queries == 0
    engine.add(prompt, SamplingParams(max_new_tokens=4), speculate=False)
    runtime.reset(160, batch=3)  # the same tensors, but no longer the engine's
    engine.run()
    assert engine.prefix_hits == 0
    off = BatchEngine(runtime, max_num_seqs=2, max_model_len=96)
    off.prefix_caching = False  # --no-enable-prefix-caching
    off.add(prompt, SamplingParams(max_new_tokens=2), speculate=False)
    off.run()
    assert off.prefix_queries == 0


def test_an_audit_rerun_keeps_its_requests_cache_salt(model_dir):
    """Found in review: the audit re-ran a salted request without its cache_salt, so its row
    offered the tenant's prompt to every unsalted request (12 of 20 tokens cached, where
    the salt should have kept it 0)."""
    from specdecode.serve.audit import Auditor
    from specdecode.serve.metrics import ServerMetrics

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=128)
    auditor = Auditor(engine, 1.0, ServerMetrics("tiny-audit-salt"))
    secret = [5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    original = engine.add(secret, params, proposer=NgramProposer(), policy=2, cache_salt="tenant-a")
    engine.run()
    auditor.offer(original)
    assert auditor.run_one()
    rerun = engine.waiting[-1]
    engine.run()
    assert rerun.cache_salt == "tenant-a"
    assert rerun.cached_tokens == 0  # an independent re-run: prefilled in full, not from the request's row
    other = engine.add(secret[:12] + [40, 41], params)  # another tenant, no salt, guessing the prefix
    engine.run()
    assert other.cached_tokens == 0
    # nor from a row that is running now: a salted prompt being decoded is not offered to others
    running = engine.add(secret, SamplingParams(max_new_tokens=30, ignore_eos=True), cache_salt="tenant-a")
    engine.step()
    engine.step()
    guess = engine.add(secret[:12] + [42, 43], params)
    engine.run()
    assert running.finished and guess.cached_tokens == 0


@needs_kernels
def test_prefill_threads_change_no_output(model_dir):
    """The server prefills on every core and decodes on one fewer: a row's entries are the
    same bits at any thread count, so the outputs are those of one thread throughout."""
    rng = random.Random(9)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    requests = [(random_prompt(rng), params, 1 if i < 4 else 20) for i in range(5)]  # the first finishes
    _, (first,) = run_batch(runtime_for(model_dir, "kernels", "q4_1", torch.bfloat16), requests[:1], False)
    # the next turn of the first conversation: a prefill chunk of one token after its cached entries
    requests.append((requests[0][0] + first.generated + [5], params, 0))
    outputs = []
    for threads in (1, 2, 3):
        runtime = runtime_for(model_dir, "kernels", "q4_1", torch.bfloat16, prefill_chunk=8)
        _, sequences = run_batch(runtime, requests, True, max_num_seqs=8, prefill_threads=threads)
        outputs.append([s.generated for s in sequences])
        assert sequences[-1].cached_tokens == len(requests[-1][0]) - 2
    assert outputs[0] == outputs[1] == outputs[2]


def test_requests_arriving_together_wait_for_their_shared_prefix(model_dir):
    """Three prompts with one 40-token prefix arrive in the same step: the first prefills
    it (5 chunks of 8), the others are admitted once its entries are in the cache and copy
    them, and every output is the one without prefix caching."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 97) for _ in range(40)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    requests = [(shared + [rng.randrange(3, 97) for _ in range(6)], params, 0) for _ in range(3)]
    runtime = lambda: runtime_for(model_dir, "kernels" if kernels.available() else "torch", prefill_chunk=8)  # noqa: E731
    _, cold = run_batch(runtime(), requests, False)
    _, warm = run_batch(runtime(), requests, True)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert [s.cached_tokens for s in warm] == [0, 40, 40]


def test_a_failed_admission_or_an_abort_while_waiting_frees_everything(model_dir):
    """A request whose admission fails is failed alone (its row returned, the others decode
    on); one whose drafter fails to start decodes without speculation; one aborted while it
    waits leaves the queue at once."""

    class Broken(NgramProposer):
        def start(self, tokens, capacity):
            raise RuntimeError("drafter exploded")

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    good = engine.add([5, 6, 7], params)
    broken = engine.add([5, 6, 8], params, proposer=Broken(), policy=2)
    failing = engine.add([5, 6, 9], params)
    queued = engine.add([9, 10, 11], params)
    waiting = engine.add([12, 13], params)
    engine.abort(waiting)
    assert waiting.finish_reason == "abort" and all(s is not waiting for s in engine.waiting)
    k_max = engine._k_max

    def failing_admission(sequence):
        if sequence is failing:
            raise RuntimeError("admission exploded")
        return k_max(sequence)

    engine._k_max = failing_admission
    engine.run()
    assert failing.finish_reason == "abort" and "admitting" in failing.error
    assert broken.proposer is None and broken.error is None
    assert len(good.generated) == len(broken.generated) == len(queued.generated) == 4
    assert sorted(engine.free_rows) == [0, 1]


@needs_kernels
def test_decode_threads_chosen_by_measurement_change_no_output(model_dir):
    """The server lets each decode pass run on one or two kernel threads, whichever it has
    measured faster (looking at the other every few passes): a row's logits are the same
    bits at any thread count, so every output equals one thread's throughout, and both
    counts ran."""
    from specdecode.control.threads import ThreadChoice

    rng = random.Random(11)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    requests = [(random_prompt(rng), params, i % 3) for i in range(7)]
    outputs = []
    for choice in (None, ThreadChoice((1, 2), explore_every=2)):
        runtime = runtime_for(model_dir, "kernels", "q4_1", torch.bfloat16)
        stack, real, teams = runtime.kernels, runtime.kernels.lib, []

        class Spy:  # the team size each layer-stack call of the kernels got
            def __getattr__(self, name):
                function = getattr(real, name)
                if name != "sd_forward_layers":
                    return function
                return lambda *args: teams.append(stack.model.num_threads) or function(*args)

        stack.lib = Spy()
        _, sequences = run_batch(runtime, requests, True, max_num_seqs=4, make_drafter=lambda: NgramProposer(), k=2,
                                 decode_threads=choice)
        outputs.append([s.generated for s in sequences])
        if choice is not None:
            assert all(count > 0 for count in choice.counts.values()), choice.counts
            assert choice.counts.get(("batch", 1)) and choice.counts.get(("batch", 2)), choice.counts
            assert teams.count(1) >= sum(n for (_, t), n in choice.counts.items() if t == 1) > 0
            assert teams.count(2) >= sum(n for (_, t), n in choice.counts.items() if t == 2) > 0
    assert outputs[0] == outputs[1]


def test_a_sequence_counts_the_decode_steps_it_shared(model_dir):
    """batched_steps: 0 for a request decoded alone (the router may learn from its time),
    every decode step after the first for two requests running together."""
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64,
                         make_drafter=NgramProposer, make_policy=lambda: 2)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = engine.add([5, 6, 7, 5, 6, 7], params)
    engine.run()
    first, second = engine.add([5, 6, 7, 5], params), engine.add([9, 8, 9, 8], params)
    engine.run()
    assert alone.batched_steps == 0 and alone.stats.target_forwards > 0
    assert first.batched_steps > 0 and second.batched_steps > 0
    assert first.batched_steps <= first.stats.target_forwards


def test_batch_engine_check_of_test_cuda_on_the_cpu(tmp_path):
    """The check tests/test_cuda.py runs on a GPU, here on the CPU's torch backend."""
    from test_cuda import batch_on

    batch_on("cpu", tmp_path)


def test_timed_passes_wait_for_the_device_first(model_dir, monkeypatch):
    """Found in review for the GPU: a forward pass returns there once its kernels are
    queued, so the prefill was timed as the time to queue it (and its work charged to the
    first step), and the batched engine's verification times (which price k and teach the
    router) were launch times. Both engines now wait for the target's device before they
    read the clock after a pass: the prefill, each prefill chunk and each decode pass."""
    import specdecode.engine as engine_module
    import specdecode.serve.batch as batch_module

    calls = []
    monkeypatch.setattr(engine_module, "synchronize", lambda device: calls.append(("engine", device.type)))
    monkeypatch.setattr(batch_module, "synchronize", lambda device: calls.append(("batch", device.type)))
    runtime = runtime_for(model_dir, "torch")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    SpeculativeEngine(runtime, proposer=NgramProposer(), k=2).generate([5, 6, 7, 5, 6], params)
    assert calls == [("engine", "cpu")]  # once, after the prefill (a step's verification reads the logits)
    calls.clear()
    engine = BatchEngine(runtime_for(model_dir, "torch", prefill_chunk=2), max_num_seqs=2, max_model_len=64,
                         make_drafter=NgramProposer, make_policy=lambda: 2)
    sequence = engine.add([5, 6, 7, 5, 6], params)
    engine.run()
    assert len(sequence.generated) == 4
    # two prefill chunks of 2 (the prompt's last token is the first pass's input), then one
    # wait per decode pass
    assert calls[:2] == [("batch", "cpu")] * 2 and len(calls) == 2 + sequence.stats.target_forwards


def test_a_failing_step_leaks_no_row_and_loses_no_finished_sequence(model_dir):
    """Found in review: a prefix copy that failed kept its row out of the free rows for
    good; a step that failed part way lost the sequences it had already reaped (aborted
    ones: never reported); and the audit counted a re-run that an engine error aborted as
    a losslessness mismatch."""
    from specdecode.serve.audit import Auditor
    from specdecode.serve.metrics import ServerMetrics

    runtime = runtime_for(model_dir, "torch")
    engine = BatchEngine(runtime, max_num_seqs=2, max_model_len=64)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    prompt = list(range(5, 30))
    engine.add(prompt, params)
    engine.run()

    def boom(*args, **kwargs):
        raise RuntimeError("device error")

    real_copy, runtime.copy_prefix = runtime.copy_prefix, boom
    failed = engine.add(prompt[:20] + [3, 4], params)
    engine.run()
    runtime.copy_prefix = real_copy
    assert failed.finish_reason == "abort" and sorted(engine.free_rows) == [0, 1]

    # a step that fails after reaping an aborted row: the reaped row is still handed on
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=1, max_model_len=64)
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    left = engine.add([5, 6, 7], long)
    engine.step()
    engine.step()
    engine.abort(left)
    real_forward, engine.runtime.forward_rows = engine.runtime.forward_rows, boom
    engine.add([11, 12, 13], long)
    with pytest.raises(RuntimeError):
        engine.step()
    engine.runtime.forward_rows = real_forward
    assert left in engine.reaped  # ServerState._fail_all reports these with the rows it fails

    # an audit re-run aborted by an engine error is not a mismatch
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    metrics = ServerMetrics("tiny")
    auditor = Auditor(engine, 1.0, metrics)
    original = engine.add([5, 6, 7, 5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True),
                          proposer=NgramProposer(), policy=2)
    engine.run()
    auditor.offer(original)
    assert auditor.run_one()
    audit = engine.waiting[-1]
    audit.error = "internal error while decoding"
    engine._finish(audit, "abort")
    auditor.compare(audit)
    assert auditor.mismatches == []
    assert metrics.registry.get_sample_value("specdecode:audit_mismatches_total", {"model_name": "tiny"}) == 0


def test_an_audit_mismatch_of_a_sampled_request_reports_both_tokens_probabilities(model_dir):
    """A sampled request's mismatch carries each token's probability under the request's
    processed distribution (the logit margin says little of what a draw picks between),
    as bench's divergence reports do; a greedy one carries the margin alone."""
    from specdecode.serve.audit import Auditor
    from specdecode.serve.metrics import ServerMetrics
    from specdecode.verify.sampling import logits_to_probs

    runtime = runtime_for(model_dir, "torch")
    prompt = [5, 6, 7, 5, 6, 7]
    for params in (SamplingParams(max_new_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_k=20, max_new_tokens=6, seed=3, ignore_eos=True)):
        engine = BatchEngine(runtime, max_num_seqs=2, max_model_len=64)
        auditor = Auditor(engine, 1.0, ServerMetrics("tiny"))
        original = engine.add(prompt, params, proposer=NgramProposer(), policy=2)
        engine.run()
        auditor.offer(original)
        assert auditor.run_one()
        rerun = engine.waiting[-1]
        engine.run()
        assert rerun.generated == original.generated  # a seeded lookup run is the plain run
        plain = list(original.generated)
        original.generated[2] = (plain[2] + 1) % runtime.vocab_size  # as if speculation had changed token 2
        auditor.compare(rerun)
        (record,) = auditor.mismatches
        assert record["position"] == 2 and record["plain_token"] == plain[2]
        runtime.reset(16)
        logits = runtime(torch.tensor([prompt + plain[:2]]))[0, -1].float()
        top = logits.topk(2).values
        assert record["top2_margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
        if params.greedy:
            assert "probabilities" not in record
        else:
            probs = logits_to_probs(logits, params)
            assert record["probabilities"] == {
                "speculative": pytest.approx(float(probs[original.generated[2]]), abs=1e-5),
                "plain": pytest.approx(float(probs[plain[2]]), abs=1e-5)}


def test_drafts_past_the_end_count_alike_in_both_engines(model_dir):
    """The batched engine's per-request figures drop the drafts accepted after the end of the
    output, as the single-sequence engine's do (its /metrics counts stay vLLM's)."""
    from specdecode.proposers.base import Proposal

    runtime = runtime_for(model_dir, "torch")
    prompt = [5, 6, 7, 8]
    free = SpeculativeEngine(runtime).generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    eos = free[5]
    assert eos not in free[:5]

    class Oracle:  # the target's own greedy continuation: every draft is accepted
        def start(self, tokens, capacity):
            pass

        def propose(self, tokens, k, params, generator):
            done = len(tokens) - len(prompt)
            return Proposal(torch.tensor(free[done:done + k], dtype=torch.int64))

    alone = SpeculativeEngine(runtime, proposer=Oracle(), k=8, eos_token_ids=(eos,)).generate(
        prompt, SamplingParams(max_new_tokens=12)).stats
    engine = BatchEngine(runtime_for(model_dir, "torch"), eos_token_ids=(eos,), max_num_seqs=1, max_model_len=64)
    batched = engine.add(prompt, SamplingParams(max_new_tokens=12), proposer=Oracle(), policy=8)
    engine.run()
    assert batched.generated == free[:5]
    # tau counts the 5 tokens and the EOS that ended them; the EOS drafted at position 6 stays
    # accepted, the drafts after it are neither drafted nor accepted, the pass's own token is out
    assert batched.stats.tau * batched.stats.target_forwards == len(free[:5]) + 1
    assert batched.stats.accepted_per_position == alone.accepted_per_position
    assert batched.stats.drafted_per_position == alone.drafted_per_position
    assert (batched.stats.accepted_tokens, batched.stats.draft_tokens, batched.stats.ended_early) == \
        (alone.accepted_tokens, alone.draft_tokens, alone.ended_early) == (6, 6, 1)


def test_an_eos_after_a_stop_string_or_the_budget_is_past_the_end():
    """Found in review: a step whose accepted drafts ran on past a stop string (or the token
    budget) into an EOS counted that EOS as produced, so accepted tokens, the acceptance per
    position and τ came out one too high. Only an EOS that ended the output counts."""
    from types import SimpleNamespace

    from specdecode.engine import ended_at_eos, past_the_end

    A, B, C, EOS = 10, 11, 12, 2
    stopped, running = SimpleNamespace(stopped=True), SimpleNamespace(stopped=False)
    assert past_the_end([A, B, EOS, C], [A, B], "stop", stopped) == 2  # the stop string ended it at B
    assert past_the_end([A, B, EOS, C], [A, B], "stop", running) == 1  # the EOS ended it
    assert past_the_end([A, B, EOS, C], [A, B], "stop", None) == 1  # no tracker: no stop strings
    assert past_the_end([A, EOS, C], [A], "length", running) == 2  # the budget ended it at A
    assert past_the_end([A, B], [A, B], "length", running) == 0 and past_the_end([A, B], [A, B], None, running) == 0
    assert ended_at_eos([A, EOS], [A], "stop", running) and not ended_at_eos([A, EOS], [A], "stop", stopped)
    assert not ended_at_eos([A, EOS], [A], "length", running)


def test_drafts_past_the_end_leave_the_acceptance_of_those_before_it():
    """Found in review: dropping the tokens after the end of the output took back the last
    accepted drafts, counting the step's own token (the target's) as one of them: at the
    context limit a draft that was output lost its acceptance, and an EOS drafted first lost
    its own, so the later acceptance read 1.0 where it was 0.5 (and -0.0 for one step)."""
    from specdecode.metrics import GenerationStats

    limit = GenerationStats()
    limit.observe_step(1, 1)
    limit.drop_accepted(1)  # [d1, own]: d1 output, then the context ended
    assert (limit.alpha, limit.tau, limit.accepted_per_position) == (1.0, 1.0, [1])
    runs = GenerationStats()
    runs.observe_step(4, 0)
    runs.observe_step(4, 2)
    runs.observe_step(4, 4)
    runs.drop_accepted(4)  # [EOS, d2, d3, d4, own]: the EOS ended the output
    assert runs.first_alpha == pytest.approx(2 / 3) and runs.later_alpha == pytest.approx(0.5)
    assert runs.tau == pytest.approx((0 + 1 + 2 + 1 + 1) / 3) and runs.draft_tokens == 9
    one = GenerationStats()
    one.observe_step(4, 4)
    one.drop_accepted(4)
    assert (one.first_alpha, one.later_alpha, one.tau) == (1.0, 1.0, 1.0)
    # positions whose drafts were all taken back were never drafted: not rates of 0.0, which
    # the bench and analyze averaged as rejections (found in review)
    assert one.acceptance_per_position == [1.0]


def test_drafts_past_the_end_count_the_same_whether_right_or_wrong():
    """Found in review: a draft after the end of the output counted as drafted (and as a
    rejection) when it was wrong, and not when it was right, so the same output reported
    different acceptance. [EOS, x, ...]: the EOS is accepted and ends the output; whatever
    follows it, the step counts one draft, accepted, and no rejection."""
    from specdecode.metrics import GenerationStats

    def after_eos(drafted: int, accepted: int) -> GenerationStats:
        stats = GenerationStats()
        stats.observe_step(3, 1)  # an earlier step: the first accepted, the second rejected
        stats.observe_step(drafted, accepted)
        stats.drop_accepted(accepted)  # [EOS, accepted drafts after it..., own]: all but the EOS past the end
        return stats

    cases = [after_eos(2, 2), after_eos(2, 1), after_eos(4, 4), after_eos(4, 3), after_eos(4, 1)]
    figures = {(s.draft_tokens, s.accepted_tokens, s.rejections, tuple(s.drafted_per_position[:3]),
                tuple(s.accepted_per_position[:3]), sum(s.drafted_per_position[3:]), s.alpha, s.tau) for s in cases}
    assert figures == {(4, 2, 1, (2, 1, 1), (2, 0, 0), 0, 0.5, 1.5)}
    tree = GenerationStats()
    tree.observe_step(6, 1, depth=3, rejected=True)  # a tree of 6 nodes, 3 deep; its first node (EOS) accepted
    tree.drop_accepted(1)
    assert (tree.drafted_per_position, tree.accepted_per_position, tree.rejections) == ([1, 0, 0], [1, 0, 0], 0)
    assert (tree.draft_tokens, tree.accepted_tokens) == (6, 1)  # a tree's other nodes stay drafted


def test_a_row_alone_prices_drafting_by_the_proposers_call(model_dir):
    """The k policy learns drafting's cost from the time the proposer takes, as in the
    single-sequence engine; the k choice and whatever else ran before the pass are not
    drafting. Served, that stretch also held the event loop's hold on the GIL, which priced
    drafting at 2-3x its cost there."""
    import time as clock

    class SlowChoice(FixedK):
        def choose(self, context):
            clock.sleep(0.03)
            return super().choose(context)

        def observe_cost(self, draft_seconds, passes, verify_seconds, scored, *rest):
            noted.append((draft_seconds, passes))

    class SlowProposer(NgramProposer):
        def propose(self, tokens, k, params, generator):
            clock.sleep(0.01)
            return super().propose(tokens, k, params, generator)

    noted = []
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    engine.add([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_new_tokens=6, ignore_eos=True),
               proposer=SlowProposer(), policy=SlowChoice(2))
    engine.run()
    drafted = [seconds for seconds, passes in noted if passes]
    assert drafted and all(0.01 <= seconds < 0.025 for seconds in drafted), noted


class _OffVocabDrafter(NgramProposer):
    """Prompt lookup with one id outside the vocabulary appended to every draft."""

    def propose(self, tokens, k, params, generator):
        proposal = super().propose(tokens, k, params, generator)
        proposal.draft_ids = torch.cat([proposal.draft_ids, torch.tensor([10 ** 6])])[:max(k, 1)]
        return proposal


def test_a_draft_outside_the_vocabulary_fails_no_row(model_dir):
    """Found in review: one row's draft id outside the vocabulary raised inside the step, and
    the server then failed every running request. The drafts before it are verified; every
    row decodes as it would alone."""
    rng = random.Random(5)
    prompts = [random_prompt(rng) for _ in range(4)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    runtime = runtime_for(model_dir, "torch")
    expected = alone_outputs(runtime, prompts, params, (None, 1))
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=4, max_model_len=128,
                         make_drafter=_OffVocabDrafter, make_policy=lambda: 3)
    sequences = [engine.add(prompt, p, speculate=i % 2 == 0) for i, (prompt, p) in enumerate(zip(prompts, params))]
    engine.run()
    assert [s.generated for s in sequences] == expected
    assert all(s.finish_reason == "length" and s.error is None for s in sequences)
    assert sum(s.stats.draft_tokens for s in sequences) > 0



@pytest.mark.parametrize("k", [0, 3])
def test_a_seeded_sampled_row_draws_what_the_single_sequence_engine_draws(model_dir, k):
    """The server's engine and `generate`'s give a seeded sampled request the same tokens,
    plain or with lookup drafts (a mutation audit: the batched engine's draws taken one
    position early passed, as nothing compared the two engines on sampled output)."""
    prompt = [5, 9, 13, 5, 9, 13, 5, 9, 22, 31]
    params = SamplingParams(temperature=0.9, top_k=30, seed=4, max_new_tokens=20, ignore_eos=True)
    expected = SpeculativeEngine(runtime_for(model_dir, "torch"), proposer=NgramProposer() if k else None,
                                 k=k or 5).generate(prompt, params)
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=128,
                         make_drafter=NgramProposer if k else None, make_policy=lambda: k)
    sequence = engine.add(prompt, params)
    engine.run()
    assert sequence.generated == expected.token_ids
    assert (sequence.stats.draft_tokens > 0) == (k > 0)


class _RepeatLast(NgramProposer):
    """Drafts the last token k times: a drafter that always has a draft."""

    def propose(self, tokens, k, params, generator):
        from specdecode.proposers.base import Proposal

        return Proposal(torch.tensor([tokens[-1]] * k, dtype=torch.int64))


def test_rows_verified_apart_from_a_row_at_the_context_limit_read_their_own_logits(model_dir):
    """A row whose drafts the batch's padding would carry past its cache is scored in a pass
    of its own; the other rows, scored together, each read their own logits (a mutation
    audit: reading a neighbour's passed)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    long_prompt = [3 + i % 90 for i in range(79)]

    def alone(prompt, drafter):
        engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=1, max_model_len=80)
        sequence = engine.add(prompt, params, proposer=drafter, policy=3 if drafter else None,
                              speculate=drafter is not None)
        engine.run()
        return sequence.generated

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=3, max_model_len=80)
    near = engine.add(long_prompt, params, speculate=False)
    first = engine.add([7], params, proposer=_RepeatLast(), policy=3)
    second = engine.add([40], params, proposer=_RepeatLast(), policy=3)
    engine.run()
    assert first.generated != second.generated
    assert first.generated == alone([7], _RepeatLast()) and second.generated == alone([40], _RepeatLast())
    assert near.generated == alone(long_prompt, None)


def test_a_drafting_row_runs_to_the_context_limit(model_dir):
    """A row that drafts runs up to the last slot of its context, as a plain one does, and
    decodes the same tokens (a mutation audit: one more slot of room failed the request)."""
    params = SamplingParams(max_new_tokens=500, ignore_eos=True)
    outputs = []
    for k in (0, 4):
        engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=48,
                             make_drafter=NgramProposer, make_policy=lambda: k)
        sequence = engine.add([5, 6, 7, 8] * 6, params, speculate=k > 0)
        engine.run()
        assert sequence.finish_reason == "length" and len(sequence.tokens) == 48
        assert (sequence.stats.draft_tokens > 0) == (k > 0)
        outputs.append(sequence.generated)
    assert outputs[0] == outputs[1]


class _RecordingK(FixedK):
    """A fixed k that keeps every (drafted, accepted) it is told."""

    def __init__(self, k):
        super().__init__(k)
        self.seen = []

    def observe(self, drafted, accepted):
        self.seen.append((drafted, accepted))
        super().observe(drafted, accepted)


def test_both_engines_tell_the_policy_and_the_stats_what_each_step_drafted_and_accepted(model_dir):
    """The k policy hears each step's drafts and accepted drafts (not the bonus token), and
    the stats count a draft pass per lookup draft token, as ``GenerationStats`` defines it,
    in both engines (a mutation audit: an off-by-one in either passed)."""
    prompt, params = [5, 6, 7, 8] * 5, SamplingParams(max_new_tokens=24, ignore_eos=True)
    single = _RecordingK(3)
    stats = SpeculativeEngine(runtime_for(model_dir, "torch"), proposer=NgramProposer(), k=single).generate(
        prompt, params).stats
    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=128)
    batched = _RecordingK(3)
    sequence = engine.add(prompt, params, proposer=NgramProposer(), policy=batched)
    engine.run()
    for policy, counted in ((single, stats), (batched, sequence.stats)):
        assert counted.draft_tokens > 0 and counted.draft_passes == counted.draft_tokens
        assert sum(d for d, _ in policy.seen) >= counted.draft_tokens  # the last step's drafts past the end drop
        assert sum(a for _, a in policy.seen) >= counted.accepted_tokens
        assert all(0 <= a <= d for d, a in policy.seen)


def test_the_audit_counts_and_places_mismatches(model_dir):
    """The audit skips requests decoded plainly; a mismatch (tokens or finish reason) is counted in /metrics and recorded at the first divergent position, also where one output is a prefix of the other. Found by a mutation audit: no test failed without it."""
    from specdecode.serve.audit import Auditor
    from specdecode.serve.metrics import ServerMetrics

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    metrics = ServerMetrics("tiny")
    auditor = Auditor(engine, 1.0, metrics)

    def value(name):
        return metrics.registry.get_sample_value(f"specdecode:{name}_total", {"model_name": "tiny"})

    original = engine.add([5, 6, 7, 5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True),
                          proposer=NgramProposer(), policy=2)
    plain = engine.add([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.run()
    auditor.offer(plain)  # decoded plainly: nothing to compare
    assert not auditor.backlog
    auditor.offer(original)
    assert auditor.run_one()
    rerun = engine.waiting[-1]
    engine.run()
    assert rerun.generated == original.generated and rerun.finish_reason == "length"
    original.finish_reason = "stop"  # the same tokens, ended otherwise: still a mismatch
    auditor.compare(rerun)
    assert len(auditor.mismatches) == 1 and value("audit_requests") == 1 and value("audit_mismatches") == 1
    original.finish_reason = "length"
    original.generated = original.generated[:4]  # speculation stopped early: diverges where it ends
    auditor.compare(rerun)
    record = auditor.mismatches[1]
    assert record["position"] == 4 and record["speculative_token"] is None
    assert record["plain_token"] == rerun.generated[4] and value("audit_mismatches") == 2


def test_the_audit_samples_requests_at_its_rate(model_dir):
    """--audit-rate 0.25 audits about a quarter of the requests offered, not all. Found by a mutation audit: no test failed without it."""
    from specdecode.serve.audit import Auditor
    from specdecode.serve.metrics import ServerMetrics

    engine = BatchEngine(runtime_for(model_dir, "torch"), max_num_seqs=2, max_model_len=64)
    auditor = Auditor(engine, 0.25, ServerMetrics("tiny"), backlog=1000)
    original = engine.add([5, 6, 7, 5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True),
                          proposer=NgramProposer(), policy=2)
    engine.run()
    for _ in range(400):
        auditor.offer(original)
    assert 60 <= len(auditor.backlog) <= 140


def test_a_plain_forward_on_the_engines_cache_makes_it_stop_trusting_its_prefixes(model_dir):
    """Found by a mutation audit: a cache that someone else reset is not trusted (above),
    but no test wrote one with a plain forward, which marks it as no longer the engine's
    (its rows' slots were overwritten: a prefix reused from them would be wrong)."""
    runtime = runtime_for(model_dir, "torch")
    prompt = list(range(5, 30))
    engine = BatchEngine(runtime, max_num_seqs=2, max_model_len=96)
    for _ in range(2):
        engine.add(prompt, SamplingParams(max_new_tokens=2), speculate=False)
        engine.run()
    hits = engine.prefix_hits
    assert hits > 0  # the second request reused the first one's prompt
    runtime(torch.tensor([[3, 4, 5]] * 2))  # a forward outside the engine's bookkeeping (both rows)
    engine.add(prompt, SamplingParams(max_new_tokens=2), speculate=False)
    engine.run()
    assert engine.prefix_hits == hits
