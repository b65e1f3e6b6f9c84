"""Prompt files: the built-in suite (``data/prompts.jsonl``, 9 categories x 10, written for
this project) and JSONL in Spec-Bench's ``{question_id, category, turns}`` or our
``{prompt, category}`` form.

A record with several turns (MT-bench's two-turn questions in Spec-Bench) is a
conversation: ``bench`` and ``analyze`` decode turn 1, then turn 2 after the chat holding
turn 1 and the model's own answer to it, as Spec-Bench does. Each prompt dict keeps
``turns`` (every user turn) and ``prompt`` (the first)."""

from __future__ import annotations

import json
from collections import defaultdict
from importlib import resources
from pathlib import Path

from .config import SpecDecodeError


def load_prompts(path: str | None, limit: int | None = None) -> list[dict]:
    """Read Spec-Bench ``{question_id, category, turns}`` or ``{prompt, category}`` lines."""
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"--limit must be at least 1, got {limit}")
    if path is None:
        text = resources.files("specdecode.data").joinpath("prompts.jsonl").read_text()
        origin = "the built-in suite"
    else:
        file = Path(path)
        if not file.is_file():
            raise SpecDecodeError(f"prompts file {path!r} not found")
        text, origin = file.read_text(), path
    prompts, per_category, lines_of = [], defaultdict(int), {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise SpecDecodeError(f"{origin} line {number} is not JSON ({error.msg} at column {error.colno})") from None
        try:
            prompt = row["turns"] if "turns" in row else row["prompt"]
        except (KeyError, TypeError):
            raise SpecDecodeError(
                f"{origin} line {number}: expected {{'question_id', 'category', 'turns'}} or {{'prompt', 'category'}}"
            ) from None
        turns = _check_row(row, prompt, f"{origin} line {number}")
        category = row.get("category", "general")
        if limit is not None and per_category[category] >= limit:
            continue
        per_category[category] += 1
        question_id = row.get("question_id", f"{category}-{per_category[category]}")
        if question_id in lines_of:  # every method's run of a prompt is matched to plain's by it
            raise SpecDecodeError(f"{origin} line {number}: question_id {question_id!r} is also the id of line "
                                  f"{lines_of[question_id]}; each prompt needs its own")
        lines_of[question_id] = number
        prompts.append({"question_id": question_id, "category": category, "prompt": turns[0], "turns": turns})
    if not prompts:
        raise SpecDecodeError(f"{origin} holds no prompts")
    return prompts


def _check_row(row: dict, prompt, where: str) -> list[str]:
    """The record's user turns (one for a ``prompt``); a wrong type or an empty turn is
    refused here, before any model loads, rather than failing (or benching a wrong prompt)
    later."""
    key = "turns" if "turns" in row else "prompt"
    turns = prompt if isinstance(prompt, list) else [prompt]
    if not turns or not all(isinstance(turn, str) for turn in turns):
        raise SpecDecodeError(f"{where}: {key!r} must be a string or a non-empty list of strings, got {prompt!r}")
    for number, turn in enumerate(turns, 1):
        if not turn.strip():
            raise SpecDecodeError(f"{where}: the prompt is empty" if len(turns) == 1 else f"{where}: turn {number} is empty")
    if not isinstance(row.get("category", ""), str):
        raise SpecDecodeError(f"{where}: 'category' must be a string, got {row['category']!r}")
    question_id = row.get("question_id", "")
    if not isinstance(question_id, (str, int)) or isinstance(question_id, bool):  # Spec-Bench numbers its questions
        raise SpecDecodeError(f"{where}: 'question_id' must be a string or an integer, got {question_id!r}")
    return turns
