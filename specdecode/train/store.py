"""``specdecode train store``: the token store that ``--method suffix`` drafts from.

The store is the target's own answers (``train data``'s ``answers.jsonl``, greedy and
sampled rows), joined into one token array. Nothing is learnt: the index is sorted when
the store loads (a fraction of a second for a million tokens). The directory gets the
tokens (safetensors, uint16 where the vocabulary fits), ``store.json`` (vocabulary size,
counts, the data recipe) and ``MANIFEST.json`` (sha256 of each file and the command that
reproduces it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import ConfigError
from ..models.loading import sha256_file
from .data import read_records, read_utf8
from ..proposers.suffix import STORE_FILE, TokenStore


def read_answers(data: Path) -> list[list[int]]:
    path = data / "answers.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} not found: build the target's answers first with `specdecode train data --out {data}`")
    # the range of the ids is the store's to check, against the vocabulary it is built for
    # an empty answer (EOS first) adds nothing to draft from; a file of only those built a
    # store of separators (found in review)
    answers = [row["answer_ids"] for row in read_records(path, {"answer_ids": list}) if row["answer_ids"]]
    if not answers:
        raise ConfigError(f"{path} holds no answers with any tokens")
    return answers


def build_store(data: Path, out: Path, vocab_size: int, command: str | None = None, log=print) -> dict:
    started = time.perf_counter()
    answers = read_answers(data)
    store = TokenStore(answers, vocab_size)
    recipe = {}
    for name in ("summary.json", "answers.settings.json"):
        if (data / name).is_file():
            text = read_utf8(data / name)  # (not UTF-8: its own error)
            try:  # found in review: an interrupted `train data` left a truncated summary, and a traceback here
                recipe[name.removesuffix(".json")] = json.loads(text)
            except ValueError as error:
                raise ConfigError(f"{data / name} is not valid JSON ({error}); run `specdecode train data` "
                                  f"--out {data} again to rewrite it") from None
    meta = {"answers": len(answers), "data": recipe, "command": command}
    store.save(out, meta)
    files = {name: {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
             for name in (STORE_FILE, "store.json")}
    manifest = {"files": files, "reproduce": command, "answers": meta["answers"], "tokens": store.answer_tokens}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"token store: {meta['answers']:,} answers, {store.answer_tokens:,} tokens, "
        f"{files[STORE_FILE]['bytes'] / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s")
    return manifest
