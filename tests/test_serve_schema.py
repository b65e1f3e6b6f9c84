"""schemathesis over the server's OpenAPI schema: generated requests never get a 5xx."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

from conftest import save_chat_model, tiny_server_state  # noqa: E402
from specdecode.serve.app import create_app  # noqa: E402


def build_app(tmp_dir):
    state = tiny_server_state(save_chat_model(tmp_dir, seed=8, num_layers=1),
                              '{"method": "ngram", "num_speculative_tokens": 2}', max_model_len=128)
    return create_app(state, state.tokenizer)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from fastapi.testclient import TestClient

    application = build_app(tmp_path_factory.mktemp("schema"))
    with TestClient(application):  # runs the lifespan: the engine thread
        yield application


def operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in schema.get_all_operations()]


def test_no_server_errors(app):
    """Every operation of the schema (completions, chat, models, health, metrics), 40
    generated requests each (operations without parameters need fewer): no 5xx."""
    from hypothesis import given

    checked = []
    for operation in operations(app):

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 4)  # short generations: the property is the status
            if isinstance(case.body, dict) and isinstance(case.body.get("max_completion_tokens"), int):
                case.body["max_completion_tokens"] = min(case.body["max_completion_tokens"], 4)
            if isinstance(case.body, dict) and isinstance(case.body.get("n"), int) and case.body["n"] > 3:
                case.body["n"] = 3  # a few choices: each generates up to the context without max_tokens
            response = case.call()
            case.validate_response(response, checks=(not_a_server_error,))
            checked.append(response.status_code)

        check()
    assert len(checked) >= 60 and any(code == 200 for code in checked) and any(code == 400 for code in checked)
