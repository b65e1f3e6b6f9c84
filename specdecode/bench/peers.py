"""Other engines run beside ours in ``specdecode bench``, on the same prompt token ids, the
same output budget and EOS ids, greedy, prefill included in their time.

- ``hf``: transformers ``generate()`` on the same checkpoint, in fp32 (its reference
  precision; bf16 matrix products are emulated on CPUs without bf16 units).
- ``llamacpp``: llama.cpp through llama-cpp-python (``make peers``), on the same GGUF file,
  with as many threads as torch uses. Its KV cache is reset before every request, so no
  prefill is reused between runs.
"""

from __future__ import annotations

import time

import torch

from ..config import SpecDecodeError

PEERS = ("hf", "llamacpp")

LLAMACPP_INSTALL = (
    "bench method 'llamacpp' needs llama-cpp-python: run `make peers`, or "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_OPENMP=OFF' pip install 'specdecode[peers]'"
)


class HFPeer:
    label = "transformers generate(), fp32"

    def __init__(self, model_dir, eos_ids: tuple[int, ...], device: torch.device | str = "cpu",
                 max_positions: int | None = None):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        # the checkpoint's generation_config.json (a repetition penalty, say) would be merged
        # into every call's own config: the peer decodes from transformers' defaults alone
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()
        self.eos_ids = eos_ids
        # our engine stops at the model's positions: so does the peer (found in review: it
        # decoded past them, 40 tokens against 10, read as a divergence)
        self.max_positions = max_positions
        if self.device.type != "cpu":
            self.label = f"transformers generate(), fp32, {self.device.type}"

    def greedy(self, max_new_tokens: int):
        """Plain greedy decoding, whatever the checkpoint's generation_config.json says (a
        repetition penalty there applied even with do_sample=False; found in review): argmax
        of the raw logits, stopping at our EOS ids alone, as our engine decodes."""
        from transformers import GenerationConfig

        eos = self.eos_ids
        return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos) or None,
                                pad_token_id=eos[0] if eos else 0)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        eos = self.eos_ids
        if self.max_positions is not None:
            max_new_tokens = max(min(max_new_tokens, self.max_positions - len(prompt_ids)), 0)
        if max_new_tokens == 0:
            return [], 0.0
        ids = torch.tensor([prompt_ids], device=self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            # every prompt token attended: without a mask transformers reads the pad id (0
            # where the model names no EOS) as padding and masked those prompt tokens out
            output = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                         generation_config=self.greedy(max_new_tokens))
            new = output[0, len(prompt_ids):].tolist()  # waits for the device
        seconds = time.perf_counter() - started
        while new and new[-1] in eos:
            new.pop()
        return new, seconds


class LlamaCppPeer:
    label = "llama.cpp (llama-cpp-python), same GGUF"

    def __init__(self, gguf_path, context: int, eos_ids: tuple[int, ...], threads: int | None = None):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SpecDecodeError(LLAMACPP_INSTALL) from None
        if gguf_path is None:
            raise SpecDecodeError("bench method 'llamacpp' runs a GGUF model; this model is a checkpoint directory")
        threads = threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf_path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.eos_ids = set(eos_ids)
        self.context = min(context, self.llm.n_ctx())  # its buffers hold the context asked for
        self.version = getattr(__import__("llama_cpp"), "__version__", "?")

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        started = time.perf_counter()
        self.llm.reset()  # no prefix of an earlier request is reused
        new: list[int] = []
        # at the end of the context it stops, as our engine does ("length"); llama_decode
        # would fail there instead (found in review)
        max_new_tokens = min(max_new_tokens, self.context - len(prompt_ids))
        if max_new_tokens > 0:
            for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                           reset=True):
                if token in self.eos_ids:
                    break
                new.append(token)
                if len(new) >= max_new_tokens:
                    break
        return new, time.perf_counter() - started


def build_peer(name: str, target, context: int):
    """The peer for bench method ``name`` over the loaded target model."""
    if name == "hf":
        return HFPeer(target.source.path, target.eos_token_ids, target.runtime.device, target.runtime.max_positions)
    if name == "llamacpp":
        return LlamaCppPeer(target.source.gguf, context, target.eos_token_ids)
    raise SpecDecodeError(f"unknown peer {name!r}; choose from {PEERS}")
