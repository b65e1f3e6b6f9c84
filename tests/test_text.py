"""The incremental detokenizer: the same text as a full decode, stop strings on the token
that completes them (across token and character boundaries), special-token stops."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdecode.text import TextTracker

SAMPLES = ["plain ascii text", "caf\u00e9 cr\u00e8me", "price: 5\u20ac each", "emoji \U0001F600 here", "\u4e2d\u6587 mixed",
           "\u20ac\u20ac\u20ac", "a\u00e9\U0001F600\u4e2d"]


def byte_level_tokenizer(merges=()):
    """Every byte one token (GPT-2's byte-to-unicode alphabet): multi-byte characters span
    2-4 tokens, as in SmolLM2's byte-level BPE; ``merges``: pairs also made one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<|end|>": 1}
    vocab.update({ch: i + 2 for i, ch in enumerate(sorted(alphabet))})
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    backend = Tokenizer(models.BPE(vocab, list(merges), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    return tokenizer


def byte_fallback_tokenizer():
    """A Llama-style tokenizer: ASCII characters are tokens, anything else falls back to
    <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<|end|>": 1}
    vocab.update({f"<0x{b:02X}>": 2 + b for b in range(256)})
    vocab.update({chr(c): 258 + i for i, c in enumerate(range(32, 127))})
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    return tokenizer


TOKENIZERS = {"byte_level": byte_level_tokenizer, "byte_fallback": byte_fallback_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def encode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # the tokenizer round-trips the sample
    return ids


def test_incremental_text_equals_a_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        text = "".join(rng.choice(SAMPLES) for _ in range(3))
        ids = encode(tokenizer, text)
        tracker = TextTracker(tokenizer)
        streamed = []
        for token in ids:
            assert not tracker.add(token)
            streamed.append(tracker.delta())
            assert "\ufffd" not in streamed[-1]  # never half a character
        streamed.append(tracker.delta(final=True))
        assert tracker.text == text and "".join(streamed) == text


def test_a_truncated_character_shows_as_a_full_decode_does(tokenizer):
    ids = encode(tokenizer, "ok \u20ac")[:-1]  # the euro sign's last byte never comes
    tracker = TextTracker(tokenizer)
    for token in ids:
        tracker.add(token)
    assert tracker.text == "ok "
    assert tracker.delta(final=True) == tokenizer.decode(ids)


@pytest.mark.parametrize("text, stop", [("ab\u20acxcd", "\u20acx"), ("hello world", "o w"), ("x\U0001F600y", "\U0001F600"),
                                        ("caf\u00e9!", "\u00e9!")])
def test_stop_is_found_on_the_token_that_completes_it(tokenizer, text, stop):
    ids = encode(tokenizer, text)
    completes = len(encode(tokenizer, text[: text.find(stop) + len(stop)]))  # tokens up to the stop's end
    tracker = TextTracker(tokenizer, (stop,))
    hits = [index for index, token in enumerate(ids, 1) if tracker.add(token)]
    assert hits and hits[0] == completes
    assert tracker.text == text[: text.find(stop)]


def test_stop_completed_by_the_last_token_of_the_budget(tokenizer):
    ids = encode(tokenizer, "the end\u20ac")
    tracker = TextTracker(tokenizer, ("end\u20ac",))
    assert [tracker.add(token) for token in ids][-1] is True
    assert tracker.text == "the "


def test_a_tokenizer_that_cleans_up_spaces_loses_no_text():
    """Found in review: with clean_up_tokenization_spaces (Llama 3's tokenizers), decoding
    more tokens could give shorter text (" ." -> "."), and the tracker dropped those pieces:
    "Hi , you . I do n't" came out as "Hi  you  I do n't". Pieces decode without it."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(32, 127))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    cleaning = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>",
                                       clean_up_tokenization_spaces=True)
    text = "Hi , you . I do n't know ! x"
    ids = cleaning(text, add_special_tokens=False)["input_ids"]
    tracker = TextTracker(cleaning)
    for token in ids:
        tracker.add(token)
    tracker.finish()
    assert tracker.text == text
    stopped = TextTracker(cleaning, ("you .",))
    assert any(stopped.add(token) for token in ids) and stopped.text == "Hi , "


def test_a_special_token_stop_string_matches_its_token(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    ids = encode(tokenizer, "answer") + [end] + encode(tokenizer, "more")
    tracker = TextTracker(tokenizer, ("<|end|>",))
    hits = [index for index, token in enumerate(ids) if tracker.add(token)]
    assert hits[0] == len(encode(tokenizer, "answer")) and tracker.text == "answer"
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "ok<|end|>more"]  # the same characters, ordinary tokens
    tracker = TextTracker(tokenizer, ("<|end|>",))
    hits = [index for index, token in enumerate(spelled) if tracker.add(token)]
    assert hits[0] == len("ok<|end|>") - 1 and tracker.text == "ok"


def test_a_special_token_stop_keeps_the_text_before_it_as_an_eos_would(tokenizer):
    """The kept tokens end inside a character: their text shows as a full decode shows it,
    as when an EOS ends the output there (found in review: the pending text was dropped)."""
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    kept = encode(tokenizer, "Hi \u00e9")[:-1]  # the first byte of the accented character
    tracker = TextTracker(tokenizer, ("<|end|>",))
    assert [tracker.add(token) for token in kept + [end]][-1]
    assert tracker.text == tokenizer.decode(kept) == "Hi \ufffd" and tracker.stop_reason == "<|end|>"


def test_a_prompt_ending_inside_a_character_loses_no_new_text(tokenizer):
    """A prompt given as token ids that ends within a character (a continuation of an
    output cut at max_tokens): the bytes that complete it are not shown, and nothing after
    them is lost. Found in review: a byte-fallback decoder shows each pending byte as a
    replacement character, and two characters of the new text were dropped, with a stop in
    them."""
    ids = encode(tokenizer, "ok \U0001F600abc")
    cut = len(encode(tokenizer, "ok ")) + (3 if len(ids) > 6 else 0)  # 3 of the emoji's 4 bytes
    assert cut < len(ids) - 3
    tracker = TextTracker(tokenizer, context=ids[:cut])
    for token in ids[cut:]:
        tracker.add(token)
    assert tracker.text + tracker.delta(final=True)[len(tracker.text):] == "abc"
    stopped = TextTracker(tokenizer, ("ab",), context=ids[:cut])
    hits = [index for index, token in enumerate(ids[cut:]) if stopped.add(token)]
    assert hits[0] == len(ids) - cut - 2 and stopped.text == ""


def test_a_stop_is_found_on_a_token_that_also_starts_a_character():
    """A token holding the stop's last character and the first byte of the next character
    (SmolLM2 has about 40 such, " \xc3"): the stop is found on it, not one token later."""
    tokenizer = byte_level_tokenizer(merges=[("\u0120", "\u00c3")])  # GPT-2's space, byte 0xC3
    ids = encode(tokenizer, "Q: \u00f1o")
    assert len(ids) == 5  # "Q", ":", " \xc3", "\xb1", "o"
    tracker = TextTracker(tokenizer, ("Q: ",))
    hits = [index for index, token in enumerate(ids) if tracker.add(token)]
    assert hits[0] == 2 and tracker.text == ""


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    tracker = TextTracker(tokenizer, ("STOP",))
    pieces = []
    for token in encode(tokenizer, "go ST"):
        tracker.add(token)
        pieces.append(tracker.delta())
    assert "".join(pieces) == "go "  # "ST" may become "STOP"
    for token in encode(tokenizer, "ART"):
        tracker.add(token)
        pieces.append(tracker.delta())
    assert "".join(pieces) + tracker.delta(final=True) == "go START"
    # every prefix up to one character short of the stop is held back (a mutation audit:
    # holding back two characters at most passed the "ST" above)
    tracker, pieces = TextTracker(tokenizer, ("STOP",)), []
    for token in encode(tokenizer, "go STO"):
        tracker.add(token)
        pieces.append(tracker.delta())
    assert "".join(pieces) == "go "


def test_of_two_stops_the_one_that_starts_first_cuts_the_text():
    """One token completes two stop strings: the text ends where the earlier one starts,
    and that one is the stop reason, whatever the order they were listed in (a mutation
    audit: the first listed passed the tests)."""
    tokenizer = byte_level_tokenizer(merges=[("b", "c")])
    ids = encode(tokenizer, "abc")
    assert len(ids) == 2  # "a", "bc": the second token completes both stops
    tracker = TextTracker(tokenizer, ("c", "b"))
    assert [tracker.add(token) for token in ids] == [False, True]
    assert tracker.text == "a" and tracker.stop_reason == "b"


def sentencepiece_word_tokenizer():
    """Words with SentencePiece's "\u2581" space marker and the decoder of Llama 2 /
    Mistral's tokenizer.json, which strips the leading space of what it decodes."""
    words = ["The", "capital", "of", "France", "is", "Paris", "and", "Berlin"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({"\u2581" + word: 3 + i for i, word in enumerate(words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    return tokenizer, lambda text: [vocab["\u2581" + word] for word in text.split()]


def test_the_first_new_word_keeps_its_leading_space_after_the_prompt():
    """Decoded after the prompt's last tokens, as vLLM does: alone, the first token's space
    was stripped ("isParis"), and a stop string starting with it could not match."""
    tokenizer, ids = sentencepiece_word_tokenizer()
    prompt, new = ids("The capital of France is"), ids("Paris and Berlin")
    tracker = TextTracker(tokenizer, context=prompt)
    pieces = []
    for token in new:
        tracker.add(token)
        pieces.append(tracker.delta())
    pieces.append(tracker.delta(final=True))
    assert "".join(pieces) == " Paris and Berlin" == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)):]
    stopped = TextTracker(tokenizer, (" Paris",), context=prompt)
    assert stopped.add(new[0]) and stopped.text == ""


def test_a_step_of_several_tokens_gives_the_text_one_at_a_time_gives():
    """A speculative step commits several tokens with one decode (``add_many``): every
    step's delta and the final text are those of adding its tokens one by one, for any
    split into steps (characters split across steps, words after the prompt)."""
    rng = random.Random(1)
    cases = []
    for name in sorted(TOKENIZERS):
        tokenizer = TOKENIZERS[name]()
        for _ in range(10):
            text = "".join(rng.choice(SAMPLES) for _ in range(3))
            cases.append((tokenizer, encode(tokenizer, "a caf\u00e9 "), encode(tokenizer, text)))
    words, ids = sentencepiece_word_tokenizer()
    cases.append((words, ids("The capital of France is"), ids("Paris and Berlin and Paris")))
    for tokenizer, prompt, new in cases:
        one, many = TextTracker(tokenizer, context=prompt), TextTracker(tokenizer, context=prompt)
        at = 0
        while at < len(new):
            step = new[at:at + rng.randint(1, 5)]
            at += len(step)
            for token in step:
                assert not one.add(token)
            many.add_many(step)
            assert many.delta() == one.delta()
        assert many.delta(final=True) == one.delta(final=True)
        assert many.text == one.text == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)):]
    with pytest.raises(ValueError, match="one at a time"):
        TextTracker(words, (" Paris",)).add_many(ids("Paris"))


def test_a_prompt_ending_inside_a_character_not_completed_shows_only_the_new_text():
    """The prompt ends inside a character and the next token does not complete it (the
    model went on with ASCII): the new text is that token's alone, without the replacement
    characters a byte-fallback decoder shows for the prompt's dangling bytes (a mutation
    audit: skipping them as one character whenever the prompt's text ended in one passed)."""
    tokenizer = byte_fallback_tokenizer()
    ids = encode(tokenizer, "ok \U0001F600abc")
    context = ids[:6]  # "ok " and 3 of the emoji's 4 bytes
    tracker = TextTracker(tokenizer, context=context)
    for token in ids[7:]:  # the 4th byte never comes
        tracker.add(token)
    assert tracker.text == "abc" and tracker.delta(final=True) == "abc"


def test_a_token_with_no_text_keeps_the_space_of_the_word_after_it():
    """A token that decodes to nothing (a special token, skipped; an EOS under ignore_eos)
    between two words: the next word keeps its leading space through a SentencePiece
    decoder that strips the first space of what it decodes (a mutation audit: moving the
    offsets past a token that gave no text passed, and gave "Parisand Berlin")."""
    tokenizer, ids = sentencepiece_word_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("</s>")
    tracker = TextTracker(tokenizer, context=ids("The capital of France is"))
    pieces = []
    for token in ids("Paris") + [eos] + ids("and Berlin"):
        tracker.add(token)
        pieces.append(tracker.delta())
    pieces.append(tracker.delta(final=True))
    assert "".join(pieces) == tracker.text == " Paris and Berlin"


def test_a_longer_stop_is_found_beside_a_shorter_one(tokenizer):
    """Stops of different lengths: the longer one, spanning several tokens, is still found
    on the token that completes it (a mutation audit: searching back only as far as the
    shortest stop passed every test)."""
    ids = encode(tokenizer, "hello world")
    tracker = TextTracker(tokenizer, ("!", "o w"))
    hits = [index for index, token in enumerate(ids, 1) if tracker.add(token)]
    assert hits and hits[0] == len(encode(tokenizer, "hello w"))
    assert tracker.text == "hell" and tracker.stop_reason == "o w"


def test_streaming_holds_back_the_longest_possible_stop_start_and_no_more(tokenizer):
    """The tail held back is the longest one that may still start a stop: a shorter one let
    part of the stop stream out before it was found ("xab" streamed for a text cut to "x"),
    a longer one delayed text that cannot start it (a mutation audit: both passed)."""
    tracker, pieces = TextTracker(tokenizer, ("abab",)), []
    for token in encode(tokenizer, "xabab"):
        tracker.add(token)
        pieces.append(tracker.delta())
    assert tracker.stopped and "".join(pieces) + tracker.delta(final=True) == tracker.text == "x"
    tracker = TextTracker(tokenizer, ("abc",))
    for token in encode(tokenizer, "xaab"):
        tracker.add(token)
    assert tracker.delta() == "xa"  # "ab" may become "abc"; the "a" before it cannot


def test_tokens_after_a_stop_never_reach_the_text(tokenizer):
    """Tokens added after a stop string ended the text are kept as ids but give no text,
    not even in the final delta (a mutation audit: finish read them in)."""
    tracker = TextTracker(tokenizer, ("b",))
    assert [tracker.add(token) for token in encode(tokenizer, "abcd")] == [False, True, True, True]
    assert tracker.delta(final=True) == tracker.text == "a" and tracker.stop_reason == "b"


def test_a_stop_string_is_refused_without_a_tokenizer():
    """Without a tokenizer there is no text to find a stop in: silently ignoring it would run
    to the token budget."""
    with pytest.raises(ValueError, match="need a tokenizer"):
        TextTracker(None, ("STOP",))
    assert not TextTracker(None).add(5)


def test_a_stop_string_that_is_an_added_special_token_matches_its_token():
    """A special token added to the vocabulary but not among the named special tokens
    (Llama 3's <|eot_id|> kind: in ``added_tokens_decoder`` only) is a stop on its id too;
    its text is never shown, so the text alone never matched (a mutation audit). A stop
    string that is no token is not matched by id: an unknown token does not end the text."""
    from tokenizers import AddedToken

    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens([AddedToken("<|im_end|>", special=True)])
    assert "<|im_end|>" not in tokenizer.all_special_tokens
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "answer") + [end] + encode(tokenizer, "more")
    tracker = TextTracker(tokenizer, ("<|im_end|>",))
    hits = [index for index, token in enumerate(ids) if tracker.add(token)]
    assert hits and hits[0] == len("answer") and tracker.text == "answer" and tracker.stop_reason == "<|im_end|>"
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    tracker = TextTracker(tokenizer, ("STOP",))
    assert not any(tracker.add(token) for token in encode(tokenizer, "go") + [unk] + encode(tokenizer, "on"))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_each_token_decodes_a_bounded_window_not_the_whole_output(name, monkeypatch):
    """A mutation audit: a prefix offset that never moved on decoded the whole output again
    at every token (quadratic in the output), and every other test passed."""
    import specdecode.text as text_module

    tokenizer = TOKENIZERS[name]()
    lengths, real = [], text_module.decode
    monkeypatch.setattr(text_module, "decode", lambda tok, ids, **kw: lengths.append(len(ids)) or real(tok, ids, **kw))
    text = "plain ascii text " * 20 + "caf\u00e9 \U0001F600 end"
    ids = encode(tokenizer, text)
    tracker = TextTracker(tokenizer, ("STOP",), context=encode(tokenizer, "prompt: "))
    for token in ids:
        assert not tracker.add(token)
    assert tracker.delta(final=True) == text
    assert max(lengths) <= text_module.CONTEXT_TOKENS + 8, max(lengths)  # a window, not the tokens so far
