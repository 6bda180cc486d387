"""A property-based fuzzer (schemathesis) driven by the server's own OpenAPI schema: requests generated from every
route's declared body and parameters, valid and not, against a tiny engine. No request may get a 5xx, and the
server must be healthy after. Bounded here (a few examples per route); benchmarks/fuzz_server.py runs the long one."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzzer needs schemathesis (the test extra)")
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.runner.serving.test_server import MODEL, LiveServer  # noqa: E402

EXAMPLES_PER_ROUTE = 12


@pytest.fixture(scope="module")
def live(engine_factory):
    server = LiveServer(engine_factory("gqa"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def served_model(case, model: str):
    """A body's `model` names the served model, so requests reach the validation behind that check (an unknown
    model's 404 is tested elsewhere)."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model
    return case


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_generated_request_gets_a_server_error(case, live):
    response = served_model(case, MODEL).call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r:.500}: {response.text[:500]}"


def test_the_server_is_healthy_after_the_fuzzing(live):
    assert httpx.get(f"{live.url}/health").status_code == 200
