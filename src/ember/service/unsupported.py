"""SDK methods ember does not implement: one error, the one the SDK raises over HTTP.

`ember serve` answers an endpoint it does not have with 404 and the JSON body
`{"error": ..., "category": "user"}`; the SDK turns that into `tinker.NotFoundError`
with the message `Error code: 404 - {body}`. In process the same call raises the same
class with the same message, built here from the same body (never `AttributeError`).
"""

from __future__ import annotations

import httpx
import tinker

# SDK method -> why ember has no counterpart (in process and over HTTP).
UNSUPPORTED: dict[str, str] = {
    "copy_weights": "ember has no projects to copy weights between",
    "assign_session_project": "ember has no projects",
    "export_session_trace": "ember keeps no session traces",
    "search_sessions": "list_sessions lists the owner's sessions",
    "get_audit_log": "ember keeps no audit log",
    "get_billing_usage": "ember has no billing",
    "get_current_checkpoint_storage_usage": "ember has no storage accounting",
    "whoami": "in process the caller is the operator (no credential to describe)",
    "get_console_url": "in process there is no server, so no console to link to (ember serve has one)",
    "holder": "the SDK's HTTP connection holder does not exist in process",
    "from_sampler_handle": "in process, create the sampler with ServiceClient.create_sampling_client",
    "create": "in process, create the sampler with ServiceClient.create_sampling_client",
}

# Routes the SDK calls outside its client classes' methods (its CLI, or a feature its
# client config turns on and ember leaves off, docs/protocol.md §1.4) -> why ember answers
# them with that reason; `ember serve` refuses them like the calls above (404, the reason).
UNSERVED_ROUTES: dict[str, str] = {
    "get_self_api_key": "ember's API keys are set by its operator (--api-key, --api-keys-file); set "
                        "TINKER_API_KEY instead of running `tinker auth login`",
    "delete_self_api_key": "ember's API keys are set by its operator (--api-key, --api-keys-file); only the "
                           "operator revokes one",
    "auth_token": "ember takes plain API keys, no JWT exchange (client config pjwt_auth_enabled is off)",
    "join_sampling_session": "a SamplingClient gets its own sampling session from create_sampling_session "
                             "(client config sample_join_sampling_session is off)",
    "cancel_future": "a sample request runs to completion once queued (dynamic config sample_cancel_enabled is off)",
    "retrieve_futures": "futures are polled one at a time with retrieve_future (client config "
                        "sample_use_retrieve_futures is off)",
    "create_custom_loss": "custom losses run in the client with forward_backward_custom (client config "
                          "custom_loss_server_side is off)",
}

IN_PROCESS_URL = "http://ember.in-process/api/v1"


def unsupported_body(method: str) -> dict[str, str]:
    """The 404 body of an SDK call (`UNSUPPORTED`) or route (`UNSERVED_ROUTES`) ember refuses."""
    reason = UNSUPPORTED.get(method) or UNSERVED_ROUTES[method]
    return {"error": f"{method} is not supported by ember: {reason}", "category": "user"}


def unsupported_error(method: str) -> tinker.NotFoundError:
    """The `tinker.NotFoundError` the SDK makes of ember serve's 404 for `method`."""
    body = unsupported_body(method)
    request = httpx.Request("POST", f"{IN_PROCESS_URL}/{method}")
    response = httpx.Response(404, json=body, request=request)
    return tinker.NotFoundError(f"Error code: 404 - {body}", response=response, body=body)


def unsupported(method: str):
    """A method that raises `unsupported_error(method)` with any arguments; a coroutine
    function for `<method>_async`, whose error names `<method>`."""
    base = method.removesuffix("_async")

    def call(*_args, **_kwargs):
        raise unsupported_error(base)

    async def call_async(*_args, **_kwargs):
        raise unsupported_error(base)

    fn = call_async if method.endswith("_async") else call
    fn.__name__ = fn.__qualname__ = method
    fn.__doc__ = f"Not supported by ember: {UNSUPPORTED[base]}."
    return fn
