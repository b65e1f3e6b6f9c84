"""The suite's plain greedy outputs, for the offline replays (scripts/suffix_tree_replay.py,
scripts/suffix_k_ceiling.py): read from a JSON cache, or decoded and written there."""

import json
from pathlib import Path

from specdecode.config import SamplingParams, SpeculativeConfig
from specdecode.factory import build_engine
from specdecode.prompts import load_prompts


def plain_outputs(config, target, limit: int | None, cache: str | None, max_new_tokens: int = 128) -> list[dict]:
    """[{"prompt_ids": [...], "output": [...]}] for the suite's prompts (``limit`` per category)."""
    if cache and Path(cache).is_file():
        return json.loads(Path(cache).read_text())
    plain = build_engine(config, SpeculativeConfig(method="none"), target=target)
    records = []
    for prompt in load_prompts(None, limit):
        ids = plain.encode(prompt["prompt"])
        records.append({"prompt_ids": ids,
                        "output": plain.generate(ids, SamplingParams(max_new_tokens=max_new_tokens)).token_ids})
    if cache:
        Path(cache).write_text(json.dumps(records))
    return records
