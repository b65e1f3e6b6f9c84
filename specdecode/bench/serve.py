"""``specdecode bench-serve``: load a running server the way ``vllm bench serve`` does.

For each concurrency level (a closed loop: N clients, each sending its next request when
the last one finished) or request rate (an open loop: Poisson arrivals), and for each mode
(the server's default speculation, and the same requests with ``"speculative":
{"enabled": false}``), streamed chat completions report TTFT, TPOT (time per output token
after the first), ITL (gaps between streamed chunks; a chunk carries a step's tokens) and
end-to-end latency (mean, p50, p99), request and output-token throughput, and the
acceptance the server counted meanwhile, scraped from /metrics.

Without ``--url`` the command starts ``specdecode serve`` itself on a free loopback port
and stops it at the end.

``--rounds N`` runs the whole plan N times, the modes in turn first (spec, plain, then
plain, spec, ...), and reports per level the median throughput of each mode and the
median of the rounds' own ratios (speculation against plain at a level; plain at a level
against plain at the lowest one). On our 2-core machines the speed drifts by up to a third
within minutes, so a ratio of two levels measured minutes apart says little; the ratio of
the two halves of one round, measured back to back, says more, and their median more still.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..config import SpecDecodeError

MODES = ("spec", "plain")


def percentile(values: list[float], q: float) -> float | None:
    """``vllm bench serve``'s: numpy's, interpolating linearly between ranks; None for no
    values (a level whose requests all failed read 0 ms, a perfect latency; found in review)."""
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarize(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else None, "p50": percentile(values, 50),
            "p99": percentile(values, 99)}


def _latency(seconds: float | None, width: int, digits: int, unit: str = "ms") -> str:
    """A table cell: ``seconds`` in ms (or s), '-' where nothing was measured."""
    if seconds is None:
        return f"{'-':>{width + len(unit)}}"
    return f"{seconds * (1000 if unit == 'ms' else 1):>{width}.{digits}f}{unit}"


def _figure(value: float | None, width: int, digits: int) -> str:
    """A table cell: ``value``, '-' where there is none (a level whose requests all failed)."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"


def scrape(text: str) -> dict[str, float]:
    """The speculative counters of a Prometheus exposition (summed over labels), and the
    accepted tokens per draft position as ``per_pos/<position>``."""
    wanted = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
              "spec_decode_num_accepted_tokens_total", "generation_tokens_total", "audit_requests_total",
              "audit_mismatches_total", "num_requests_running", "audit_pending")
    totals, replicas = dict.fromkeys(wanted, 0.0), set()
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].split(":", 1)[-1]
        if 'replica="' in line:  # a replica behind Ray's proxy answered (its series carry its name)
            replicas.add(line.split('replica="', 1)[1].split('"', 1)[0])
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
        elif name == PER_POSITION and 'position="' in line:
            key = "per_pos/" + line.split('position="', 1)[1].split('"', 1)[0]
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    totals["replicas"] = ",".join(sorted(replicas))
    return totals


def acceptance_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """What `vllm bench serve` reports of speculation between two scrapes: the acceptance
    rate (accepted / draft tokens), the mean acceptance length (1 + accepted / drafts) and
    the acceptance rate per draft position (accepted there / drafts). Scrapes that
    different replicas answered (``--replicas``: Ray's proxy picks one per scrape) give no
    figures: their counters are different processes' (found in review: negative counts)."""
    if before.get("replicas", "") != after.get("replicas", ""):
        return {"drafts": None, "draft_tokens": None, "accepted_tokens": None, "acceptance_rate": None,
                "mean_acceptance_length": None, "acceptance_per_position": [],
                "acceptance_note": "the two /metrics scrapes were answered by different replicas"}

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, drafted = delta("spec_decode_num_drafts_total"), delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    positions = sorted(int(k.split("/", 1)[1]) for k in after if k.startswith("per_pos/"))
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": [delta(f"per_pos/{p}") / drafts for p in positions] if drafts else []}


async def one_request(client, url: str, model: str, prompt: str | list[dict], max_tokens: int, mode: str,
                      results: list) -> None:
    """One streamed chat request; ``prompt``: the user's text, or the messages to send."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if mode == "plain":
        body["speculative"] = {"enabled": False}
    started = time.perf_counter()
    first, last, gaps, tokens, error = None, None, [], 0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):  # the server failed it mid-stream (HTTP 200 already sent)
                        error = f"stream error: {str(chunk['error'].get('message', chunk['error']))[:200]}"
                        break
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
    except Exception as exc:  # a failed request is counted, not fatal
        error = repr(exc)
    if error is None and tokens == 0:  # ignore_eos: every request that ran produced tokens and reported them
        error = "the stream ended without a usage chunk or with no tokens"
    ended = time.perf_counter()
    results.append({"ttft": None if first is None else first - started, "e2e": ended - started, "itl": gaps,
                    "tokens": tokens, "error": error,
                    "tpot": (ended - first) / (tokens - 1) if first is not None and tokens > 1 else None})


async def run_level(url: str, model: str, prompts: list, max_tokens: int, mode: str, concurrency: int | None,
                    rate: float | None, seed: int) -> dict:
    import httpx

    results: list[dict] = []
    # no pool cap: httpx's default of 100 connections would hold a wider level's requests back
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, headers=auth_headers(), limits=limits) as client:
        before = scrape((await client.get(f"{url}/metrics")).text)
        started = time.perf_counter()
        if rate is None:
            queue = list(prompts)

            async def worker():
                while queue:
                    await one_request(client, url, model, queue.pop(0), max_tokens, mode, results)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng, tasks = random.Random(seed), []
            for i, prompt in enumerate(prompts):
                tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, mode, results)))
                if i < len(prompts) - 1:  # gaps between arrivals only: none after the last (it stretched the wall time)
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        after = scrape((await client.get(f"{url}/metrics")).text)
    done = [r for r in results if r["error"] is None]
    output_tokens = sum(r["tokens"] for r in done)
    return {
        "mode": mode, "concurrency": concurrency, "request_rate": rate, "requests": len(results),
        "failed": len(results) - len(done), "errors": [r["error"] for r in results if r["error"]][:3],
        # None where every request failed: no throughput to compare (found in review: a "0.00x" ratio)
        "wall_seconds": wall, "request_throughput": len(done) / wall if done else None,
        "output_throughput": output_tokens / wall if done else None,
        "output_tokens": output_tokens,
        "ttft": summarize([r["ttft"] for r in done if r["ttft"] is not None]),
        "tpot": summarize([r["tpot"] for r in done if r["tpot"] is not None]),
        "itl": summarize([g for r in done for g in r["itl"]]),
        "e2e": summarize([r["e2e"] for r in done]),
        **acceptance_figures(before, after),
    }


def wait_for_audits(url: str, limit: float = 600.0) -> dict[str, float]:
    """The server audits when idle: wait until no audit is waiting or re-running
    (``audit_pending``, set before a request's reply goes out; a server without
    --audit-rate has no such sample). It used to wait for the audit count to stop moving,
    and returned at once while the count was still 0 with the first audits queued (found
    in review)."""
    import httpx

    deadline = time.time() + limit
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        totals = scrape(text)
        if ":audit_pending{" not in text or totals["audit_pending"] == 0 or time.time() > deadline:
            return totals
        time.sleep(0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], port: int, log_path: Path) -> subprocess.Popen:
    import httpx

    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), *serve_args],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if process.poll() is not None:
            raise SpecDecodeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise SpecDecodeError(f"the server did not come up within 900 s; see {log_path}")


def redacted(serve_args: list[str]) -> list[str]:
    """The server's arguments with its API key hidden, for the log and the JSON (which are
    committed with results; found in review: the key was written out)."""
    shown = list(serve_args)
    for i, arg in enumerate(shown):
        if arg == "--api-key" and i + 1 < len(shown):
            shown[i + 1] = "***"
        elif arg.startswith("--api-key="):
            shown[i] = "--api-key=***"
    return shown


def unfit(row: dict) -> str | None:
    """Why a row's throughput cannot enter a ratio, None if it can: some of its requests
    failed (a fast 503 refusal shortens the wall time, and the tokens are the successful
    ones), or a plain row's server drafted meanwhile (a server that ignores our
    ``speculative`` field, vLLM's for one: its "plain" speculated, and the ratio read about
    1.00x; found in review). Such a row enters no ratio and no median of its mode."""
    if row.get("failed"):
        return f"{row['mode']}: {row['failed']} of {row['requests']} requests failed"
    if row["mode"] == "plain" and row.get("drafts"):
        return f"plain: the server drafted {int(row['drafts'])} times (it ignored speculative.enabled false)"
    return None


def ratio_summary(rows: list[dict]) -> list[dict]:
    """Per level (concurrency or rate): each mode's median output throughput over the
    rounds, and the median, min and max of the rounds' own ratios: spec against plain at
    that level, and plain at that level against plain at the lowest concurrency. Rows
    ``unfit`` for a ratio are left out of both, and listed under ``left_out``."""
    def key(row):
        return row["concurrency"] or row["request_rate"]

    rounds = sorted({row.get("round", 0) for row in rows})
    levels = sorted({key(row) for row in rows})
    by = {(row.get("round", 0), key(row), row["mode"]): row["output_throughput"] for row in rows
          if row["output_throughput"] is not None and not unfit(row)}  # a level whose requests all failed has none
    left_out = [{"round": row.get("round", 0), "level": key(row), "mode": row["mode"], "why": unfit(row)}
                for row in rows if unfit(row)]

    def spread(values: list[float]) -> dict | None:
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}

    lowest = levels[0] if rows and rows[0]["concurrency"] else None
    summary = []
    for level in levels:
        entry = {"level": level, "concurrency": level if lowest is not None else None,
                 "request_rate": None if lowest is not None else level}
        for mode in MODES:
            values = [by[r, level, mode] for r in rounds if (r, level, mode) in by]
            entry[f"{mode}_tok_s"] = statistics.median(values) if values else None
        entry["spec_over_plain"] = spread([by[r, level, "spec"] / by[r, level, "plain"] for r in rounds
                                           if by.get((r, level, "spec")) and by.get((r, level, "plain"))])
        # the rows this level's ratios left out: its own, and the lowest level's plain rows
        # that plain_over_lowest needed
        entry["left_out"] = [left for left in left_out if left["level"] == level
                             or (lowest is not None and level != lowest and left["level"] == lowest
                                 and left["mode"] == "plain")]
        entry["plain_over_lowest"] = None
        if lowest is not None and level != lowest:
            entry["plain_over_lowest"] = spread([by[r, level, "plain"] / by[r, lowest, "plain"] for r in rounds
                                                 if by.get((r, level, "plain")) and by.get((r, lowest, "plain"))])
        summary.append(entry)
    return summary


def print_summary(summary: list[dict], rounds: int) -> None:
    lowest = next((entry["level"] for entry in summary if entry["concurrency"]), None)
    print(f"\nover {rounds} round{'s' if rounds > 1 else ''} (median tok/s; ratios: median of each round's own, "
          f"[min, max])")
    print(f"{'level':>6} {'spec tok/s':>11} {'plain tok/s':>12} {'spec/plain':>22} "
          f"{'plain/plain@' + str(lowest) if lowest else '':>24}")

    def ratio(spread: dict | None) -> str:
        return "-" if spread is None else f"{spread['median']:.2f}x [{spread['min']:.2f}, {spread['max']:.2f}]"

    for entry in summary:
        spec = "-" if entry["spec_tok_s"] is None else f"{entry['spec_tok_s']:.1f}"
        plain = "-" if entry["plain_tok_s"] is None else f"{entry['plain_tok_s']:.1f}"
        print(f"{entry['level']:>6} {spec:>11} {plain:>12} {ratio(entry['spec_over_plain']):>22} "
              f"{ratio(entry['plain_over_lowest']) if lowest else '':>24}")
        for left in entry.get("left_out", []):
            where = "" if left.get("level", entry["level"]) == entry["level"] else f" at level {left['level']}"
            print(f"{'':>6} round {left['round']} left out of the ratios{where}: {left['why']}")


def print_table(rows: list[dict]) -> None:
    header = (f"{'round':>5} {'mode':<6} {'conc':>5} {'rate':>5} {'req':>4} {'fail':>4} {'req/s':>6} {'tok/s':>7} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>8} "
              f"{'alpha':>6} {'MAL':>5}")
    print(header)
    for r in rows:
        alpha = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        length = "-" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"{r.get('round', 0):>5} {r['mode']:<6} {r['concurrency'] or '-':>5} {r['request_rate'] or '-':>5} {r['requests']:>4} "
              f"{r['failed']:>4} {_figure(r['request_throughput'], 6, 2)} {_figure(r['output_throughput'], 7, 1)} "
              f"{_latency(r['ttft']['p50'], 7, 0)} {_latency(r['ttft']['p99'], 7, 0)} "
              f"{_latency(r['tpot']['p50'], 7, 1)} {_latency(r['itl']['p50'], 6, 1)} {_latency(r['itl']['p99'], 6, 1)} "
              f"{_latency(r['e2e']['p50'], 7, 2, 's')} {alpha:>6} {length:>5}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    # levels of concurrency, or of request rate for a --request-rate run (which has no
    # concurrency: its figure was left empty; found in review)
    key = "concurrency" if any(r["concurrency"] for r in rows) else "request_rate"
    label = "concurrent clients" if key == "concurrency" else "request rate (requests/s)"
    for mode in MODES:
        levels = sorted({r[key] for r in rows if r["mode"] == mode and r[key]})
        if not levels:
            continue
        # the median over the rounds at each level
        chosen = [[r for r in rows if r["mode"] == mode and r[key] == level] for level in levels]
        throughput = [[r["output_throughput"] for r in group if r["output_throughput"] is not None] for group in chosen]
        left.plot(levels, [statistics.median(values) if values else math.nan for values in throughput], marker="o",
                  label=mode)
        tpot = [[r["tpot"]["p50"] * 1000 for r in group if r["tpot"]["p50"] is not None] for group in chosen]
        right.plot(levels, [statistics.median(values) if values else math.nan for values in tpot], marker="o",
                   label=mode)
    left.set_xlabel(label)
    left.set_ylabel("output tokens/s")
    left.set_title("Token throughput")
    right.set_xlabel(label)
    right.set_ylabel("p50 TPOT (ms)")
    right.set_title("Time per output token")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def auth_headers() -> dict[str, str]:
    """The key for a server started with --api-key: OPENAI_API_KEY, as `vllm bench serve`
    and the openai client read it."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(url: str) -> str:
    """The model id the server at ``url`` serves, or an error that says why there is none."""
    import httpx

    try:
        response = httpx.get(f"{url}/v1/models", timeout=10, headers=auth_headers())
    except httpx.HTTPError as error:
        raise SpecDecodeError(f"cannot reach a server at {url}: {error}") from None
    if response.status_code == 401:
        raise SpecDecodeError(f"{url} wants an API key: set OPENAI_API_KEY to the server's --api-key")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise SpecDecodeError(f"{url}/v1/models answered {response.status_code} without a model: "
                              f"{response.text[:200]!r}") from None


def bench_serve(prompts: list[dict], concurrency: list[int], rate: float | None, num_prompts: int, max_tokens: int,
                modes: list[str], url: str | None, serve_args: list[str], out: Path | None, seed: int = 0,
                model: str | None = None, rounds: int = 1) -> list[dict]:
    from tqdm import tqdm

    process = None
    if url is None:
        port = free_port()
        log_path = (out.with_suffix(".server.log") if out else Path("bench-serve.server.log"))
        print(f"specdecode: starting `specdecode serve {' '.join(redacted(serve_args))}` on port {port} "
              f"(log: {log_path})", file=sys.stderr)
        process = start_server(serve_args, port, log_path)
        url = f"http://127.0.0.1:{port}"
        for i, arg in enumerate(serve_args):  # the server this command started wants its own key
            key = serve_args[i + 1] if arg == "--api-key" and i + 1 < len(serve_args) else (
                arg.partition("=")[2] if arg.startswith("--api-key=") else None)
            if key:
                os.environ["OPENAI_API_KEY"] = key
    try:
        import httpx

        model = model or served_model(url)
        from ..prompts import categories_in_turn
        from .runner import conversation

        # each prompt's first turn, after its system prompt where the file gives one; the
        # categories taken in turn, so that N requests mix every task type (the suite is
        # stored category by category: the first 32 were code, JSON, templates and two
        # summaries, the tasks lookup drafts best; found in review)
        texts = [conversation([p["prompt"]], [], p.get("system")) for p in categories_in_turn(prompts)]
        rows = []
        levels = [None] if rate is not None else concurrency
        # untimed: one round at the widest level in every mode, so that no measured level
        # pays first-time allocations (a batch of that many rows, each request shape)
        # (found in review: with fewer prompts than the widest level, the warm-up ran fewer rows;
        # and a rate run's arrivals can hold every request at once, not 4)
        widest = max(concurrency) if rate is None else num_prompts
        for mode in modes:
            warm = [texts[i % len(texts)] for i in range(widest)]
            asyncio.run(run_level(url, model, warm, 16, mode, widest, None, seed))
        # round i runs the modes in turn first, so that a drift of the machine's speed
        # within a round favours neither
        plan = [(i, level, mode) for i in range(rounds) for level in levels
                for mode in (modes if i % 2 == 0 else modes[::-1])]
        warned = False
        for i, level, mode in tqdm(plan, desc="bench-serve", unit="level", file=sys.stderr):
            # the server audits when idle: the last level's audits (plain re-runs in the
            # batch) must not run inside this one's timing
            wait_for_audits(url)
            # every level starts from an empty prefix cache, so it reuses only what its own
            # requests share (a system prompt), not the prompts the last level sent
            reset = httpx.post(f"{url}/reset_prefix_cache", timeout=10, headers=auth_headers())
            if reset.status_code != 200 and not warned:
                warned = True
                print(f"specdecode: {url}/reset_prefix_cache answered {reset.status_code}: a level may reuse "
                      f"prompts the last one sent, if the server caches prefixes", file=sys.stderr)
            count = max(num_prompts, level or 1)
            chosen = [texts[i % len(texts)] for i in range(count)]
            row = asyncio.run(run_level(url, model, chosen, max_tokens, mode, level, rate, seed))
            rows.append({"round": i, **row})
            for error in dict.fromkeys(row["errors"]):  # a table of failed requests alone does not say why
                tqdm.write(f"specdecode: {row['failed']} of {row['requests']} {mode} requests failed, e.g. {error}",
                           file=sys.stderr)
        audit = wait_for_audits(url)
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    print_table(rows)
    summary = ratio_summary(rows)
    if rounds > 1 or len(modes) > 1:
        print_summary(summary, rounds)
    if audit["audit_requests_total"]:
        print(f"audit: {audit['audit_requests_total']:.0f} requests re-decoded plainly, "
              f"{audit['audit_mismatches_total']:.0f} differed")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        # the server's arguments too: two runs that differ only there (--schedule task against
        # fcfs) could not be told apart (found in review); None: a server started elsewhere (--url)
        out.write_text(json.dumps({"url": url, "model": model, "max_tokens": max_tokens, "rounds": rounds,
                                   "serve_args": redacted(serve_args) if process is not None else None,
                                   "rows": rows, "summary": summary,
                                   "audit": {k: audit[k] for k in ("audit_requests_total", "audit_mismatches_total")}},
                                  indent=1))
        plot(rows, out.with_suffix(".png"))
        print(f"specdecode: wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return rows
