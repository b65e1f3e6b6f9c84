"""From configuration to a ready engine: resolve models, load runtimes, build the proposer."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path

import torch

from .config import (DEFAULT_NGRAM_SIZES, ConfigError, EngineConfig, SpecDecodeError, SpeculativeConfig,
                     VocabularyMismatchError, is_count, self_draft_layers)
from .control.policies import CostAwareK, CostModel, FixedK, ThresholdK, TreeBudget
from .cost.theory import best_k, tau_conditional
from .engine import SpeculativeEngine
from .metrics import acceptance_rates
from .models.hf import load_hf
from .models.llama import DEFAULT_PREFILL_CHUNK, checkpoint_files, load_native
from .models.loading import ModelSource, load_tokenizer, resolve_model, sha256_file
from .models.quant import WEIGHT_CHOICES
from .proposers.draft_model import DraftModelProposer
from .proposers.ngram import NgramProposer

RUNTIMES = ("auto", "native", "hf")
# the EAGLE head trained for the default model (specdecode train eagle; see its MANIFEST)
DEFAULT_EAGLE_HEAD = Path(__file__).parent / "data" / "heads" / "smollm2-135m-instruct-eagle3"
# the Medusa heads trained for the default model (specdecode train medusa; see their MANIFEST)
DEFAULT_MEDUSA_HEADS = Path(__file__).parent / "data" / "heads" / "smollm2-135m-instruct-medusa"
# the token store of the default model's own answers (specdecode train store; see its MANIFEST)
DEFAULT_TOKEN_STORE = Path(__file__).parent / "data" / "stores" / "smollm2-135m-instruct"


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
                try:  # found in review: a corrupt file, or ids as strings, ended in a traceback
                    data = json.loads(path.read_text())
                except (ValueError, UnicodeDecodeError) as error:
                    raise SpecDecodeError(f"{path} is not valid JSON ({error})") from None
                eos = data.get("eos_token_id") if isinstance(data, dict) else None
                eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
                if not all(is_count(i) for i in eos):
                    raise SpecDecodeError(f"{path}: eos_token_id must be an integer or a list of them, got {eos!r}")
                ids.update(eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def load_model(name: str, dtype: torch.dtype, runtime: str = "auto", weights: str = "auto", backend: str = "auto",
               exact: bool | None = None, device: str = "cpu", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
               cuda_graphs: bool = True) -> LoadedModel:
    """Resolve ``name`` and load it. The native runtime's backend and weight format come
    from ``choose_backend`` (EngineConfig documents the arguments)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but torch sees no CUDA GPU here")
    source = resolve_model(name)
    if runtime == "native" and not source.native:
        raise ConfigError(f"the native runtime supports llama, mistral and qwen2, not {source.model_type!r}")
    use_native = runtime == "native" or (runtime == "auto" and source.native)
    refusal = native_refusal(source) if use_native and runtime == "auto" else None
    if refusal is not None:  # a Llama-family config the native runtime cannot compute: transformers can
        log(f"{source.model_type}: {refusal.removesuffix('; use --runtime hf')}; running it through transformers")
        use_native = False
    if not use_native:
        if (weights not in ("auto", dense_weights(dtype)) or exact or backend != "auto"
                or prefill_chunk != DEFAULT_PREFILL_CHUNK):  # (the chunk was ignored: found in review)
            raise ConfigError(f"{source.model_type!r} runs through transformers, which takes neither --weights, "
                              "--exact, --backend nor --prefill-chunk; use --dtype to choose its precision")
        model = load_hf(source.path, dtype, device)
        return LoadedModel(source, model, load_tokenizer(source))
    backend, fmt = choose_backend(source, dtype, weights, backend, exact, device)

    def load(fmt: str, backend: str = backend):
        return load_native(source.path, dtype, fmt, backend, source.gguf, prefill_chunk, device, cuda_graphs)

    if fmt == "auto":
        from .cost.formats import fastest_weights

        # keyed by the files too: another checkpoint saved where this one was took its choice (a
        # q8_0 that its 48-wide layers could not take; found in review)
        key = f"{source.path.resolve()}{checkpoint_mark(source.path)}"
        fmt = fastest_weights(key, dtype, auto_candidates(source), load)
    native = load(fmt)
    if fmt == "bf16" and source.gguf is not None:
        rounded = gguf_tensors_rounded_to_bf16(source)
        if rounded:  # found in review: said nothing, where the other formats' second quantization is logged
            log(f"{rounded} GGUF tensors are stored in a format bf16 cannot hold exactly and were rounded to bf16 "
                "(--weights int4 carries Q4_0/Q4_1 blocks exactly, int8 Q8_0 blocks)")
    carried = native.weights.carried
    requantized = sorted(name for name, how in carried.items() if how.startswith("requantized"))
    if requantized:
        log(f"{len(requantized)} GGUF tensors are in a format {fmt} cannot carry exactly and were quantized "
            f"(a second time where the GGUF's were quantized already; e.g. {requantized[0]}: "
            f"{carried[requantized[0]]})")
    return LoadedModel(source, native, load_tokenizer(source))


def gguf_tensors_rounded_to_bf16(source: ModelSource) -> int:
    """How many of a GGUF's matrices are stored in another type than BF16: --weights bf16
    rounds their values (an F32 or F16 matrix's too, unless it holds bf16 numbers only)."""
    from .models.loading import gguf_tensor_index
    from .models.quant import GGML_BF16

    return sum(1 for t in gguf_tensor_index(source.gguf, source.path).values()
               if len(t.shape) == 2 and t.tensor_type != GGML_BF16)


def native_refusal(source: ModelSource) -> str | None:
    """Why the native runtime cannot compute this Llama-family checkpoint (a sliding window,
    MLP or o_proj biases, another activation, a RoPE it cannot tabulate), or None. With
    ``--runtime auto`` such a model goes through transformers. Found in review: refused with
    "use --runtime hf", which draft models (always auto) and ``check`` could not take."""
    from .models.llama import LlamaConfig, NativeUnsupported, rope_inverse_frequencies

    try:
        rope_inverse_frequencies(LlamaConfig.from_hf(source.config), source.path)
    except NativeUnsupported as error:
        return str(error)
    if (source.gguf is None and source.path.is_dir() and not any(source.path.glob("*.safetensors"))
            and any(source.path.glob("pytorch_model*.bin"))):
        # the native runtime reads safetensors only; transformers reads these (found in
        # review: --runtime auto failed, naming safetensors, where --runtime hf loaded it)
        return "the checkpoint's weights are pytorch_model*.bin files, which the native runtime does not read"
    return None


def load_target(engine: EngineConfig, runtime: str = "auto") -> LoadedModel:
    """The target ``engine`` names, loaded with its threads: ``--weights auto`` times the
    formats on them and caches the choice under their count (found in review: `generate`,
    `bench`, `analyze` and `check` set --threads only after loading, so the choice was
    measured, and keyed, at the default count)."""
    if engine.num_threads:
        torch.set_num_threads(engine.num_threads)
    return load_model(engine.model, engine.torch_dtype, runtime, engine.weights, engine.backend, engine.exact,
                      engine.device, engine.prefill_chunk, engine.cuda_graphs)


def require_tokenizer(target: LoadedModel, model: str, command: str) -> None:
    """Commands that encode text prompts say at once that a model has no tokenizer (found
    in review: after the cost profile and the calibration, advising token ids, which no
    command line takes)."""
    if target.tokenizer is None:
        raise SpecDecodeError(f"{model} has no tokenizer files: `specdecode {command}` needs one to encode its "
                              "prompts (add the tokenizer's files to the checkpoint directory)")


def dense_weights(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def auto_candidates(source: ModelSource) -> list[str]:
    """Formats ``--weights auto`` measures: a GGUF whose layers are 4-bit blocks is a 4-bit
    model, so int4 competes; one stored in 8, 16 or 32 bits, like any other checkpoint, is
    never silently cut below 8 (any GGUF had int4 among them: an F16 GGUF was quantized to
    4 bits unasked; found in review)."""
    if source.gguf is None:
        return ["q8_0", "bf16"]
    from .models.loading import gguf_tensor_index
    from .models.quant import GGML_4BIT

    layers = [t for name, t in gguf_tensor_index(source.gguf, source.path).items()
              if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2]
    four_bit = sum(t.tensor_type in GGML_4BIT for t in layers)
    return ["q4_1", "q8_0", "bf16"] if layers and 2 * four_bit >= len(layers) else ["q8_0", "bf16"]


def choose_backend(source: ModelSource, dtype: torch.dtype, weights: str, backend: str, exact: bool | None,
                   device: str) -> tuple[str, str]:
    """(backend, layer weight format or 'auto'). The kernels run on the CPU wherever they
    build; the torch backend stores dense weights in ``dtype``. ``--dtype fp32`` means full
    precision, so its 'auto' weights are fp32."""
    from . import kernels

    fmt = WEIGHT_CHOICES.get(weights, weights)
    dense = dense_weights(dtype)
    quantized = fmt in ("q8_0", "q4_1")
    if device != "cpu" or backend == "torch":
        where = f"device {device!r}" if device != "cpu" else "backend 'torch'"
        if exact:
            raise ConfigError(f"--exact needs specdecode's CPU kernels; {where} is not batch invariant")
        if backend == "kernels":
            raise ConfigError(f"the kernels backend runs on the CPU only, not on {where}")
        if fmt not in ("auto", dense):
            raise ConfigError(f"--weights {weights} needs specdecode's CPU kernels; on {where} the weights are "
                              f"stored in --dtype ({dense})")
        return "torch", dense
    reason = kernels.unavailable_reason()
    if reason is not None:
        if backend == "kernels" or exact or quantized:
            raise ConfigError(f"specdecode's CPU kernels are unavailable here ({reason}); "
                              "they are needed for --backend kernels, --exact and --weights int8/int4")
        if fmt not in ("auto", dense):
            raise ConfigError(f"without the CPU kernels the weights are stored in --dtype ({dense}), not {weights}")
        log(f"CPU kernels unavailable ({reason}); running on torch")
        return "torch", dense
    shape = kernel_shape_refusal(source)
    if shape is not None:  # found in review: the defaults failed on a model torch runs exactly
        if backend == "kernels" or exact or quantized or fmt not in ("auto", dense):
            raise ConfigError(f"{shape}: --backend kernels, --exact and --weights int8/int4 need them; "
                              "use --backend torch")
        log(f"{shape}; running on torch")
        return "torch", dense
    if fmt == "auto" and dtype == torch.float32:
        fmt = "fp32"
    return "kernels", fmt


def kernel_shape_refusal(source: ModelSource) -> str | None:
    """Why the CPU kernels cannot run this model's attention, or None."""
    from .models.cpu_runtime import check_attention_shape
    from .models.llama import LlamaConfig

    try:
        config = LlamaConfig.from_hf(source.config)
    except SpecDecodeError:  # a config the native loader refuses: it says so itself, later
        return None
    try:
        check_attention_shape(config)
    except SpecDecodeError as error:
        return str(error)
    return None


def padded_alike(target_tokenizer, draft_tokenizer, target_size: int, draft_size: int) -> bool:
    """Both have the same tokenizer, whose every id is below both models' vocabulary size
    (embeddings padded to different sizes around it). ``check`` asks it of configs."""
    if target_tokenizer is None or draft_tokenizer is None:
        return False
    vocabulary = target_tokenizer.get_vocab()
    return vocabulary == draft_tokenizer.get_vocab() and max(vocabulary.values(), default=-1) < min(target_size,
                                                                                                      draft_size)


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must map every token to the target's id. Embeddings padded to different
    sizes are fine where both tokenizers are the same and fit in both (Qwen2.5's 0.5B-7B
    and 14B-72B; found in review: refused as "must share the target's tokenizer")."""
    padded = padded_alike(target.tokenizer, draft.tokenizer, target.runtime.vocab_size, draft.runtime.vocab_size)
    if draft.runtime.vocab_size != target.runtime.vocab_size and not padded:
        raise VocabularyMismatchError(
            f"vocabulary mismatch: target {target.source.name!r} has {target.runtime.vocab_size} "
            f"tokens, draft {draft.source.name!r} has {draft.runtime.vocab_size}; a draft model "
            "must share the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if padded:
            return
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise VocabularyMismatchError(
                f"vocabulary mismatch: target {target.source.name!r} and draft "
                f"{draft.source.name!r} map tokens to different ids"
            )
    elif target.tokenizer is not None:  # lossless all the same, but its drafts may mean other tokens
        log(f"draft {draft.source.name!r} has no tokenizer files: only its vocabulary size ({draft.runtime.vocab_size}) "
            "could be checked against the target's; if it was trained with another tokenizer, its drafts will "
            "rarely be accepted")


def build_proposer(spec: SpeculativeConfig, target: LoadedModel, engine: EngineConfig):
    """The drafter ``spec`` names; a draft model loads with ``engine``'s settings."""
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_sizes)
    if spec.method == "suffix":
        from .proposers.suffix import SuffixProposer

        return SuffixProposer(load_store(spec.draft, target), spec.ngram_sizes)
    if spec.method == "eagle":
        return eagle_proposer(spec.draft, target, spec.tree_width)
    if spec.method == "medusa":
        return medusa_proposer(spec.draft, target)
    if spec.method == "tree":
        from .proposers.merged_tree import MergedTreeProposer

        return MergedTreeProposer(NgramProposer(spec.ngram_sizes), eagle_proposer(spec.draft, target, spec.tree_width))
    if spec.draft.startswith("self:"):
        if not hasattr(target.runtime, "layer_skip_view"):
            raise ConfigError("--draft self:L needs the native runtime")
        num_layers = self_draft_layers(spec.draft, target.runtime.cfg.num_layers)
        return DraftModelProposer(target.runtime.layer_skip_view(num_layers))
    source = resolve_model(spec.draft)
    if not source.native or native_refusal(source) is not None:
        # a draft that runs through transformers: --weights, --backend, --exact and
        # --prefill-chunk are the target's flags (found in review: the chunk refused the draft)
        engine = replace(engine, weights="auto", backend="auto", exact=None, prefill_chunk=DEFAULT_PREFILL_CHUNK)
    draft = load_target(replace(engine, model=spec.draft))
    check_vocabularies(target, draft)
    return DraftModelProposer(draft.runtime, target.runtime.vocab_size)


def eagle_proposer(path: str | None, target: LoadedModel, tree_width: int = 1):
    """An EAGLE drafter with the head ``load_head`` finds for ``target``."""
    from .proposers.eagle import EagleProposer

    head = load_head(path, target)  # refused without the native runtime
    weights = target.runtime.weights
    stored = getattr(head, "stored_embedding", None)  # an imported head's own embedding, if it has one
    head = head.to(weights.device)  # beside the target: its features stay there
    if stored is not None and not same_embedding(stored, checkpoint_embedding(target)):
        # vLLM keeps a head's own embedding when it is not the target's, and drafts with it
        log(f"the EAGLE head at {path} stores an embedding of its own (not the target's): drafting with it, as vLLM does")
        stored = stored.to(weights.device)
        return EagleProposer(head, lambda ids: stored[ids], tree_width=tree_width)
    return EagleProposer(head, lambda ids: weights.embed_rows(ids).float(), tree_width=tree_width)


def checkpoint_embedding(target: LoadedModel) -> torch.Tensor:
    """The target's token embedding [V, H] as its checkpoint holds it (its dtype too;
    float32 where it is dequantized from a GGUF): the runtime's copy may be quantized (Q8_0
    under --weights int8), and a head exported with that copy carried another embedding
    than the target's (found in review)."""
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    try:
        files = checkpoint_files(target.source.path)  # the files the loader read, as transformers picks them
    except SpecDecodeError:
        files = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return target.runtime.weights.embed.dequantize().float()  # a checkpoint we cannot read it from


def same_embedding(stored: torch.Tensor, embedding: torch.Tensor, tolerance: float = 0.02) -> bool:
    """Whether ``stored`` is ``embedding`` up to rounding (bf16, Q8_0: well under 1% of a
    row's norm; another embedding differs by about its whole norm)."""
    if stored.shape != embedding.shape:
        return False
    error = (stored.float() - embedding.float()).norm(dim=-1) / embedding.float().norm(dim=-1).clamp_min(1e-12)
    return bool(error.max() <= tolerance)


def _head_dir(path: str | None, target: LoadedModel, noun: str, default: Path, usage: str) -> Path:
    """The directory of a drafter that reads the target's hidden states (``path``, or the
    one shipped for the default model), refused where the target has no native runtime."""
    if not hasattr(target.runtime, "weights"):
        raise ConfigError(f"{noun}: the native runtime is needed (the drafter reads the target's hidden states); "
                          "the transformers runtime (--runtime hf) has none")
    if path is None:
        if not target.source.is_default:
            raise ConfigError(f"{noun}: this model needs {usage}; drafters are shipped only for the default model")
        path = str(default)
    if not Path(path).is_dir():
        raise ConfigError(f"{noun} not found: {path} is not a directory")
    return Path(path)


def _check_trained_for(noun: str, directory: Path, config, target: LoadedModel) -> None:
    """Refuse a drafter trained for a target of another vocabulary or hidden size, and say so
    where its recipe names another checkpoint of the same shape (it still drafts: the output
    stays lossless, but a head learnt on another model's states is seldom right)."""
    cfg = target.runtime.cfg
    if config.target_vocab_size != cfg.vocab_size or config.hidden_size != cfg.hidden_size:
        raise VocabularyMismatchError(
            f"{noun} at {directory}: trained for a target with {config.target_vocab_size} tokens and hidden size "
            f"{config.hidden_size}; {target.source.name!r} has {cfg.vocab_size} and {cfg.hidden_size}")
    other = trained_for_another(directory, target.source)
    if other is not None:  # found in review: another model's head drafted at 0% without a word
        log(f"warning: {noun} at {directory}: trained for {other} (another model, or this one in another "
            "file format); drafting anyway (the output stays the target's, acceptance may be low)")


def trained_for_another(directory: Path, source) -> str | None:
    """"X, not Y" where the head at ``directory`` was trained for another checkpoint than
    ``source``, else None. A head learns one target's hidden states, so sizes that fit are
    not enough. Its recipe's checkpoint digest decides where it has one (a model moved or
    named otherwise is still the same; the same weights in another file format are not:
    the warning says so); else the target's name it was saved with. The digest reads the
    target's weight files once a machine (``sha256_file`` remembers it), as training did."""
    from .models.loading import DEFAULT_MODEL_NAMES

    try:
        saved = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    saved = saved if isinstance(saved, dict) else {}
    recipe = saved.get("recipe") if isinstance(saved.get("recipe"), dict) else {}
    trained = recipe.get("target")
    if isinstance(trained, str) and "|" in trained and source is not None:  # "llama <digest>|how it ran"
        from .train.data import checkpoint_identity

        ours = checkpoint_identity(source)
        return None if trained.split("|")[0] == ours else f"checkpoint {trained.split('|')[0]!r}, not {ours!r}"
    name = saved.get("target")
    if not name or source is None:
        return None
    same = str(name) == str(source.name) or (str(name) in DEFAULT_MODEL_NAMES and source.is_default)
    return None if same else f"{name}, not {source.name}"


def load_head(path: str | None, target: LoadedModel):
    """An EAGLE head from ``path`` (default: the one shipped for the default model),
    checked against the target it is to draft for."""
    from .proposers.eagle_head import EagleHead

    directory = _head_dir(path, target, "EAGLE head", DEFAULT_EAGLE_HEAD,
                          "--head HEAD_DIR (a head trained for this target with `specdecode train eagle`)")
    runtime = target.runtime
    head = EagleHead.load(directory, target_layers=getattr(runtime, "num_layers", None))
    _check_trained_for("EAGLE head", directory, head.config, target)
    if max(head.config.capture_layers) >= runtime.num_layers:
        raise ConfigError(f"EAGLE head {directory} reads layer {max(head.config.capture_layers)}; "
                          f"the target has {runtime.num_layers}")
    return head


def medusa_proposer(path: str | None, target: LoadedModel):
    """A Medusa drafter with the heads at ``path`` (default: those shipped for the default
    model), checked against ``target`` and bound to its final norm and output rows."""
    from .proposers.medusa import MedusaHeads, MedusaProposer

    directory = _head_dir(path, target, "Medusa heads", DEFAULT_MEDUSA_HEADS,
                          "--head HEADS_DIR (heads trained for this target with `specdecode train medusa`)")
    heads = MedusaHeads.load(directory)
    _check_trained_for("Medusa heads", directory, heads.config, target)
    weights = target.runtime.weights
    heads = heads.to(weights.device).bind(weights.norm, weights.lm_head.dequantize())
    return MedusaProposer(heads, target.runtime.num_layers)


def load_store(path: str | None, target: LoadedModel):
    """A token store from ``path`` (default: the one shipped for the default model),
    checked against the target's vocabulary; loaded once per directory. None for another
    model without ``path``: suffix lookup then drafts from the request alone."""
    if path is None:
        if not target.source.is_default:
            _note_no_store(target.source.name)
            return None
        path = str(DEFAULT_TOKEN_STORE)
    if not Path(path).is_dir():
        raise ConfigError(f"token store not found: {path} is not a directory")
    store = _load_store(str(Path(path).resolve()))
    vocab = target.runtime.vocab_size  # either runtime (the transformers one has no cfg)
    if store.vocab_size != vocab:
        raise VocabularyMismatchError(f"token store {path} holds ids of a {store.vocab_size}-token vocabulary; "
                                      f"{target.source.name!r} has {vocab}")
    return store


@lru_cache(maxsize=16)
def _note_no_store(model: str) -> None:
    log(f"no token store for {model!r} (one is shipped only for the default model): suffix lookup drafts from "
        "the request alone, as prompt lookup does; build one with `specdecode train store` and pass --store DIR")


@lru_cache(maxsize=4)
def _load_store(path: str):
    from .proposers.suffix import TokenStore

    return TokenStore.load(Path(path))


@lru_cache(maxsize=16)
def _file_fingerprint(path: Path, size: int, mtime: float) -> str:
    return sha256_file(path)[:8]


def _fingerprint_mark(path: Path) -> str:
    """' sha256:XXXXXXXX' for a file that exists (hashed once per size and mtime), else ''."""
    stat = path.stat() if path.is_file() else None
    return f" sha256:{_file_fingerprint(path, stat.st_size, stat.st_mtime)}" if stat else ""


def checkpoint_mark(directory: Path) -> str:
    """Fingerprints of a checkpoint directory's config.json and first weight file, and the
    names, sizes and modification times of the others (a sharded checkpoint saved over
    another with only a later shard changed kept the key; hashing every shard of a large
    model would cost its load). A copy of the checkpoint elsewhere is measured anew once."""
    shards = sorted(shard for shard in directory.glob("*.safetensors") if shard.is_file())
    weights = shards[0] if shards else directory / "model.safetensors"
    others = "".join(f" {shard.name}:{shard.stat().st_size}:{shard.stat().st_mtime_ns}" for shard in shards[1:])
    return _fingerprint_mark(directory / "config.json") + _fingerprint_mark(weights) + others


def files_mark(path: Path) -> str:
    """The fingerprint of a model given as one file (a GGUF) or as a checkpoint directory."""
    return _fingerprint_mark(path) if path.is_file() else checkpoint_mark(path)


def drafter_key(spec: SpeculativeConfig) -> str:
    """How a drafter is named in cost profiles and reports. A head's name carries a
    fingerprint of its weights, so a retrained head is calibrated anew; a drafter that
    looks up the request's n-grams names sizes other than the default, whose acceptance
    differs (calibrated with (3, 2, 1), ``--ngram-sizes 1`` started from those rates)."""
    sizes = tuple(sorted(set(spec.ngram_sizes), reverse=True))
    mark_sizes = "" if sizes == DEFAULT_NGRAM_SIZES else f" n={','.join(map(str, sizes))}"
    if spec.method in ("eagle", "tree"):  # the head alone (eagle) looks up no n-grams
        mark = _fingerprint_mark(Path(spec.draft or DEFAULT_EAGLE_HEAD) / "model.safetensors")
        return (f"{spec.method}:{spec.draft or 'default'}{mark}"
                + (f" width {spec.tree_width}" if spec.tree_width > 1 else "")
                + (mark_sizes if spec.method == "tree" else ""))
    if spec.method == "medusa":
        mark = _fingerprint_mark(Path(spec.draft or DEFAULT_MEDUSA_HEADS) / "model.safetensors")
        return f"medusa:{spec.draft or 'default'}{mark}"
    if spec.method == "suffix":
        mark = _fingerprint_mark(Path(spec.draft or DEFAULT_TOKEN_STORE) / "tokens.safetensors")
        return f"suffix:{spec.draft or 'default'}{mark}{mark_sizes}"
    if spec.method == "ngram":
        return f"ngram{mark_sizes}"
    path = Path(spec.draft or "").expanduser()
    if spec.draft and path.exists():  # a draft model's files: one key by any path, a new one when they change
        return f"draft:{path.resolve()}{files_mark(path)}"
    return f"draft:{spec.draft}"  # self:L, or a name the loader resolves


def model_key(model: LoadedModel) -> str:
    """A model and how it runs (backend, weight format, dtype, and a prefill chunk shorter
    than the profile's largest size, which splits those passes): each has its own costs.
    Keyed by the checkpoint's files as well as its path: another model saved at the path
    took the costs and calibrated acceptances measured for the one before (found in review)."""
    from .cost.profile import SIZES

    describe = getattr(model.runtime, "describe", None)
    path = model.source.path
    key = f"{path.resolve()}{files_mark(path)}|{describe() if describe else type(model.runtime).__name__}"
    chunk = getattr(model.runtime, "prefill_chunk", None)
    return key + (f"|chunk {chunk}" if isinstance(chunk, int) and chunk < max(SIZES) else "")


def cost_profile(target: LoadedModel, dtype: str, drafters: dict | None = None, force: bool = False):
    """The target's cost profile on this machine (measured once, then cached)."""
    from .cost.profile import get_profile, load_profile

    if not force and load_profile(model_key(target), dtype) is None:
        log("measuring the cost profile of this model on this machine (once; cached)")
    return get_profile(model_key(target), dtype, target.runtime, drafters, force=force)


# One prompt per task type of the suite, written for calibration alone: neither the
# benchmark suite's prompts nor the drafter training set's (a head calibrated on prompts it
# was trained on would start every request too hopeful), so the adaptive-k priors come
# from a mixed workload no measurement is taken on.
CALIBRATION_PROMPTS = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping [start, end] "
    "pairs and returns them sorted.",
    "Write a four-line poem about a night train crossing a snowy valley.",
    "From the sentence 'The bakery on Mill Road, opened by Ana Ruiz in 2011, sells 300 loaves a "
    "day', extract the owner, the street and the year as a list.",
    "Return a JSON object describing a book: title 'The Quiet Harbour', author Mei Lin, year 2019, "
    "pages 312. Output only JSON.",
    "A shop sells pencils in packs of 12. A school needs 150 pencils. How many packs must it buy?",
    "Why do leaves change colour in autumn?",
    "Summarize in two sentences: The village council voted to close the main street to cars on "
    "Saturdays from May to September. Shop owners had asked for the change after a trial last "
    "year brought more visitors. Buses will be rerouted along the river road, and parking will "
    "be free at the station on those days.",
    "Complete this message by filling the brackets: 'Dear [name], your order [number] will "
    "arrive on [date]. Thank you for shopping with [shop].'",
    "Translate into French: 'The museum opens at nine and closes at six on weekdays.'",
)


def calibration_runs(target: LoadedModel, proposer, k: int = 4, max_new_tokens: int = 32) -> list:
    """Greedy generations with a fixed k on the calibration prompts (one per task type);
    their GenerationStats. Empty without a tokenizer."""
    from .config import SamplingParams

    if target.tokenizer is None:
        return []
    engine = SpeculativeEngine(target.runtime, target.tokenizer, proposer, k, target.eos_token_ids)
    # a small context keeps half for the prompt's end (found in review: at 38 positions or
    # fewer the room went to 0 or below, [-room:] kept the whole prompt, and every generate
    # on such a model failed, blaming the user's prompt)
    max_new_tokens = max(min(max_new_tokens, (target.runtime.max_positions - k - 2) // 2), 1)
    room = target.runtime.max_positions - max_new_tokens - k - 2
    if room < 1:
        return []
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [engine.generate(engine.encode(prompt)[-room:], params).stats for prompt in CALIBRATION_PROMPTS]


def calibrate_acceptance(target: LoadedModel, proposer) -> tuple[float, float] | None:
    """(first, later) acceptance of ``proposer`` over the calibration runs
    (metrics.acceptance_rates); None if none ran."""
    runs = calibration_runs(target, proposer)
    if not any(s.drafted_per_position and s.drafted_per_position[0] for s in runs):
        return None  # nothing drafted: no evidence, not "never accepted" (cached, that was a prior of 0 for good)
    return acceptance_rates(runs)


def build_policy(spec: SpeculativeConfig, target: LoadedModel, proposer, dtype: str):
    """A fixed k, or the adaptive policy ``spec.k_policy`` when ``spec.k == 'auto'``.

    The cost-aware policy gets the cost profile and, as its default priors, the drafter's
    two acceptance rates calibrated once on this target (cached in the profile)."""
    from .cost.profile import record_acceptance

    if proposer is None:
        return spec.k if isinstance(spec.k, int) else 1
    most = getattr(proposer, "max_drafts", None)  # Medusa: one draft per head
    if most is not None:
        if isinstance(spec.k, int) and spec.k > most:
            raise ConfigError(f"{spec.method} drafts at most {most} tokens a step (one per head); got k = {spec.k}")
        spec = replace(spec, k_max=min(spec.k_max, most))
    chunk = getattr(target.runtime, "prefill_chunk", None)
    if getattr(proposer, "drafts_trees", False) and isinstance(chunk, int):
        # a tree of k nodes is scored with the last token in one pass of at most one prefill
        # chunk: a larger k was cut to chunk - 1 without a word, to no drafts at chunk 1
        # (found in review)
        if chunk < 2 or (isinstance(spec.k, int) and spec.k >= chunk):
            raise ConfigError(f"{spec.method} scores its tree and the last token in one pass of at most "
                              f"--prefill-chunk {chunk} tokens: k must be below {chunk}, got {spec.k}")
        spec = replace(spec, k_max=min(spec.k_max, chunk - 1))
    if spec.k != "auto":  # priced by the cached profile, if any, for logits on demand (FixedK)
        from .cost.profile import load_profile

        lazy = getattr(target.runtime, "lazy_logits", False)
        profile = load_profile(model_key(target), dtype) if lazy else None
        return FixedK(spec.k, CostModel(profile, drafter_key(spec)) if profile is not None else None)
    if spec.k_policy == "threshold":
        return ThresholdK(start_k=min(5, spec.k_max), k_min=min(2, spec.k_max), k_max=spec.k_max)
    name = drafter_key(spec)
    profile = cost_profile(target, dtype, {name: proposer})
    if name not in profile.acceptance:
        log(f"calibrating the acceptance of {name} on {len(CALIBRATION_PROMPTS)} built-in prompts (once; cached)")
        rates = calibrate_acceptance(target, proposer)
        if rates is not None:
            profile.acceptance[name] = list(rates)
            record_acceptance(model_key(target), dtype, name, list(rates))
    first, later = profile.acceptance.get(name) or (None, None)
    costs = CostModel(profile, name)
    if getattr(proposer, "drafts_trees", False):  # a node budget per step
        prior = None
        if first is not None:  # the best chain the calibrated rates predict, as the prior rate
            conditional = [later] * (spec.k_max - 1)
            prior = best_k(first, lambda k: profile.v(k, 256), costs.c, spec.k_max,
                           tau=lambda k: tau_conditional(first, conditional, k))[1]
        return TreeBudget(costs, k_max=spec.k_max, prior_rate=prior)
    return CostAwareK(costs, k_max=spec.k_max, default_prior=first, default_later=later)


def build_engine(engine: EngineConfig, spec: SpeculativeConfig, runtime: str = "auto",
                 target: LoadedModel | None = None) -> SpeculativeEngine:
    if engine.num_threads:
        torch.set_num_threads(engine.num_threads)
    if target is None:
        target = load_target(engine, runtime)
    proposer = build_proposer(spec, target, engine)
    policy = build_policy(spec, target, proposer, engine.dtype)
    speculative = SpeculativeEngine(target.runtime, target.tokenizer, proposer, policy, target.eos_token_ids)
    speculative.drafter = drafter_key(spec) if proposer is not None else None
    speculative.threads = decode_thread_choice(engine, target)
    return speculative


def decode_thread_choice(engine_config: EngineConfig, target: LoadedModel):
    """Kernel threads for decode passes, chosen by measuring them, where --threads leaves the
    count open and the CPU kernels run: every core, or one fewer. The kernels' threads meet
    at a barrier in every layer, so a process that takes a core from one of them stalls
    them all. On a 2-core Zen 3 with another process busy on one core, a 128-token plain
    decode took 50-650 ms a token on two threads and 8 ms on one, against 5-6 ms on two with
    the machine to itself (docs/performance.md, "Another process on the machine"). Every
    core runs until two passes in a row stall; both counts are measured from then on. A row's logits
    are the same bits at any count, so the choice changes timing only."""
    cores = torch.get_num_threads()
    if engine_config.num_threads or cores < 2 or getattr(target.runtime, "kernels", None) is None:
        return None
    from .control.threads import ThreadChoice
    from .cost.profile import load_profile

    profile = load_profile(model_key(target), engine_config.dtype)  # cached only: never measured here
    predict = None if profile is None else (lambda rows, width, context: profile.time_ms(width, context))
    return ThreadChoice((cores, cores - 1), predict, log=log, look_when_stalled=True)


def log(message: str) -> None:
    print(f"specdecode: {message}", file=sys.stderr, flush=True)
