"""The server under load on loopback, client disconnects, and a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import threading
import time

import httpx
import pytest
import torch

from conftest import save_chat_model, tiny_server_state
from specdecode.bench.serve import free_port, start_server
from specdecode.config import SamplingParams
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model
from specdecode.serve.app import create_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("load"), seed=6)


class ServerThread:
    """uvicorn serving the app in this process (loopback), stopped on exit."""

    def __init__(self, model_dir, **kwargs):
        import uvicorn

        self.state = tiny_server_state(model_dir, '{"method": "ngram", "num_speculative_tokens": 3}', **kwargs)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state, self.state.tokenizer), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


def rss_mb() -> float:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def wait_idle(state, seconds=30.0):
    deadline = time.time() + seconds
    while time.time() < deadline and (state.engine.num_running or state.engine.num_waiting):
        time.sleep(0.02)


def read_event(line: str, text: list[str], finish: str | None) -> str | None:
    """One SSE line of a streamed completion: its text appended to ``text``; the finish
    reason so far."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return finish
    chunk = json.loads(line[6:])
    if chunk["choices"]:
        text.append(chunk["choices"][0]["text"])
        finish = chunk["choices"][0]["finish_reason"] or finish
    return finish


async def streamed(client, url, body, disconnect_after=None):
    text, finish = [], None
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            finish = read_event(line, text, finish)
            if disconnect_after is not None and len(text) >= disconnect_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text), finish


def test_load_many_clients_mixed_requests(model_dir):
    """32 concurrent clients, 320 requests: streamed, non-streamed and abandoned
    mid-stream. Every completed response is whole and equals the prompt decoded alone;
    every row is free at the end, and the process grew by less than 64 MB."""
    rng = random.Random(1)
    prompts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 30))) for _ in range(24)]
    reference_model = load_model(str(model_dir), torch.float32, backend="torch")
    plain = SpeculativeEngine(reference_model.runtime, reference_model.tokenizer)
    expected = {}
    with ServerThread(model_dir, max_num_seqs=8, max_queued_requests=400) as server:
        jobs = []
        for index in range(320):
            prompt, max_tokens = prompts[index % len(prompts)], 4 + index % 13
            kind = ("stream", "json", "disconnect")[index % 3]
            jobs.append((prompt, max_tokens, kind))
            key = (prompt, max_tokens)
            if key not in expected:
                ids = reference_model.tokenizer(prompt)["input_ids"]
                expected[key] = plain.generate(ids, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)).text

        async def main(jobs):
            url = f"{server.url}/v1/completions"
            queue = list(jobs)
            results = []
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                async def worker():
                    while queue:
                        prompt, max_tokens, kind = queue.pop()
                        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                        if kind == "json":
                            response = await client.post(url, json=body)
                            assert response.status_code == 200, response.text
                            choice = response.json()["choices"][0]
                            results.append((prompt, max_tokens, choice["text"], choice["finish_reason"]))
                        elif kind == "stream":
                            text, finish = await streamed(client, url, body)
                            results.append((prompt, max_tokens, text, finish))
                        else:
                            await streamed(client, url, body, disconnect_after=1)
                await asyncio.gather(*(worker() for _ in range(32)))
            return results

        asyncio.run(main(jobs[:64]))  # warm: allocator pools, first requests of each shape
        wait_idle(server.state)
        resident = rss_mb()
        started = time.time()
        results = asyncio.run(main(jobs))
        assert time.time() - started < 300
        wait_idle(server.state)
        assert rss_mb() - resident < 64, (resident, rss_mb())  # server memory stays bounded
        wait_idle(server.state)
        engine = server.state.engine
        assert engine.num_running == 0 and engine.num_waiting == 0
        assert sorted(engine.free_rows) == list(range(8))
    assert len(results) == sum(kind != "disconnect" for *_, kind in jobs)
    for prompt, max_tokens, text, finish in results:
        assert finish == "length" and text == expected[(prompt, max_tokens)], (prompt, max_tokens)


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition, summed over labels, named without our prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1]
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def test_disconnect_mid_stream_frees_the_row(model_dir):
    with ServerThread(model_dir, max_num_seqs=2, max_model_len=256) as server:
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "abc", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
                await streamed(client, f"{server.url}/v1/completions", body, disconnect_after=2)

        asyncio.run(main())
        wait_idle(server.state)
        assert server.state.engine.num_running == 0
        assert sorted(server.state.engine.free_rows) == [0, 1]
        text = httpx.get(f"{server.url}/metrics").text
        assert 'specdecode:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text


def test_a_request_aborted_while_it_waits_is_counted(model_dir):
    """A client that leaves while its request waits for a row: the request never runs, and
    is still reported (request_success{finished_reason="abort"}); its prompt tokens are not
    (vLLM counts them once the prefill is done), and the tokens and the time to first token
    of the one that ran are counted while it runs, not when it ends."""
    with ServerThread(model_dir, max_num_seqs=1, max_model_len=256) as server:
        state = server.state
        hog = state.engine.add([5, 6, 7], SamplingParams(max_new_tokens=240, ignore_eos=True, temperature=0))
        state.wakeup.set()
        waiting = state.engine.add([8, 9, 10, 11], SamplingParams(max_new_tokens=5, temperature=0))
        assert not waiting.finished
        deadline = time.monotonic() + 60
        running = metric_values(httpx.get(f"{server.url}/metrics").text)
        while running["generation_tokens_total"] < 10 and time.monotonic() < deadline:
            time.sleep(0.002)
            running = metric_values(httpx.get(f"{server.url}/metrics").text)
        still_running = not hog.finished  # read after the metrics: counted while it ran
        state.abort(waiting)
        wait_idle(state)
        assert hog.finish_reason == "length" and waiting.finish_reason == "abort" and not waiting.generated
        assert still_running, "the hog ended before the metrics were read: slow the test down"
        assert running["prompt_tokens_total"] == 3 and running["time_to_first_token_seconds_count"] == 1
        assert 10 <= running["generation_tokens_total"] < 240
        after = metric_values(httpx.get(f"{server.url}/metrics").text)
        assert after["request_success_total"] == 2
        assert after["prompt_tokens_total"] == 3 and after["generation_tokens_total"] == 240
        assert after["time_to_first_token_seconds_count"] == 1


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_drains_in_flight_requests(model_dir, tmp_path):
    port = free_port()
    process = start_server(["--model", str(model_dir), "--dtype", "fp32", "--backend", "torch", "--max-model-len",
                            "256", "--speculative-config", '{"method": "none"}', "--shutdown-timeout", "30"], port,
                           tmp_path / "log")
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"prompt": "abc", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        text, finish = [], None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                before = len(text)
                finish = read_event(line, text, finish)
                if before == 0 and len(text) == 1:
                    process.send_signal(signal.SIGTERM)  # mid-request
        assert finish == "length" and len("".join(text)) > 0
        # uvicorn re-raises the signal once it has shut down gracefully
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "log").read_text()
    assert "Traceback" not in log and "Finished server process" in log, log


def test_bench_serve_rounds_alternate_modes_and_report_round_ratios(model_dir, tmp_path, capsys):
    """``bench-serve --rounds 2`` against a live server: every (round, level, mode) measured,
    the modes in turn first, and the summary's ratios taken round by round."""
    from specdecode.bench.serve import bench_serve

    prompts = [{"prompt": f"Count to {n}."} for n in range(4)]
    with ServerThread(model_dir, max_num_seqs=4) as server:
        rows = bench_serve(prompts, [1, 2], None, 2, 6, ["spec", "plain"], server.url, [], tmp_path / "b.json",
                           rounds=2)
    assert [(r["round"], r["concurrency"], r["mode"]) for r in rows] == [
        (0, 1, "spec"), (0, 1, "plain"), (0, 2, "spec"), (0, 2, "plain"),
        (1, 1, "plain"), (1, 1, "spec"), (1, 2, "plain"), (1, 2, "spec")]
    assert all(r["failed"] == 0 and r["output_tokens"] == r["requests"] * 6 for r in rows)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["serve_args"] is None and saved["rounds"] == 2 and len(saved["rows"]) == 8 and (tmp_path / "b.png").exists()
    by = {(r["round"], r["concurrency"], r["mode"]): r["output_throughput"] for r in rows}
    level2 = saved["summary"][1]
    ratios = sorted(by[i, 2, "spec"] / by[i, 2, "plain"] for i in (0, 1))
    assert level2["spec_over_plain"]["min"] == pytest.approx(ratios[0])
    assert level2["spec_over_plain"]["median"] == pytest.approx(sum(ratios) / 2)
    assert level2["plain_over_lowest"]["max"] == pytest.approx(max(by[i, 2, "plain"] / by[i, 1, "plain"] for i in (0, 1)))
    assert saved["summary"][0]["plain_over_lowest"] is None
    assert "over 2 rounds" in capsys.readouterr().out


def test_ratio_summary_takes_each_rounds_own_ratio():
    """A machine twice as fast in round 1: the medians of the throughputs move, the
    rounds' own ratios do not."""
    from specdecode.bench.serve import ratio_summary

    def row(i, level, mode, tok_s):
        return {"round": i, "concurrency": level, "request_rate": None, "mode": mode, "output_throughput": tok_s}

    rows = [row(0, 1, "spec", 150), row(0, 1, "plain", 100), row(0, 8, "spec", 250), row(0, 8, "plain", 250),
            row(1, 1, "plain", 200), row(1, 1, "spec", 300), row(1, 8, "plain", 500), row(1, 8, "spec", 500),
            row(2, 1, "spec", 160), row(2, 1, "plain", 100), row(2, 8, "spec", 240), row(2, 8, "plain", 260)]
    low, high = ratio_summary(rows)
    assert low["spec_over_plain"] == {"median": 1.5, "min": 1.5, "max": 1.6, "rounds": 3}
    assert low["plain_tok_s"] == 100 and low["plain_over_lowest"] is None
    assert high["plain_over_lowest"]["median"] == 2.5 and high["plain_over_lowest"]["min"] == 2.5
    assert high["spec_over_plain"]["median"] == 1.0
    assert high["spec_over_plain"]["min"] == pytest.approx(240 / 260)


def test_a_level_whose_requests_all_failed_has_no_throughput_and_no_ratio(tmp_path, capsys):
    """Found in review: such a level read 0.0 tok/s, and "0.00x [0.00, 0.00]" as its ratio."""
    from specdecode.bench.serve import plot, print_summary, print_table, ratio_summary, summarize

    def row(level, mode, tok_s):
        return {"round": 0, "concurrency": level, "request_rate": None, "mode": mode, "output_throughput": tok_s,
                "request_throughput": None if tok_s is None else 1.0, "requests": 2, "failed": 2 if tok_s is None else 0,
                "ttft": summarize([]), "tpot": summarize([]), "itl": summarize([]), "e2e": summarize([]),
                "acceptance_rate": None}

    rows = [row(1, "spec", None), row(1, "plain", 100.0), row(2, "spec", 150.0), row(2, "plain", None)]
    first, second = ratio_summary(rows)
    assert first["spec_tok_s"] is None and first["spec_over_plain"] is None
    assert second["plain_tok_s"] is None and second["spec_over_plain"] is None and second["plain_over_lowest"] is None
    print_summary([first, second], 1)
    print_table(rows)
    plot(rows, tmp_path / "p.png")
    assert "0.00x" not in capsys.readouterr().out


def test_bench_serve_warms_up_as_many_rows_as_its_widest_level(monkeypatch, tmp_path):
    """Found in review: the warm-up sent one request per prompt, so with fewer prompts than
    the widest level the server never ran that many rows before it was measured."""
    from specdecode.bench import serve

    calls = []

    async def run_level(url, model, prompts, max_tokens, mode, concurrency, rate, seed):
        calls.append((mode, len(prompts), max_tokens, concurrency))
        return {"mode": mode, "concurrency": concurrency, "request_rate": rate, "output_throughput": 1.0}

    class Measured(Exception):
        pass

    def measured(url):  # the first measured level: the warm-up is over
        raise Measured

    monkeypatch.setattr(serve, "run_level", run_level)
    monkeypatch.setattr(serve, "wait_for_audits", measured)
    with pytest.raises(Measured):
        serve.bench_serve([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], [1, 8], None, 16, 32,
                          ["spec", "plain"], "http://127.0.0.1:9", [], None, model="tiny")
    assert calls == [("spec", 8, 16, 8), ("plain", 8, 16, 8)]


def test_bench_serve_records_the_servers_arguments_without_its_key(monkeypatch, tmp_path, capsys):
    """The JSON names the arguments of the server bench-serve started (a --schedule task run
    and an fcfs run could not be told apart), with the API key hidden there and in the log
    line (found in review: written out in the first version)."""
    import httpx

    from specdecode.bench import serve

    class Process:
        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    async def run_level(url, model, prompts, max_tokens, mode, concurrency, rate, seed):
        return {"mode": mode, "concurrency": concurrency, "request_rate": rate, "output_throughput": 1.0,
                "request_throughput": 1.0, "requests": 1, "failed": 0, "errors": [], "ttft": serve.summarize([]),
                "tpot": serve.summarize([]), "itl": serve.summarize([]), "e2e": serve.summarize([]),
                "acceptance_rate": None}

    monkeypatch.setattr(serve, "start_server", lambda args, port, log: Process())
    monkeypatch.setattr(serve, "run_level", run_level)
    monkeypatch.setattr(serve, "wait_for_audits", lambda url: {"audit_requests_total": 0, "audit_mismatches_total": 0})
    monkeypatch.setattr(httpx, "post", lambda *args, **kwargs: httpx.Response(200))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = ["--schedule", "task", "--api-key", "sk-SECRET", "--api-key=sk-OTHER"]
    serve.bench_serve([{"prompt": "a"}], [1], None, 1, 4, ["spec"], None, args, tmp_path / "b.json", model="tiny")
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["serve_args"] == ["--schedule", "task", "--api-key", "***", "--api-key=***"]
    assert "SECRET" not in capsys.readouterr().err and "sk-" not in (tmp_path / "b.json").read_text()


def test_bench_serve_names_an_unreachable_server_and_sends_the_key(model_dir, monkeypatch):
    """Found in review: `bench-serve --url` to a server that was not running, or that wanted
    a key, ended in httpx's traceback or KeyError: 'data'."""
    from specdecode.bench.serve import served_model
    from specdecode.config import SpecDecodeError

    with pytest.raises(SpecDecodeError, match="cannot reach a server at http://127.0.0.1:9"):
        served_model("http://127.0.0.1:9")
    with ServerThread(model_dir, api_key="sekrit") as server:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        with pytest.raises(SpecDecodeError, match="set OPENAI_API_KEY"):
            served_model(server.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sekrit")
        assert served_model(server.url) == "tiny"


def test_audits_wait_for_a_quiet_engine_and_bench_serve_waits_for_them(model_dir):
    """Found in review: audits started in the milliseconds between a client's requests, so
    bench-serve's speculative levels timed audit re-runs and its plain levels none; and its
    wait for audits returned at once while the first ones were still queued (their count
    was 0). Audits now start after a quiet spell, and /metrics shows those pending."""
    import asyncio

    import httpx

    from specdecode.bench.serve import run_level, scrape, wait_for_audits

    with ServerThread(model_dir, max_num_seqs=2, audit_rate=1.0) as server:
        server.state.audit_idle_s = 1.0  # a quiet spell no gap between one client's requests reaches, however slow
        texts = [[{"role": "user", "content": f"abcabc abc {i}"}] for i in range(6)]
        asyncio.run(run_level(server.url, "tiny", texts, 40, "spec", 1, None, 0))  # closed loop, one client
        during = scrape(httpx.get(f"{server.url}/metrics").text)
        # none ran inside the level (requests that speculated are audited: the router may send some plain)
        assert during["audit_requests_total"] == 0 and during["audit_pending"] > 0
        done = wait_for_audits(server.url)
        assert done["audit_pending"] == 0 and done["audit_requests_total"] == during["audit_pending"]
