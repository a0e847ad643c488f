"""An SDK call ember does not support raises the same error class and message over HTTP
(`ember serve`) as in process (`ember.ServiceClient`)."""

from __future__ import annotations

import pytest
import tinker

from ember.server.routes_unsupported import ENDPOINTS
from helpers.server import API_KEY

# The RestClient methods among the refused endpoints (the rest are routes no client method
# reaches: tests/server/test_server_sdk_routes.py sends each).
CALLS = {
    "assign_session_project": ("session-1", "project-1"),
    "export_session_trace": ("session-1",),
    "search_sessions": (tinker.types.SessionSearchRequest.model_construct(),),
    "copy_weights": ("tinker://run-1/weights/a", "project-1"),
    "get_audit_log": (),
    "get_billing_usage": ("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"),
    "get_current_checkpoint_storage_usage": (),
}


def test_every_unsupported_endpoint_is_exercised():
    assert {method for _, _, method in ENDPOINTS if hasattr(tinker.RestClient, method)} == set(CALLS)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CALLS))
def test_unsupported_call_raises_the_same_over_http_and_in_process(ember_server, make_in_process_rest, method):
    rest = tinker.RestClient(base_url=ember_server.base_url, api_key=API_KEY)
    with pytest.raises(tinker.APIStatusError) as over_http:
        getattr(rest, method)(*CALLS[method]).result(timeout=60)
    with pytest.raises(tinker.APIStatusError) as in_process:
        getattr(make_in_process_rest, method)(*CALLS[method])
    assert type(over_http.value) is type(in_process.value) is tinker.NotFoundError
    assert str(over_http.value) == str(in_process.value)


@pytest.fixture
def make_in_process_rest(tmp_path, tiny_model_dir):
    import ember

    sc = ember.ServiceClient(models={"tiny/qwen3": str(tiny_model_dir)}, data_dir=tmp_path / "data")
    yield sc.create_rest_client()
    sc.close("success")
