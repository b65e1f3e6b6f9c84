"""``specdecode bench``: every prompt with every method, same prompts, same output lengths.

Methods: ``none`` (plain decoding, our runtime; the baseline every ratio divides by),
``ngram``, ``draft`` (speculative, our engine), and the peers (``bench/peers.py``):
``llamacpp`` (llama.cpp on the same GGUF) and ``hf`` (transformers ``generate()``).
tokens/s counts new tokens over the wall time of the whole request, prefill included;
per category the median of the per-prompt figures and the aggregate (all new tokens over
all seconds). A generation that differs from plain decoding is reported with its first
divergent position and the target's top-2 logit margin there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import re
import secrets
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import ConfigError, EngineConfig, SpecDecodeError
from ..control.policies import FixedK
from ..metrics import tau_of
from ..prompts import load_prompts
from ..text import decode
from .peers import PEERS, build_peer
from .plots import plot_bench

KNOWN_METHODS = ("none", "ngram", "suffix", "draft", "eagle", "tree", "medusa", *PEERS)


def parse_method(spec: str) -> tuple[str, str | None]:
    """'ngram' -> ('ngram', None: --k applies); 'ngram@3', 'draft@auto', 'ngram@threshold'."""
    name, at, k = spec.partition("@")
    if at and not k:  # 'ngram@' ran as ngram, labelled 'ngram@' (found in review)
        raise SpecDecodeError(f"{spec!r}: give k after the @ (an integer, auto or threshold), or leave the @ out")
    if name not in KNOWN_METHODS:
        raise SpecDecodeError(f"unknown bench method {name!r} in {spec!r}; choose from {KNOWN_METHODS}")
    if k and name in ("none", *PEERS):
        raise SpecDecodeError(f"{spec!r}: {name} takes no k")
    if k and not re.fullmatch(r"(auto|threshold|[1-9][0-9]*)(x[1-9][0-9]*)?", k):
        raise SpecDecodeError(f"{spec!r}: k is an integer, auto or threshold (and eagle@6x3 a tree of 6 nodes, "
                              "3 children each)")
    if "x" in k and name not in ("eagle", "tree"):
        raise SpecDecodeError(f"{spec!r}: a tree width is for eagle and tree; {name} drafts chains (give k alone)")
    return name, (k or None)


def build_engines(args, methods: list[str], engine_config: EngineConfig, spec_config, target,
                  context: int | None = None) -> dict:
    """One engine per method spec (sharing the target); a peer for 'hf' and 'llamacpp'.
    ``context``: the longest sequence the run needs (a peer's KV cache is sized to it, as
    ours is sized per request); default the model's limit."""
    from ..factory import build_engine

    engines = {}
    for spec in methods:
        name, k = parse_method(spec)
        if name in PEERS:
            engines[spec] = build_peer(name, target, context or target.runtime.max_positions)
        else:
            engines[spec] = build_engine(engine_config, spec_config(args, name, k), args.runtime, target=target)
    return engines


def encode_prompts(target, prompts: list[dict], engine_config: EngineConfig) -> list[list[int]]:
    """Each prompt's first turn as token ids; one the model cannot take (beyond its context)
    is refused here, by its id, not when the run reaches it (found in review: minutes in,
    and without saying which prompt)."""
    from ..engine import SpeculativeEngine, check_prompt

    encoder = SpeculativeEngine(target.runtime, target.tokenizer)
    encoded = []
    for p in prompts:
        ids = encoder.encode(conversation(p.get("turns", [p["prompt"]])[:1], [], p.get("system")),
                             engine_config.chat_template)
        try:
            check_prompt(ids, target.runtime.max_positions, target.runtime.vocab_size)
        except SpecDecodeError as error:
            raise SpecDecodeError(f"prompt {p['question_id']!r}: {error}") from None
        encoded.append(ids)
    return encoded


def describe_prompts(prompts: list[dict]) -> str:
    """'90 prompts', or '80 prompts (160 turns)' where some are conversations."""
    turns = sum(len(p.get("turns") or [p["prompt"]]) for p in prompts)
    return f"{len(prompts)} prompts" + (f" ({turns} turns)" if turns > len(prompts) else "")


def conversation(turns: list[str], replies: list[str], system: str | None = None) -> list[dict]:
    """Chat messages: the system prompt if any, each user turn, followed by the model's
    reply where there is one."""
    messages = [{"role": "system", "content": system}] if system else []
    for number, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if number < len(replies):
            messages.append({"role": "assistant", "content": replies[number]})
    return messages


def turn_encoder(target, engine_config: EngineConfig):
    """``encode(turns, replies)``: the prompt ids of a conversation's latest turn, after the
    earlier turns and the model's own replies to them (token ids, decoded as a chat client
    would show them), as Spec-Bench decodes MT-bench's second turns."""
    from ..engine import SpeculativeEngine

    encoder = SpeculativeEngine(target.runtime, target.tokenizer)

    def encode(turns: list[str], replies: list[list[int]], system: str | None = None) -> list[int]:
        texts = [decode(target.tokenizer, ids) for ids in replies]
        return encoder.encode(conversation(turns, texts, system), engine_config.chat_template)

    return encode


TURN_MARGIN = 16  # tokens a reply may gain when its text is encoded again, per turn


def needed_context(encoded: list[list[int]], params, target, prompts: list[dict] | None = None,
                   follow_up=None) -> int:
    """The longest prompt plus the output budget and a margin for drafts; for a prompt of
    several turns, its whole conversation with replies as long as the budget allows."""
    lengths = [len(ids) for ids in encoded]
    for number, prompt in enumerate(prompts or []):
        turns = prompt.get("turns") or [prompt["prompt"]]
        if len(turns) > 1 and follow_up is not None:
            empty = [[] for _ in turns[1:]]
            lengths[number] = (len(follow_up(turns, empty, prompt.get("system")))
                               + len(empty) * (params.max_new_tokens + TURN_MARGIN))
    return min(max(lengths) + params.max_new_tokens + 16, target.runtime.max_positions)


def warm_up(engines: dict, prompt_ids: list[int], params, capacity: int | None = None) -> None:
    """First calls allocate and warm kernels; keep them out of the measurements.
    ``capacity``: the most tokens a measured run holds (``needed_context``). Each engine's
    caches are sized for it here: a run that needed a larger cache than any before it
    allocated one inside its timing, so whichever method met a long prompt first paid it
    (found in review; `generate --compare` always charged it to the speculative run)."""
    warm = prompt_ids[:16]
    for label, engine in engines.items():
        if parse_method(label)[0] in PEERS:
            engine.generate(warm, 8)
            continue
        engine.generate(warm, dataclasses.replace(params, max_new_tokens=8, ignore_eos=True))
        if capacity is not None:
            engine.target.reset(capacity)
            if engine.proposer is not None:
                engine.proposer.start(list(warm), capacity)


def check_repeats(repeats: int, params) -> None:
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    if repeats > 1 and not params.greedy and params.seed is None:
        raise ConfigError("--repeats with sampling needs --seed, so that every repeat decodes the same text")


def _repeats_must_agree(engine) -> bool:
    """Whether greedy repeats of one request must decode the same tokens on ``engine``
    (run_records): on a batch-invariant runtime, or where k is not adaptive."""
    if getattr(getattr(engine, "target", None), "exact", False):
        return True
    policy = getattr(engine, "policy", None)
    return getattr(engine, "proposer", None) is None or policy is None or isinstance(policy, (int, FixedK))


def run_records(engines: dict, prompts: list[dict], encoded: list[list[int]], params, eos_ids,
                desc: str = "bench", repeats: int = 1, follow_up=None, max_context: int | None = None) -> list[dict]:
    """Every prompt through every engine; the first engine ('none') is the baseline that
    'identical_to_plain' compares with. Adaptive k starts each request from the built-in
    prior for the prompt's task type (router.DEFAULT_PRIORS), never from a router's state
    left by earlier runs; what an engine learns as it runs (step and draft costs, the
    acceptance per kind of draft) carries from prompt to prompt, as in a server.
    Records come prompt by prompt, engines in order within each.

    A prompt of several ``turns`` is a conversation: one record per turn (``turn`` 1, 2,
    ...), each engine decoding turn n + 1 after its own replies to turns 1..n, prompts built
    by ``follow_up(turns, replies)`` (``turn_encoder``). Where an engine's earlier reply
    differed from plain decoding's, its later turns start from another context: they are
    not identical to plain (``context_differs``), and no divergence margin is computed.
    A conversation whose next turn would not fit ``max_context`` tokens (the model's) ends
    there, for every engine, and is counted on stderr.

    ``repeats`` > 1 runs each prompt's round of engines that many times and keeps, per
    engine, the fastest run (as timeit does: a stall of the machine only ever adds time).
    Every repeat is the same request: with sampling, ``params.seed`` must be set. Greedy
    repeats must decode the same tokens (else it is a bug, raised) on a batch-invariant
    runtime (``exact``) and wherever every repeat scores the same rows (plain decoding, a
    fixed k, the peers). Other repeats may not where k is adaptive: what the policy learnt
    in between moves k; sampled draws follow the drafts, and without batch invariance (the
    torch backend, a GPU) scoring a different number of rows can flip a near-tie. The
    record then says ``repeats_identical: false``."""
    check_repeats(repeats, params)
    conversations = [prompt.get("turns") or [prompt["prompt"]] for prompt in prompts]
    if follow_up is None and any(len(turns) > 1 for turns in conversations):
        raise SpecDecodeError("prompts of several turns need an encoder for the later turns (follow_up)")
    records = []
    baseline_label = next(label for label in engines if parse_method(label)[0] == "none")
    baseline = engines[baseline_label]
    turn_count = sum(len(turns) for turns in conversations)
    progress = tqdm(total=turn_count * len(engines) * repeats, desc=desc, unit="gen")
    # prompt-major: every engine runs a prompt within seconds of the baseline, so a drift
    # of the machine's speed over a long run does not bias one method against another
    cut = []
    for prompt, first_ids, turns in zip(prompts, encoded, conversations):
        replies: dict[str, list[list[int]]] = {label: [] for label in engines}
        for turn in range(1, len(turns) + 1):
            contexts = {label: first_ids if turn == 1 else follow_up(turns[:turn], replies[label], prompt.get("system"))
                        for label in engines}
            if turn > 1 and max_context is not None and max(map(len, contexts.values())) >= max_context:
                cut.append(f"{prompt['question_id']} at turn {turn}")
                progress.update((len(turns) - turn + 1) * len(engines) * repeats)
                break
            runs: dict[str, list[dict]] = defaultdict(list)
            turn_params = params if params.greedy or params.seed is None else dataclasses.replace(
                params, seed=request_seed(params.seed, prompt["question_id"], turn))
            for _ in range(repeats):
                for label, engine in engines.items():
                    runs[label].append(_run_one(label, engine, prompt, turns[turn - 1], contexts[label], turn_params,
                                                eos_ids))
                    progress.update()
            reference = None
            for label, attempts in runs.items():
                record = min(attempts, key=lambda r: r["seconds"])
                token_ids = record.pop("token_ids")
                if any(r["token_ids"] != token_ids for r in attempts if r is not record):
                    if params.greedy and _repeats_must_agree(engines[label]):
                        where = prompt["question_id"] if len(turns) == 1 else f"{prompt['question_id']} (turn {turn})"
                        raise SpecDecodeError(f"{label} decoded different tokens on repeats of {where}")
                    record["repeats_identical"] = False
                if repeats > 1:
                    record["repeat_seconds"] = [r["seconds"] for r in attempts]
                if label == baseline_label:
                    reference = token_ids
                record["turn"] = turn
                same_context = contexts[label] == contexts[baseline_label]
                record["identical_to_plain"] = same_context and token_ids == reference
                if not same_context:
                    record["context_differs"] = True
                elif reference is not None and not record["identical_to_plain"]:
                    # sampled runs too: with a drafter that does not sample (lookup, Medusa) a seeded
                    # sampled output is plain sampling's, and a difference is a defect worth its place
                    # (found in review: none was reported, and `divergent` said 0)
                    record["first_divergence"] = baseline.first_divergence(contexts[label], reference, token_ids,
                                                                           turn_params)
                replies[label].append(token_ids)
                records.append(record)
    progress.close()
    if cut:
        print(f"specdecode: {len(cut)} conversation(s) ended where the next turn would not fit the model's context "
              f"of {max_context} tokens ({', '.join(cut[:5])}{', ...' if len(cut) > 5 else ''})", file=sys.stderr)
    return records


def request_seed(seed: int, question_id, turn: int) -> int:
    """A sampled request's seed: the run's ``seed`` mixed with the prompt and the turn, the
    same for every method and repeat (so runs pair), another for every request. One seed for
    every prompt gave a drafter that samples the same draws on each, so a run's acceptance
    was one draw of the randomness, not an average over prompts (found in review: α 0.10 to
    0.18 by seed, against 0.12 to 0.14 with a seed per prompt)."""
    digest = hashlib.sha256(f"{seed}|{question_id}|{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # a positive signed 64-bit seed


SEED_RULE = "per request: int.from_bytes(sha256(f'{seed}|{question_id}|{turn}')[:8], 'little') >> 2"


def record_key(record: dict) -> tuple:
    """What pairs a record with plain decoding's record of the same request."""
    return record["question_id"], record.get("turn", 1)


def _run_one(label: str, engine, prompt: dict, text: str, prompt_ids: list[int], params, eos_ids) -> dict:
    """One generation -> its record (with the token ids, which the caller removes).
    ``text``: the turn's user text (the router's task type is read from it)."""
    from ..control.router import Router, classify

    name, _ = parse_method(label)
    record = {"question_id": prompt["question_id"], "category": prompt["category"], "method": label}
    if name in PEERS:
        token_ids, seconds = engine.generate(prompt_ids, params.max_new_tokens)
        record.update(alpha=None, tau=1.0, k=0)
    else:
        task = classify(text)
        # a fresh router: the built-in prior for the task type, never state left by earlier runs
        prior = Router().prior(task, engine.drafter) if engine.drafter else None
        result = engine.generate(prompt_ids, params, prior_alpha=prior)
        stats = result.stats
        token_ids, seconds = result.token_ids, stats.wall_seconds
        chosen = getattr(engine.policy, "chosen", None)
        record.update(
            k=engine.k_label, task=task, alpha=stats.alpha if name != "none" else None,
            trial_alpha=stats.trial_alpha if name != "none" else None,
            first_alpha=stats.first_alpha if name != "none" else None, tau=stats.tau,
            draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds,
            prefill_seconds=stats.prefill_seconds, draft_tokens=stats.draft_tokens,
            draft_passes=stats.draft_passes,  # a tree's head passes (analyze prices the drafter by them)
            accepted_tokens=stats.accepted_tokens, target_forwards=stats.target_forwards,
            ended_early=stats.ended_early,
            acceptance_per_position=stats.acceptance_per_position,
            steps_by_drafted=dict(sorted(stats.steps_by_drafted.items())),
            k_chosen_mean=sum(chosen) / len(chosen) if chosen else None,
            # the steps that ran without a draft: the policy's k = 0, and also no match found
            # or k capped to 0 at the end (found in review: the policy's choices alone read
            # 25% where every step ran plain)
            plain_steps_share=(stats.steps_by_drafted.get(0, 0) / sum(stats.steps_by_drafted.values())
                               if chosen and stats.steps_by_drafted else None),
        )
    record.update(
        prompt_tokens=len(prompt_ids), new_tokens=len(token_ids), seconds=seconds,
        tokens_per_s=len(token_ids) / seconds if seconds else 0.0, token_ids=token_ids,
    )
    return record


def draft_model(args, methods: list[str], spec_config) -> str | None:
    """The draft model ``--method draft`` runs with (``--draft``, or its default) when one of
    ``methods`` is a draft-model spec; None otherwise (the JSON reports record it)."""
    if any(parse_method(method)[0] == "draft" for method in methods):
        return spec_config(args, "draft").draft
    return None


def run_bench(args, methods: list[str], engine_config: EngineConfig, spec_config, params) -> int:
    from ..factory import load_target, log, require_tokenizer

    for spec in methods:
        parse_method(spec)  # fail on a typo before loading anything
    peers = [spec for spec in methods if parse_method(spec)[0] in PEERS]
    if peers and not params.greedy:  # they were run greedily beside sampled decoding, and compared with it
        raise SpecDecodeError(f"{', '.join(peers)} decode greedily here; compare them at --temperature 0")
    check_repeats(args.repeats, params)
    if not params.greedy and params.seed is None:
        # one seed for every method: each drew its own (found in review: plain and prompt
        # lookup sampled different texts, "same 0%", their speedups over different lengths)
        params = dataclasses.replace(params, seed=secrets.randbits(31))
        log(f"sampling with seed {params.seed} for every method, mixed with each prompt's id (--seed sets it)")
    methods = ["none", *[m for m in dict.fromkeys(methods) if m != "none"]]  # the baseline first
    prompts = load_prompts(args.prompts, args.limit)
    log(f"loading {args.model} ({args.dtype}); {describe_prompts(prompts)} x {len(methods)} methods")
    target = load_target(engine_config, args.runtime)
    require_tokenizer(target, args.model, "bench")
    encoded = encode_prompts(target, prompts, engine_config)
    follow_up = turn_encoder(target, engine_config)
    context = needed_context(encoded, params, target, prompts, follow_up)
    engines = build_engines(args, methods, engine_config, spec_config, target, context)
    warm_up(engines, encoded[0], params, context)
    profile = profile_in_use(target, args.dtype)
    if profile is not None:
        v = ", ".join(f"v({size}) {value:.2f}" for size, value in profile["v"].items())
        log(f"cost profile for --k auto and tree budgets (measured {profile['measured_at'] or 'at an unrecorded time'}): "
            f"{v} at {profile['context']} tokens; specdecode profile --remeasure measures it again")
    records = run_records(engines, prompts, encoded, params, target.eos_token_ids, repeats=args.repeats,
                          follow_up=follow_up, max_context=target.runtime.max_positions)

    summary = summarize(records)
    print_summary(summary, methods, sampled=not params.greedy)
    sweep = k_sweep(summary, methods, args.k)
    if sweep:
        print_k_sweep(sweep)
    if args.out:
        payload = {
            "config": {"model": args.model, "dtype": args.dtype, "k": args.k, "k_policy": args.k_policy,
                       "k_max": args.k_max, "max_new_tokens": params.max_new_tokens,
                       "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                       "seed": params.seed, "seed_rule": None if params.greedy else SEED_RULE, "methods": methods,
                       "repeats": args.repeats,
                       "draft": draft_model(args, methods, spec_config),
                       "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                       "prompts": args.prompts or "builtin", "cost_profile": profile},
            "summary": summary,
            "k_sweep": sweep,
            "records": records,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=2))
        picture = plot_bench(summary, records, Path(args.out).with_suffix(".png"))
        log(f"wrote {args.out} and {picture}")
    return 0


def profile_in_use(target, dtype: str) -> dict | None:
    """The summary of the cached cost profile for ``target`` (None where there is none, as
    for the transformers runtime): the adaptive policies decide by it, and a machine's
    costs drift between measurements, so a benchmark says which one it ran with."""
    from ..cost.profile import load_profile
    from ..factory import model_key

    profile = load_profile(model_key(target), dtype)
    return profile.summary() if profile is not None else None


def summarize(records: list[dict]) -> dict:
    """Per category (and 'overall') and method: medians of tokens/s and of the per-prompt
    speedup against plain; pooled alpha and tau; share identical to plain."""
    plain = {record_key(r): r["tokens_per_s"] for r in records if r["method"] == "none"}
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["category"], r["method"])].append(r)
        groups[("overall", r["method"])].append(r)
    summary: dict[str, dict] = defaultdict(dict)
    for (category, method), rows in groups.items():
        drafted = sum(r.get("draft_tokens", 0) for r in rows)
        accepted = sum(r.get("accepted_tokens", 0) for r in rows)
        passes = sum(r.get("target_forwards", 0) for r in rows)
        ended = sum(r.get("ended_early", 0) for r in rows)
        margins = [r["first_divergence"]["top2_margin"] for r in rows if r.get("first_divergence")]
        summary[category][method] = {
            "prompts": len(rows),
            # the prompts that made a token: one answered by EOS first has no rate (a 0.0 pulled
            # the median down beside a speedup that leaves it out; found in review)
            "tokens_per_s": _median([r["tokens_per_s"] for r in rows if r["new_tokens"]]),
            "aggregate_tokens_per_s": sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
            # paired by prompt and turn, and only where the turn's prompt is plain's: a turn
            # after a reply that differed from plain's ran on another prompt (found in review)
            # and not where this run made no token (EOS drawn first): no ratio, as analyze's
            # annotate (a 0.0 pulled the median down; found in review)
            "speedup": _median([r["tokens_per_s"] / plain[record_key(r)] for r in rows
                                if plain.get(record_key(r)) and r["new_tokens"] and not r.get("context_differs")]),
            "alpha": accepted / drafted if drafted else None,
            "tau": tau_of(accepted, passes, ended) if passes else 1.0,
            "identical_to_plain": sum(r["identical_to_plain"] for r in rows) / len(rows),
            "new_tokens": statistics.median(r["new_tokens"] for r in rows),
            # pooled over the steps, as analyze pools them (a mean over prompts weighed a
            # prompt of 10 steps as one of 1,000; found in review: the two reports differed)
            "k_chosen_mean": _pooled(rows, "k_chosen_mean"),
            "drafts_per_pass": drafted / passes if passes else 0.0,  # chain tokens or tree nodes, plain steps included
            "plain_steps_share": _pooled(rows, "plain_steps_share"),
            "divergent": len(margins),
            "divergence_margin_median": statistics.median(margins) if margins else None,
            "divergence_margin_max": max(margins) if margins else None,
        }
    return dict(summary)


def _pooled(rows: list[dict], name: str) -> float | None:
    """A per-prompt figure of ``name`` averaged over the prompts' steps (each prompt weighed
    by its target passes); None where no prompt has it."""
    weighed = [(r[name], r.get("target_forwards") or 1) for r in rows if r.get(name) is not None]
    return sum(x * n for x, n in weighed) / sum(n for _, n in weighed) if weighed else None


def _median(values: list[float]) -> float | None:
    """The median, or None where no prompt has a plain decoding to compare with (plain
    produced no token, or every turn followed another reply than plain's): a 0.0 here read
    as "0.00x" and "-100%" in the k sweep (found in review)."""
    return statistics.median(values) if values else None


def print_summary(summary: dict, methods: list[str], sampled: bool = False) -> None:
    """The table: tok/s (median per prompt and aggregate), speedup (median per-prompt ratio
    to plain), acceptance, share identical to plain, output length, draft tokens (or tree
    nodes) scored per target pass; then, where
    outputs differ from plain, the top-2 margins at their first divergence."""
    header = (f"{'category':<14}{'method':<17}{'n':>4}{'tok/s':>8}{'agg':>8}{'speedup':>9}{'alpha':>7}{'tau':>6}"
              f"{'same':>6}{'len':>6}{'k/pass':>8}")
    print(header)
    print("-" * len(header))
    categories = sorted(c for c in summary if c != "overall") + ["overall"]
    for category in categories:
        for method in methods:
            row = summary[category].get(method)
            if row is None:
                continue
            alpha = f"{row['alpha']:.2f}" if row["alpha"] is not None else "-"
            speedup = f"{'-':>9}" if row["speedup"] is None else f"{row['speedup']:>8.2f}x"
            rate = f"{'-':>8}" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:>8.1f}"
            print(
                f"{category:<14}{method:<17}{row['prompts']:>4}{rate}"
                f"{row['aggregate_tokens_per_s']:>8.1f}{speedup}"
                f"{alpha:>7}{row['tau']:>6.2f}{row['identical_to_plain']:>6.0%}{row['new_tokens']:>6.0f}"
                f"{row['drafts_per_pass']:>8.2f}"
            )
    overall = summary.get("overall", {})
    divergent = [(m, overall[m]) for m in methods if overall.get(m, {}).get("divergent")]
    if divergent:
        print("outputs not identical to plain decoding, at their first divergent token (target's top-2 logit margin):")
        if sampled:
            print("  (sampled: a drafter whose drafts are sampled, a draft model or EAGLE chains, draws other "
                  "tokens than plain sampling; any other drafter gives plain sampling's tokens)")
        for method, row in divergent:
            print(f"  {method:<17}{row['divergent']:>4} prompts, margin median {row['divergence_margin_median']:.3f}, "
                  f"max {row['divergence_margin_max']:.3f}")


def is_fixed_k(spec: str, default_k: object = "auto") -> bool:
    """'ngram@3' and 'eagle@6x3' (a tree of 6 nodes) run a fixed k; 'ngram@auto',
    'ngram@threshold' and 'eagle@autox3' choose it; a bare 'ngram' runs ``default_k`` (the
    run's --k: found in review, 'ngram' under --k 4 was compared as an adaptive policy)."""
    return (parse_method(spec)[1] or str(default_k)).partition("x")[0].isdigit()


def k_sweep(summary: dict, methods: list[str], default_k: object = "auto") -> dict:
    """For each method run with several fixed k and adaptively (method@auto, @threshold):
    per category, the best fixed k and how each adaptive policy compares with it.
    ``default_k``: the run's --k, what a method without @k ran."""
    result = {}
    for base in dict.fromkeys(parse_method(m)[0] for m in methods):
        fixed = [m for m in methods if parse_method(m)[0] == base and is_fixed_k(m, default_k)]
        adaptive = [m for m in methods if parse_method(m)[0] == base and m not in fixed]
        if not fixed or not adaptive or base in ("none", *PEERS):
            continue
        for category, rows in summary.items():
            speedups = {m: rows[m]["speedup"] for m in fixed if m in rows and rows[m]["speedup"] is not None}
            if not speedups or max(speedups.values()) <= 0:  # no prompt of this category was timed
                continue
            best = max(speedups, key=speedups.get)
            # share of prompts decoded token-identical to plain: below 1 (bf16) the two
            # speedups being compared come partly from different texts
            entry = {"best_fixed": best, "best_fixed_speedup": speedups[best],
                     "best_fixed_identical": rows[best]["identical_to_plain"]}
            for m in adaptive:
                if m in rows and rows[m]["speedup"] is not None:
                    entry[m] = {"speedup": rows[m]["speedup"], "vs_best_fixed": rows[m]["speedup"] / speedups[best] - 1.0,
                                "identical_to_plain": rows[m]["identical_to_plain"]}
            result.setdefault(base, {})[category] = entry
    return result


def sweep_policies(entry: dict) -> list[str]:
    """The adaptive methods a k-sweep entry compares (its other keys describe the best fixed k)."""
    return [key for key, value in entry.items() if isinstance(value, dict) and "vs_best_fixed" in value]


def print_k_sweep(sweep: dict) -> None:
    for base, categories in sweep.items():
        adaptive = sorted({key for entry in categories.values() for key in sweep_policies(entry)})
        print(f"\n{base}: adaptive k against the best fixed k (median speedup vs plain)")
        print(f"{'category':<14}{'best fixed':>14}" + "".join(f"{m:>26}" for m in adaptive))
        order = sorted(c for c in categories if c != "overall") + ["overall"]
        for category in order:
            entry = categories.get(category)
            if entry is None:
                continue
            cells = "".join(
                f"{entry[m]['speedup']:>17.2f}x ({entry[m]['vs_best_fixed']:+.0%})" if m in entry else f"{'-':>26}"
                for m in adaptive
            )
            print(f"{category:<14}{entry['best_fixed'] + ' ' + format(entry['best_fixed_speedup'], '.2f') + 'x':>14}{cells}")
