"""--replicas: the same app on Ray Serve, two replicas on loopback."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from conftest import save_chat_model
from specdecode.bench.serve import free_port
from specdecode.config import EngineConfig, SamplingParams
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_sigterm_lets_a_stream_in_flight_finish(tmp_path):
    """Found in review: under --replicas the driver blocked in Ray's wait, which takes
    Ctrl-C only; SIGTERM killed it and cut every stream in flight, and --shutdown-timeout
    never reached the deployment. Now the replicas drain behind the proxy. First in the
    module: its server starts a Ray of its own, before ray_session's is up."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import save_char_tokenizer

    torch.manual_seed(0)  # wide enough that a long stream takes seconds on the torch backend
    config = AutoConfig.for_model("llama", vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "m")
    save_char_tokenizer(tmp_path / "m")
    port = free_port()
    command = [str(Path(sys.executable).parent / "specdecode"), "serve", "--model", str(tmp_path / "m"), "--replicas",
               "1", "--speculative-config", '{"method": "none"}', "--dtype", "fp32", "--backend", "torch", "--threads",
               "1", "--port", str(port), "--shutdown-timeout", "300"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, received = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)

        def stream():
            body = {"prompt": "abc", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        received.append(line[6:])

        reader = threading.Thread(target=stream)
        reader.start()
        while not received and reader.is_alive():
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        reader.join(300)
        assert server.wait(300) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert received and received[-1] == "[DONE]" and len(received) > 100


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the in-process tests (starting it took about 10 s a test)."""
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_replicas_serve_the_same_answers(tmp_path, ray_session):
    from ray import serve

    from specdecode.serve.server import ray_application

    path = save_chat_model(tmp_path / "m", seed=12)
    port = free_port()
    config = EngineConfig(model=str(path), dtype="fp32", backend="torch", num_threads=1)
    application = ray_application(config, '{"method": "ngram", "num_speculative_tokens": 2}', replicas=2,
                                  max_num_seqs=4, max_queued_requests=16, served_model_name="tiny")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application, name="specdecode", route_prefix="/", blocking=False)
        prompts = [f"{'abcdefgh'[i % 8] * (2 + i % 4)}x{i}" for i in range(24)]

        def ask(prompt):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                  json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            body = response.json()
            return body["choices"][0]["text"], body["system_fingerprint"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        serve.shutdown()
    reference = load_model(str(path), torch.float32, backend="torch")
    plain = SpeculativeEngine(reference.runtime, reference.tokenizer)
    expected = [plain.generate(reference.tokenizer(p)["input_ids"],
                               SamplingParams(max_new_tokens=8, ignore_eos=True)).text for p in prompts]
    assert [text for text, _ in answers] == expected
    assert len({replica for _, replica in answers}) == 2  # both replicas answered


def test_overload_is_the_replicas_own_json_503(tmp_path, ray_session):
    """Found in review: Ray's own queue limit answered part of a burst's 503s in plain text,
    without Retry-After, and let one request more than --max-queued-requests 0 through to
    wait. Each replica now answers overload itself, as the single server does."""
    from ray import serve

    from specdecode.serve.server import ray_application

    path = save_chat_model(tmp_path / "m", seed=12)
    port = free_port()
    config = EngineConfig(model=str(path), dtype="fp32", backend="torch", num_threads=1)
    application = ray_application(config, '{"method": "none"}', replicas=1, max_num_seqs=1, max_queued_requests=0,
                                  served_model_name="tiny")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application, name="specdecode", route_prefix="/", blocking=False)

        def ask(index):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                                  json={"prompt": f"abc{index}", "max_tokens": 240, "ignore_eos": True})
            return response.status_code, response.headers.get("content-type"), response.headers.get("Retry-After"), \
                response.text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, range(8)))
    finally:
        serve.shutdown()
    refused = [reply for reply in replies if reply[0] != 200]
    assert refused and len(refused) < len(replies), [reply[:3] for reply in replies]
    for status, kind, retry_after, text in refused:
        assert status == 503 and kind == "application/json" and retry_after == "1", (status, kind, text[:200])
