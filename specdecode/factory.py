"""From configuration to a ready engine: resolve models, load runtimes, build the proposer."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cached_property

import torch

from .config import ConfigError, EngineConfig, SpecDecodeError, SpeculativeConfig
from .control.policies import CostAwareK, CostModel, ThresholdK
from .engine import SpeculativeEngine
from .metrics import acceptance_rates
from .models.hf import load_hf
from .models.llama import load_native
from .models.loading import ModelSource, load_tokenizer, resolve_model
from .proposers.draft_model import DraftModelProposer
from .proposers.ngram import NgramProposer

RUNTIMES = ("auto", "native", "hf")


class VocabularyMismatchError(SpecDecodeError, ValueError):
    """Draft and target do not share a vocabulary, so draft ids mean nothing to the target."""


@dataclass
class LoadedModel:
    source: ModelSource
    runtime: object  # NativeRuntime or HFRuntime
    tokenizer: object | None

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from generation_config.json, config.json and the tokenizer (read once)."""
        ids: set[int] = set()
        for config_name in ("generation_config.json", "config.json"):
            path = self.source.path / config_name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def load_model(name: str, dtype: torch.dtype, runtime: str = "auto") -> LoadedModel:
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    source = resolve_model(name)
    if runtime == "native" and not source.native:
        raise ConfigError(f"the native runtime supports llama, mistral and qwen2, not {source.model_type!r}")
    use_native = runtime == "native" or (runtime == "auto" and source.native)
    model = load_native(source.path, dtype) if use_native else load_hf(source.path, dtype)
    return LoadedModel(source, model, load_tokenizer(source))


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    if draft.runtime.vocab_size != target.runtime.vocab_size:
        raise VocabularyMismatchError(
            f"vocabulary mismatch: target {target.source.name!r} has {target.runtime.vocab_size} "
            f"tokens, draft {draft.source.name!r} has {draft.runtime.vocab_size}; a draft model "
            "must share the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise VocabularyMismatchError(
                f"vocabulary mismatch: target {target.source.name!r} and draft "
                f"{draft.source.name!r} map tokens to different ids"
            )


def build_proposer(spec: SpeculativeConfig, target: LoadedModel, dtype: torch.dtype):
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_sizes)
    if spec.draft.startswith("self:"):
        try:
            num_layers = int(spec.draft.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"--draft self:L needs an integer layer count, got {spec.draft!r}") from None
        if not hasattr(target.runtime, "layer_skip_view"):
            raise ConfigError("--draft self:L needs the native runtime")
        total = target.runtime.cfg.num_layers
        if not 1 <= num_layers < total:
            raise ConfigError(f"--draft self:L needs 1 <= L < {total} (the target's layers), got {num_layers}")
        return DraftModelProposer(target.runtime.layer_skip_view(num_layers))
    draft = load_model(spec.draft, dtype)
    check_vocabularies(target, draft)
    return DraftModelProposer(draft.runtime)


def drafter_key(spec: SpeculativeConfig) -> str:
    """How a drafter is named in cost profiles and reports."""
    return "ngram" if spec.method == "ngram" else f"draft:{spec.draft}"


def model_key(model: LoadedModel) -> str:
    return str(model.source.path.resolve())


def cost_profile(target: LoadedModel, dtype: str, drafters: dict | None = None, force: bool = False):
    """The target's cost profile on this machine (measured once, then cached)."""
    from .analysis.profile import get_profile, load_profile

    if not force and load_profile(model_key(target), dtype) is None:
        log("measuring the cost profile of this model on this machine (once; cached)")
    return get_profile(model_key(target), dtype, target.runtime, drafters, force=force)


CALIBRATION_PROMPTS = ("code-03", "summarization-03", "open_qa-03")


def calibration_runs(target: LoadedModel, proposer, k: int = 4, max_new_tokens: int = 32) -> list:
    """Greedy generations with a fixed k on three built-in prompts (code, summary,
    question); their GenerationStats. Empty without a tokenizer."""
    from .bench.runner import load_prompts
    from .config import SamplingParams

    if target.tokenizer is None:
        return []
    prompts = {p["question_id"]: p["prompt"] for p in load_prompts(None)}
    engine = SpeculativeEngine(target.runtime, target.tokenizer, proposer, k, target.eos_token_ids)
    room = target.runtime.max_positions - max_new_tokens - k - 2
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [engine.generate(engine.encode(prompts[q])[-room:], params).stats for q in CALIBRATION_PROMPTS]


def calibrate_acceptance(target: LoadedModel, proposer) -> tuple[float, float] | None:
    """(first, later) acceptance of ``proposer`` over the calibration runs
    (metrics.acceptance_rates); None if none ran."""
    runs = calibration_runs(target, proposer)
    return acceptance_rates(runs) if runs else None


def build_policy(spec: SpeculativeConfig, target: LoadedModel, proposer, dtype: str):
    """A fixed k, or the adaptive policy ``spec.k_policy`` when ``spec.k == 'auto'``.

    The cost-aware policy gets the cost profile and, as its default priors, the drafter's
    two acceptance rates calibrated once on this target (cached in the profile)."""
    from .analysis.profile import record_acceptance

    if proposer is None or spec.k != "auto":
        return spec.k if isinstance(spec.k, int) else 1
    if spec.k_policy == "threshold":
        return ThresholdK(start_k=min(5, spec.k_max), k_max=max(spec.k_max, 2))
    name = drafter_key(spec)
    profile = cost_profile(target, dtype, {name: proposer})
    if name not in profile.acceptance:
        log(f"calibrating the acceptance of {name} on 3 built-in prompts (once; cached)")
        rates = calibrate_acceptance(target, proposer)
        if rates is not None:
            profile.acceptance[name] = list(rates)
            record_acceptance(model_key(target), dtype, name, list(rates))
    first, later = profile.acceptance.get(name) or (None, None)
    return CostAwareK(CostModel(profile, name), k_max=spec.k_max, default_prior=first, default_later=later)


def build_engine(engine: EngineConfig, spec: SpeculativeConfig, runtime: str = "auto",
                 target: LoadedModel | None = None) -> SpeculativeEngine:
    if engine.num_threads:
        torch.set_num_threads(engine.num_threads)
    if target is None:
        target = load_model(engine.model, engine.torch_dtype, runtime)
    proposer = build_proposer(spec, target, engine.torch_dtype)
    policy = build_policy(spec, target, proposer, engine.dtype)
    engine = SpeculativeEngine(target.runtime, target.tokenizer, proposer, policy, target.eos_token_ids)
    engine.drafter = drafter_key(spec) if proposer is not None else None
    return engine


def log(message: str) -> None:
    print(f"specdecode: {message}", file=sys.stderr, flush=True)
