"""Shared fixtures: tiny randomly initialised checkpoints saved as Hugging Face dirs."""

from __future__ import annotations

import os

import pytest
import torch

TINY_VOCAB = 97


def save_tiny_model(path, model_type: str = "llama", seed: int = 0, vocab_size: int = TINY_VOCAB,
                    num_layers: int = 2, hidden_size: int = 64, init_std: float = 0.2, num_heads: int = 4,
                    num_kv_heads: int = 2):
    """Build a tiny random causal LM with transformers and save it as a checkpoint dir.

    A large ``init_std`` spreads the logits, so greedy argmax has clear winners and
    fp32 equality tests are not decided by rounding noise between batched and single-token
    matrix products.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        initializer_range=init_std,
        tie_word_embeddings=(model_type == "llama"),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        sliding_window=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    """A second, differently seeded model with the same vocabulary: a (bad) draft model."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=1, num_layers=1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Unit tests never write to the user's cache; the slow tests share one conversion.
    Session-wide, so that module fixtures (a served app measuring its cost profile) see it
    too: a function-scoped one was set only after them."""
    with pytest.MonkeyPatch.context() as patch:
        if "SPECDECODE_CACHE" not in os.environ:
            patch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


def save_char_tokenizer(path):
    """A 97-token character tokenizer (3 specials + the 94 printable ASCII characters),
    so tiny models can be driven by text: stop strings, chat-less prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(c): 3 + i for i, c in enumerate(range(33, 127))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-text"), "llama", seed=7)
    save_char_tokenizer(path)
    return path


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}assistant:"


def save_chat_model(path, seed: int, num_layers: int = 2):
    """A tiny random Llama with the character tokenizer and a plain chat template: what
    the server's tests serve."""
    save_tiny_model(path, "llama", seed=seed, num_layers=num_layers)
    tokenizer = save_char_tokenizer(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def tiny_server_state(model_dir, speculative: str, **kwargs):
    """The server's state for a tiny model on the torch backend in fp32, named 'tiny'."""
    from specdecode.config import EngineConfig
    from specdecode.factory import load_model
    from specdecode.serve.server import build_state

    config = EngineConfig(model=str(model_dir), dtype="fp32", backend="torch")
    target = load_model(str(model_dir), torch.float32, backend="torch")
    return build_state(config, speculative, target=target, served_model_name="tiny", **kwargs)


def pooled_chisquare(observed: torch.Tensor, expected: torch.Tensor, minimum: float = 5.0) -> float:
    """Chi-square p-value of counts against expected counts over the cells the expectation
    allows (expected > 0), the cells expected fewer than ``minimum`` times pooled into one
    (the test's approximation needs about 5 per cell)."""
    from scipy.stats import chisquare

    support = expected > 0
    observed, expected = observed[support].double(), expected[support].double()
    small = expected < minimum
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chisquare(observed.numpy(), expected.numpy())[1])
