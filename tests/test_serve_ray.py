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


def test_two_replicas_serve_the_same_answers(tmp_path):
    from ray import serve

    from specdecode.serve.server import ray_application

    path = save_chat_model(tmp_path / "m", seed=12)
    port = free_port()
    config = EngineConfig(model=str(path), dtype="fp32", backend="torch", num_threads=1)
    application = ray_application(config, '{"method": "ngram", "num_speculative_tokens": 2}', replicas=2,
                                  max_num_seqs=4, max_queued_requests=16, served_model_name="tiny")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
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
        ray.shutdown()
    reference = load_model(str(path), torch.float32, backend="torch")
    plain = SpeculativeEngine(reference.runtime, reference.tokenizer)
    expected = [plain.generate(reference.tokenizer(p)["input_ids"],
                               SamplingParams(max_new_tokens=8, ignore_eos=True)).text for p in prompts]
    assert [text for text, _ in answers] == expected
    assert len({replica for _, replica in answers}) == 2  # both replicas answered
