"""A bounded schemathesis run against the server's own OpenAPI schema, over every route: valid
and invalid requests must never produce a 5xx, with the key, without it, and behind
``--root-path``; the engine must stay healthy."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

# The shared server with its key; the same without a key (401s); the --root-path server;
# (server, with the key, examples per operation). CI runs 5 examples per operation with the key
# (generating them is most of the time: 12 took ~1 min of a 2-core CI run); "key-long" is the
# deeper search, under QWENSERVE_RUN_BENCHMARKS=1.
VARIANTS = {"key": ("server", True, 5), "no-key": ("server", False, 4),
            "root-path": ("guarded", True, 4), "key-long": ("server", True, 25)}  # fmt: skip


def _operations(raw: dict) -> list[tuple[str, str]]:
    return [(path, method.upper()) for path, item in raw["paths"].items() for method in item]


@pytest.fixture(scope="module")
def schemas(server, guarded):
    return {
        name: schemathesis.openapi.from_url(srv.base_url + "/openapi.json")
        for name, srv in (("server", server), ("guarded", guarded))
    }


def test_every_route_is_covered(schemas):
    routes = set(_operations(schemas["server"].raw_schema))
    expected = {("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                ("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/models", "GET"),
                ("/v1/models/{model}", "GET"), ("/health", "GET"), ("/metrics", "GET"),
                ("/version", "GET"), ("/reset_prefix_cache", "POST")}  # fmt: skip
    assert expected <= routes, expected - routes


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=[pytest.mark.benchmark] if v == "key-long" else []) for v in VARIANTS])
def test_no_server_errors(request, schemas, variant, mode):
    which, with_key, examples = VARIANTS[variant]
    srv = request.getfixturevalue(which)
    schema = schemas[which]
    headers = srv.headers if with_key else {}
    statuses: list[int] = []
    for path, method in _operations(schema.raw_schema):
        strategy = schema[path][method].as_strategy(generation_mode=mode)

        @seed(1234)
        @settings(
            max_examples=examples,
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
            response = case.call(base_url=srv.base_url, headers=headers, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (path, case.body, response.text[:500])  # noqa: B023 (run() is called in this iteration)

        try:
            run()
        except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
            assert mode == GenerationMode.NEGATIVE
    assert statuses
    if not with_key:
        assert 401 in statuses
    srv.wait_idle(timeout_s=30)
