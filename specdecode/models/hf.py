"""Adapter over transformers' AutoModelForCausalLM, for architectures without a native runtime.

Same interface as ``NativeRuntime`` (reset / forward / rollback / length), chain drafts
only: transformers' cache cannot take an arbitrary tree mask over new tokens. Rollback
crops the DynamicCache.
"""

from __future__ import annotations

import inspect

import torch

from ..config import SpecDecodeError
from . import device_label


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "context_length", "seq_length")


class HFRuntime:
    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        config = model.config
        parameters = inspect.signature(model.forward).parameters
        if "past_key_values" not in parameters:
            # Mamba keeps its state in cache_params, RWKV in state, GPT-1 keeps none: the cache
            # handed over went into **kwargs, and every pass saw only its own tokens (found in
            # review: plain greedy output silently wrong from the first token)
            raise SpecDecodeError(f"{config.model_type} takes no past_key_values cache, which the transformers "
                                  "adapter decodes with; it cannot run here")
        self.takes_positions = "position_ids" in parameters
        # multimodal configs (Gemma 3, Llama 4, Mllama) keep these in their text config
        # (found in review: an AttributeError traceback on vocab_size)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None)
        if not isinstance(self.vocab_size, int):
            raise SpecDecodeError(f"{config.model_type}'s config names no vocabulary size")
        # the first context key set, from the text config (found in review: MPT's max_seq_len
        # was not read, and a long prompt failed inside transformers)
        self.max_positions = next((value for key in CONTEXT_KEYS for where in (text, config)
                                   if isinstance(value := getattr(where, key, None), int) and value > 0), 2048)
        # a recurrent layer (Mamba's in a hybrid, Qwen3-Next's linear attention) cannot be cut
        # back past rejected drafts: known here, a speculative engine refuses it at once
        self.rolls_back = self._cache_croppable()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.backend, self.weight_format, self.exact = "transformers", str(self.dtype).removeprefix("torch."), False
        self.cache = None
        self.length = 0
        self.capacity = 0

    def _cache_croppable(self) -> bool:
        from transformers import DynamicCache

        try:
            return bool(getattr(DynamicCache(config=self.model.config), "is_croppable", True))
        except Exception:  # noqa: BLE001 - a config transformers builds no cache from: rollback says later
            return True

    def reset(self, capacity: int, batch: int = 1) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        # a sliding-window layer keeps only its window, and refused to crop back past it (a
        # rejected draft) once the sequence was longer: keep the past so rollback can cut it
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.capacity = min(capacity, self.max_positions)
        self.length = 0

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}; cache holds {self.length}")
        if length < self.length:
            # a recurrent state (Mamba, Qwen3-Next's linear attention) cannot be cut back:
            # transformers' crop left the rejected drafts in it (greedy output differed from
            # plain decoding, silently) or failed inside with a TypeError (found in review)
            if not getattr(self.cache, "is_croppable", True):
                raise SpecDecodeError(f"{self.model.config.model_type} keeps a recurrent state that cannot be rolled "
                                      "back past rejected drafts: speculative decoding cannot run on it "
                                      "(use --method none)")
            self.cache.crop(length - self.length)  # transformers 5: negative = tokens to drop
        self.length = length

    @torch.inference_mode()
    def forward(self, input_ids, positions=None, tree_mask=None, last_only=False, return_hidden=False):
        if tree_mask is not None or positions is not None:
            raise SpecDecodeError("the transformers adapter supports chain drafts only (no token trees)")
        num_new = input_ids.shape[1]
        if self.length + num_new > self.capacity:
            raise SpecDecodeError(f"sequence of {self.length + num_new} tokens exceeds the context {self.capacity}")
        # the positions, as generate() passes them: a model that does not derive them from
        # the cache (Bamba) put every step at 0 without them (found in review)
        extra = ({"position_ids": torch.arange(self.length, self.length + num_new, device=self.device)[None]}
                 if self.takes_positions else {})
        out = self.model(
            input_ids=input_ids.to(self.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=return_hidden,
            logits_to_keep=1 if last_only else 0,
            **extra,
        )
        self.length += num_new
        if return_hidden:
            hidden = out.hidden_states[-1][:, -1:] if last_only else out.hidden_states[-1]
            return out.logits, hidden
        return out.logits

    __call__ = forward

    def describe(self) -> str:
        """How it runs; it keys the cost profile (``device_label``)."""
        return f"transformers{device_label(self.device)}, {self.weight_format}"


def load_hf(model_dir, dtype: torch.dtype, device: str = "cpu") -> HFRuntime:
    from transformers import AutoModelForCausalLM

    from .loading import ModelNotFoundError, checkpoint_problems

    try:  # found in review: a config.json without a known model_type ended in a ValueError traceback
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    except Exception as error:  # transformers' errors name the problem; the traceback does not help
        raise ModelNotFoundError(f"model {str(model_dir)!r}: transformers cannot load it "
                                 f"({type(error).__name__}: {str(error)[:300]})") from None
    # transformers initialises a missing tensor at random and drops an unexpected one, with a
    # line on stderr: the logits are then wrong (found in review: a checkpoint whose config
    # had lost its attention bias loaded and differed by 6.9 in a logit). Refused by name.
    problems = checkpoint_problems(info)
    if problems:
        raise ModelNotFoundError(f"model {str(model_dir)!r}: its checkpoint does not match its config "
                                 f"({'; '.join(problems)})")
    return HFRuntime(model.to(device))
