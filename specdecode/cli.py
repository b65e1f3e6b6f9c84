"""One entry point: ``specdecode <verb>``.

    specdecode generate "PROMPT" [--method none|ngram|suffix|draft|eagle|tree|medusa] [--draft M|self:L] [--head DIR] [--k N] ...
    specdecode bench [--prompts FILE.jsonl] [--methods none,suffix,ngram@3,...] [--out results.json]
    specdecode profile [--model M] [--draft D] [--dtype bf16|fp32] [--remeasure]
    specdecode train data [--target M] [--out DIR] [--prompts N] [--samples S]
    specdecode train store [--target M] [--data DIR] [--out DIR]
    specdecode train eagle [--target M] [--data DIR] [--out DIR] [--draft-vocab N] [--ttt-steps S] [--minutes M]
    specdecode train medusa [--target M] [--data DIR] [--out DIR] [--heads K] [--draft-vocab N] [--minutes M]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

from .config import (DEFAULT_SELF_DRAFT, ConfigError, EngineConfig, SamplingParams, SpecDecodeError,
                     SpeculativeConfig, parse_int_list, parse_k)


def _add_exact_flags(parser: argparse.ArgumentParser) -> None:
    exact = parser.add_mutually_exclusive_group()
    exact.add_argument("--exact", dest="exact", action="store_true", default=None, help="every scored row's logits bitwise independent of what else is scored (other drafts, other requests' rows), so greedy speculation equals plain decoding bit for bit (default wherever the kernels run)")
    exact.add_argument("--no-exact", dest="exact", action="store_false", help="the default made explicit: bitwise invariance where the kernels run, and the torch backend's batch-dependent kernels allowed (--exact refuses them)")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF directory or a .gguf file")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="KV cache precision (and the torch backend's); fp32 = full precision everywhere, weights included (default bf16)")
    parser.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"], help="layer weight format: 'auto' (default) measures which decodes fastest on this machine; int4 carries a GGUF's Q4_1 blocks exactly (docs/performance.md)")
    parser.add_argument("--backend", default="auto", choices=["auto", "kernels", "torch"], help="specdecode's CPU kernels (batch invariant; the default where they build) or PyTorch's")
    _add_exact_flags(parser)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (cuda: torch backend)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per forward pass (bounds activation memory; at most 512)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="with --device cuda: launch every kernel of a step from Python instead of replaying recorded CUDA graphs of small steps")
    parser.add_argument("--runtime", default="auto", choices=["auto", "native", "hf"], help="native Llama-family runtime or the transformers adapter")
    parser.add_argument("--k", default="auto", help="draft tokens per step: 'auto' (default: chosen per step from measured acceptance and costs, 0 = plain when speculation would lose) or an integer")
    parser.add_argument("--k-policy", default="cost", choices=["cost", "threshold"], help="with --k auto: 'cost' (expected speedup, cost profile) or 'threshold' (the literature's acceptance thresholds)")
    parser.add_argument("--k-max", type=int, default=10, help="with --k auto: the most draft tokens per step")
    parser.add_argument("--draft", default=None, help="draft model for --method draft: a path, or self:L (the target's first L layers; default self:4; untrained, it loses here: docs/performance.md)")
    parser.add_argument("--store", default=None, help="token store directory for --method suffix (default: the store shipped for the default model)")
    parser.add_argument("--head", default=None, help="head directory for --method eagle, tree or medusa (default: the head shipped for the default model)")
    parser.add_argument("--tree-width", type=int, default=None, help="--method eagle/tree: children per expanded node of the head's dynamic tree of --k nodes (default 3; 1 drafts chains; bench spec eagle@6x3)")
    parser.add_argument("--ngram-sizes", default="3,2,1", help="n-gram sizes of the request's own text tried by --method ngram, suffix and tree, longest first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def _top_k(text: str) -> int:
    """--top-k: -1 disables it as 0 does, as the server and vLLM read it (found in review: the
    server took -1 and the CLI refused it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    return 0 if value == -1 else value


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=_top_k, default=0, help="0 (or -1, as vLLM and our server take it) disables it")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")


REPEATS_HELP = "run each prompt's round of methods N times and time each method by its fastest run (default 1)"


def _target_flags(parser, seed: bool = True) -> None:
    """How `train` runs the target: seed (where the verb draws anything), dtype, weights,
    backend, threads."""
    if seed:  # found in review: train store and export took --seed and read it nowhere
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"])
    parser.add_argument("--backend", default="auto", choices=["auto", "kernels", "torch"])
    parser.add_argument("--threads", type=int, default=None)
    parser.set_defaults(exact=None, device="cpu", prefill_chunk=256, cuda_graphs=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)

    gen = verbs.add_parser("generate", help="generate text, speculatively")
    gen.add_argument("prompt")
    gen.add_argument("--method", default="suffix", choices=["none", "ngram", "suffix", "draft", "eagle", "tree", "medusa"])
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    gen.add_argument("--compare", action="store_true", help="also run plain decoding and report speedup and identity")
    gen.add_argument("--route", action=argparse.BooleanOptionalAction, default=False, help="classify the prompt's task type and choose the method from acceptance measured on past requests of that type (--no-route overrides a preset's)")
    gen.add_argument("--preset", default=None, help="a named configuration (specdecode presets lists them); flags override it")
    _add_model_args(gen)
    _add_sampling_args(gen)

    bench = verbs.add_parser("bench", help="plain vs speculative on the same prompts")
    bench.add_argument("--prompts", default=None, help="JSONL or a JSON array: Spec-Bench question.jsonl (every turn, "
                       "each after the model's own reply to the one before), {prompt, category}, GSM8K, Alpaca, "
                       "ShareGPT or chat messages; default: our suite")
    bench.add_argument("--methods", default="none,suffix", help="comma list of none, ngram, suffix, draft, eagle, tree, medusa, hf (transformers generate), llamacpp; default: plain and the default method")
    bench.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    bench.add_argument("--out", default=None, help="write per-prompt records and the summary as JSON, and a plot beside it (.png)")
    bench.add_argument("--repeats", type=int, default=1, help=REPEATS_HELP)
    _add_model_args(bench)
    _add_sampling_args(bench)

    prof = verbs.add_parser("profile", help="measure what scoring n tokens and drafting cost on this machine (cached)")
    prof.add_argument("--methods", default=PROFILE_DEFAULT_METHODS, help="drafters to cost: ngram and/or draft (the --draft model)")
    prof.add_argument("--remeasure", action="store_true", help="measure again even if a cached profile exists")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON")
    _add_model_args(prof)
    for action in prof._actions:  # accepted only to be refused by name (cmd_profile): not listed
        if set(action.option_strings) & {"--k", "--k-policy", "--k-max", "--store", "--head", "--tree-width"}:
            action.help = argparse.SUPPRESS

    ana = verbs.add_parser("analyze", help="per prompt and category: acceptance, predicted and measured speedup, recommendations")
    ana.add_argument("--prompts", default=None, help="a prompt file as for bench; default: our suite")
    ana.add_argument("--methods", default="suffix", help="comma list of method specs: suffix (the default method), ngram, draft, ngram@3, draft@auto ...")
    ana.add_argument("--temperatures", default="0,0.7,1.0", help="comma list; each runs plain and every method")
    ana.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    ana.add_argument("--out", default="results/analysis", help="directory for summary.md, analysis.json, PNGs, report.html")
    ana.add_argument("--serving", default="latency", choices=["latency", "throughput"], help="throughput: add the batch-serving skip check")
    ana.add_argument("--batch", type=int, default=8, help="batch size for the throughput and memory checks")
    ana.add_argument("--budget", type=float, default=None, help="memory budget in GiB (default: this machine's RAM)")
    ana.add_argument("--repeats", type=int, default=1, help=REPEATS_HELP)
    _add_model_args(ana)
    _add_sampling_args(ana)
    for action in ana._actions:  # accepted only to be refused by name (cmd_analyze): --temperatures
        if "--temperature" in action.option_strings:
            action.help = argparse.SUPPRESS

    verbs.add_parser("presets", help="list the named configurations for --preset")

    check = verbs.add_parser("check", help="is DRAFT a usable drafter for TARGET, and what speedup to expect")
    check.add_argument("target", help="model name, HF directory or .gguf")
    check.add_argument("draft", help="model name, HF directory, .gguf, self:L, ngram, or heads: eagle / medusa (the shipped ones), eagle:DIR, medusa:DIR or DIR")
    check.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    check.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"], help="the target's layer weight format for the calibration and the cost profile, as generate takes it")
    check.add_argument("--k", type=int, default=None, help="k for the calibration (default 5, or as many as the drafter drafts if fewer: Medusa's heads)")
    check.add_argument("--no-calibration", action="store_true", help="tokenizer and architecture checks only")

    train = verbs.add_parser("train", help="train drafters for a target: data (the target's answers), eagle (a head), medusa (heads), store (suffix lookup's), export (a head for vLLM)")
    train_verbs = train.add_subparsers(dest="train_verb", required=True)
    data = train_verbs.add_parser("data", help="the target's own answers to our training prompts, and local code for teacher forcing (resumable)")
    data.add_argument("--target", "--model", dest="model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF directory or a .gguf file")
    data.add_argument("--out", default="data/train", help="directory to write (and resume) answers.jsonl, corpus.jsonl, summary.json (default data/train)")
    data.add_argument("--prompts", type=int, default=None, help="training prompts to answer, the first N of the set (the nine categories interleaved; default all)")
    data.add_argument("--samples", type=int, default=1, help="sampled answers per prompt beside the greedy one (default 1)")
    data.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers (default 0.8)")
    data.add_argument("--batch", type=int, default=16, help="rows decoded together by the batching engine (default 16; each sampled row has its own seed, so the answers do not depend on it)")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--corpus-tokens", type=int, default=2_000_000, help="tokens of the standard library's sources to keep (0: none)")
    data.add_argument("--chunk-tokens", type=int, default=512, help="tokens per corpus chunk")
    _target_flags(data)
    eagle = train_verbs.add_parser("eagle", help="train an EAGLE-3-style head for the target on `train data`'s output (resumable)")
    eagle.add_argument("--target", "--model", dest="model", default="default", help="the target: 'default', a HF directory or a .gguf file")
    eagle.add_argument("--data", default="data/train", help="directory written by `specdecode train data` (default data/train)")
    eagle.add_argument("--out", default="data/eagle", help="head directory to write (and resume: checkpoint.pt, features/) (default data/eagle)")
    eagle.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head can draft: the most frequent in the data (default 8192)")
    eagle.add_argument("--ttt-steps", type=int, default=3, help="steps unrolled on the head's own outputs in training (default 3)")
    eagle.add_argument("--minutes", type=float, default=60.0, help="training time budget, feature extraction excluded (default 60)")
    eagle.add_argument("--lr", type=float, default=3e-4)
    eagle.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per optimizer step (default 2048)")
    eagle.add_argument("--bf16", action="store_true", help="mixed precision: the head's products and the target's distribution over the draft vocabulary in bf16 autocast (weights, optimizer state and the loss stay fp32)")
    eagle.add_argument("--corpus-tokens", type=int, default=200_000, help="tokens of the local code corpus to train on beside the answers")
    eagle.add_argument("--max-length", type=int, default=768, help="tokens per training sequence at most")
    medusa = train_verbs.add_parser("medusa", help="train Medusa heads for the target on `train data`'s output (resumable)")
    medusa.add_argument("--target", "--model", dest="model", default="default", help="the target: 'default', a HF directory or a .gguf file")
    medusa.add_argument("--data", default="data/train", help="directory written by `specdecode train data` (default data/train)")
    medusa.add_argument("--out", default="data/medusa", help="heads directory to write (and resume: checkpoint.pt, features/) (default data/medusa)")
    medusa.add_argument("--heads", type=int, default=3, help="heads, so drafts per step at most (default 3)")
    medusa.add_argument("--draft-vocab", type=int, default=8192, help="tokens the heads can draft: the most frequent in the data (default 8192)")
    medusa.add_argument("--minutes", type=float, default=20.0, help="training time budget, the target's pass over the data excluded (default 20)")
    medusa.add_argument("--lr", type=float, default=1e-3)
    medusa.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimizer step (default 4096)")
    medusa.add_argument("--corpus-tokens", type=int, default=200_000, help="tokens of the local code corpus to train on beside the answers")
    medusa.add_argument("--max-length", type=int, default=768, help="tokens per training sequence at most")
    _target_flags(medusa)
    store = train_verbs.add_parser("store", help="the token store --method suffix drafts from: the target's answers from `train data`")
    store.add_argument("--target", "--model", dest="model", default="default", help="the target the answers came from (for its vocabulary)")
    store.add_argument("--data", default="data/train", help="directory written by `specdecode train data` (default data/train)")
    store.add_argument("--out", default="data/store", help="store directory to write (default data/store)")
    store.add_argument("--command", default=None, help="the command that reproduces the store, for its MANIFEST.json")
    _target_flags(store, seed=False)
    export = train_verbs.add_parser("export", help="write an EAGLE head in vLLM's eagle3 (EAGLE-3) or the speculators layout")
    export.add_argument("--head", default=None, help="head directory (default: the head shipped for the default model)")
    export.add_argument("--format", default="eagle3", choices=["eagle3", "speculators"], help="eagle3: vLLM --speculative-config method eagle3 / EAGLE-3; speculators: the speculators library (vLLM reads it too)")
    export.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors)")
    export.add_argument("--target", "--model", dest="model", default="default", help="the head's target (its embedding goes into the speculators layout)")
    export.add_argument("--verifier", default=None, help="the target's name for the speculators config (default: HuggingFaceTB/SmolLM2-135M-Instruct for the default model, else --target)")
    export.add_argument("--k", type=int, default=3, help="speculative tokens the speculators config proposes (default 3)")
    _target_flags(export, seed=False)
    eagle.add_argument("--init", default=None, help="go on training a head (a directory written by train eagle): its draft vocabulary and weights")
    _target_flags(eagle)

    srv = verbs.add_parser("serve", help="OpenAI-compatible HTTP server: continuous batching, per-request speculation, Prometheus metrics")
    srv.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF directory or a .gguf file")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: SmolLM2-135M-Instruct, or --model)")
    srv.add_argument("--speculative-config", default=None, help='JSON with vLLM\'s keys (method: ngram|suffix|eagle|eagle3|medusa|none (draft_model and tree are refused: not batched yet), model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max) and ours ("num_speculative_tokens": "auto", k_max, k_policy, preset, router); default: suffix, k auto, router on')
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (one target pass per step)")
    srv.add_argument("--max-queued-requests", type=int, default=64, help="requests waiting for a batch row before 503")
    srv.add_argument("--max-model-len", type=int, default=None, help="context per sequence (default: the model's)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    srv.add_argument("--schedule", default="fcfs", choices=["fcfs", "task"], help="admission order: arrival, or requests of the running rows' task type first (docs/serving.md)")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="start a prompt from the longest prefix it shares with a cache row (a system prompt, earlier turns) instead of prefilling it again; on by default, as in vLLM (docs/serving.md)")
    srv.add_argument("--prefill-threads", type=int, default=None, help="kernel threads for prefill chunks (default: every core when --threads is left to its default, else --threads): a chunk is long and compute bound, so it may use the core the front end keeps")
    srv.add_argument("--audit-rate", type=float, default=0.0, help="fraction of speculative requests (greedy, and sampled ones whose drafter does not sample, with the seed they drew) re-run plainly when idle and compared (/metrics)")
    srv.add_argument("--replicas", type=int, default=None, help="serve N replicas of the engine behind Ray Serve's proxy (pip install 'specdecode[ray]'; docs/serving.md)")
    srv.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    srv.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"])
    srv.add_argument("--backend", default="auto", choices=["auto", "kernels", "torch"])
    _add_exact_flags(srv)  # the batched engine's rows too (found in review: serve refused the flag)
    srv.add_argument("--threads", type=int, default=None, help="kernel threads (default: decode passes on every core or on every core but one, whichever they measure faster while serving; the cost profile at every core but one; docs/serving.md)")
    srv.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill chunk; chunks interleave with decode steps")
    srv.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="with --device cuda: launch every kernel of a step from Python instead of replaying recorded CUDA graphs of the batched steps (and of the profile's and calibration's)")
    srv.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs (cuda: the torch backend, as for generate)")

    bs = verbs.add_parser("bench-serve", help="load a server with concurrent streamed requests: TTFT, TPOT, ITL, latency, throughput, with and without speculation")
    bs.add_argument("--url", default=None, help="a running server (default: start `specdecode serve` with --serve-args on a free port)")
    bs.add_argument("--serve-args", default="", help="flags for the server this command starts, e.g. \"--max-num-seqs 8\"")
    bs.add_argument("--concurrency", default=None, help="comma list of concurrent clients (closed loop; default 1,2,4,8)")
    bs.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead of --concurrency")
    bs.add_argument("--prompts", default=None, help="JSONL as for bench, first turns only (default: our suite)")
    bs.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    bs.add_argument("--num-prompts", type=int, default=16, help="requests per level (at least the concurrency)")
    bs.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (EOS ignored)")
    bs.add_argument("--modes", default="spec,plain", help="spec (the server's default speculation), plain (speculation off per request)")
    bs.add_argument("--out", default=None, help="write the rows as JSON (and a plot beside it)")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--rounds", type=int, default=1, help="run every level and mode N times, the modes in turn first; report medians and the median of each round's own ratios")

    mem = verbs.add_parser("memory", help="weights, KV cache and activation memory of target + drafter")
    mem.add_argument("--target", default="default", help="model name, HF directory, config.json, or a named size (135M, 360M, 1B, 3B, 7B, 8B, 13B, 70B)")
    mem.add_argument("--draft", default=None, help="same forms, or self:L, or ngram")
    mem.add_argument("--batch", type=int, default=1)
    mem.add_argument("--context", type=int, default=None, help="tokens per sequence (default 2048, or the model's limit if less)")
    mem.add_argument("--k", type=int, default=5)
    mem.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16", "int8", "int4"], help="KV cache dtype (int8/int4: those weights, bf16 cache)")
    mem.add_argument("--weights", default=None, choices=["fp32", "bf16", "int8", "int4"], help="weight storage format (default: --dtype)")
    mem.add_argument("--prefill-chunk", type=int, default=256, help="tokens per forward chunk (the runtime's scratch)")
    mem.add_argument("--no-process", dest="process", action="store_false", help="leave out the Python process itself (measured once here)")
    mem.add_argument("--budget", type=float, default=None, help="GiB available (default: this machine's RAM)")
    mem.add_argument("--json", action="store_true")
    parser.verb_parsers = verbs.choices
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse; a --preset supplies defaults that explicit flags still override."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "preset", None) is not None:  # "" named no preset, and was ignored
        from .config import preset

        values = preset(args.preset)
        verb_parser = parser.verb_parsers[args.verb]
        unknown = [key for key in values if not hasattr(args, key)]
        if unknown:
            raise SpecDecodeError(f"preset {args.preset!r} sets {unknown}, which {args.verb} does not take")
        verb_parser.set_defaults(**{key: str(v) if key == "k" else v for key, v in values.items()})
        args = parser.parse_args(argv)
    verb_parser = getattr(parser, "verb_parsers", {}).get(args.verb)
    # what each flag is when not given (a preset's value included): a flag that differs was given
    # (a preset's drafter settings too: its ngram_sizes read as a flag the user gave, and
    # `--preset code-assistant --method eagle` was refused; found in review)
    args.flag_defaults = {} if verb_parser is None else {
        name: verb_parser.get_default(name) for name in ("k", "k_policy", "k_max", "top_p", "top_k", "seed",
                                                         *DRAFTER_FLAGS)}
    return args


def _check_sampling_flags(args) -> None:
    """Refuse sampling flags a greedy run would ignore (found in review: `--top-k 40 --seed 1`
    without --temperature decoded greedily, rc 0), as the k flags a fixed k ignores are.
    A preset's values are defaults, not flags given."""
    from .config import GREEDY_BELOW

    if args.temperature >= GREEDY_BELOW:
        return
    defaults = getattr(args, "flag_defaults", {})
    given = [flag for flag, name, default in (("--top-p", "top_p", 1.0), ("--top-k", "top_k", 0), ("--seed", "seed", None))
             if getattr(args, name) != defaults.get(name, default)]
    if given:
        raise SpecDecodeError(f"{' and '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling, but "
                              f"--temperature {args.temperature:g} decodes greedily: give --temperature > 0, "
                              "or leave them out")


def _set_threads(engine_config: EngineConfig) -> None:
    """--threads for this process's torch work (the kernels read it from the config)."""
    if engine_config.num_threads:
        import torch

        torch.set_num_threads(engine_config.num_threads)


def _spec_config(args, method: str, k: str | None = None) -> SpeculativeConfig:
    """The speculative config from flags; ``k`` overrides --k ('threshold' = --k auto
    --k-policy threshold), for bench specs like ngram@3."""
    from_flag, k = k is None, args.k if k is None else k
    width = getattr(args, "tree_width", None)
    if isinstance(k, str) and "x" in k:  # bench specs: eagle@6x3 = 6 tree nodes, 3 children per node
        k, _, shape = k.partition("x")
        if not shape.isdigit():
            raise SpecDecodeError(f"a tree spec is K x WIDTH (e.g. eagle@6x3), got width {shape!r}")
        if from_flag and width is not None and width != int(shape):  # --k 6x2 --tree-width 4 took 2 silently
            raise SpecDecodeError(f"--k {k}x{shape} and --tree-width {width} give two tree widths; give one")
        if method not in ("eagle", "tree"):  # it was dropped without a word
            raise SpecDecodeError(f"{k}x{shape}: a tree width is for eagle and tree; {method} drafts chains "
                                  f"(give k alone)")
        width = int(shape)
    policy = "threshold" if k == "threshold" else args.k_policy
    if getattr(args, "draft", None) is not None and not args.draft.strip():
        # found in review: an empty --draft ran the default self:4 without a word
        raise SpecDecodeError("--draft is empty: give a draft model (a directory, a .gguf file, 'default') or "
                              "self:L (the target's first L layers)")
    return SpeculativeConfig(
        method=method, k=parse_k("auto" if k == "threshold" else k), tree_width=width,
        draft=(getattr(args, "head", None) if method in ("eagle", "tree", "medusa")
               else getattr(args, "store", None) if method == "suffix" else args.draft or DEFAULT_SELF_DRAFT),
        ngram_sizes=parse_int_list(args.ngram_sizes, "--ngram-sizes"), k_policy=policy, k_max=args.k_max,
    )


# drafter flags, and the methods that read them (each is ignored by every other method)
DRAFTER_FLAGS = {"store": ("--store", ("suffix",)), "head": ("--head", ("eagle", "tree", "medusa")),
                 "tree_width": ("--tree-width", ("eagle", "tree")), "draft": ("--draft", ("draft",)),
                 "ngram_sizes": ("--ngram-sizes", ("ngram", "suffix", "tree"))}
DRAFTER_DEFAULTS = {"ngram_sizes": "3,2,1"}  # flags with a default: given only where they differ from it


def _check_drafter_flags(args, methods: list[str]) -> None:
    """Refuse a drafter flag that none of ``methods`` (names, or bench specs such as
    eagle@6x3) reads: `--method ngram --store DIR` ran prompt lookup alone and said nothing.
    A misspelt method is named first (``parse_method``)."""
    from .bench.runner import parse_method

    names = [parse_method(method)[0] for method in methods]
    defaults = {**DRAFTER_DEFAULTS, **getattr(args, "flag_defaults", {})}  # a preset's values are defaults too
    for attr, (flag, readers) in DRAFTER_FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None and value != defaults.get(attr) and not any(name in readers for name in names):
            raise SpecDecodeError(f"{flag} is read by method {' or '.join(readers)} only; "
                                  f"{', '.join(names)} would ignore it")
    width = getattr(args, "tree_width", None)
    for method in methods:  # a bench spec's own width beside --tree-width (eagle@6x3 ran at 3; found in review)
        name, k = parse_method(method)
        if width is not None and k and "x" in k and int(k.partition("x")[2]) != width:
            raise SpecDecodeError(f"{method} and --tree-width {width} give two tree widths; give one")


def check_writable(path: str | None, flag: str, plot: bool = False) -> None:
    """Fail at the start, not after a run of many minutes, when the report cannot be
    written where ``flag`` says (the folder is made now, as the run would). ``plot``: the
    run also draws its plot beside it, as the same name with .png."""
    if path is None:
        return
    if not path.strip():  # found in review: bench --out '' ran to the end and wrote nothing
        raise SpecDecodeError(f"{flag} is empty: name the file to write")
    if plot and Path(path).suffix.lower() == ".png":  # found in review: the plot overwrote the records
        raise SpecDecodeError(f"{flag} {path}: names the JSON records, and the plot goes beside them as "
                              f"{Path(path).with_suffix('.png').name}, the same file; give a .json name")
    import tempfile

    if Path(path).is_dir():  # found in review: checked as writable, the run's end then failed to write it
        raise SpecDecodeError(f"{flag} {path}: is a directory; give a file name")
    if plot and Path(path).with_suffix(".png").is_dir():  # the plot's place: a traceback at the end (found in review)
        raise SpecDecodeError(f"{flag} {path}: the plot goes beside it as {Path(path).with_suffix('.png')}, "
                              "which is a directory")
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError as error:
        raise SpecDecodeError(f"{flag} {path}: cannot write there ({error.strerror or error})") from None


def _check_k_flags(args, methods: list[str]) -> None:
    """Refuse k flags the run would ignore: --k-policy and --k-max choose k under --k auto,
    so beside a fixed --k they did nothing; and no method drafts with --method none (or
    only peers) but it printed k=0 as if it had been taken."""
    from .bench.runner import PEERS, parse_method

    defaults = getattr(args, "flag_defaults", {})  # a preset's values are its defaults, not flags given
    ignored = [flag for flag, value, default in (("--k-policy", args.k_policy, defaults.get("k_policy", "cost")),
                                                 ("--k-max", args.k_max, defaults.get("k_max", 10)))
               if value != default]
    names = [parse_method(method) for method in methods]
    draft_nothing = f"{', '.join(methods)} {'drafts' if len(methods) == 1 else 'draft'} nothing with it"
    if args.k != "auto":
        if ignored:
            raise SpecDecodeError(f"{' and '.join(ignored)} choose k under --k auto; --k {args.k} fixes it, so "
                                  "they would be ignored")
        if all(name in ("none", *PEERS) or k is not None for name, k in names):
            raise SpecDecodeError(f"--k {args.k} would be ignored: {draft_nothing}")
    elif ignored and all(name in ("none", *PEERS) for name, _ in names):  # --method none --k-max 3 ran plain, rc 0
        raise SpecDecodeError(f"{' and '.join(ignored)} would be ignored: {draft_nothing}")
    elif ignored and all(name in ("none", *PEERS) or (k is not None and k.split("x")[0] not in ("auto", "threshold"))
                         for name, k in names):  # ngram@3 --k-max 5 ran at 3 and recorded k_max 5 (found in review)
        raise SpecDecodeError(f"{' and '.join(ignored)} choose k under k auto; {', '.join(methods)} "
                              f"{'fixes' if len(methods) == 1 else 'fix'} it, so they would be ignored")
    # each spec's config, before the model loads (found in review: bench refused ngram@1000
    # only after loading it); the flags' own first, so that a flag's error is not blamed on a spec
    drafting = [(method, name, k) for method, (name, k) in zip(methods, names) if name not in ("none", *PEERS)]
    if drafting:
        _spec_config(args, drafting[0][1], None)
    for method, name, k in drafting:
        try:
            _spec_config(args, name, k)
        except ConfigError as error:
            raise (SpecDecodeError(f"{method}: {error}") if k is not None else error) from None


def _engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, chat_template=not getattr(args, "no_chat_template", False),
                        num_threads=args.threads, weights=args.weights, backend=args.backend, exact=args.exact,
                        device=args.device, prefill_chunk=args.prefill_chunk, cuda_graphs=args.cuda_graphs)


def _sampling(args, stop=()) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_new_tokens=args.max_new_tokens, seed=args.seed, stop=tuple(stop),
    )


def cmd_generate(args) -> int:
    from .factory import build_engine, load_target, log, require_tokenizer

    engine_config = _engine_config(args)
    params = _sampling(args, args.stop)
    if args.compare and not params.greedy and params.seed is None:  # both runs must draw alike to compare
        import dataclasses
        import secrets

        params = dataclasses.replace(params, seed=secrets.randbits(31))
        print(f"[plain] sampling: both runs use seed {params.seed} (--seed to choose one)", file=sys.stderr)
    from .control.router import Router, router_state_path, update_saved
    from .factory import drafter_key

    if not args.prompt.strip():  # refused by encode, but only after the model loaded and calibrated
        raise SpecDecodeError("the prompt is empty")
    _check_drafter_flags(args, [args.method])
    _check_k_flags(args, [args.method])
    _check_sampling_flags(args)
    configured = _spec_config(args, args.method)
    state_path = router_state_path(args.model, _engine_config(args))
    if args.route:
        # saved now, whether or not the request speculates: the per-task request count is
        # what brings a task routed to plain decoding back to speculation every retry_every
        route = update_saved(state_path, lambda router: router.route(args.prompt, args.method, drafter_key(configured)),
                             warn=log)
        log(f"route: {route.reason} -> {route.method}")
    else:
        # the method is the flag's; the prompt's task picks the prior only: the acceptance
        # measured for it (found in review: a task the router had turned off got no prior,
        # and every 20th run of it the router's optimistic retry prior, never saved)
        from dataclasses import replace

        router = Router().load(state_path, warn=log)
        route = router.route(args.prompt, args.method, drafter_key(configured))
        route = replace(route, prior_alpha=router.prior(route.task, drafter_key(configured)))
    spec = _spec_config(args, route.method if args.route else args.method)
    log(f"loading {args.model} ({args.dtype})")
    target = load_target(engine_config, args.runtime)
    log(f"running on {target.runtime.describe()}")
    require_tokenizer(target, args.model, "generate")  # before the cost profile and calibration
    engine = build_engine(engine_config, spec, args.runtime, target=target)
    prompt_ids = engine.encode(args.prompt, engine_config.chat_template)
    context = target.runtime.max_positions
    if len(prompt_ids) < context < len(prompt_ids) + params.max_new_tokens:
        # found in review: cut at the context without a word, "length" as if --max-new-tokens
        # had run out (the server refuses such a request; a CLI run says so and goes on)
        log(f"warning: the prompt's {len(prompt_ids)} tokens + --max-new-tokens {params.max_new_tokens} exceed "
            f"the model's context of {context} tokens: at most {context - len(prompt_ids)} new tokens")
    stream = None if args.json else (lambda text: print(text, end="", flush=True))
    if args.compare:
        from .bench.runner import warm_up

        # the first forward passes of a process pay one-off costs (a GPU's library handles and
        # kernel loads: about 0.2 s on an H200) that would be charged to whichever run went first
        plain = build_engine(engine_config, SpeculativeConfig(method="none"), args.runtime, target=target)
        # a drafter's first call (a head's, a layer-skip draft's) pays one-off costs too:
        # warmed up on an engine of its own, so that what its k policy learns there (a
        # prompt's first 16 tokens, first-call costs) does not steer the measured run; a draft
        # model from a path is not loaded a second time for it
        engines = {"none": plain}
        if engine.method != "draft" or str(spec.draft or "").startswith("self:"):  # not a second draft model
            engines[args.method] = build_engine(engine_config, spec, args.runtime, target=target)
        warm_up(engines, prompt_ids, params, min(len(prompt_ids) + params.max_new_tokens + engine.k + 1,
                                                  target.runtime.max_positions))
    result = engine.generate(prompt_ids, params, on_text=stream, prior_alpha=route.prior_alpha)
    # learnt only from a request that drafted: one that ran plain would teach the task an
    # acceptance of 0 and talk its later requests out of speculating (as analyze and the server)
    if args.route and engine.policy is not None and hasattr(engine.policy, "costs") and result.stats.draft_tokens:
        from .control.router import speedup_from_stats

        # the drafting and verification time, as the server measures it (the wall time after
        # the prefill also held the first passes' one-off costs: no warm-up precedes this run)
        stats = result.stats
        measured = speedup_from_stats(stats, engine.policy.costs.profile, len(prompt_ids),
                                      decode_seconds=stats.draft_seconds + stats.verify_seconds,
                                      costs=engine.policy.costs)
        # read again and saved under the lock: another process may have learnt meanwhile
        update_saved(state_path, lambda router: router.observe(route.task, engine.drafter, stats.first_alpha,
                                                               measured, stats.new_tokens), warn=log)
    record = {"text": result.text, "finish_reason": result.finish_reason, "method": engine.method, "k": engine.k_label, "stats": result.stats.to_dict()}
    if engine.policy is not None and hasattr(engine.policy, "chosen"):
        record["k_per_step"] = engine.policy.chosen
    record["route"] = {"task": route.task, "prior_alpha": route.prior_alpha, "routed": args.route,
                       "method": spec.method, "reason": route.reason}
    if args.compare:
        baseline = plain.generate(prompt_ids, params)
        record["plain"] = {"tokens_per_s": baseline.stats.tokens_per_s, "new_tokens": baseline.stats.new_tokens}
        # None where plain decoding made no token (EOS first): no ratio (found in review: a traceback)
        # and where this run made none: as bench, no ratio (found in review: "0.00x")
        record["speedup"] = (result.stats.tokens_per_s / baseline.stats.tokens_per_s
                             if baseline.stats.tokens_per_s and result.stats.new_tokens else None)
        record["identical_to_plain"] = baseline.token_ids == result.token_ids
        if not record["identical_to_plain"]:  # sampled too (found in review: only greedy said where)
            record["first_divergence"] = plain.first_divergence(prompt_ids, baseline.token_ids, result.token_ids,
                                                                params)
    from .analysis.memory import peak_rss_bytes

    record["peak_rss_mb"] = peak_rss_bytes() / 2**20  # the whole process, loading included
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print()
    print(f"[{engine.method} k={engine.k_label}] {result.stats.summary()}", file=sys.stderr)
    if args.compare:
        print(
            f"[plain] {record['plain']['new_tokens']} tokens at {record['plain']['tokens_per_s']:.1f} tok/s | "
            f"speedup {'-' if record['speedup'] is None else format(record['speedup'], '.2f') + 'x'} | "
            f"identical to plain: {record['identical_to_plain']}",
            file=sys.stderr,
        )
        if not record["identical_to_plain"] and not params.greedy:
            print("[plain] sampled: a drafter whose drafts are sampled (a draft model, EAGLE chains) keeps the "
                  "target's distribution but not plain sampling's tokens; the others give those tokens",
                  file=sys.stderr)
        divergence = record.get("first_divergence")
        if divergence:
            print(f"[plain] first differs at new token {divergence['position']}, where the target's top-2 logit "
                  f"margin is {divergence['top2_margin']:.4f} (a near-tie when small)", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import run_bench

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:  # it benched plain decoding alone, for minutes, against nothing
        raise SpecDecodeError(f"--methods takes a comma list of methods, got {args.methods!r}")
    _check_drafter_flags(args, methods)
    _check_k_flags(args, methods)
    _check_sampling_flags(args)
    check_writable(args.out, "--out", plot=True)
    return run_bench(args, methods, _engine_config(args), _spec_config, _sampling(args))


PROFILE_DRAFTERS = ("ngram", "draft")
PROFILE_DEFAULT_METHODS = "ngram,draft"  # the draft: --draft, or self:4 where the target has more layers


def cmd_profile(args) -> int:
    from .factory import build_proposer, cost_profile, drafter_key, load_target, log

    engine_config = _engine_config(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in PROFILE_DRAFTERS for m in methods):  # "" timed no drafter, saying nothing
        raise SpecDecodeError(f"profile --methods takes a comma list of {PROFILE_DRAFTERS}, got {args.methods!r}")
    _check_drafter_flags(args, methods)
    policy_flags = [flag for flag, value, default in (("--k", args.k, "auto"), ("--k-policy", args.k_policy, "cost"),
                                                       ("--k-max", args.k_max, 10)) if value != default]
    if policy_flags:  # it measures what passes cost; no k is chosen here
        raise SpecDecodeError(f"profile measures costs and chooses no k: {', '.join(policy_flags)} would be ignored "
                              "(they are for generate and bench; serve takes them in --speculative-config)")
    specs = [_spec_config(args, method, k="1") for method in methods]
    _set_threads(engine_config)
    log(f"loading {args.model} ({args.dtype})")
    target = load_target(engine_config, args.runtime)
    layers = getattr(getattr(target.runtime, "cfg", None), "num_layers", 0)
    # found in review: the default methods failed on such a model; then "draft,ngram" still did, where
    # "ngram,draft" did not. With another method beside it the implied self:4 is skipped with a word; asked
    # for alone, build_proposer refuses it, naming the default
    if "draft" in methods and len(set(methods)) > 1 and args.draft is None and \
            layers <= int(DEFAULT_SELF_DRAFT.split(":")[1]):
        log(f"not costing the default draft {DEFAULT_SELF_DRAFT}: the target has {layers or 'no native'} layers "
            "(give --draft, or --methods ngram)")
        specs = [spec for spec in specs if spec.method != "draft"]
    drafters = {drafter_key(spec): build_proposer(spec, target, engine_config) for spec in specs}
    profile = cost_profile(target, args.dtype, drafters, force=args.remeasure)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    print(format_profile(profile, args.model))
    return 0


PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def format_profile(profile, model: str) -> str:
    """The step-cost table: ms and v(T) per context, then T = 1 against the time reading
    the step's bytes takes at the measured bandwidth."""
    measured = f", measured {profile.measured_at}" if profile.measured_at else ""
    lines = [f"cost profile: {model} on {profile.machine}, {profile.threads} threads; {profile.runtime or profile.dtype}"
             f"{measured}"]
    # the bytes a step reads are known for the native runtime only (the transformers
    # runtime's are 0: its limit lines divided by zero; found in review)
    known = bool(profile.bandwidth_gbs and profile.weight_bytes)
    if profile.bandwidth_gbs and not known:
        lines.append(f"memory read bandwidth {profile.bandwidth_gbs:.1f} GB/s (measured); the bytes a step reads are "
                     "not known for this runtime")
    if known:
        lines.append(f"memory read bandwidth {profile.bandwidth_gbs:.1f} GB/s (measured); a single-token step reads "
                     f"{profile.weight_bytes / 1e6:.1f} MB of weights and {profile.kv_bytes_per_token / 1e3:.1f} kB of "
                     "keys and values per cached token")
    lines.append(f"{'T':>4}" + "".join(f"{f'ctx {c} ms':>15}{'v':>7}" for c in profile.contexts))
    for index, size in enumerate(profile.sizes):
        if size not in PROFILE_SIZES:
            continue
        cells = "".join(f"{profile.step_ms[row][index]:>15.2f}{profile.step_ms[row][index] / profile.step_ms[row][0]:>7.2f}"
                        for row in range(len(profile.contexts)))
        lines.append(f"{size:>4}{cells}")
    lines.append("v(T) = time to score T tokens / one decode step (T = 1); speculation with k drafts scores k + 1")
    if known:
        lines.append("T = 1 against the bandwidth limit (time to read the weights | the weights and the KV cache):")
        for row, context in enumerate(profile.contexts):
            weights, both = profile.bandwidth_limit_ms(context), profile.bandwidth_limit_ms(context, with_cache=True)
            step = profile.step_ms[row][0]
            lines.append(f"  ctx {context:>5}: limit {weights:6.2f} ms | {both:6.2f} ms; step {step:6.2f} ms = "
                         f"{step / weights:.2f}x | {step / both:.2f}x")
    if profile.head_ms:
        passes = " / ".join(f"{ms:.2f}" for ms in profile.head_full_ms[1:])
        sizes = "/".join(str(size) for size in profile.head_sizes[1:])
        lines.append(f"output head after the layers: on demand {profile.head_ms:.2f} ms for the first row read, "
                     f"{profile.head_next_ms:.2f} ms for each further one; one pass over {sizes} rows {passes} ms")
        lines.append("  greedy verification computes logits on demand where the k policy expects that to cost less")
    if profile.graph_attention:
        lines.append("CUDA graphs: the attention each step's recording kept, by measurement: "
                     + ", ".join(f"T={size} {name}" for size, name in profile.graph_attention.items()))
    for name, c in profile.drafters.items():
        lines.append(f"drafter {name}: c = {c:.3f} of a target step per draft token")
    if profile.batch_ms:
        one = profile.batch_ms[0][0]
        lines.append(f"batched steps (specdecode serve), ms at {profile.batch_context} tokens of context per row, "
                     "and / one single-token step:")
        lines.append(f"{'rows':>5}" + "".join(f"{f'width {w}':>16}" for w in profile.batch_widths))
        for rows, cells in zip(profile.batch_rows, profile.batch_ms):
            lines.append(f"{rows:>5}" + "".join(f"{ms:>9.2f} ({ms / one:4.1f})" for ms in cells))
    return "\n".join(lines)


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecDecodeError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= v < math.inf for v in values):  # nan passed "v < 0" (found in review)
        raise SpecDecodeError(f"{flag} needs at least one value, each a finite number >= 0, got {text!r}")
    return values


def cmd_analyze(args) -> int:
    from .analysis.analyzer import analyze
    from .factory import log

    # a temperature once: twice, each pass's records were paired with the other's plain run
    temperatures = list(dict.fromkeys(_float_list(args.temperatures, "--temperatures")))
    if args.temperature != 0.0:  # it was replaced by --temperatures without a word (found in review)
        raise SpecDecodeError(f"--temperature {args.temperature}: analyze runs every temperature --temperatures lists")
    if args.batch < 1:  # the memory and throughput checks come after every generation: found wrong before
        raise SpecDecodeError(f"--batch must be at least 1, got {args.batch}")
    if args.budget is not None and not 0 < args.budget < math.inf:
        raise SpecDecodeError(f"--budget must be a finite number > 0 GiB, got {args.budget}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:  # found in review: every plain run went first, then the plot crashed
        raise SpecDecodeError(f"--methods takes a comma list of methods, got {args.methods!r}")
    from .bench.runner import PEERS, parse_method

    peers = [m for m in methods if parse_method(m)[0] in PEERS]
    if peers:  # a peer has no drafter to analyze: it failed after the target and the engines had loaded
        raise SpecDecodeError(f"--methods {','.join(peers)}: analyze measures drafters against plain decoding; "
                              f"compare {' and '.join(peers)} with `specdecode bench --methods none,{','.join(peers)}`")
    if all(parse_method(m)[0] == "none" for m in methods):  # found in review: a traceback from the plots, after the run
        raise SpecDecodeError(f"--methods {args.methods}: analyze measures drafters against plain decoding; "
                              "name one (e.g. --methods none,ngram)")
    if not args.out.strip():  # Path("") is the working directory
        raise SpecDecodeError("--out is empty: name the directory the reports go to")
    _check_drafter_flags(args, methods)
    _check_k_flags(args, methods)
    for name in ("summary.md", "analysis.json", "report.html"):  # a directory in a report's place failed at the end
        check_writable(str(Path(args.out) / name), "--out")
    analyze(args, _engine_config(args), _spec_config, _sampling(args), temperatures, methods, Path(args.out))
    print((Path(args.out) / "summary.md").read_text())
    log(f"wrote {args.out}: summary.md, analysis.json, report.html and PNG plots")
    return 0


def cmd_check(args) -> int:
    from .analysis.compat import calibrate, check_static, format_check

    if args.k is not None and args.k < 1:  # refused by the calibration only, so --no-calibration --k -2 passed
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    result = check_static(args.target, args.draft)
    calibration = None
    if result.compatible and not args.no_calibration:
        try:
            calibration = calibrate(args.target, args.draft, args.dtype, args.k, args.weights)
        except SpecDecodeError:  # the static checks still hold: shown before the error (found in review)
            print(format_check(result, None))
            raise
    print(format_check(result, calibration))
    return 0 if result.compatible else 1


def cmd_memory(args) -> int:
    from .analysis.memory import deployment_memory, format_report

    report = deployment_memory(args.target, args.draft, args.dtype, args.batch, args.context, args.k, args.budget,
                               args.weights, args.prefill_chunk, args.process)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["fits"] else 1


def cmd_train(args) -> int:

    from .engine import SpeculativeEngine
    from .factory import load_target
    from .train.data import build_data, check_settings

    out = getattr(args, "out", None)
    if out is not None and not out.strip():  # Path("") is the working directory: it wrote there, reporting "/"
        raise SpecDecodeError("--out is empty: name the directory to write")
    if getattr(args, "corpus_tokens", 0) < 0:  # train eagle and medusa took -1 as 0 (train data refused it)
        raise SpecDecodeError(f"--corpus-tokens must be >= 0, got {args.corpus_tokens}")
    if out:  # before the target loads and the work starts (found in review: a traceback after the load)
        check_writable(str(Path(out) / ".specdecode-write-check"), "--out")

    if args.train_verb == "eagle":
        return cmd_train_eagle(args)
    if args.train_verb == "medusa":
        return cmd_train_medusa(args)
    if args.train_verb == "export":
        return cmd_train_export(args)
    if args.train_verb == "store":
        from .factory import log
        from .train.store import build_store

        engine_config = _engine_config(args)
        _set_threads(engine_config)
        target = load_target(engine_config)
        from .train.data import check_data_target, target_identity

        check_data_target(Path(args.data), target_identity(target))  # the target's own answers, as for heads
        build_store(Path(args.data), Path(args.out), target.runtime.vocab_size, args.command, log=log)
        print(f"written to {args.out}/; use it with --method suffix --store {args.out}")
        return 0
    check_settings(args.prompts, args.samples, args.temperature, args.max_new_tokens, args.corpus_tokens,
                   args.chunk_tokens, args.batch, args.seed)
    engine_config = _engine_config(args)
    _set_threads(engine_config)
    target = load_target(engine_config)
    plain = SpeculativeEngine(target.runtime, target.tokenizer, None, 0, target.eos_token_ids)
    summary = build_data(target, Path(args.out), args.prompts, args.samples, args.temperature, args.max_new_tokens,
                         args.corpus_tokens, args.chunk_tokens, args.seed, plain.encode, args.batch)
    print(summary.format())
    written = "answers.jsonl, corpus.jsonl, summary.json" if args.corpus_tokens else "answers.jsonl, summary.json"
    print(f"written to {args.out}/ ({written})")  # no corpus file without corpus tokens (found in review)
    return 0


DEFAULT_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model's Hugging Face name


def cmd_train_export(args) -> int:

    from .factory import checkpoint_embedding, load_head, load_target, log
    from .proposers.eagle_formats import export_head

    if args.k < 1:
        raise SpecDecodeError(f"--k must be >= 1, got {args.k}")
    engine_config = _engine_config(args)
    _set_threads(engine_config)
    target = load_target(engine_config)
    runtime = target.runtime
    head = load_head(args.head, target)
    embed = checkpoint_embedding(target) if args.format == "speculators" else None
    verifier = args.verifier or (DEFAULT_VERIFIER if args.model == "default" else args.model)
    architectures = target.source.config.get("architectures") or ["LlamaForCausalLM"]
    files = export_head(head, Path(args.out), args.format, verifier=verifier, max_positions=runtime.max_positions,
                        embed=embed, speculative_tokens=args.k, verifier_architectures=list(architectures))
    log(f"wrote {', '.join(str(f) for f in files)} ({args.format} layout)")
    if args.format == "eagle3":
        print(f"vLLM: --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{args.out}\", "
              f"\"num_speculative_tokens\": {args.k}}}'")
    else:
        print(f"vLLM: vllm serve {args.out}  (the speculators config names the verifier {verifier})")
    return 0


def _train_drafter(args, train, written: str) -> int:
    """Load the target, run ``train(target, log)`` and report its held-out acceptance;
    ``written``: what was written, and how to use it."""
    import json

    from .factory import load_target, log
    from .train.eagle import HELD_OUT_EVERY

    engine_config = _engine_config(args)
    _set_threads(engine_config)
    report = train(load_target(engine_config), log)
    print(json.dumps(report, indent=2))
    if report["held_out_chains"]:
        taus = ", ".join(f"k={k}: {t:.2f}" for k, t in report["chain_tau"].items())
        print(f"held-out acceptance: first token {report['first_token_agreement']:.1%}; chain tau {taus}")
    else:
        from .train.prompts import held_out, training_prompts

        # (found in review: this still described the split by position, ids ending in 019)
        first = next((i + 1 for i, p in enumerate(training_prompts()) if held_out(p["id"], HELD_OUT_EVERY)), None)
        print(f"held-out acceptance: not measured (the data holds no held-out greedy answers, or none whose text "
              f"no trained sequence holds: of each category the prompts of one filler (topic, function or "
              f"passage) in {HELD_OUT_EVERY} and one written prompt in {HELD_OUT_EVERY} are held out; the first "
              f"is the set's prompt {first}, so `train data` needs at least {first} prompts)")
    print(written.format(out=args.out))
    return 0


def cmd_train_eagle(args) -> int:
    from .train.eagle import check_train_settings, train_eagle

    check_train_settings(args.draft_vocab, args.ttt_steps, args.minutes, args.lr, args.batch_tokens, args.max_length)
    return _train_drafter(args, lambda target, log: train_eagle(
        target, Path(args.data), Path(args.out), args.draft_vocab, args.ttt_steps, args.minutes, args.lr,
        args.batch_tokens, args.corpus_tokens, args.max_length, args.seed,
        init=Path(args.init) if args.init else None, log=log, bf16=args.bf16),
        "head written to {out}/ (config.json, model.safetensors); use it with --method eagle --head {out}")


def cmd_train_medusa(args) -> int:
    from .train.medusa import check_medusa_settings, train_medusa

    check_medusa_settings(args.heads, args.draft_vocab, args.minutes, args.lr, args.batch_tokens, args.max_length)
    return _train_drafter(args, lambda target, log: train_medusa(
        target, Path(args.data), Path(args.out), args.heads, args.draft_vocab, args.minutes, args.lr,
        args.batch_tokens, args.corpus_tokens, args.max_length, args.seed, log=log),
        "heads written to {out}/ (config.json, model.safetensors); use them with --method medusa --head {out}")


def cmd_presets(args) -> int:
    from .config import load_presets

    for name, values in load_presets().items():
        settings = ", ".join(f"{k}={v}" for k, v in values.items() if k != "description")
        print(f"{name}\n    {values.get('description', '')}\n    {settings}")
    return 0


def cmd_serve(args) -> int:
    import torch

    from .serve.server import build_state, serve, serving_threads

    most = 4 * (os.cpu_count() or 1)  # as --threads (EngineConfig); found in review: unbounded, a segfault
    if args.prefill_threads is not None and not 1 <= args.prefill_threads <= most:
        raise SpecDecodeError(f"--prefill-threads must be in 1..{most} (4x this machine's {os.cpu_count()} cores), "
                              f"got {args.prefill_threads}")
    if not 1 <= args.port <= 65535:
        raise SpecDecodeError(f"--port must be in 1..65535, got {args.port}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise SpecDecodeError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if not args.shutdown_timeout >= 0:
        raise SpecDecodeError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    from .serve.server import check_api_key

    check_api_key(args.api_key)  # before Ray or the model starts
    if args.replicas is not None and args.device != "cpu":  # its replicas ask Ray for CPUs only
        raise SpecDecodeError("--replicas runs CPU replicas; serve one engine on the GPU without it (--device cuda)")
    decode_threads = None
    if args.threads is None and args.replicas is None:
        args.threads = serving_threads()
        # decode passes: that many or every core, whichever the passes measure faster here
        decode_threads = tuple(dict.fromkeys((args.threads, torch.get_num_threads())))
        if args.prefill_threads is None:  # prefill chunks may take the front end's core too
            args.prefill_threads = torch.get_num_threads()
    config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads, weights=args.weights,
                          backend=args.backend, device=args.device, prefill_chunk=args.prefill_chunk,
                          cuda_graphs=args.cuda_graphs, exact=args.exact)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.replicas is not None:
        from .serve.server import ray_application, serve_ray

        application = ray_application(config, args.speculative_config, args.replicas, args.max_num_seqs,
                                      args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
                                      api_key=args.api_key, max_model_len=args.max_model_len,
                                      served_model_name=args.served_model_name, audit_rate=args.audit_rate,
                                      schedule=args.schedule, prefix_caching=args.enable_prefix_caching,
                                      prefill_threads=args.prefill_threads)
        serve_ray(application, args.host, args.port)
        return 0
    state = build_state(config, args.speculative_config, args.max_num_seqs, args.max_queued_requests, args.api_key,
                        args.max_model_len, args.served_model_name, args.audit_rate, schedule=args.schedule,
                        prefix_caching=args.enable_prefix_caching, prefill_threads=args.prefill_threads,
                        decode_threads=decode_threads)
    serve(state, args.host, args.port, args.shutdown_timeout)
    return 0


def cmd_bench_serve(args) -> int:
    import shlex

    from .bench.serve import MODES, bench_serve
    from .prompts import load_prompts

    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))  # a mode once (the summary kept the last)
    if not modes or any(m not in MODES for m in modes):
        raise SpecDecodeError(f"--modes takes a comma list of {MODES}, got {args.modes!r}")
    if args.request_rate is not None and args.concurrency is not None:  # it ran open loop and dropped it (in review)
        raise SpecDecodeError(f"--request-rate sends requests as they arrive (open loop); --concurrency "
                              f"{args.concurrency} is for closed-loop runs: give one of the two")
    concurrency = "1,2,4,8" if args.concurrency is None else args.concurrency
    levels = list(dict.fromkeys(parse_int_list(concurrency, "--concurrency")))  # a level once
    if args.request_rate is None and (not levels or min(levels) < 1):
        raise SpecDecodeError("--concurrency needs positive integers")
    if args.request_rate is not None and not 0 < args.request_rate < float("inf"):  # nan sent every request at once
        raise SpecDecodeError(f"--request-rate must be a finite number > 0, got {args.request_rate}")
    if args.rounds < 1:
        raise SpecDecodeError(f"--rounds must be at least 1, got {args.rounds}")
    if args.max_tokens < 1 or args.num_prompts < 1:
        raise SpecDecodeError(f"--max-tokens and --num-prompts must be at least 1, got {args.max_tokens} and "
                              f"{args.num_prompts}")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as error:
        raise SpecDecodeError(f"--serve-args {args.serve_args!r}: {error}") from None
    # found in review: a --port there bound the server elsewhere than bench-serve polled (a
    # 15-minute wait), and with --url the server flags were dropped without a word
    if args.url and serve_args:
        raise SpecDecodeError("--serve-args starts a server, and --url uses one already running: give one of them")
    placed = [arg for arg in serve_args if arg.split("=")[0] in ("--port", "--host")]
    if placed:
        raise SpecDecodeError(f"--serve-args may not set {placed[0].split('=')[0]}: bench-serve starts its server on "
                              "a free port of 127.0.0.1 itself")
    check_writable(args.out, "--out", plot=True)
    bench_serve(load_prompts(args.prompts, args.limit), levels, args.request_rate, args.num_prompts, args.max_tokens,
                modes, args.url, serve_args, Path(args.out) if args.out else None, args.seed, rounds=args.rounds)
    return 0


def _replace_what_stdout_cannot_encode() -> None:
    """Generated text on a console that is not UTF-8 (a Windows code page, PYTHONIOENCODING=ascii)
    comes out with "?" for what it cannot encode (found in review: a UnicodeEncodeError traceback
    from the streamed text); stderr already escapes such characters."""
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    if encoding != "utf8" and hasattr(sys.stdout, "reconfigure"):
        try:
            sys.stdout.reconfigure(errors="replace")
        except (ValueError, OSError):  # a stream that cannot be changed: left as it is
            pass


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="specdecode: %(message)s")
    _replace_what_stdout_cannot_encode()
    try:
        args = parse_args(argv)
        return {"generate": cmd_generate, "bench": cmd_bench, "profile": cmd_profile, "presets": cmd_presets,
                "check": cmd_check, "memory": cmd_memory, "analyze": cmd_analyze, "train": cmd_train,
                "serve": cmd_serve, "bench-serve": cmd_bench_serve}[args.verb](args)
    except SpecDecodeError as error:
        print(f"specdecode: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a line of its own after any half-drawn progress bar (found in review: nothing)
        print("\nspecdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdecode generate ... | head`: the reader left (found in review: a traceback)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush must not fail again
        except (OSError, ValueError):  # stdout is no file (captured)
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
