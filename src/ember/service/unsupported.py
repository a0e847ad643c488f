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
    "get_console_url": "ember has no web console",
    "holder": "the SDK's HTTP connection holder does not exist in process",
    "from_sampler_handle": "in process, create the sampler with ServiceClient.create_sampling_client",
    "create": "in process, create the sampler with ServiceClient.create_sampling_client",
}

IN_PROCESS_URL = "http://ember.in-process/api/v1"


def unsupported_body(method: str) -> dict[str, str]:
    return {"error": f"{method} is not supported by ember: {UNSUPPORTED[method]}", "category": "user"}


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
