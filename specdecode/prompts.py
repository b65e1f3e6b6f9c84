"""Prompt files: the built-in suite (``data/prompts.jsonl``, 9 categories x 10, written for
this project) and JSONL in Spec-Bench's ``{question_id, category, turns}`` or our
``{prompt, category}`` form."""

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
        prompt = _check_row(row, prompt, f"{origin} line {number}")
        category = row.get("category", "general")
        if limit is not None and per_category[category] >= limit:
            continue
        per_category[category] += 1
        question_id = row.get("question_id", f"{category}-{per_category[category]}")
        if question_id in lines_of:  # every method's run of a prompt is matched to plain's by it
            raise SpecDecodeError(f"{origin} line {number}: question_id {question_id!r} is also the id of line "
                                  f"{lines_of[question_id]}; each prompt needs its own")
        lines_of[question_id] = number
        prompts.append({"question_id": question_id, "category": category, "prompt": prompt})
    if not prompts:
        raise SpecDecodeError(f"{origin} holds no prompts")
    return prompts


def _check_row(row: dict, prompt, where: str) -> str:
    """The record's first prompt text; a wrong type or an empty prompt is refused here, before
    any model loads, rather than failing (or benching a wrong prompt) later."""
    key = "turns" if "turns" in row else "prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(turn, str) for turn in prompt):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise SpecDecodeError(f"{where}: {key!r} must be a string or a non-empty list of strings, got {prompt!r}")
    if not prompt.strip():
        raise SpecDecodeError(f"{where}: the prompt is empty")
    if not isinstance(row.get("category", ""), str):
        raise SpecDecodeError(f"{where}: 'category' must be a string, got {row['category']!r}")
    question_id = row.get("question_id", "")
    if not isinstance(question_id, (str, int)) or isinstance(question_id, bool):  # Spec-Bench numbers its questions
        raise SpecDecodeError(f"{where}: 'question_id' must be a string or an integer, got {question_id!r}")
    return prompt
