"""A bounded schemathesis run against the server's own OpenAPI schema: valid and invalid bodies
for the POST operations must never produce a 5xx, and the engine must stay healthy."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

OPERATIONS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", OPERATIONS)
def test_no_server_errors(server, schema, path, mode):
    strategy = schema[path]["POST"].as_strategy(generation_mode=mode)
    statuses: list[int] = []

    @seed(1234)
    @settings(
        max_examples=12,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case):
        if isinstance(case.body, dict):  # keep generation short: the model is not under test
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int) and case.body[key] > 8:
                    case.body[key] = 8
            if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
                case.body["n"] = 2
        response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text[:500])

    run()
    assert statuses
    server.wait_idle()
