"""Prompt files: the built-in suite (``data/prompts.jsonl``, 9 categories x 10, written for
this project) and JSONL in Spec-Bench's ``{question_id, category, turns}`` or our
``{prompt, category}`` form.

Other public layouts load too (``ACCEPTED``): a GSM8K ``question``, an Alpaca
``instruction`` with its ``input``, the user turns of ShareGPT ``conversations`` or chat
``messages`` (with its system prompt), in JSONL or in one JSON array. A conversation record
with no usable user turn (public dumps hold some) is left out and counted on stderr.

A record with several turns (MT-bench's two-turn questions in Spec-Bench) is a
conversation: ``bench`` and ``analyze`` decode turn 1, then turn 2 after the chat holding
turn 1 and the model's own answer to it, as Spec-Bench does. Each prompt dict keeps
``turns`` (every user turn) and ``prompt`` (the first)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from importlib import resources
from pathlib import Path

from .config import ConfigError, SpecDecodeError


ID_KEYS = ("question_id", "id", "task_id")  # Spec-Bench, ShareGPT, HumanEval
ACCEPTED = ("{question_id, category, turns} (Spec-Bench, MT-bench), {prompt, category} (ours, HumanEval), "
            "{question} (GSM8K), {instruction, input} (Alpaca), or {conversations | messages} (ShareGPT, chat: "
            "the user's turns)")


def load_prompts(path: str | None, limit: int | None = None) -> list[dict]:
    """Read a prompt file: JSONL, or one JSON array of records (ShareGPT's files), in any of
    the layouts of ``ACCEPTED``. ``limit``: at most that many prompts per category."""
    if limit is not None and limit < 1:
        raise SpecDecodeError(f"--limit must be at least 1, got {limit}")
    if path is None:
        text = resources.files("specdecode.data").joinpath("prompts.jsonl").read_text()
        origin = "the built-in suite"
    else:
        file = Path(path)
        if not file.is_file():
            raise SpecDecodeError(f"prompts file {path!r} not found")
        try:
            text, origin = file.read_text(encoding="utf-8-sig"), path  # a byte-order mark is not JSON
        except (UnicodeDecodeError, OSError) as error:
            raise SpecDecodeError(f"prompts file {path!r} cannot be read as UTF-8 text ({error})") from None
    prompts, per_category, lines_of, skipped = [], defaultdict(int), {}, []
    for where, row in _records(text, origin):
        try:
            key, prompt, system = _user_turns(row, where)
        except _Unusable as reason:  # a dump's broken conversation: left out, as vLLM's benchmarks do
            skipped.append(str(reason))
            continue
        turns = _check_row(row, key, prompt, where)
        category = row.get("category", "general")
        if category == "overall":  # the reports' row over every category: its prompts would count twice there
            raise SpecDecodeError(f"{where}: the category 'overall' names the reports' row over all categories; "
                                  "rename it")
        if limit is not None and per_category[category] >= limit:
            continue
        per_category[category] += 1
        id_key = next((k for k in ID_KEYS if k in row), None)
        question_id = row[id_key] if id_key else f"{category}-{per_category[category]}"
        if question_id in lines_of:  # every method's run of a prompt is matched to plain's by it
            raise SpecDecodeError(f"{where}: question_id {question_id!r} is also the id of {lines_of[question_id]}; "
                                  "each prompt needs its own")
        lines_of[question_id] = where.removeprefix(f"{origin} ")
        prompt = {"question_id": question_id, "category": category, "prompt": turns[0], "turns": turns}
        if system:
            prompt["system"] = system
        prompts.append(prompt)
    if skipped:
        print(f"specdecode: left out {len(skipped)} record(s) of {origin} that hold no usable conversation "
              f"(the first: {skipped[0]})", file=sys.stderr)
    if not prompts:
        raise SpecDecodeError(f"{origin} holds no prompts")
    return prompts


class _Unusable(Exception):
    """A conversation record with nothing to ask (no user turn, an empty or non-text one)."""


def _records(text: str, origin: str):
    """(where, record) for each record of a JSONL text or of one JSON array."""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecDecodeError(f"{origin} is not JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
        except RecursionError:  # arrays nested thousands deep (found in review: a traceback)
            raise SpecDecodeError(f"{origin} nests its JSON too deeply to be a prompt file") from None
        for number, row in enumerate(rows, 1):
            yield f"{origin} record {number}", row
        return
    for number, row in json_lines(text, origin):
        yield f"{origin} line {number}", row


def json_lines(text: str, origin: str):
    """(line number, record) for each non-blank line of a JSONL text; a line that is not
    JSON is refused by ``origin`` and number (ConfigError). The prompt files and the
    training data (``train/data.py``) read their lines through it. Lines end at "\n" only:
    ``splitlines`` also broke them at U+2028, U+2029 and U+0085, which JSON allows raw in a
    string (``json.dumps(ensure_ascii=False)`` writes them so), and refused valid files."""
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{origin} line {number} is not JSON ({error.msg} at column {error.colno})") from None
        except RecursionError:  # found in review: a traceback
            raise ConfigError(f"{origin} line {number} nests its JSON too deeply") from None
        yield number, record


def _user_turns(row, where: str) -> tuple[str, object, str | None]:
    """The key a record's prompt comes from, its value (checked by ``_check_row``) and the
    conversation's system prompt, if it has one."""
    if not isinstance(row, dict):
        raise SpecDecodeError(f"{where}: expected a JSON object: {ACCEPTED}")
    for key in ("turns", "prompt", "question"):
        if key in row:
            return key, row[key], None
    for key in ("conversations", "conversation", "messages"):
        if key in row:
            messages = row[key]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise SpecDecodeError(f"{where}: {key!r} must be a list of messages ({{from, value}} or "
                                      f"{{role, content}}), got {messages!r:.80}")
            speakers = [(m.get("from", m.get("role")), m.get("value", m.get("content"))) for m in messages]
            turns = [text for speaker, text in speakers if speaker in ("human", "user")]
            if not turns:
                raise _Unusable(f"{where}: {key!r} holds no user turn (a message from 'human' or with role 'user')")
            if not all(isinstance(turn, str) and turn.strip() for turn in turns):
                raise _Unusable(f"{where}: {key!r} holds an empty or non-text user turn")
            system = next((text for speaker, text in speakers if speaker == "system"), None)
            return key, turns, system if isinstance(system, str) and system.strip() else None
    if "instruction" in row:
        instruction, extra = row["instruction"], row.get("input")
        # Alpaca's fields are text: a list of instructions loaded as a conversation and its
        # input was dropped without a word (found in a mutation audit)
        if not isinstance(instruction, str) or not isinstance(extra, (str, type(None))):
            raise SpecDecodeError(f"{where}: 'instruction' and 'input' must be strings, got "
                                  f"{instruction!r:.80} and {extra!r:.80}")
        if extra is not None and extra.strip():
            return "instruction", f"{instruction}\n\n{extra}", None
        return "instruction", instruction, None
    raise SpecDecodeError(f"{where}: expected {ACCEPTED}")


def _check_row(row: dict, key: str, prompt, where: str) -> list[str]:
    """The record's user turns (one for a ``prompt``); a wrong type or an empty turn is
    refused here, before any model loads, rather than failing (or benching a wrong prompt)
    later."""
    turns = prompt if isinstance(prompt, list) else [prompt]
    if not turns or not all(isinstance(turn, str) for turn in turns):
        raise SpecDecodeError(f"{where}: {key!r} must be a string or a non-empty list of strings, got {prompt!r}")
    for number, turn in enumerate(turns, 1):
        if not turn.strip():
            raise SpecDecodeError(f"{where}: the prompt is empty" if len(turns) == 1 else f"{where}: turn {number} is empty")
    if not isinstance(row.get("category", ""), str):
        raise SpecDecodeError(f"{where}: 'category' must be a string, got {row['category']!r}")
    id_key = next((k for k in ID_KEYS if k in row), None)  # the one used
    question_id = row.get(id_key, "")
    if not isinstance(question_id, (str, int)) or isinstance(question_id, bool):  # Spec-Bench numbers its questions
        raise SpecDecodeError(f"{where}: {id_key!r} must be a string or an integer, got {question_id!r}")
    return turns


def categories_in_turn(prompts: list[dict]) -> list[dict]:
    """The prompts reordered so that categories alternate: the first of each category (in
    the order they first appear), then the second of each, and so on."""
    by_category: dict[str, list[dict]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.get("category", "general"), []).append(prompt)
    queues = list(by_category.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
