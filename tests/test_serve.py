"""specdecode serve: the OpenAI API through the official client, errors, metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from conftest import save_chat_model, tiny_server_state
from specdecode.config import ConfigError, SamplingParams
from specdecode.engine import SpeculativeEngine
from specdecode.factory import load_model
from specdecode.serve.app import create_app
from specdecode.serve.server import parse_speculative_config

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("serve"), seed=4)


def make_client(model_dir, spec='{"method": "ngram", "num_speculative_tokens": 3}', **kwargs):
    state = tiny_server_state(model_dir, spec, **kwargs)
    return TestClient(create_app(state, state.tokenizer)), state


@pytest.fixture(scope="module")
def served(model_dir):
    client, state = make_client(model_dir, max_num_seqs=4)
    # the server owns its runtime's cache: references run on a second copy of the model
    reference_model = load_model(str(model_dir), torch.float32, backend="torch")
    with client:
        yield client, state, reference_model


def openai_client(client, api_key="unused"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=client, max_retries=0)


def reference(target, prompt_ids, max_tokens, stop=()):
    engine = SpeculativeEngine(target.runtime, target.tokenizer, None, 1, target.eos_token_ids)
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_tokens, stop=tuple(stop)))


def test_completion_and_chat_match_plain_decoding(served):
    client, state, target = served
    api = openai_client(client)
    prompt = "abcabcabcab"
    completion = api.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    expected = reference(target, target.tokenizer(prompt)["input_ids"], 20)
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason
    assert completion.usage.completion_tokens == len(expected.token_ids)
    extension = completion.model_extra["speculative"]
    assert extension["method"] == "ngram" and extension["drafted_tokens"] >= extension["accepted_tokens"]

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "xyzxyz"}]
    chat = api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=15, temperature=0)
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat.choices[0].message.content == reference(target, list(ids["input_ids"]), 15).text
    assert chat.choices[0].message.role == "assistant"


def test_streaming_with_usage_and_stop_strings(served):
    client, state, target = served
    api = openai_client(client)
    prompt = "hello hello hello"
    full = reference(target, target.tokenizer(prompt)["input_ids"], 24)
    stop = full.text[5:7]
    expected = full.text[: full.text.find(stop)]
    chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    # vLLM's stop_reason: the stop string on the last choice chunk, null before it and
    # where the budget ended the text (found in review: absent)
    reasons = [c.choices[0].model_extra.get("stop_reason", "absent") for c in chunks if c.choices]
    assert reasons[-1] == stop and set(reasons[:-1]) <= {None}, reasons
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["@never@", stop]}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["stop_reason"] == stop
    assert client.post("/v1/completions", json={**body, "stop": None, "max_tokens": 3}).json()["choices"][0][
        "stop_reason"] is None
    raw = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                                               "stream_options": {"include_usage": True}}).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["total_tokens"] > 0

    stream = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=10,
                                         temperature=0, stream=True)
    deltas = list(stream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_per_request_speculation(served):
    client, state, target = served
    api = openai_client(client)
    runs = [api.completions.create(model="tiny", prompt="qwerty", max_tokens=16, temperature=0.9, seed=3,
                                   extra_body={"speculative": {"num_speculative_tokens": 2}}) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    # with k auto the drafts per step follow what the policy learnt from every request so
    # far; the target's own draws still give the tokens plain sampling gives
    sampled = dict(model="tiny", prompt="abcabcabcabcabc", max_tokens=24, temperature=0.8, seed=5)
    alone = api.completions.create(extra_body={"speculative": {"enabled": False}}, **sampled).choices[0].text
    for _ in range(3):
        again = api.completions.create(extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": "auto"}},
                                       **sampled)
        assert again.choices[0].text == alone
    plain = api.completions.create(model="tiny", prompt="abababab", max_tokens=12, temperature=0,
                                   extra_body={"speculative": {"enabled": False}})
    assert plain.model_extra["speculative"]["method"] == "none"
    echoed = api.completions.create(model="tiny", prompt="abababab", max_tokens=12, temperature=0, echo=True)
    assert echoed.choices[0].text == "abababab" + plain.choices[0].text
    assert plain.model_extra["speculative"]["drafted_tokens"] == 0
    drafted = api.completions.create(model="tiny", prompt="abababab", max_tokens=12, temperature=0,
                                     extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": 4},
                                                 "task_type": "code"})
    assert drafted.choices[0].text == plain.choices[0].text
    assert drafted.model_extra["speculative"]["drafted_tokens"] > 0
    assert drafted.model_extra["speculative"]["task_type"] == "code"


def test_n_choices_are_the_requests_with_seeds_seed_plus_index(served):
    """n > 1: choice i is what the same request alone samples with seed + i, streamed or
    not; greedy choices are all the plain decoding; usage counts the prompt once and every
    choice's tokens."""
    client, state, target = served
    api = openai_client(client)
    kwargs = dict(model="tiny", prompt="many samples of one prompt: qwerty", max_tokens=10, temperature=0.9)
    several = api.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in several.choices] == [0, 1, 2]
    responses = [api.completions.create(seed=7 + i, **kwargs) for i in range(3)]
    alone = [r.choices[0].text for r in responses]
    assert [c.text for c in several.choices] == alone
    assert len(set(alone)) > 1  # the seeds differ, and so do the samples
    assert several.usage.prompt_tokens == len(target.tokenizer(kwargs["prompt"])["input_ids"])
    assert several.usage.completion_tokens == sum(r.usage.completion_tokens for r in responses)
    texts = {0: "", 1: "", 2: ""}
    chunks = list(api.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[i] for i in range(3)] == alone
    assert chunks[-1].usage.completion_tokens == several.usage.completion_tokens
    messages = [{"role": "user", "content": "xyzxyz"}]
    greedy = api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0, n=2)
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = reference(target, list(ids["input_ids"]), 8).text
    assert [c.message.content for c in greedy.choices] == [expected, expected]


def test_concurrent_greedy_requests_equal_their_outputs_alone(served):
    client, state, target = served
    prompts = [f"{chr(97 + i % 26) * (1 + i % 5)}{i}xy{i}" for i in range(16)]

    def ask(prompt):
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                        "temperature": 0})
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts == [reference(target, target.tokenizer(p)["input_ids"], 12).text for p in prompts]

    def ask_auto(prompt):  # adaptive k per request, its policy built at startup, not mid-batch
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                        "speculative": {"num_speculative_tokens": "auto"}})
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask_auto, prompts)) == texts


@pytest.mark.parametrize("body, status, fragment", [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "n": 1000}, 400, "n = 1000 exceeds what the server holds"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "a" * 300}, 400, "context is 256 tokens"),
    ({"prompt": "hi", "max_tokens": 300}, 400, "maximum context length is 256 tokens"),  # was cut short silently
    ({"prompt": "hi", "speculative": {"method": "medusa"}}, 400, "not available"),
    # named as the client sent it, not as our "draft" (found in review)
    ({"prompt": "hi", "speculative": {"method": "draft_model"}}, 400, "method 'draft_model' is not available"),
    ({"prompt": "hi", "speculative": {"num_speculative_tokens": 0}}, 400, "num_speculative_tokens"),
    ({"prompt": "hi", "speculative": {"bogus": 1}}, 400, "bogus"),
    ({"prompt": "hi", "task_type": "poetry"}, 400, "task_type"),
    ({}, 400, "prompt"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "hi", "logit_bias": {"5": -100}}, 400, "logit_bias"),  # these were accepted and ignored
    ({"prompt": "hi", "frequency_penalty": 1.5}, 400, "frequency_penalty"),
    ({"prompt": "hi", "presence_penalty": -0.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "model": "gpt-4", "max_tokens": 2}, 404, "does not exist"),
    ({"prompt": "", "model": "gpt-4"}, 404, "does not exist"),  # the model before the prompt
    ({"prompt": ["a", "b"]}, 400, "batch of prompts"),
    ({"prompt": [[1, 2], [3]]}, 400, "batch of prompts"),  # OpenAI's batch of token lists (found in review)
    ({"prompt": "hi", "stop": 5}, 400, "stop: must be one of str, list[str]"),  # param was "stop.str"
    ({"prompt": [-1], "echo": True}, 400, "vocabulary"),  # found by schemathesis: echo decoded the ids first
    # vLLM's and OpenAI's parameters that change the answer: refused, never ignored (found in review)
    ({"prompt": "hi", "stop_token_ids": [51]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ({"prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ({"prompt": "hi", "structured_outputs": {"choice": ["a"]}}, 400, "structured_outputs"),
    ({"prompt": "hi", "functions": [{"name": "f"}]}, 400, "functions"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "only allowed when stream is true"),
    ({"prompt": "\ud800 hi"}, 400, "not valid UTF-8 text (lone surrogate U+D800 at character 0)"),  # was a 500
    ({"prompt": "hi", "priority": 5}, 400, "priority"),  # found in review: these four were accepted and ignored
    ({"prompt": "hi", "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ({"prompt": "hi", "modalities": ["text", "audio"]}, 400, "modalities"),
    ({"prompt": "hi", "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ({"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
])
def test_errors_are_openai_json(served, body, status, fragment):
    client, _, _ = served
    response = client.post("/v1/completions", content=json.dumps(body),  # ASCII JSON: escapes a lone surrogate
                           headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_validation_errors_name_the_param_and_take_json_types_as_sent(served):
    """Found in review: a validation 400 put the field's name in ``type`` and left
    ``param`` null; lax parsing read ``"max_tokens": true`` as 1 token, ``[true, 5]`` as
    token ids and ``"stream": "yes"`` as a stream; an explicit null for ``n``, ``stream``
    or ``echo`` (which OpenAI's schema allows) was refused; ``max_completion_tokens`` on
    /v1/completions was ignored (the reply ran to 16 tokens); and a chat request over the
    context with ``max_completion_tokens`` was told about ``max_tokens``."""
    client, _, _ = served
    for body, param in (({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "hi", "temperature": 3}, "temperature"),
                        ({"prompt": "hi", "n": 0}, "n"),
                        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
                        ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
                        ({"prompt": [True, 5], "max_tokens": 2}, "prompt"),
                        ({"prompt": "hi", "stream": "yes"}, "stream"),
                        ({"prompt": "hi", "n": True}, "n"),
                        ({"prompt": "hi", "temperature": False}, "temperature"),  # was greedy (found in review)
                        ({"prompt": "hi", "temperature": "0"}, "temperature"),
                        ({"prompt": "hi", "top_p": True}, "top_p"),  # was 1.0
                        ({"prompt": "hi", "max_completion_tokens": 40}, "max_completion_tokens")):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), (body, error)
    nulls = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0, "n": None,
                                                 "stream": None, "echo": None, "ignore_eos": None})
    plain = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
    assert nulls.status_code == 200 and nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 10 ** 6})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_completion_tokens"
    response = client.post("/v1/chat/completions", json={**chat, "add_special_tokens": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "add_special_tokens"
    # a chat beyond the context names its messages, not a "prompt" parameter chat does not have
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 5000}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text


def test_add_special_tokens_is_honoured_on_completions(tmp_path):
    """Found in review: vLLM's ``add_special_tokens`` was accepted and ignored, so a text
    prompt kept its BOS when the client asked for none (a silently different answer)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = save_chat_model(tmp_path / "bos", seed=4)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save_pretrained(path)
    client, _ = make_client(path)
    with client:
        body = {"prompt": "abcab", "max_tokens": 4, "temperature": 0}
        with_bos = client.post("/v1/completions", json=body).json()
        without = client.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
        ids = client.post("/v1/completions", json={**body, "prompt": tokenizer("abcab", add_special_tokens=False)["input_ids"]}).json()
    assert with_bos["usage"]["prompt_tokens"] == 6 and without["usage"]["prompt_tokens"] == 5
    assert without["choices"][0]["text"] == ids["choices"][0]["text"]


def test_malformed_json_unknown_route_and_models(served):
    client, _, _ = served
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] is None
    assert response.json()["error"]["message"].startswith("the body is not valid JSON")  # was "10: JSON decode error"
    single = client.post("/v1/completions", json={"prompt": [[5, 6, 7]], "max_tokens": 2, "temperature": 0})
    assert single.status_code == 200 and single.json()["usage"]["prompt_tokens"] == 3
    assert client.get("/v1/nothing").status_code == 404
    wrong_method = client.get("/v1/completions")  # a 405 names the methods the route takes, as HTTP asks
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    models = openai_client(client).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.get("/health").status_code == 200


def test_metrics_use_vllm_names(served):
    client, state, _ = served
    client.post("/v1/completions", json={"prompt": "abcabcabc", "max_tokens": 8, "temperature": 0,
                                         "speculative": {"num_speculative_tokens": 3}})
    text = client.get("/metrics").text
    for name in ("specdecode:spec_decode_num_drafts_total", "specdecode:spec_decode_num_draft_tokens_total",
                 "specdecode:spec_decode_num_accepted_tokens_total", "specdecode:time_to_first_token_seconds_bucket",
                 "specdecode:inter_token_latency_seconds_bucket", "specdecode:e2e_request_latency_seconds_bucket",
                 "specdecode:num_requests_running", "specdecode:num_requests_waiting",
                 "specdecode:prompt_tokens_total", "specdecode:generation_tokens_total",
                 'specdecode:request_success_total{finished_reason="length",model_name="tiny"}',
                 "specdecode:task_acceptance_rate",
                 # every other series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana)
                 # queries: 6 of its 11 panels were empty (found in review)
                 "specdecode:time_per_output_token_seconds_bucket", "specdecode:kv_cache_usage_perc",
                 "specdecode:request_prompt_tokens_bucket", "specdecode:request_generation_tokens_bucket",
                 "specdecode:request_queue_time_seconds_sum", "specdecode:request_prefill_time_seconds_sum",
                 "specdecode:request_decode_time_seconds_sum", "specdecode:request_max_num_generation_tokens_sum",
                 "specdecode:request_time_per_output_token_seconds_bucket", "specdecode:request_params_max_tokens_sum"):
        assert name in text, name
    assert 'le="2560.0"' in text  # vLLM's TTFT buckets
    value = lambda name: state.metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "tiny"})  # noqa: E731
    assert value("request_generation_tokens_count") >= 1 and value("request_generation_tokens_sum") >= 8
    assert value("request_params_max_tokens_sum") >= 8 and value("request_prefill_time_seconds_count") >= 1
    assert 0 <= value("kv_cache_usage_perc") <= 1


def test_a_request_is_in_the_metrics_when_its_client_has_the_response(model_dir, monkeypatch):
    """Found through a flaky test: a finished request was counted (success, e2e, prefix hits,
    the router's lesson) after the engine's step, while its client already had the
    response, so /metrics read right after a response could miss it. Reporting is slowed
    here to make that order show whenever it is wrong."""
    from specdecode.serve.app import ServerState

    finished = ServerState._finished

    def slow(self, sequence):
        time.sleep(0.3)
        finished(self, sequence)

    monkeypatch.setattr(ServerState, "_finished", slow)
    client, state = make_client(model_dir)
    with client:
        for round_ in range(1, 3):
            response = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 4, "temperature": 0,
                                                            "stream": round_ == 2})
            assert response.status_code == 200
            success = state.metrics.success.labels(model_name="tiny", finished_reason="length")._value.get()
            assert success == round_


def test_the_last_steps_tokens_and_the_running_gauge_are_counted_when_the_client_has_its_reply(model_dir):
    """Found in review: a step's tokens and the running gauge were counted after the step,
    while the client already had its reply: /metrics read then was short of the last
    step's tokens and still showed the request running (11 of 20 requests). The step that
    produced only the EOS is an inter-token gap, as vLLM counts it."""
    client, state = make_client(model_dir, max_num_seqs=4)

    def value(name):
        return state.metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "tiny"}) or 0

    with client:
        for i in range(10):
            before = value("generation_tokens_total")
            reply = client.post("/v1/completions", json={"prompt": f"abcabc {i}", "max_tokens": 8, "temperature": 0})
            assert value("generation_tokens_total") - before == reply.json()["usage"]["completion_tokens"]
            assert value("num_requests_running") == 0
        body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "speculative": {"enabled": False}}
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])  # a later token made the EOS
        state.engine.eos_token_ids = frozenset({eos})
        gaps = value("inter_token_latency_seconds_count")
        reply = client.post("/v1/completions", json=body).json()
        assert reply["choices"][0]["finish_reason"] == "stop"
        # a gap per token after the first, the EOS's included
        assert value("inter_token_latency_seconds_count") - gaps == reply["usage"]["completion_tokens"] - 1
        # and a null max_completion_tokens is the default, as null is everywhere else (it was a 400)
        assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                                     "max_completion_tokens": None}).status_code == 200


def test_a_repeated_prompt_reuses_its_cached_prefix(served):
    """Automatic prefix caching: the same prompt again starts from the first one's KV
    entries (all its tokens but the last), reported as OpenAI's cached_tokens and in
    vLLM's prefix-cache counters, and answers the same; after /reset_prefix_cache it is
    prefilled in full."""
    client, state, target = served
    api = openai_client(client)
    prompt = "the same long prompt, asked twice: abcdefgh"
    before = state.metrics.prefix_hits.labels(model_name="tiny")._value.get()
    first, second = (api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0) for _ in range(2))
    assert second.choices[0].text == first.choices[0].text
    prompt_tokens = len(target.tokenizer(prompt)["input_ids"])
    assert second.usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
    after = state.metrics.prefix_hits.labels(model_name="tiny")._value.get()
    assert after - before == first.usage.prompt_tokens_details.cached_tokens + prompt_tokens - 1
    text = client.get("/metrics").text
    assert "specdecode:prefix_cache_queries_total" in text and "specdecode:prefix_cache_hits_total" in text
    assert client.post("/reset_prefix_cache").status_code == 200  # vLLM's route: forget them all
    third = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0 and third.choices[0].text == first.choices[0].text


def test_a_cache_salt_keeps_prefixes_apart(served):
    """vLLM's cache_salt: a prefix cached for one salt is not reused (nor reported in
    cached_tokens) for another, or for none; the same salt reuses it. Found in review:
    accepted and ignored, so one tenant learnt from cached_tokens how much of its prompt
    another's recent prompt shared."""
    client, _, target = served
    prompt = "a system prompt two tenants share, long enough to be worth caching: wxyz"
    prompt_tokens = len(target.tokenizer(prompt)["input_ids"])

    def cached(**salt):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, **salt})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"], response.json()["choices"][0]["text"]

    assert client.post("/reset_prefix_cache").status_code == 200
    first, text = cached(cache_salt="tenant-a")
    assert first == 0
    assert cached(cache_salt="tenant-b") == (0, text) and cached() == (0, text)
    assert cached(cache_salt="tenant-a") == (prompt_tokens - 1, text)


def test_chat_messages_reach_the_template_with_their_names_and_tool_calls(served):
    """Found in review: a message's name, tool_calls and tool_call_id were dropped, so the
    model read another conversation than the one sent (vLLM hands them to the template)."""
    client, state, _ = served
    tokenizer = state.tokenizer  # the server's own
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}{% if m.get('name') %}({{ m['name'] }}){% endif %}:"
                               "{{ m['content'] }}{% if m.get('tool_calls') %}call:{{ m['tool_calls'][0]['function']['name'] }}"
                               "{% endif %}{% if m.get('tool_call_id') %}#{{ m['tool_call_id'] }}{% endif %}|{% endfor %}a:")
    try:
        messages = [{"role": "user", "content": "hi", "name": "bob"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"}]
        response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        rendered = "user(bob):hi|assistant:call:f|tool:42#c1|a:"
        assert response.json()["usage"]["prompt_tokens"] == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    finally:
        tokenizer.chat_template = template


def test_tool_call_arguments_reach_the_template_parsed_as_vllm_hands_them(served):
    """Found in review: OpenAI's function.arguments (a JSON string) reached the template as
    that string, so a template writing ``arguments | tojson`` (Qwen2.5's, Llama 3.1's)
    showed the model double-encoded JSON; vLLM parses it first. Unparsable ones are a 400."""
    client, state, _ = served
    tokenizer = state.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
                               "<{{ c.function.arguments | tojson }}>{% endfor %}{% else %}{{ m.content }}{% endif %}|"
                               "{% endfor %}a:")
    try:
        def call(arguments):
            return [{"role": "user", "content": "add"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}]
        response = client.post("/v1/chat/completions", json={"messages": call('{"a": 1}'), "max_tokens": 1,
                                                             "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        rendered = 'user:add|assistant:<{"a": 1}>|a:'  # parsed, then written back by tojson
        assert response.json()["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        response = client.post("/v1/chat/completions", json={"messages": call("{not json"), "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        # nested past the parser's recursion limit: a 400 too (found in review: a 500)
        response = client.post("/v1/chat/completions", json={"messages": call("[" * 100_000), "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    finally:
        tokenizer.chat_template = template


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path):
    """As vLLM (--generation-config auto): a request that leaves temperature, top_p or top_k
    out gets the checkpoint's (found in review: always 1.0 / 1.0 / off). top_k 1 there makes
    every draw the argmax, so a request with no sampling parameters decodes greedily."""
    model = save_chat_model(tmp_path / "model", seed=4)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6, "top_k": 1}))
    client, state = make_client(model)
    assert state.sampling_defaults == {"temperature": 0.6, "top_k": 1}
    body = {"prompt": "abcabcabc", "max_tokens": 12}
    with client:
        greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        for seed in (1, 2):
            assert client.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]["text"] == greedy
        hot = {client.post("/v1/completions", json={**body, "seed": seed, "top_k": 0, "temperature": 2.0}
                           ).json()["choices"][0]["text"] for seed in (1, 2, 3)}
        assert hot != {greedy}  # the request's own values win


def test_sampling_defaults_are_numbers_of_the_right_kind(tmp_path):
    """Found in review: a generation_config.json with "top_k": 40.0 was checked as int(40.0)
    but handed to requests as the float, so every request that left top_k out failed in its
    first step, and the failure aborted every running request with it."""
    from specdecode.serve.server import sampling_defaults

    model = save_chat_model(tmp_path / "model", seed=4)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 1, "top_k": 40.0}))
    defaults = sampling_defaults(model)
    assert defaults == {"temperature": 1.0, "top_k": 40} and type(defaults["top_k"]) is int
    client, _ = make_client(model)
    with client:
        response = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 4, "seed": 1})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_k": 2.5}))
    with pytest.raises(ConfigError, match="sampling defaults are not usable.*top_k must be a whole number"):
        sampling_defaults(model)


def test_bad_stop_strings_other_parameters_and_a_form_body_are_clear_errors(served):
    """Found in review: a stop string holding a lone surrogate (valid JSON, not UTF-8) was a
    500; verbosity and web_search_options were accepted and ignored; a JSON body sent with
    curl -d's form type got "body: Input should be a valid dictionary"."""
    client, _, _ = served
    for path, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 2, "stop": "\ud800"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2,
                                                 "stop": ["x", "\udc80"]})):
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
    for extra in ({"verbosity": "low"}, {"web_search_options": {}}):
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                              "max_tokens": 2, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(extra))
    response = client.post("/v1/completions", content='{"prompt": "ab", "max_tokens": 1}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]
    # and with no Content-Type at all (requests.post(data=...); found in review: the same riddle)
    request = client.build_request("POST", "/v1/completions", content=b'{"prompt": "ab", "max_tokens": 1}')
    assert "content-type" not in request.headers
    response = client.send(request)
    assert response.status_code == 415 and "no Content-Type" in response.json()["error"]["message"], response.text


def test_unknown_keys_and_messages_without_content_are_refused_by_name(served):
    """Found in review: a misspelt key ("temprature", "max_new_tokens", "stop_sequences")
    ran with the default, and a message {"role": "user", "contents": ...} or with no content
    at all was answered as an empty message."""
    client, _, _ = served
    chat = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}
    for path, body, param in (("/v1/completions", {"prompt": "ab", "max_tokens": 2, "temprature": 0.5}, "temprature"),
                              ("/v1/completions", {"prompt": "ab", "max_new_tokens": 2}, "max_new_tokens"),
                              ("/v1/chat/completions", {**chat, "stop_sequences": ["c"]}, "stop_sequences"),
                              ("/v1/chat/completions", {**chat, "prompt": "other"}, "prompt")):
        response = client.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert param in response.json()["error"]["message"]
    for message in ({"role": "user", "contents": "write a poem"}, {"role": "user"}, {"role": "system", "content": None},
                    {"role": "user", "text": "hello"}):
        response = client.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2})
        assert response.status_code == 400 and "messages" in response.json()["error"]["message"], response.text
    # what OpenAI's clients send that changes no answer still runs, and so does a null
    for extra in ({"user": "u1", "metadata": {"a": "b"}, "store": False}, {"temprature": None}):
        assert client.post("/v1/chat/completions", json={**chat, **extra}).status_code == 200
    refused = {"role": "assistant", "content": None, "refusal": "no"}
    assert client.post("/v1/chat/completions", json={**chat, "messages": [chat["messages"][0], refused,
                                                                          chat["messages"][0]]}).status_code == 200
    # a reply sent back as the openai client dumps it (found in review of the first version: a 400)
    dumped = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None, "reasoning_content": "..."}
    history = [chat["messages"][0], dumped, chat["messages"][0]]
    assert client.post("/v1/chat/completions", json={**chat, "messages": history}).status_code == 200
    for key, value in (("audio", {"id": "a1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        response = client.post("/v1/chat/completions", json={**chat, "messages": [{**dumped, key: value}]})
        assert response.status_code == 400 and "not supported" in response.json()["error"]["message"], response.text
    # vLLM's own keys at their defaults run; otherwise they are refused as not supported, by name
    for path, body in (("/v1/chat/completions", {**chat, "echo": False, "include_reasoning": True}),
                       ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "kv_transfer_params": {},
                                            "vllm_xargs": {}, "return_tokens_as_token_ids": False})):
        assert client.post(path, json=body).status_code == 200, body
    response = client.post("/v1/chat/completions", json={**chat, "echo": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    assert "not supported" in response.json()["error"]["message"]


def test_speculative_options_that_would_be_ignored_are_refused(served):
    """Found in review: {"enabled": false, "method": "hydra"}, method "none" with a k, and
    an empty method each ran (plainly, or with the server's default method)."""
    client, _, _ = served
    for options in ({"enabled": False, "method": "hydra"}, {"enabled": False, "num_speculative_tokens": 5},
                    {"method": "none", "num_speculative_tokens": 3}, {"method": ""}):
        response = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 2, "speculative": options})
        error = response.json()["error"]
        assert response.status_code == 400 and "speculative" in error["param"], (options, response.text)
    for options in ({"enabled": False}, {"method": "none"}, {"method": "ngram", "num_speculative_tokens": 2}):
        response = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 2, "speculative": options})
        assert response.status_code == 200, (options, response.text)


def test_api_key_and_full_queue(model_dir):
    client, state = make_client(model_dir, api_key="sekret", max_queued_requests=0)
    with client:
        with pytest.raises(openai.AuthenticationError):
            openai_client(client, api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
        # a client without the key gets 401 before any word on its body
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 401
        assert client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
                           ).status_code == 401
        # nor of its routes or its body's encoding (found in review: 404 and 400 without the key)
        assert client.post("/v1/foo", json={}).status_code == 401
        assert client.post("/v1/completions", content=b'{"prompt": "\xff"}',
                           headers={"content-type": "application/json"}).status_code == 401
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                               headers={"Authorization": "Bearer sekret"})
        assert response.status_code == 200  # a free row takes it: no queue needed
        response = client.post("/v1/completions", json={"prompt": "hi", "n": 9},
                               headers={"Authorization": "Bearer sekret"})
        assert response.status_code == 400 and "exceeds what the server holds" in response.json()["error"]["message"]

    # a key no client can send is refused at start (found in review: served, every request a 401)
    from specdecode.config import ConfigError
    from specdecode.serve.server import check_api_key

    for key in (" padded ", "clé", "tab\tkey"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            check_api_key(key)
    check_api_key("sk-Abc_123.~")


def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """Found in review: a 10 MB prompt was tokenized on the event loop, which held every
    stream and /health for 21 s."""
    import threading

    client, state, _ = served
    tokenizer = state.tokenizer
    seen = []
    encode = type(tokenizer).__call__

    def recording(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording)
    assert client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 1}).status_code == 200
    assert seen and all(name.startswith("specdecode-encode") for name in seen), seen


def wait_for(condition, limit: float = 20.0) -> None:
    """Poll ``condition`` until it holds (the engine thread works meanwhile); fail after ``limit`` s."""
    deadline = time.time() + limit
    while not condition() and time.time() < deadline:
        time.sleep(0.002)
    assert condition()


def test_a_full_queue_is_a_503_and_an_audit_gives_its_row_back(model_dir, monkeypatch):
    """Found in review: no test saw the 503 over HTTP (its JSON and Retry-After). And an
    audit's re-run held its row to its end: with one row and no queue, a lone client got
    "queue full" from a server whose gauges showed nothing running. The re-run now gives
    the row back and runs again later. Steps are slowed so that a request lasts."""
    from specdecode.serve.batch import BatchEngine

    step = BatchEngine.step

    def slow(self):
        time.sleep(0.01)
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", slow)
    long = {"prompt": "abcabc", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    short = {"prompt": "hi", "max_tokens": 2}

    client, state = make_client(model_dir, max_num_seqs=1, max_queued_requests=0)
    with client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/v1/completions", json=long)
        wait_for(lambda: state.engine.running)
        response = client.post("/v1/completions", json=short)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        assert first.result().status_code == 200
    client, state = make_client(model_dir, max_num_seqs=1, max_queued_requests=0, audit_rate=1.0)
    with client:
        assert client.post("/v1/completions", json=long).status_code == 200
        wait_for(lambda: any(s.audit_of is not None for s in list(state.engine.running)))
        assert client.post("/v1/completions", json=short).status_code == 200
        checked = state.metrics.audit_checked.labels(model_name="tiny")
        wait_for(lambda: checked._value.get() >= 1)  # run again once the row was free
        assert state.auditor.mismatches == []


def test_an_audit_gives_way_to_a_user_request_even_beside_a_free_row(model_dir, monkeypatch):
    """Found in review: an audit gave its row back only when no row was free, so a request
    arriving beside a free row waited behind the audit's prefill chunks and decoded beside
    it (48 steps for one token in the review's run). Audits now run only while no user
    request waits or runs."""
    from specdecode.serve.batch import BatchEngine

    step = BatchEngine.step

    def slow(self):
        time.sleep(0.005)
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", slow)

    client, state = make_client(model_dir, max_num_seqs=2, audit_rate=1.0)
    state.engine.prefill_chunk = 4
    with client:
        assert client.post("/v1/completions", json={"prompt": "abcdefghij" * 20, "max_tokens": 4,
                                                   "temperature": 0}).status_code == 200
        wait_for(lambda: any(s.audit_of is not None and s.prefilled > 0 for s in list(state.engine.running)))
        before = state.engine.steps
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert state.engine.steps - before <= 3  # admitted, prefilled and decoded at once
        checked = state.metrics.audit_checked.labels(model_name="tiny")
        wait_for(lambda: checked._value.get() >= 2)  # both requests audited, once idle
        assert state.auditor.mismatches == []


def test_a_request_whose_drafter_failed_is_still_audited(model_dir, monkeypatch):
    """Found in review: a drafter's failure left the request without a proposer, and the
    audit took it for a request that never speculated."""
    from specdecode.proposers.ngram import NgramProposer

    propose, calls = NgramProposer.propose, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("drafter broke")
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(NgramProposer, "propose", failing)
    client, state = make_client(model_dir, audit_rate=1.0)
    with client:
        response = client.post("/v1/completions", json={"prompt": "abcabcabc", "max_tokens": 20, "temperature": 0,
                                                        "ignore_eos": True})
        assert response.status_code == 200 and len(calls) >= 3
        checked = state.metrics.audit_checked.labels(model_name="tiny")
        wait_for(lambda: checked._value.get() >= 1)
        assert checked._value.get() == 1 and state.auditor.mismatches == []


def test_an_error_while_failing_a_step_leaves_the_engine_serving(model_dir, monkeypatch):
    """Found in review: ending the requests of a failed step detokenizes and calls their
    listeners again, unguarded; when that failed too, the engine thread died, and the
    request in flight and every later one waited forever."""
    from specdecode.serve.batch import BatchEngine

    step, finish = BatchEngine.step, BatchEngine._finish
    trouble = {"step": 1, "finish": 1}

    def bad_step(self):
        if trouble["step"] and self.running:
            trouble["step"] -= 1
            raise RuntimeError("a step fails")
        return step(self)

    def bad_finish(self, sequence, reason, *args, **kwargs):
        if trouble["finish"] and reason == "abort":
            trouble["finish"] -= 1
            raise ValueError("and so does ending its requests")
        return finish(self, sequence, reason, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "step", bad_step)
    monkeypatch.setattr(BatchEngine, "_finish", bad_finish)
    client, state = make_client(model_dir)
    with client:
        failed = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 8})
        assert failed.status_code == 500 and trouble == {"step": 0, "finish": 0}
        assert state.thread.is_alive()
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_reporting_that_fails_after_a_step_leaves_the_engine_serving_and_a_dead_engine_answers(model_dir,
                                                                                               monkeypatch):
    """Found in review: the /metrics bookkeeping after each step sat outside the step's guard;
    when it raised, the engine thread died and the request in flight (plain or streamed)
    waited for as long as its client stayed. Such a failure is logged and serving goes on;
    and should the thread die all the same, a waiting request gets a 500 (a stream, an
    error event) instead of waiting forever."""
    import threading

    from specdecode.serve.app import ServerState

    report = ServerState._report_queue
    trouble = {"left": 2}

    def bad_report(self):  # in the engine thread's loop (a submission counts the queue too)
        if trouble["left"] and threading.current_thread() is self.thread:
            trouble["left"] -= 1
            raise RuntimeError("counting for /metrics fails")
        return report(self)

    monkeypatch.setattr(ServerState, "_report_queue", bad_report)
    client, state = make_client(model_dir)
    with client:
        assert client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 4}).status_code == 200
        assert trouble["left"] == 0 and state.thread.is_alive()
        # the engine thread dies just after a request is queued, as a fault below ours could leave it
        state.stopped = True
        state.wakeup.set()
        state.thread.join(timeout=10)
        calls = {"n": 0}

        def stopped_after_submission(self):
            calls["n"] += 1
            return calls["n"] > 1  # alive when submit asks, dead from then on

        monkeypatch.setattr(ServerState, "engine_stopped", stopped_after_submission)
        response = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_stopped", response.text
        calls["n"] = 0
        streamed = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "engine_stopped", streamed.text


def test_counting_a_requests_last_step_that_fails_still_answers_the_request(model_dir, monkeypatch):
    """Found in the suite (a 600 s timeout in the test above): the /metrics bookkeeping a
    request's listener does on its last step raised, the step failed, and the request,
    finished and so no longer among the running ones a failed step aborts, waited forever.
    The client gets its output; the failure is logged."""
    from specdecode.serve.app import ServerState

    count = ServerState._count_tokens
    trouble = {"left": 1}

    def bad_count(self, sequences):  # the first count of a finished request: the listener's
        if trouble["left"] and any(s.finish_reason is not None for s in sequences):
            trouble["left"] -= 1
            raise RuntimeError("counting for /metrics fails")
        return count(self, sequences)

    monkeypatch.setattr(ServerState, "_count_tokens", bad_count)
    client, state = make_client(model_dir)
    with client:
        pool = concurrent.futures.ThreadPoolExecutor(1)  # a request that hangs fails the test in a minute
        try:
            response = pool.submit(client.post, "/v1/completions", json={"prompt": "abcabc", "max_tokens": 4}).result(60)
        finally:
            pool.shutdown(wait=False)
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        assert trouble["left"] == 0 and state.thread.is_alive()
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


def test_a_clients_request_id_names_the_response_as_vllm_does(served):
    """Found in review: the body's request_id and the X-Request-Id header were accepted and
    ignored; vLLM builds the response id from them (the header first)."""
    client, _, _ = served
    body = {"prompt": "ab", "max_tokens": 2}
    assert client.post("/v1/completions", json={**body, "request_id": "mine-1"}).json()["id"] == "cmpl-mine-1"
    response = client.post("/v1/completions", json={**body, "request_id": "mine-1"}, headers={"X-Request-Id": "hdr-2"})
    assert response.json()["id"] == "cmpl-hdr-2"
    chat = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "request_id": "c-3", "stream": True}
    events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json=chat).text.splitlines()
              if line.startswith("data: {")]
    assert events and {event["id"] for event in events} == {"chatcmpl-c-3"}
    assert client.post("/v1/completions", json={**body, "request_id": ""}).json()["id"].startswith("cmpl-")
    for bad in (7, "a\nb", "x" * 257):
        response = client.post("/v1/completions", json={**body, "request_id": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "request_id", response.text


def test_bodies_a_review_found_answered_unclearly(served):
    """Found in review: a prompt with a lone surrogate (a legal JSON escape) was refused with
    the tokenizer's TypeError text; NaN (which Python's JSON parser takes) was refused as "less
    than or equal to 2"; an empty list of content parts ran as an empty turn; and an unknown
    key with a "-" in it was named by its parent only."""
    client, _, _ = served
    for path, body, param, fragment in (
            ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt",
             "not valid UTF-8 text (lone surrogate U+D800 at character 1)"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", '
                                     '"content": "x\\udfffy"}], "max_tokens": 2}', "messages",
             "messages[1].content is not valid UTF-8 text (lone surrogate U+DFFF at character 1)"),
            ("/v1/completions", '{"prompt": "ab", "temperature": NaN}', "temperature", "finite number"),
            ("/v1/completions", '{"prompt": "ab", "top_p": Infinity}', "top_p", "finite number"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": []}], "max_tokens": 2}', "messages.0",
             "content parts are empty"),
            ("/v1/completions", '{"prompt": "ab", "stream": true, "stream_options": {"include-usage": true}}',
             "stream_options.include-usage", "stream_options.include-usage"),
            ("/v1/completions", '{"prompt": "ab", "speculative": {"num-speculative-tokens": 3}}',
             "speculative.num-speculative-tokens", "speculative.num-speculative-tokens")):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and fragment in error["message"], response.text
        assert "TextEncodeInput" not in error["message"]


def test_a_model_whose_logits_overflow_answers_500_naming_it(tmp_path):
    """Found in review: NaN logits were turned into some token silently. Now the step fails
    with an error of ours, whose cause the client is told (not a bare internal error)."""
    path = save_chat_model(tmp_path / "nan", seed=3)
    client, state = make_client(path)
    # after the start-up calibration (which refuses such a model before serving), one token's
    # embedding overflows: a prompt holding it gives NaN logits
    state.engine.runtime.weights.embed.weight[40] = float("nan")
    with client:
        failed = client.post("/v1/completions", json={"prompt": [5, 6, 40, 7], "max_tokens": 8,
                                                      "temperature": 0})
        assert failed.status_code == 500
        assert "NaN or an infinity" in failed.json()["error"]["message"], failed.json()
        assert state.thread.is_alive()


def test_the_queue_limit_counts_the_requests_beyond_the_free_rows(model_dir):
    """Two free rows and room for one queued request: the fourth request at once gets 503
    with Retry-After (the engine does not run here, so all of them wait)."""
    from specdecode.serve.app import APIError

    state = tiny_server_state(model_dir, '{"method": "none"}', max_num_seqs=2, max_queued_requests=1)

    async def submit_four() -> list:
        queue, outcomes = asyncio.Queue(), []
        for index in range(4):
            try:
                state.submit([5, 6], SamplingParams(max_new_tokens=2), None, None, "ab", f"r{index}", queue)
                outcomes.append(200)
            except APIError as error:
                outcomes.append((error.status, error.code, error.headers.get("Retry-After")))
        return outcomes

    assert asyncio.run(submit_four()) == [200, 200, 200, (503, "overloaded", "1")]


def test_audit_reruns_greedy_and_sampled_requests_and_finds_no_mismatch(model_dir):
    """Greedy requests, and sampled ones (seeded or not: the re-run takes the seed the
    request drew with) whose prompt-lookup drafts the target's own draws verify."""
    # no router: it turns speculation off for a task type whose drafts keep failing, and a
    # request that did not speculate is not audited
    client, state = make_client(model_dir, '{"method": "ngram", "num_speculative_tokens": 3, "router": false}',
                                audit_rate=1.0)
    with client:
        for prompt in ("abcabc", "xyxyxy", "hello"):
            client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
        for seed in (None, 11):
            client.post("/v1/completions", json={"prompt": "abcabcabcabc", "max_tokens": 16, "temperature": 0.9,
                                                 "seed": seed})
        import time

        deadline = time.time() + 30
        while time.time() < deadline and state.metrics.audit_checked.labels(model_name="tiny")._value.get() < 5:
            time.sleep(0.05)
        assert state.metrics.audit_checked.labels(model_name="tiny")._value.get() == 5
        assert state.auditor.mismatches == []


def test_medusa_is_served_losslessly_with_its_own_figures(model_dir, tmp_path):
    """vLLM's method name 'medusa' with trained heads' directory as the model: each row its
    own proposer over shared heads, greedy output plain decoding's."""
    from specdecode.proposers.medusa import MedusaConfig, MedusaHeads

    target = load_model(str(model_dir), torch.float32, backend="torch")
    cfg = target.runtime.cfg
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(cfg.hidden_size, 3, cfg.vocab_size, 50, cfg.rms_norm_eps))
    torch.nn.init.normal_(heads.blocks.weight, std=0.05)
    heads.set_draft_vocab(torch.arange(50))
    heads.save(tmp_path / "heads")
    spec = json.dumps({"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3})
    client, state = make_client(model_dir, spec, max_num_seqs=2)
    with client:
        api = openai_client(client)
        drafted = 0
        for prompt in ("abcabcabc", "hello there", "0123401234"):
            completion = api.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            expected = reference(target, target.tokenizer(prompt)["input_ids"], 16)
            assert completion.choices[0].text == expected.text, prompt
            extension = completion.model_extra["speculative"]
            assert extension["method"] == "medusa"
            drafted += extension["drafted_tokens"]
        assert drafted > 0
        with pytest.raises(openai.BadRequestError, match="drafts at most 3 tokens a step"):  # one per head
            api.completions.create(model="tiny", prompt="abc", max_tokens=4,
                                   extra_body={"speculative": {"num_speculative_tokens": 5}})


def test_a_request_for_ngram_drafts_with_the_configured_sizes(model_dir):
    """Found in review: with a suffix server configured for 4-grams, a request asking for
    `method: "ngram"` drafted with the default sizes (3, 2, 1)."""
    state = tiny_server_state(model_dir, '{"method": "suffix", "prompt_lookup_min": 4, "prompt_lookup_max": 4}')
    for method in ("ngram", "suffix"):
        make = state.speculation.drafters[method][0]
        assert make().ngram_sizes == (4,), method


def test_speculative_config_takes_vllm_keys():
    spec, router = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert spec.method == "ngram" and spec.k == 4 and spec.ngram_sizes == (5, 4, 3, 2) and router
    # one bound alone is the other too, as vLLM reads it (found in review: min 4 alone was refused
    # against a default max of 3, and max 5 alone meant 5..1)
    assert parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 4}')[0].ngram_sizes == (4,)
    assert parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 5}')[0].ngram_sizes == (5,)
    with pytest.raises(ConfigError, match="method 'none' decodes plainly"):  # taken and ignored before
        parse_speculative_config('{"method": "none", "num_speculative_tokens": 3}')
    spec, _ = parse_speculative_config(json.dumps({"method": "eagle3", "num_speculative_tokens": "auto"}))
    assert spec.method == "eagle" and spec.k == "auto" and spec.tree_width == 1
    spec, _ = parse_speculative_config('{"method": "medusa", "model": "heads/m", "num_speculative_tokens": 2}')
    assert spec.method == "medusa" and spec.k == 2 and spec.draft == "heads/m"
    # the methods serve runs, not vLLM's "[ngram]" model alias nor the two it refuses (found in review)
    with pytest.raises(ConfigError, match=re.escape("serve runs ['eagle', 'eagle3', 'medusa', 'ngram', 'none', 'suffix']")):
        parse_speculative_config('{"method": "hydra"}')
    for bad, fragment in (('{"method": "hydra"}', "unknown speculative method"), ("{oops", "not valid JSON"),
                          ('{"methd": "ngram"}', "unknown keys"),
                          ('{"method": "ngram", "model": "heads/x"}', "method 'ngram' reads none"),
                          # it named --draft, which serve does not have (found in review)
                          ('{"method": "draft_model"}', "'draft_model' is not served by the batched engine")):
        with pytest.raises(ConfigError, match=fragment):
            parse_speculative_config(bad)


def test_parameters_at_their_defaults_run_and_others_are_refused(served):
    """OpenAI's parameters this server does not implement run at their defaults (what
    clients send unasked) and are refused by name otherwise, on chat too."""
    client, _, _ = served
    defaults = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "logprobs": False,
                "top_logprobs": 0, "response_format": {"type": "text"}, "tool_choice": "none", "tools": []}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**chat, **defaults}).status_code == 200
    for name, value in (("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
                        ("tool_choice", "required"), ("top_logprobs", 2)):
        response = client.post("/v1/chat/completions", json={**chat, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)


def test_a_temperature_too_small_to_divide_by_decodes_greedily(served):
    """Logits divided by 1e-40 overflow to nan (the sampler then drew token 0 every step):
    below 1e-5, as vLLM, the request decodes greedily."""
    client, _, _ = served
    texts = [client.post("/v1/completions", json={"prompt": "qwerty", "max_tokens": 8, "temperature": t}
                         ).json()["choices"][0]["text"] for t in (0, 1e-40, 1e-6)]
    assert texts[0] and texts == [texts[0]] * 3


def test_stop_strings_without_a_tokenizer_are_a_400(tiny_llama_dir):
    """A model with no tokenizer takes prompts as ids; stop strings cannot be matched."""
    client, _ = make_client(tiny_llama_dir)
    with client:
        response = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "stop": "x"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stop", response.text
        assert client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}).status_code == 200


def test_token_ids_come_back_without_a_tokenizer_and_on_request(tiny_llama_dir, model_dir):
    """Found in review: a model without a tokenizer answered id prompts with empty text only,
    its tokens lost, and vLLM's return_token_ids was accepted and ignored. The ids are the
    output's (those of plain greedy decoding), streamed as deltas."""
    client, state = make_client(tiny_llama_dir)
    prompt = [5, 6, 7, 5, 6, 7]
    with client:
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
        choice = body["choices"][0]
        expected = SpeculativeEngine(load_model(str(tiny_llama_dir), torch.float32, backend="torch").runtime).generate(
            prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)).token_ids
        assert choice["token_ids"] == expected[:len(choice["token_ids"])] and choice["prompt_token_ids"] == prompt
        assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")
        streamed = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                        "stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    client, state = make_client(model_dir)
    with client:
        for chat in (False, True):
            request = ({"messages": [{"role": "user", "content": "abcabc"}]} if chat else {"prompt": "abcabc"})
            body = client.post("/v1/chat/completions" if chat else "/v1/completions",
                               json={**request, "max_tokens": 5, "temperature": 0, "return_token_ids": True}).json()
            choice = body["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            assert state.tokenizer.decode(choice["token_ids"]) == text
            assert (body if chat else choice)["prompt_token_ids"] and "token_ids" in choice


@pytest.mark.parametrize("bad, key", [
    ('{"method": ["ngram"]}', "method"), ('{"prompt_lookup_min": "x"}', "prompt_lookup_min"),
    ('{"prompt_lookup_max": 2.5}', "prompt_lookup_max"), ('{"k_max": "abc"}', "k_max"), ('{"k_max": null}', "k_max"),
    ('{"k_max": 2.5}', "k_max"), ('{"num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": -2}', "num_speculative_tokens"), ('{"model": 5}', "model"),
    ('{"preset": ["json-api"]}', "preset"), ('{"router": "false"}', "router"), ('{"router": 0}', "router"),
    # a range of 10**10 n-gram sizes ran out of memory building it (found in review)
    ('{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 10000000000}', "prompt_lookup_max"),
    ('{"method": "ngram", "prompt_lookup_max": 65}', "prompt_lookup_max"),
])
def test_speculative_config_refuses_wrong_types_by_name(bad, key):
    # a ConfigError (not a raw TypeError/ValueError) is what the CLI reports cleanly
    with pytest.raises(ConfigError, match=key):
        parse_speculative_config(bad)


def test_speculative_config_applies_every_preset_key():
    spec, router = parse_speculative_config('{"preset": "creative-writing"}')
    assert spec.method == "ngram" and spec.k == "auto" and spec.k_max == 4 and router
    spec, _ = parse_speculative_config('{"preset": "code-assistant"}')
    assert spec.ngram_sizes == (4, 3, 2) and spec.k_max == 10
    # the JSON's own keys still win over the preset
    spec, router = parse_speculative_config('{"preset": "code-assistant", "k_max": 6, "prompt_lookup_min": 1, '
                                            '"prompt_lookup_max": 2, "router": false}')
    assert spec.k_max == 6 and spec.ngram_sizes == (2, 1) and not router


def test_an_audit_that_cannot_start_does_not_stop_the_engine(model_dir):
    """An exception while starting an audit ended the engine thread, and every later
    request waited forever."""
    client, state = make_client(model_dir, audit_rate=1.0)
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("audit could not start")

    state.auditor.run_one = broken
    with client:
        import time

        deadline = time.time() + 10
        while len(calls) < 2 and time.time() < deadline:  # the idle engine tries to start an audit, again
            time.sleep(0.01)
        assert len(calls) >= 2 and state.thread.is_alive()  # (a request to a dead engine would wait forever)
        response = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_metrics_show_the_decode_threads_the_server_chose(model_dir):
    """With no --threads, build_state gives the engine a ThreadChoice over the thread counts
    it is handed; /metrics shows the count each kind of pass measured fastest."""
    client, state = make_client(model_dir, decode_threads=(1, 2))
    assert state.engine.decode_threads is not None and state.engine.decode_threads.options == (1, 2)
    with client:
        for _ in range(3):  # each request's passes run alone: both counts measured after a few
            assert client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8}).status_code == 200
        text = client.get("/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("specdecode:decode_kernel_threads{") and 'kind="alone"' in l)
    assert float(line.rsplit(" ", 1)[1]) == state.engine.decode_threads.best("alone")
    assert make_client(model_dir)[1].engine.decode_threads is None  # a fixed count: nothing to choose


def test_router_learns_only_from_requests_decoded_alone():
    """A request decoded in a batch took the batch's time: priced against one plain step per
    token it looked like a loss and turned speculation off for its task, at one client too.
    The router now learns from requests decoded alone, timed by their own steps."""
    from types import SimpleNamespace

    from specdecode.config import SamplingParams
    from specdecode.control.router import Router
    from specdecode.serve.app import SpeculationChoices
    from specdecode.serve.batch import Sequence

    profile = SimpleNamespace(acceptance={}, time_ms=lambda size, context: 5.0 + context / 1000)
    router = Router()
    choices = SpeculationChoices({"ngram": (None, None, "ngram")}, "ngram", router, profile)
    metrics = SimpleNamespace(drift_ratio=lambda task: None)

    def finished(batched_steps: int) -> Sequence:
        sequence = Sequence("r", [1, 2, 3], SamplingParams(max_new_tokens=100), proposer=object(), method="ngram",
                            task_type="code")
        sequence.batched_steps = batched_steps
        stats = sequence.stats
        stats.new_tokens, stats.draft_tokens, stats.accepted_tokens = 100, 60, 40
        stats.drafted_per_position, stats.accepted_per_position = [30], [24]
        # 0.3 s of its own steps, 4.8 s of wall time after the prefill (others' prefill ran between)
        stats.draft_seconds, stats.verify_seconds, stats.prefill_seconds, stats.wall_seconds = 0.05, 0.25, 0.2, 5.0
        return sequence

    for _ in range(5):
        choices.observe(finished(batched_steps=40), metrics)
    assert router.records == {}
    assert router.route("def f(x): return x", "ngram", "ngram").method == "ngram"
    choices.observe(finished(batched_steps=0), metrics)
    record = router.records["code/ngram"]
    # plain steps priced at the middle of the output (3 + 50 tokens); not 100 * 5 ms / 4.8 s
    assert record.speedup == pytest.approx(100 * 5.053 / 1e3 / 0.3)


def test_a_seeded_request_whose_drafter_samples_keeps_its_fixed_k_where_the_router_turned_off():
    """Found in review: a seeded sampled request whose drafter samples its drafts (EAGLE
    chains) draws other numbers decoding plainly than speculating, and with a fixed k the
    docs promise it the same text on every repeat; the router's off for its task (and the
    retry every so many requests) decoded it plainly on some repeats and speculated on
    others. Such a request now keeps the server's fixed k; the others still follow the
    router."""
    from specdecode.config import SamplingParams
    from specdecode.control.policies import FixedK
    from specdecode.control.router import Router
    from specdecode.serve.app import SpeculationChoices

    class Sampling:
        samples_drafts = True

    class Lookup:
        samples_drafts = False

    adaptive = object()  # an adaptive policy: not a FixedK
    router = Router()
    choices = SpeculationChoices({"eagle": (Sampling, lambda k: FixedK(3 if k is None else k), "eagle"),
                                  "eagle-auto": (Sampling, lambda k: adaptive if k in (None, "auto") else FixedK(k),
                                                 "eagle-auto"),
                                  "ngram": (Lookup, lambda k: FixedK(3 if k is None else k), "ngram")},
                                 "eagle", router, None)
    prompt = "Write a python function that reverses a list."
    task = router.route(prompt).task
    for drafter in ("eagle", "eagle-auto", "ngram"):
        for _ in range(5):
            router.observe(task, drafter, 0.1, 0.5, 100)  # each measured slower than plain on this task
    seeded = SamplingParams(temperature=0.8, seed=42)

    def speculated(method: str, params) -> list[bool]:
        choices.default = method  # the server's own method: the request names none
        return [choices.plan(None, None, prompt, params).speculate for _ in range(2 * router.retry_every)]

    assert all(speculated("eagle", seeded))
    unseeded = speculated("eagle", SamplingParams(temperature=0.8))
    assert unseeded.count(True) <= 2, unseeded  # the router's retries only
    assert speculated("eagle", SamplingParams(temperature=0.0, seed=42)).count(True) <= 2  # greedy: text unchanged
    assert speculated("eagle-auto", seeded).count(True) <= 2  # k auto: no reproducibility promised
    assert speculated("ngram", seeded).count(True) <= 2  # lookup: the target's own draws verify its drafts


def test_per_task_metrics_follow_vllms_definitions():
    """Found in review against vLLM's metrics: the mean accepted length counted plain
    passes (1 + accepted / drafts is over steps that drafted); the drift window held every
    drafted token while its prior is the first draft's rate (it read about 0.8 where
    nothing had changed); inter-token latency was observed once per token, each a share of
    the step's gap (vLLM observes the gap once per step); the seconds saved counted a
    request's wait for a row as decode time."""
    from types import SimpleNamespace

    from specdecode.metrics import GenerationStats
    from specdecode.serve.app import SpeculationChoices
    from specdecode.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")

    def value(name, **labels):
        return metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "m", **labels})

    for _ in range(10):
        metrics.step(3, 1, "code", 1.0)  # every step's first draft accepted, the second never
        metrics.step(0, 0, "code", 1.0)  # a plain pass beside them
    assert value("task_mean_accepted_length", task_type="code") == pytest.approx(2.0)
    assert value("task_acceptance_rate", task_type="code") == pytest.approx(1 / 3)
    assert metrics.drift_ratio("code") == pytest.approx(1.0)
    # two drafters on one task, each as calibrated: 1.0, whichever finished last (found in
    # review: divided by the last one's prior, the window read 1.86 or 0.58)
    for step in range(400):
        metrics.step(2, int(step % 4 == 0), "mixed", 0.25)  # a lookup right on 1 step in 4, as calibrated
    for step in range(100):
        metrics.step(2, int(step % 5 != 0), "mixed", 0.8)  # a head right on 4 in 5, as calibrated
    assert metrics.drift_ratio("mixed") == pytest.approx(1.0)
    metrics.step(2, 1, "uncalibrated")  # no prior: no drift
    assert metrics.drift_ratio("uncalibrated") is None
    metrics.step(0, 0, "plain-only")  # a task that never drafted reports no acceptance
    assert value("task_acceptance_rate", task_type="plain-only") is None
    metrics.token_gap(0.03)  # one step that brought 4 tokens
    assert value("inter_token_latency_seconds_count") == 1
    assert value("inter_token_latency_seconds_sum") == pytest.approx(0.03)

    choices = SpeculationChoices.__new__(SpeculationChoices)
    choices.profile = SimpleNamespace(time_ms=lambda tokens, context: 10.0)
    stats = GenerationStats(new_tokens=20, wall_seconds=5.0, prefill_seconds=0.05, draft_seconds=0.01,
                            verify_seconds=0.12)  # 4.8 s of it waiting for a row
    sequence = SimpleNamespace(proposer=object(), stats=stats, prompt_ids=[1] * 10, batched_steps=0)
    assert choices.seconds_saved(sequence) == pytest.approx(20 * 0.010 - 0.13)
    # decoded in a batch, its share of a pass is cheaper than a step alone, drafting or not:
    # not speculation's saving (found in review: credited to it)
    assert choices.seconds_saved(SimpleNamespace(**{**vars(sequence), "batched_steps": 3})) is None
    # the response's mean accepted length is the gauge's (vLLM's), tau beside it
    from specdecode.serve.app import speculation_summary

    drafted = GenerationStats()
    drafted.observe_step(4, 4)
    for _ in range(3):
        drafted.observe_step(0, 0)
    summary = speculation_summary([SimpleNamespace(stats=drafted, method="ngram", task_type="code")])
    assert summary["mean_accepted_length"] == 5.0 and summary["tokens_per_target_pass"] == 2.0
    assert speculation_summary([SimpleNamespace(stats=GenerationStats(), method="none",
                                                task_type="code")])["mean_accepted_length"] == 1.0


def test_stream_chunks_and_refusals_follow_vllm(served):
    """Found in review: the chat role went out in a chunk of its own before any token, so
    `vllm bench serve` (TTFT at the first chunk with choices) timed it as the first token,
    and the finish reason came in a chunk after the last text (one more, near-zero ITL);
    `logprobs: 0` (the chosen tokens' logprobs) and `stream_options.continuous_usage_stats`
    were accepted and ignored; `echo` on chat put the user's text in the reply, unstreamed
    only; a message's text parts were joined without vLLM's newline."""
    client, state, target = served
    body = {"messages": [{"role": "user", "content": "xyzxyz"}], "max_tokens": 5, "temperature": 0, "stream": True}
    events = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json=body).text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"]  # the role with the first text
    assert all("role" not in d for d in deltas[1:]) and all(d.get("content") for d in deltas[:-1])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
    for extra, param in (({"logprobs": 0}, "logprobs"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
                         ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
                         ({"stream": True, "stream_options": {"unknown_option": 1}}, None)):
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
        assert response.status_code == 400, extra
        assert param is None or response.json()["error"]["param"] == param
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": None}).status_code == 200
    response = client.post("/v1/chat/completions", json={**body, "stream": False, "echo": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}],
             "max_tokens": 1}
    joined = {"messages": [{"role": "user", "content": "ab\ncd"}], "max_tokens": 1}
    assert (client.post("/v1/chat/completions", json=parts).json()["usage"]["prompt_tokens"]
            == client.post("/v1/chat/completions", json=joined).json()["usage"]["prompt_tokens"])


def test_bench_serve_reports_what_vllm_bench_serve_does():
    """bench-serve scraped the number of drafts but reported neither the mean acceptance
    length (1 + accepted / drafts) nor the acceptance per position, which `vllm bench
    serve` prints (found in review); and a finish reason's series appeared only once used."""
    from specdecode.bench.serve import acceptance_figures, scrape
    from specdecode.serve.metrics import ServerMetrics
    from prometheus_client import generate_latest

    metrics = ServerMetrics("m", positions=4)
    before = scrape(generate_latest(metrics.registry).decode())
    assert metrics.registry.get_sample_value("specdecode:spec_decode_num_accepted_tokens_per_pos_total",
                                             {"model_name": "m", "position": "3"}) == 0
    assert metrics.registry.get_sample_value("specdecode:request_success_total",
                                             {"model_name": "m", "finished_reason": "length"}) == 0
    # every series exists at 0 before the first request, as vLLM's (found in review: the
    # drafting counters, the gauges, the prefix-cache counters and the histograms did not)
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "num_requests_running", "num_requests_waiting",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "m"}) == 0, name
    for drafted, accepted in ((3, 3), (3, 1), (3, 0), (0, 0)):
        metrics.step(drafted, accepted, "code")
    after = scrape(generate_latest(metrics.registry).decode())
    figures = acceptance_figures(before, after)
    assert figures["drafts"] == 3 and figures["draft_tokens"] == 9 and figures["accepted_tokens"] == 4
    assert figures["acceptance_rate"] == pytest.approx(4 / 9)
    assert figures["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert figures["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 0])
    assert acceptance_figures(before, before)["mean_acceptance_length"] is None


def test_bench_serve_counts_a_request_failed_mid_stream_as_failed():
    """Found in review: a server that fails a request after its 200 sends an error chunk
    and [DONE]; bench-serve counted it as a success of 0 tokens (throughput, latencies)."""
    import asyncio

    import httpx

    from specdecode.bench.serve import one_request

    def stream(chunks):
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    def run(chunks):
        results = []

        async def go():
            async with httpx.AsyncClient(transport=stream(chunks)) as client:
                await one_request(client, "http://server", "m", "hi", 8, "spec", results)

        asyncio.run(go())
        return results[0]

    text = {"choices": [{"index": 0, "delta": {"content": "ab"}}]}
    failed = run([text, {"error": {"message": "internal error while decoding", "type": "server_error"}}])
    assert failed["error"] == "stream error: internal error while decoding"
    assert run([text])["error"] == "the stream ended without a usage chunk or with no tokens"
    good = run([text, text, {"choices": [], "usage": {"completion_tokens": 2}}])
    assert good["error"] is None and good["tokens"] == 2


def test_replicas_refuse_a_bad_speculative_config_before_ray_starts():
    """Found in review: each replica parsed --speculative-config inside Ray, so a typo showed
    only after Ray had started, as a failed deployment in the replicas' logs."""
    from specdecode.config import EngineConfig
    from specdecode.serve.server import ray_application

    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match="unknown speculative method 'hydra'"):
        ray_application(EngineConfig(model="default"), '{"method": "hydra"}', 2, 4, 8)


def test_bench_serve_sends_a_prompts_system_message():
    """Found in review: bench-serve sent the user's turn alone, though bench decodes a chat
    record's system prompt before it."""
    import asyncio

    import httpx

    from specdecode.bench.runner import conversation
    from specdecode.bench.serve import one_request

    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        body = 'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await one_request(client, "http://s", "m", conversation(["Hi"], [], "Be brief."), 4, "spec", [])
            await one_request(client, "http://s", "m", "Hello", 4, "plain", [])

    asyncio.run(go())
    assert sent[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sent[1]["messages"] == [{"role": "user", "content": "Hello"}] and sent[1]["speculative"] == {"enabled": False}


def test_a_labelled_request_is_routed_by_its_label(served):
    """Found in review: the router classified the prompt and gated on that task's record,
    while the request's outcome was learnt under its ``task_type``, so a labelled task
    whose speculation lost was never turned off. A label's losing record now sends its
    requests to plain decoding (but for the periodic retry)."""
    from specdecode.control.router import TaskRecord, classify

    client, state, _ = served
    router = state.speculation.router
    drafter = state.speculation.drafters["ngram"][2]
    prompt = "What is the capital of France?"
    assert classify(prompt) != "creative"
    saved_records, saved_requests = dict(router.records), dict(router.requests)
    router.records[f"creative/{drafter}"] = TaskRecord(alpha=0.02, speedup=0.5, weight=5.0)
    try:
        methods = []
        for _ in range(3):
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                             "task_type": "creative"})
            assert response.status_code == 200, response.text
            methods.append(response.json()["speculative"]["method"])
        assert methods.count("none") >= 2, methods
    finally:
        router.records, router.requests = saved_records, saved_requests


def test_a_retried_task_starts_from_the_routers_retry_prior(served):
    """Found in review: the server replaced the route's prior with the task's measured
    acceptance, so the retry of a task turned off (every retry_every-th request) started
    from that low acceptance and decoded plainly instead of measuring again."""
    from specdecode.control.router import RETRY_PRIOR, TaskRecord

    _, state, _ = served
    speculation = state.speculation
    router, drafter = speculation.router, speculation.drafters["ngram"][2]
    saved_records, saved_requests = dict(router.records), dict(router.requests)
    router.records[f"creative/{drafter}"] = TaskRecord(alpha=0.05, speedup=0.8, weight=5.0)
    try:
        plans = [speculation.plan(None, "creative", "Write a poem.") for _ in range(router.retry_every)]
        retried = [plan for plan in plans if plan.speculate]
        assert len(retried) == 1 and retried[0].prior == RETRY_PRIOR, [(p.speculate, p.prior) for p in plans]
    finally:
        router.records, router.requests = saved_records, saved_requests


def test_a_stalled_stream_whose_client_left_frees_its_row_at_once(served, monkeypatch):
    """Found in review: a client that stopped reading (the server's send waiting on a full
    socket buffer) and then went away left the stream's generator suspended at a yield; its
    row was freed only by the next cyclic garbage collection, and until then the request
    decoded on (and could finish as "length", not "abort")."""
    import gc

    from specdecode.serve.batch import BatchEngine

    client, state, _ = served
    # an earlier test's work (an audit's re-run, an abort the engine has yet to reap) may
    # still hold a row: start from an idle engine (seen once in a fresh clone's run: 3 of 4 free)
    deadline = time.monotonic() + 30
    while (state.engine.running or state.engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    app, rows = client.app, len(state.engine.free_rows)
    assert rows == state.engine.max_num_seqs
    step = BatchEngine.step

    def slow(self):
        time.sleep(0.02)
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", slow)
    body = json.dumps({"prompt": "abcabc", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()

    async def stalled_then_gone():
        sent, chunks, gone, never = False, 0, asyncio.Event(), asyncio.Event()

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal chunks
            if message["type"] == "http.response.body" and message.get("body"):
                chunks += 1
                if chunks == 2:  # the socket's buffer is full: send waits, and the client leaves
                    asyncio.get_running_loop().call_later(0.05, gone.set)
                    await never.wait()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
        await app(scope, receive, send)
        await asyncio.sleep(0.3)

    gc.disable()
    try:
        asyncio.run(stalled_then_gone())
        running, free = len(state.engine.running), len(state.engine.free_rows)
    finally:
        gc.enable()
    assert (running, free) == (0, rows)


def test_a_request_that_can_never_run_is_a_400_even_when_the_queue_is_full(model_dir):
    """Found in review: the queue-full check came before the request's task_type and
    method were looked at, so with the queue full a request that could never run got a
    503, which clients retry. (The engine does not run here: the rows stay taken.)"""
    from specdecode.serve.app import APIError, SpeculativeOptions

    state = tiny_server_state(model_dir, '{"method": "ngram", "num_speculative_tokens": 3}', max_num_seqs=1,
                              max_queued_requests=0)

    async def outcomes() -> list:
        queue, seen = asyncio.Queue(), []
        for options, task in ((None, None), (None, "bogus"), (SpeculativeOptions(method="hydra"), None), (None, None)):
            try:
                state.submit([5, 6], SamplingParams(max_new_tokens=2), options, task, "ab", "r", queue)
                seen.append(200)
            except APIError as error:
                seen.append((error.status, error.param))
        return seen

    assert asyncio.run(outcomes()) == [200, (400, "task_type"), (400, "speculative.method"), (503, None)]


def test_a_requested_k_is_never_dropped_for_plain_decoding(model_dir):
    """Found in review: a request's num_speculative_tokens without a method was dropped,
    the request decoded plainly with a 200, where the server's default method is none
    (refused now, as the request's own method none with a k is) and where the router had
    turned speculation off for the task (a k asks for speculation, as a method does)."""
    from specdecode.control.router import TaskRecord
    from specdecode.serve.app import APIError, SpeculativeOptions

    plain = tiny_server_state(model_dir, '{"method": "none"}')
    with pytest.raises(APIError, match="needs a method") as refused:
        plain.speculation.plan(SpeculativeOptions(num_speculative_tokens=4), None, "abc abc abc")
    assert refused.value.status == 400
    asked = plain.speculation.plan(SpeculativeOptions(method="ngram", num_speculative_tokens=4), None, "abc abc")
    assert asked.speculate and asked.method == "ngram"

    state = tiny_server_state(model_dir, '{"method": "ngram", "num_speculative_tokens": 3}')
    speculation = state.speculation
    router, drafter = speculation.router, speculation.drafters["ngram"][2]
    router.records[f"creative/{drafter}"] = TaskRecord(alpha=0.05, speedup=0.5, weight=5.0)
    router.requests["creative"] = 1  # not the periodic retry
    assert not speculation.plan(None, "creative", "Write a poem.").speculate
    router.requests["creative"] = 1
    planned = speculation.plan(SpeculativeOptions(num_speculative_tokens=2), "creative", "Write a poem.")
    assert planned.speculate and planned.method == "ngram"
    router.requests["creative"] = 1  # "auto" restates the server's default: the router's off holds
    assert not speculation.plan(SpeculativeOptions(num_speculative_tokens="auto"), "creative", "Write a poem.").speculate
    assert not plain.speculation.plan(SpeculativeOptions(num_speculative_tokens="auto"), None, "abc abc").speculate


def test_a_model_without_a_method_is_read_as_vllm_reads_it():
    """Found in review: a model without a method was read as a token store (the default
    method, suffix), so vLLM's own form for prompt lookup ({"model": "[ngram]"}) failed
    after the target loaded, naming stores. vLLM infers the method from the model."""
    from specdecode.factory import DEFAULT_EAGLE_HEAD, DEFAULT_MEDUSA_HEADS, DEFAULT_TOKEN_STORE

    for name in ("ngram", "[ngram]"):
        spec, _ = parse_speculative_config(f'{{"model": "{name}", "num_speculative_tokens": 3}}')
        assert spec.method == "ngram" and spec.k == 3 and spec.draft is None
    # a drafter directory implies its method (review of the first fix: a store's was refused)
    for directory, method in ((DEFAULT_TOKEN_STORE, "suffix"), (DEFAULT_EAGLE_HEAD, "eagle"),
                              (DEFAULT_MEDUSA_HEADS, "medusa")):
        spec, _ = parse_speculative_config(json.dumps({"model": str(directory)}))
        assert spec.method == method and spec.draft == str(directory)
    with pytest.raises(ConfigError, match="without a method, and it is no token store, EAGLE head or Medusa heads"):
        parse_speculative_config('{"model": "/some/dir", "num_speculative_tokens": 3}')
    assert parse_speculative_config('{"model": "/heads/llama-eagle3-8b"}')[0].method == "eagle"  # by name, as vLLM
    spec, _ = parse_speculative_config('{"method": "suffix", "model": "/some/store"}')
    assert spec.method == "suffix" and spec.draft == "/some/store"
    for empty in ('{"model": ""}', '{"method": "eagle", "model": " "}'):  # Path("") is the working directory
        with pytest.raises(ConfigError, match="model is empty"):
            parse_speculative_config(empty)


def test_k_max_is_bounded_as_num_speculative_tokens_is():
    """Found in review: k_max took up to 512, and /metrics made a series per position
    (512 series, a 90 kB scrape before any request); num_speculative_tokens is held to 64."""
    from specdecode.config import MAX_SERVED_K

    assert parse_speculative_config(f'{{"method": "ngram", "k_max": {MAX_SERVED_K}}}')[0].k_max == MAX_SERVED_K
    with pytest.raises(ConfigError, match="k_max must be in 1"):
        parse_speculative_config(f'{{"method": "ngram", "k_max": {MAX_SERVED_K + 1}}}')


def test_serve_takes_exact_as_generate_does(model_dir, capsys):
    """Found in review: `serve` refused --exact (argparse's unrecognized argument), so the
    batched engine could not be asked for exactness, and `serve --backend torch` ran
    without it quietly. It now takes the flag and passes it on: refused by name where
    the rows would not be bitwise independent."""
    from specdecode import cli

    code = cli.main(["serve", "--model", str(model_dir), "--backend", "torch", "--exact", "--dtype", "fp32"])
    assert code != 0 and "exact mode needs the kernels backend" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["serve", "--no-exact"]).exact is False


def test_replicas_refuse_bad_server_flags_before_ray_starts():
    """Found in review: --max-num-seqs, --max-queued-requests and --audit-rate were checked
    in each replica, after Ray had started: hundreds of lines of Ray's tracebacks, or
    pydantic's own error for a negative max_ongoing_requests."""
    from specdecode.config import EngineConfig
    from specdecode.serve.server import ray_application

    pytest.importorskip("ray")
    config = EngineConfig(model="default")
    with pytest.raises(ConfigError, match="--max-num-seqs must be >= 1"):
        ray_application(config, None, 2, -5, 8)
    with pytest.raises(ConfigError, match="--max-queued-requests must be >= 0"):
        ray_application(config, None, 2, 4, -1)
    with pytest.raises(ConfigError, match=r"--audit-rate must be in \[0, 1\]"):
        ray_application(config, None, 2, 4, 8, audit_rate=7.0)
    with pytest.raises(ConfigError, match="model '/no/such' does not exist"):  # the drafter's files too
        ray_application(config, '{"method": "suffix", "model": "/no/such"}', 2, 4, 8)


def test_a_replicas_metrics_carry_its_name_and_bench_serve_compares_one_replicas(model_dir):
    """Found in review: behind Ray's proxy each scrape reached one replica, whose series
    carried no label, so counters went backwards between scrapes and bench-serve's deltas
    came out negative. A replica's samples now name it, and bench-serve gives no figures
    for scrapes that different replicas answered."""
    from specdecode.bench.serve import acceptance_figures, scrape

    client, state = make_client(model_dir)
    state.metrics.constant_labels = {"replica": "specdecode-123"}
    with client:
        assert client.post("/v1/completions", json={"prompt": "abcabcabc", "max_tokens": 4}).status_code == 200
        text = client.get("/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all('replica="specdecode-123"' in line for line in samples)
    one = scrape(text)
    assert one["replicas"] == "specdecode-123" and one["generation_tokens_total"] >= 1
    other = {**one, "replicas": "specdecode-456", "spec_decode_num_drafts_total": 0.0}
    assert acceptance_figures(other, one)["mean_acceptance_length"] is None
    assert acceptance_figures(one, one)["drafts"] == 0.0


def test_a_head_method_without_heads_for_the_model_is_refused_before_loading(model_dir, monkeypatch):
    """Found in review: serve with method eagle (or medusa) on a model without shipped heads
    measured the cost profile and calibrated first, then named --head, a flag serve lacks;
    a model path that does not exist was read as a token store after the load."""
    from specdecode import factory
    from specdecode.config import EngineConfig
    from specdecode.serve.server import build_state

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr(factory, "load_target", no_load)
    config = EngineConfig(model=str(model_dir), dtype="fp32", backend="torch")
    for method, kind in (("eagle", "an EAGLE head"), ("medusa", "Medusa heads")):
        with pytest.raises(ConfigError, match=f"method '{method}' needs {kind} .* as \"model\" in --speculative-config"):
            build_state(config, f'{{"method": "{method}"}}')
    with pytest.raises(ConfigError, match="model '/no/such/store' does not exist"):
        build_state(config, '{"method": "suffix", "model": "/no/such/store"}')


def test_speculative_k_is_bounded_by_max_served_k(served):
    """num_speculative_tokens up to MAX_SERVED_K is served; one more is a 400 naming the field. Found by a mutation audit: no test failed without it."""
    from specdecode.config import MAX_SERVED_K

    client, _, _ = served
    body = {"prompt": "abcabcabc", "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json={**body, "speculative": {"num_speculative_tokens": MAX_SERVED_K}}
                       ).status_code == 200
    response = client.post("/v1/completions", json={**body, "speculative": {"num_speculative_tokens": MAX_SERVED_K + 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculative.num_speculative_tokens"


def test_at_most_four_stop_strings(served):
    """Four stop strings are served (OpenAI's limit); a fifth is a 400 naming `stop`. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    body = {"prompt": "abcabc", "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json={**body, "stop": ["@1", "@2", "@3", "@4"]}).status_code == 200
    response = client.post("/v1/completions", json={**body, "stop": ["@1", "@2", "@3", "@4", "@5"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"


def test_top_k_minus_one_means_no_top_k(served):
    """top_k = -1 (vLLM's "off", which the schema allows) samples as top_k = 0 does. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    body = {"prompt": "qwerty", "max_tokens": 8, "temperature": 0.9, "seed": 3}
    off = client.post("/v1/completions", json={**body, "top_k": 0})
    minus = client.post("/v1/completions", json={**body, "top_k": -1})
    assert minus.status_code == 200, minus.text
    assert minus.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]


def test_max_tokens_defaults_to_16_and_null_means_the_default(served):
    """A completion without max_tokens, or with an explicit null, gives OpenAI's default 16 tokens. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    for extra in ({}, {"max_tokens": None}):
        body = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0, "ignore_eos": True, **extra}).json()
        assert body["usage"]["completion_tokens"] == 16, (extra, body)


def test_prompt_and_max_tokens_may_fill_the_context_exactly(served):
    """A prompt plus max_tokens equal to the context is served in full; one more token is a 400. Found by a mutation audit: no test failed without it."""
    client, state, _ = served
    limit = state.engine.max_model_len
    prompt = [5, 6, 7] * 80
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    exact = client.post("/v1/completions", json={**body, "max_tokens": limit - len(prompt)})
    assert exact.status_code == 200 and exact.json()["usage"]["completion_tokens"] == limit - len(prompt), exact.text
    over = client.post("/v1/completions", json={**body, "max_tokens": limit - len(prompt) + 1})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


def test_the_seed_of_a_later_choice_wraps_at_2_63(served):
    """With n = 2 the second choice's seed is the request's plus one, wrapped to a signed 64-bit value (2**63 - 1 + 1 -> -2**63), not a 500. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    body = {"prompt": "qwerty", "max_tokens": 6, "temperature": 0.9}
    both = client.post("/v1/completions", json={**body, "n": 2, "seed": 2 ** 63 - 1})
    assert both.status_code == 200, both.text
    second = client.post("/v1/completions", json={**body, "seed": -(2 ** 63)}).json()["choices"][0]["text"]
    assert both.json()["choices"][1]["text"] == second


def test_a_stream_ends_with_the_speculation_extension_and_done(served):
    """Only the last chunk of a stream carries the speculation figures, and the stream ends with `data: [DONE]`. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    raw = client.post("/v1/completions", json={"prompt": "abcabcabc", "max_tokens": 6, "temperature": 0, "stream": True,
                                               # explicit: the router's state depends on the tests before
                                               "speculative": {"method": "ngram", "num_speculative_tokens": 3}}).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] is not None
    assert events[-1]["speculative"]["method"] == "ngram" and events[-1]["speculative"]["drafted_tokens"] > 0
    assert all("speculative" not in e for e in events[:-1])
    assert raw.endswith("data: [DONE]\n\n")


def test_chat_without_max_tokens_may_fill_the_context(served):
    """A chat request without max_tokens may generate up to the context (vLLM's default), ending with `length`. Found by a mutation audit: no test failed without it."""
    client, state, _ = served
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                                      "ignore_eos": True}).json()
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == state.engine.max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_usage_and_speculation_figures_add_up(served):
    """total_tokens is prompt plus completion; the acceptance rate is accepted over drafted tokens. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    body = client.post("/v1/completions", json={"prompt": "abcabcabcabc", "max_tokens": 12, "temperature": 0,
                                                "speculative": {"method": "ngram", "num_speculative_tokens": 3}}).json()
    usage, extension = body["usage"], body["speculative"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert extension["drafted_tokens"] > 0
    assert extension["acceptance_rate"] == round(extension["accepted_tokens"] / extension["drafted_tokens"], 4)


def test_an_unknown_route_is_a_not_found_error(served):
    """A 404 carries OpenAI's `not_found_error` type. Found by a mutation audit: no test failed without it."""
    client, _, _ = served
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_the_api_key_needs_the_bearer_scheme_and_guards_the_cache_reset(model_dir):
    """With --api-key only `Authorization: Bearer KEY` passes (not Basic or Token), and /reset_prefix_cache needs it too (anyone could wipe the cache). Found by a mutation audit: no test failed without it."""
    client, state = make_client(model_dir, api_key="sekret")
    with client:
        for header in ("Basic sekret", "Token sekret"):
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                   headers={"Authorization": header})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", header
        assert client.post("/reset_prefix_cache").status_code == 401
        assert client.post("/reset_prefix_cache", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_health_is_503_once_the_engine_thread_has_stopped(model_dir):
    """A dead engine thread makes /health a 503 and new requests a 503 naming it. Found by a mutation audit: no test failed without it."""
    client, state = make_client(model_dir)
    with client:
        assert client.get("/health").status_code == 200
        state.stopped = True
        state.wakeup.set()
        state.thread.join(timeout=10)
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"


def test_audit_reruns_are_not_counted_as_traffic(model_dir, monkeypatch):
    """An audit's plain re-run is not counted as a running request nor in the prompt and generation token counters: those are clients' traffic. Found by a mutation audit: no test failed without it."""
    import time

    from specdecode.serve.batch import BatchEngine
    step = BatchEngine.step

    def slow(self):
        time.sleep(0.01)
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", slow)
    client, state = make_client(model_dir, '{"method": "ngram", "num_speculative_tokens": 3, "router": false}',
                                audit_rate=1.0)

    def value(name):
        return state.metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "tiny"})

    with client:
        usage = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 40, "temperature": 0,
                                                     "ignore_eos": True}).json()["usage"]
        wait_for(lambda: any(s.audit_of is not None and len(s.generated) > 2 for s in list(state.engine.running)))
        time.sleep(0.05)
        assert value("num_requests_running") == 0
        wait_for(lambda: value("audit_requests_total") == 1)
        assert value("generation_tokens_total") == usage["completion_tokens"]
        assert value("prompt_tokens_total") == usage["prompt_tokens"]


def test_a_failed_step_ends_a_stream_with_a_server_error_chunk(model_dir, monkeypatch):
    """A step that fails mid-stream ends it with an OpenAI error chunk of type `server_error`, then `data: [DONE]`. Found by a mutation audit: no test failed without it."""
    from specdecode.serve.batch import BatchEngine

    step, calls = BatchEngine.step, []

    def failing(self):
        if self.running and any(s.generated for s in self.running):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("a step fails")
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", failing)
    client, state = make_client(model_dir)
    with client:
        raw = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 30, "ignore_eos": True,
                                                   "stream": True}).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert events[-1] == {"error": {"message": "internal error while decoding", "type": "server_error",
                                    "param": None, "code": None}}, events[-1]
    assert raw.endswith("data: [DONE]\n\n")


def test_a_server_shutting_down_answers_a_retryable_503(served):
    """While shutting down, a request gets a 503 with Retry-After (clients retry it), not a 500. Found by a mutation audit: no test failed without it."""
    client, state, _ = served
    state.accepting = False
    try:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    finally:
        state.accepting = True
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.json()["error"]["code"] == "shutting_down"


def test_server_metrics_record_what_they_are_given():
    """Each ServerMetrics call updates its own series with its own values and labels. Found by a mutation audit: no test failed without it."""
    from specdecode.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")

    def value(name, **labels):
        return metrics.registry.get_sample_value("specdecode:" + name, {"model_name": "m", **labels})

    metrics.finished("stop", 1.5, "code", 0.25, cached_tokens=3, looked_up=10)
    metrics.finished("stop", 2.0, "code", 0.5, cached_tokens=0, looked_up=4)
    assert value("request_success_total", finished_reason="stop") == 2
    assert value("request_success_total", finished_reason="length") == 0
    assert value("prefix_cache_queries_total") == 14 and value("prefix_cache_hits_total") == 3
    assert value("task_seconds_saved", task_type="code") == pytest.approx(0.75)  # summed over requests
    metrics.token_gap(0.02)
    assert value("inter_token_latency_seconds_count") == 1 and value("time_per_output_token_seconds_count") == 1
    metrics.request_done(prompt_tokens=5, generated=1, max_tokens=100, arrival=0.0, scheduled=1.0, first_token=2.0,
                         finish=2.0)  # one token: no time per output token (nothing to divide by)
    assert value("request_params_max_tokens_sum") == 100 and value("request_generation_tokens_sum") == 1
    assert value("request_time_per_output_token_seconds_count") == 0
    assert value("request_queue_time_seconds_sum") == 1.0 and value("request_prefill_time_seconds_sum") == 1.0
    metrics.queue(running=2, waiting=5)
    assert value("num_requests_running") == 2 and value("num_requests_waiting") == 5


def test_speculative_config_bounds_are_inclusive_and_sizes_start_at_1():
    """n-gram sizes up to MAX_NGRAM and a fixed k up to MAX_SERVED_K are taken; a size of 0
    is refused by name; "tree" is refused as "draft_model" is; an unset k_policy is the
    cost model's. Found by a mutation audit: no test gave a bound itself, nor a 0."""
    from specdecode.config import MAX_NGRAM, MAX_SERVED_K

    spec, _ = parse_speculative_config(json.dumps({"method": "ngram", "prompt_lookup_min": MAX_NGRAM,
                                                   "prompt_lookup_max": MAX_NGRAM}))
    assert spec.ngram_sizes == (MAX_NGRAM,)
    spec, _ = parse_speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": MAX_SERVED_K}))
    assert spec.k == MAX_SERVED_K and spec.k_policy == "cost"
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        with pytest.raises(ConfigError, match=f"{key} must be an integer >= 1, got 0"):
            parse_speculative_config(json.dumps({"method": "ngram", key: 0}))
    with pytest.raises(ConfigError, match="'tree' is not served by the batched engine"):
        parse_speculative_config('{"method": "tree"}')


def test_a_directory_of_medusa_heads_by_model_type_implies_medusa(tmp_path):
    """A config.json saying model_type "medusa" (the Medusa project's own heads) implies the
    method, as vLLM infers it. Found by a mutation audit: only our own architecture name
    was tried."""
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "config.json").write_text(json.dumps({"model_type": "medusa", "medusa_num_heads": 3}))
    spec, _ = parse_speculative_config(json.dumps({"model": str(tmp_path / "heads")}))
    assert spec.method == "medusa" and spec.draft == str(tmp_path / "heads")


def test_serve_options_refuse_an_unknown_schedule():
    """Found by a mutation audit: no test gave --schedule a bad value."""
    from specdecode.serve.server import check_serve_options

    with pytest.raises(ConfigError, match="--schedule must be one of"):
        check_serve_options(4, 8, schedule="lifo")
    check_serve_options(1, 0, 1.0, "task")  # the bounds themselves are taken


def test_replicas_options_reach_the_deployment(monkeypatch):
    """--replicas 0 is refused before Ray starts; a replica is routed at most one request
    more than it holds, Ray's proxy queues without a limit of its own, and
    --shutdown-timeout is the replicas' graceful shutdown; replicas share the cores. Found
    by a mutation audit: none of these reached a test outside a real Ray cluster."""
    import os

    import torch

    from specdecode.config import EngineConfig
    from specdecode.serve import server

    ray_serve = pytest.importorskip("ray.serve")
    with pytest.raises(ConfigError, match="--replicas must be >= 1, got 0"):
        server.ray_application(EngineConfig(model="default"), None, 0, 4, 8)
    builders, real_ingress = [], ray_serve.ingress
    monkeypatch.setattr(ray_serve, "ingress", lambda builder: builders.append(builder) or real_ingress(builder))
    application = server.ray_application(EngineConfig(model="default"), '{"method": "none"}', 2, 4, 8,
                                         shutdown_timeout=12.5)
    deployment = application._bound_deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 4 + 8 + 1
    assert deployment.max_queued_requests == -1
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 12.5
    # each replica's kernel threads: its share of the cores, or --threads
    threads = []

    class Built(Exception):
        pass

    def no_state(*args, **kwargs):
        raise Built

    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(server, "build_state", no_state)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for config, replicas in ((EngineConfig(model="default"), 2), (EngineConfig(model="default", num_threads=3), 2),
                             (EngineConfig(model="default"), 16)):
        builders.clear()
        server.ray_application(config, '{"method": "none"}', replicas, 4, 8)
        with pytest.raises(Built):
            builders[0]()
    assert threads == [4, 3, 1]


def test_serve_passes_the_shutdown_timeout_and_stops_accepting_on_a_signal(model_dir, monkeypatch):
    """--shutdown-timeout is uvicorn's graceful shutdown, and from the signal on the state
    refuses new requests while in-flight ones drain. Found by a mutation audit: neither
    was tested without a real server."""
    import signal

    import uvicorn

    from specdecode.serve.server import serve

    state = tiny_server_state(model_dir, '{"method": "none"}')
    seen = {}

    def run(self):
        seen["timeout"], seen["host"], seen["port"] = (self.config.timeout_graceful_shutdown, self.config.host,
                                                       self.config.port)
        seen["before"] = state.accepting
        self.handle_exit(signal.SIGTERM, None)
        seen["after"], seen["exiting"] = state.accepting, self.should_exit

    monkeypatch.setattr(uvicorn.Server, "run", run)
    serve(state, "127.0.0.1", 8123, 7.5)
    assert seen == {"timeout": 7.5, "host": "127.0.0.1", "port": 8123, "before": True, "after": False,
                    "exiting": True}


def test_serving_threads_leave_one_core_to_the_event_loop(monkeypatch):
    """Found by a mutation audit: no test held the count."""
    from specdecode.serve.server import serving_threads

    for cores, expected in ((8, 7), (2, 1), (1, 1)):
        monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
        assert serving_threads() == expected


def test_the_servers_name_metrics_positions_and_auditor_follow_its_flags(model_dir):
    """The default model is served under its name, any other under its path; a fixed k has
    that many per-position series, "auto" k_max's; no auditor at --audit-rate 0; one
    decode thread count leaves nothing to choose. Found by a mutation audit."""
    from prometheus_client import generate_latest

    from specdecode.config import EngineConfig
    from specdecode.serve.server import build_state

    target = load_model(str(model_dir), torch.float32, backend="torch")
    for model, name in (("default", "SmolLM2-135M-Instruct"), (str(model_dir), str(model_dir))):
        state = build_state(EngineConfig(model=model, dtype="fp32", backend="torch"), '{"method": "none"}',
                            target=target, decode_threads=(2,))
        assert state.metrics.model_name == name and state.auditor is None
        assert state.engine.decode_threads is None

    def positions(state):
        text = generate_latest(state.metrics.registry).decode()
        return sum(line.startswith("specdecode:spec_decode_num_accepted_tokens_per_pos_total{") for line in text.splitlines())

    fixed = tiny_server_state(model_dir, '{"method": "ngram", "num_speculative_tokens": 3, "k_max": 6}')
    auto = tiny_server_state(model_dir, '{"method": "ngram", "k_max": 6}')
    assert positions(fixed) == 3 and positions(auto) == 6


def test_a_negative_top_k_in_generation_config_is_off(tmp_path):
    """vLLM's and older configs' top_k -1 means no top-k: a default of 0 (off), not a
    config refused at start. Found by a mutation audit: no test gave a negative top_k."""
    from specdecode.serve.server import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": -1}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": 0}
