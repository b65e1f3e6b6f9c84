"""Time to first token of a conversation's second turn, with its first turn in the prefix
cache and without (after /reset_prefix_cache), against a running `specdecode serve`.

    specdecode serve --port 8000 &
    python scripts/multiturn_ttft.py --url http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def first_token(url: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first streamed content, and the request's usage."""
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return first, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=400)
    args = parser.parse_args()
    question = "Explain how a bicycle gear system works, in detail, with examples of gear ratios."
    first_turn = httpx.post(f"{args.url}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": args.answer_tokens, "temperature": 0})
    answer = first_turn.json()["choices"][0]["message"]["content"]
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    conversation = history + [{"role": "user", "content": "Now summarise that in one sentence."}]
    results = {"cached": [], "uncached": []}
    for round_ in range(args.rounds):
        # another second turn leaves the first turn's entries in a free row
        httpx.post(f"{args.url}/v1/chat/completions", timeout=120, json={
            "messages": history + [{"role": "user", "content": f"Question {round_}: one word?"}], "max_tokens": 1})
        results["cached"].append(first_token(args.url, conversation))
        httpx.post(f"{args.url}/reset_prefix_cache", timeout=10)
        results["uncached"].append(first_token(args.url, conversation))
        httpx.post(f"{args.url}/reset_prefix_cache", timeout=10)
    prompt = results["cached"][0][1].get("prompt_tokens")
    print(f"second turn: {prompt} prompt tokens")
    for name, runs in results.items():
        cached = [usage.get("prompt_tokens_details", {}).get("cached_tokens") for _, usage in runs]
        print(f"{name:9s} TTFT median {statistics.median(t for t, _ in runs) * 1e3:7.1f} ms, cached tokens {cached}")


if __name__ == "__main__":
    main()
