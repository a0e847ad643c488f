"""In-process `RestClient`: the SDK's RestClient listing methods over an `ember.service`."""

from __future__ import annotations

from concurrent.futures import Future as ConcurrentFuture
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from ember.client.context import ClientContext
from ember.service.unsupported import unsupported


def _now(fn: Callable[[], Any]) -> APIFuture:
    """Run a direct service call and wrap its outcome in an SDK future."""
    f: ConcurrentFuture = ConcurrentFuture()
    try:
        f.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - raised by .result()
        f.set_exception(exc)
    return AwaitableConcurrentFuture(f)


class RestClient:
    """Same method names, arguments and return types (APIFuture[...]) as `tinker.RestClient`."""

    def __init__(self, context: ClientContext) -> None:
        self._ctx = context
        self._service, self._owner = context.service, context.owner

    @property
    def context(self) -> ClientContext:
        """Read-only: the `ClientContext` (service, owner, session) this client works from,
        the one its `ServiceClient` made. ember's own (the SDK's client has none): an in-process
        caller reaches the service and its session through it."""
        return self._ctx

    def get_server_capabilities(self) -> APIFuture[types.GetServerCapabilitiesResponse]:
        return _now(self._service.get_server_capabilities)

    def get_training_run(self, training_run_id: str,
                         access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.TrainingRun]:
        return _now(lambda: self._service.get_training_run(self._owner, training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path: str,
                                        access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.TrainingRun]:
        run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
        return self.get_training_run(run_id, access_scope)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[types.WeightsInfoResponse]:
        return _now(lambda: self._service.get_weights_info(self._owner, tinker_path))

    def list_training_runs(self, limit: int = 20, offset: int = 0,
                           access_scope: Literal["owned", "accessible"] = "owned",
                           project_id: str | None = None) -> APIFuture[types.TrainingRunsResponse]:
        return _now(lambda: self._service.list_training_runs(self._owner, limit, offset))

    def list_checkpoints(self, training_run_id: str) -> APIFuture[types.CheckpointsListResponse]:
        return _now(lambda: self._service.list_checkpoints(self._owner, training_run_id))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[types.CheckpointsListResponse]:
        return _now(lambda: self._service.list_user_checkpoints(self._owner, limit, offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        return _now(lambda: self._service.delete_checkpoint(self._owner, training_run_id, checkpoint_id))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return self.delete_checkpoint(parsed.training_run_id, parsed.checkpoint_id)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return _now(lambda: self._service.set_checkpoint_public(
            self._owner, parsed.training_run_id, parsed.checkpoint_id, True))

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return _now(lambda: self._service.set_checkpoint_public(
            self._owner, parsed.training_run_id, parsed.checkpoint_id, False))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None) -> APIFuture[None]:
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        return _now(lambda: self._service.set_checkpoint_ttl(
            self._owner, parsed.training_run_id, parsed.checkpoint_id, ttl_seconds))

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[types.ExternalWeightsUrlsResponse]:
        """In process the caller is the operator: the URLs are `file://` URLs of the export's
        files (urllib opens them), under the same owner check as over HTTP."""
        parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        if not parsed.checkpoint_id.startswith("external_weights/"):  # as the SDK, before any call
            raise ValueError("get_external_weights_urls only accepts external weights checkpoints "
                             f"(tinker://<training_run_id>/external_weights/<name>), got {tinker_path!r}")

        def links() -> types.ExternalWeightsUrlsResponse:
            got = self._service.external_weights_links(self._owner, parsed.training_run_id, parsed.checkpoint_id)
            return types.ExternalWeightsUrlsResponse(
                urls={f: (Path(got.directory) / f).as_uri() for f in got.files},
                expires=datetime.fromtimestamp(got.expires, tz=timezone.utc))

        return _now(links)

    def get_session(self, session_id: str,
                    access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.GetSessionResponse]:
        return _now(lambda: self._service.get_session(self._owner, session_id))

    def list_sessions(self, limit: int = 20, offset: int = 0,
                      access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.ListSessionsResponse]:
        return _now(lambda: self._service.list_sessions(self._owner, limit, offset))

    def get_sampler(self, sampler_id: str) -> APIFuture[types.GetSamplerResponse]:
        return _now(lambda: self._service.get_sampler(self._owner, sampler_id))

    # ------------------------------------------------------------------ async variants (awaitable results)
    async def get_training_run_async(self, training_run_id: str,
                                     access_scope: Literal["owned", "accessible"] = "owned") -> types.TrainingRun:
        return await self.get_training_run(training_run_id, access_scope)

    async def get_training_run_by_tinker_path_async(self, tinker_path: str, access_scope: Literal[
            "owned", "accessible"] = "owned") -> types.TrainingRun:
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    async def list_training_runs_async(self, limit: int = 20, offset: int = 0,
                                       access_scope: Literal["owned", "accessible"] = "owned",
                                       project_id: str | None = None) -> types.TrainingRunsResponse:
        return await self.list_training_runs(limit, offset, access_scope, project_id)

    async def list_checkpoints_async(self, training_run_id: str) -> types.CheckpointsListResponse:
        return await self.list_checkpoints(training_run_id)

    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0) -> types.CheckpointsListResponse:
        return await self.list_user_checkpoints(limit, offset)

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        return await self.delete_checkpoint(training_run_id, checkpoint_id)

    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        return await self.delete_checkpoint_from_tinker_path(tinker_path)

    async def publish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        return await self.publish_checkpoint_from_tinker_path(tinker_path)

    async def unpublish_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        return await self.unpublish_checkpoint_from_tinker_path(tinker_path)

    async def set_checkpoint_ttl_from_tinker_path_async(self, tinker_path: str, ttl_seconds: int | None) -> None:
        return await self.set_checkpoint_ttl_from_tinker_path(tinker_path, ttl_seconds)

    async def get_external_weights_urls_async(self, tinker_path: str) -> types.ExternalWeightsUrlsResponse:
        return await self.get_external_weights_urls(tinker_path)

    async def get_session_async(self, session_id: str,
                                access_scope: Literal["owned", "accessible"] = "owned") -> types.GetSessionResponse:
        return await self.get_session(session_id, access_scope)

    async def list_sessions_async(self, limit: int = 20, offset: int = 0,
                                  access_scope: Literal["owned", "accessible"] = "owned") -> types.ListSessionsResponse:
        return await self.list_sessions(limit, offset, access_scope)

    async def get_sampler_async(self, sampler_id: str) -> types.GetSamplerResponse:
        return await self.get_sampler(sampler_id)

    def get_telemetry(self) -> None:
        """None: in process there is no SDK telemetry to report."""
        return None

    # ------------------------------------------------------------------ not in ember (see ember.service.unsupported)
    copy_weights = unsupported("copy_weights")
    copy_weights_async = unsupported("copy_weights_async")
    assign_session_project = unsupported("assign_session_project")
    assign_session_project_async = unsupported("assign_session_project_async")
    export_session_trace = unsupported("export_session_trace")
    export_session_trace_async = unsupported("export_session_trace_async")
    search_sessions = unsupported("search_sessions")
    get_audit_log = unsupported("get_audit_log")
    get_audit_log_async = unsupported("get_audit_log_async")
    get_billing_usage = unsupported("get_billing_usage")
    get_billing_usage_async = unsupported("get_billing_usage_async")
    get_current_checkpoint_storage_usage = unsupported("get_current_checkpoint_storage_usage")
    get_current_checkpoint_storage_usage_async = unsupported("get_current_checkpoint_storage_usage_async")
    whoami = unsupported("whoami")
