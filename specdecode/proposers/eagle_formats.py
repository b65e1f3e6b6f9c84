"""EAGLE-3 heads in the layouts other engines load: export, and import back.

Two layouts besides ours (``config.json`` with ``"architecture": "specdecode-eagle3"``):

- ``eagle3``: the original EAGLE-3 checkpoint, which vLLM's ``eagle3`` method loads
  (``Eagle3LlamaForCausalLM``): a Llama config with ``num_hidden_layers`` 1,
  ``draft_vocab_size`` and ``architectures: ["LlamaForCausalLMEagle3"]``; tensors
  ``midlayer.*`` (the decoder layer, its q/k/v reading 2H), ``fc``, ``norm``,
  ``lm_head`` [N, H], and the vocabulary maps ``d2t`` (int64 [N], an *offset*: target id =
  draft id + d2t[draft id]) and ``t2d`` (bool [V], the target ids the head can draft). No
  token embedding: the target's is shared, as ours does.
- ``speculators``: the speculators library's ``Eagle3Speculator`` (vLLM reads it too):
  the decoder layer under ``layers.0.*``, the Llama sizes under ``transformer_layer_config``,
  ``speculators_config`` naming the verifier (the target) and a greedy proposal method,
  and ``embed_tokens.weight`` (the target's, frozen) when exported with the target.

Both read the target's residual stream entering the layers ``eagle_aux_hidden_state_layer_ids``
(vLLM's convention and ours), and both put the fused feature, not its norm, on the
residual path (``norm_before_residual: false``); a checkpoint that says otherwise (or uses
the speculators variants ``norm_before_fc``, ``fc_norm``, ``norm_output``) is refused, since
this head does not compute it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import SpecDecodeError, is_count
from ..models.llama import rope_config
from ..models.loading import shared_mode

FORMATS = ("eagle3", "speculators")

# our parameter -> the decoder layer's name in the Llama layout (under midlayer. or layers.0.)
LAYER_NAMES = {
    "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
    "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight", "input_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight", "post_norm.weight": "post_attention_layernorm.weight",
}
OUTER_NAMES = ("fc.weight", "norm.weight", "lm_head.weight")
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def detect(raw: dict) -> str:
    """Which layout a head's config.json is: "specdecode", "eagle3" or "speculators"."""
    if raw.get("architecture") == "specdecode-eagle3":
        return "specdecode"
    if raw.get("architecture") == "specdecode-medusa":
        raise SpecDecodeError("config.json holds Medusa heads, not an EAGLE head: use them with --method medusa")
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise SpecDecodeError(f"a speculators {raw['speculators_model_type']!r} checkpoint is not an EAGLE-3 head")
        return "speculators"
    if "draft_vocab_size" in raw or any("Eagle3" in a for a in raw.get("architectures") or []):
        return "eagle3"
    raise SpecDecodeError("config.json is not an EAGLE-3 head (ours, vLLM/EAGLE's eagle3 or speculators')")


def _llama_config(config) -> dict:
    return {"model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "num_hidden_layers": 1, "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta, "hidden_act": "silu", "vocab_size": config.target_vocab_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


def export_head(head, out: Path, fmt: str, verifier: str | None = None, max_positions: int | None = None,
                embed: torch.Tensor | None = None, speculative_tokens: int = 3,
                verifier_architectures: list[str] | None = None) -> list[Path]:
    """Write ``head`` to ``out`` in layout ``fmt``; returns the files written. ``verifier``:
    the target's name or path, and ``verifier_architectures`` its config's architectures
    (speculators names both); ``embed`` [V, H]: the target's token embedding, stored by
    the speculators layout. A head imported with an embedding of its own
    (``stored_embedding``) is written with that one, in either layout."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise SpecDecodeError(f"unknown head format {fmt!r}; one of {FORMATS}")
    c = head.config
    state = {k: v.detach() for k, v in head.state_dict().items()}
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    tensors = {prefix + LAYER_NAMES[name]: state[name] for name in LAYER_NAMES}
    tensors |= {name: state[name] for name in OUTER_NAMES}
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    d2t = head.d2t.to(torch.int64)
    tensors["d2t"] = (d2t - torch.arange(c.draft_vocab_size)).contiguous()
    t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    layers = list(c.capture_layers)
    if layers != sorted(set(layers)):  # vLLM gathers each layer once, in ascending order
        raise SpecDecodeError(f"this head reads the target's layers {layers}; vLLM and speculators read each layer "
                              "once, in ascending order, so they would feed it other features (a target of "
                              "fewer than 7 layers: train the head for one of 7 or more, or keep our layout)")
    llama = _llama_config(c) | ({"max_position_embeddings": max_positions} if max_positions else {})
    # a head imported with an embedding of its own drafts with it: written in either layout,
    # in place of the target's (found in review: re-exported, it became the target's, or none)
    own = getattr(head, "stored_embedding", None)
    if own is not None:
        embed = own
    written = own if fmt == "eagle3" else embed  # eagle3 stores only a head's own embedding
    if written is not None and tuple(written.shape) != (c.target_vocab_size, c.hidden_size):
        raise SpecDecodeError(f"{'the head' if own is not None else 'target'} embedding {tuple(written.shape)} does "
                              f"not fit the head ({c.target_vocab_size} x {c.hidden_size})")
    if fmt == "eagle3":
        if own is not None:
            tensors["embed_tokens.weight"] = own.to(torch.bfloat16).contiguous()
        config = {"architectures": ["LlamaForCausalLMEagle3"], **llama, "draft_vocab_size": c.draft_vocab_size,
                  "target_hidden_size": c.hidden_size, "eagle_aux_hidden_state_layer_ids": layers,
                  "norm_before_residual": False, "torch_dtype": "bfloat16"}
    else:
        if not verifier:  # vLLM would serve a target named "", speculators fail to load it
            raise SpecDecodeError("the speculators layout names its verifier (the target's name or path): "
                                  "pass verifier=")
        if embed is not None:
            # in the target checkpoint's own dtype: vLLM shares the target's embedding only
            # where the stored one equals it, else drafts with the stored copy (found in
            # review: a bf16 copy of an fp32 target's embedding drafted other tokens at near-ties)
            tensors["embed_tokens.weight"] = embed.contiguous()
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": False, "norm_before_fc": False,
            "fc_norm": False, "norm_output": False, "target_hidden_size": c.hidden_size,
            "eagle_aux_hidden_state_layer_ids": layers, "embed_requires_grad": False, "torch_dtype": "bfloat16",
            "transformer_layer_config": llama,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier,
                             "architectures": verifier_architectures or ["LlamaForCausalLM"]},
            },
        }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shared_mode(out / "model.safetensors", 0o666)  # safetensors writes 0600
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / "config.json", out / "model.safetensors"]


def import_head(directory: Path, raw: dict, fmt: str, target_layers: int | None = None):
    """An EagleHead from a directory in layout ``fmt`` ("eagle3" or "speculators").
    ``target_layers``: the target's layer count, for checkpoints that do not name the
    layers they read (the EAGLE-3 default 2, L/2, L-3 is taken then)."""
    from .eagle_head import EagleConfig, EagleHead, capture_layers

    llama = raw.get("transformer_layer_config", {}) if fmt == "speculators" else raw
    if fmt == "speculators" and "norm_before_residual" not in raw:
        # vLLM reads a speculators config without it as true, the speculators library as
        # false: the two draft differently from the same file (found in review: it loaded as false)
        raise SpecDecodeError(f"{directory}: the speculators config does not say norm_before_residual; vLLM reads "
                              "that as true and the speculators library as false, so which head it is is "
                              "ambiguous: set it in config.json")
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag, llama.get(flag, False)):
            raise SpecDecodeError(f"{directory}: {flag} = true is a variant this head does not compute")
    if llama.get("num_hidden_layers", 1) != 1:
        raise SpecDecodeError(f"{directory}: {llama['num_hidden_layers']} decoder layers; heads with one are supported")
    # RoPE as the target loader reads it: transformers 5 writes rope_parameters (theta inside);
    # a non-empty rope_scaling comes first (found in a mutation audit: a linear rope_scaling
    # beside a default rope_parameters loaded as default RoPE, where the target reads it linear)
    try:
        rope = rope_config(llama)[1]
    except SpecDecodeError as error:  # it says "config.json": the head's, not the target's
        raise SpecDecodeError(f"{directory}/{error}") from None
    rope_theta = rope.get("rope_theta", llama.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpecDecodeError(f"{directory}: RoPE scaling {rope!r} is not supported by EAGLE heads here")
    if raw.get("embed_requires_grad"):  # its own trained embedding; this head drafts with the target's
        raise SpecDecodeError(f"{directory}: embed_requires_grad = true (a head trained with its own token "
                              "embedding) is a variant this head does not compute: it shares the target's")
    # vLLM reads the layers from the top level, then from eagle_config (as some checkpoints keep them)
    layers = (raw.get("eagle_aux_hidden_state_layer_ids") or llama.get("eagle_aux_hidden_state_layer_ids")
              or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if layers is None:
        if target_layers is None:
            raise SpecDecodeError(f"{directory} does not name the target layers it reads; load it for a target")
        layers = capture_layers(target_layers)  # as this head was made for such a target
    try:
        layers = [int(i) for i in layers]
    except (TypeError, ValueError):
        raise SpecDecodeError(f"{directory}: the target layers it reads must be integers, got {layers!r}") from None
    if len(set(layers)) != len(layers):
        raise SpecDecodeError(f"{directory}: it names target layer(s) twice: {layers}")
    # vLLM hands the head the layers' states in ascending order, whatever order the config
    # lists: read in the listed order, a head listing [2, 0, 1] drafted from another
    # concatenation than it does in vLLM (found in review)
    layers = sorted(layers)
    try:
        hidden, heads = llama["hidden_size"], llama["num_attention_heads"]
        config = EagleConfig(hidden, llama["intermediate_size"], heads, llama.get("num_key_value_heads", heads),
                             llama.get("head_dim") or hidden // heads, llama.get("rms_norm_eps", 1e-6),
                             float(rope_theta), llama["vocab_size"],
                             llama["vocab_size"] if raw.get("draft_vocab_size") is None else raw["draft_vocab_size"],
                             tuple(int(i) for i in layers))
    except KeyError as missing:
        raise SpecDecodeError(f"{directory}/config.json lacks {missing}") from None
    check_sizes(config, directory)
    if raw.get("target_hidden_size") not in (None, config.hidden_size):
        raise SpecDecodeError(f"{directory}: target hidden size {raw['target_hidden_size']} differs from the "
                              f"head's {config.hidden_size}; not supported")
    tensors = read_tensors(Path(directory) / "model.safetensors")
    prefix = next((p for p in ("midlayer.", "layers.0.") if p + "self_attn.q_proj.weight" in tensors), None)
    if prefix is None:
        raise SpecDecodeError(f"{directory}/model.safetensors has no decoder layer (midlayer.* or layers.0.*)")
    names = {ours: prefix + theirs for ours, theirs in LAYER_NAMES.items()} | {n: n for n in OUTER_NAMES}
    missing = [theirs for theirs in names.values() if theirs not in tensors]
    if missing:
        raise SpecDecodeError(f"{directory}/model.safetensors lacks {missing}")
    # the vocabulary maps are read below; an embedding is the target's (frozen: refused
    # above otherwise) and the target's own is used; any other tensor is a part of a
    # variant this head does not compute
    unknown = sorted(set(tensors) - set(names.values()) - {"d2t", "t2d", "embed_tokens.weight"})
    if unknown:
        raise SpecDecodeError(f"{directory}/model.safetensors holds {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, "
                              "which this EAGLE head does not compute; loading it would draft from a different model")
    head = EagleHead(config)
    # a head's own embedding, where it stores one: vLLM drafts with it when it is not the
    # target's (``factory.eagle_proposer`` does the same); it was dropped (found in review)
    head.stored_embedding = tensors["embed_tokens.weight"].float() if "embed_tokens.weight" in tensors else None
    state = {ours: tensors[theirs].float() for ours, theirs in names.items()}
    offsets = tensors.get("d2t")
    if offsets is None and config.draft_vocab_size != config.target_vocab_size:
        # vLLM reads a missing map as the first N ids; a head trained on a reduced vocabulary
        # then loads and drafts other tokens than it learnt (found in review)
        raise SpecDecodeError(f"{directory}/model.safetensors has no d2t map, but its draft vocabulary "
                              f"({config.draft_vocab_size} tokens) is smaller than the target's "
                              f"({config.target_vocab_size}): which target token each draft id stands for is unknown")
    if offsets is not None and tuple(offsets.shape) != (config.draft_vocab_size,):
        # (found in a mutation audit: a RuntimeError from torch's broadcasting)
        raise SpecDecodeError(f"{directory}/model.safetensors: its d2t map has shape {tuple(offsets.shape)}, "
                              f"expected ({config.draft_vocab_size},) for a draft vocabulary of that size")
    state["d2t"] = torch.arange(config.draft_vocab_size) + (0 if offsets is None else offsets.to(torch.int64))
    load_checked(head, state, directory)
    t2d = tensors.get("t2d")
    if t2d is not None:
        expected = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        expected[head.d2t] = True
        if t2d.shape != expected.shape or not torch.equal(t2d.bool(), expected):
            raise SpecDecodeError(f"{directory}: its t2d (the target ids it drafts) disagrees with its d2t")
    return head.eval()


SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "target_vocab_size",
               "draft_vocab_size")


def check_sizes(config, directory) -> None:
    """A head config's sizes are whole numbers >= 1, or an error naming the field (a
    draft_vocab_size given as a string failed deep in torch; found in review)."""
    for name in SIZE_FIELDS:
        value = getattr(config, name)
        if not is_count(value) or value < 1:
            raise SpecDecodeError(f"{directory}/config.json: {name} must be an integer >= 1, got {value!r}")


def read_tensors(path: Path) -> dict:
    """A head's safetensors file, or an error naming it. Weights that are NaN or infinite are
    refused by tensor (found in review: a head of NaNs loaded, `check` called it compatible,
    and it drafted nothing that was ever accepted, without a word)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors' own error type: a truncated or corrupt file
        raise SpecDecodeError(f"{path} is not a readable safetensors file ({error})") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SpecDecodeError(f"{path}: tensor {name!r} holds NaN or infinite values; the head is damaged "
                                  "(train or copy it again)")
    return tensors


def load_checked(head, state: dict, directory: Path) -> None:
    """``state`` into ``head``, every tensor used and of its shape, and a draft vocabulary of
    distinct ids inside the target's (else an error naming the head; a d2t outside the
    vocabulary failed only when drafting)."""
    try:
        head.load_state_dict(state)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise SpecDecodeError(f"{directory}: tensors do not fit the config: {' '.join(lines[1:3]) or lines[0]}") from None
    d2t, c = head.d2t, head.config
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= c.target_vocab_size):
        raise SpecDecodeError(f"{directory}: its draft vocabulary maps to target ids outside [0, {c.target_vocab_size})")
    if d2t.unique().numel() != d2t.numel():
        raise SpecDecodeError(f"{directory}: its draft vocabulary names a target id twice")
