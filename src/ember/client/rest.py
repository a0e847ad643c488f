"""In-process `RestClient`: the SDK's RestClient listing methods over an `ember.service`."""

from __future__ import annotations

from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Callable, Literal

from tinker import types
from tinker.lib.public_interfaces.api_future import APIFuture, AwaitableConcurrentFuture

from ember.service.api import ServiceAPI


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

    def __init__(self, service: ServiceAPI, owner: str) -> None:
        self._service, self._owner = service, owner

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

    def get_session(self, session_id: str,
                    access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.GetSessionResponse]:
        return _now(lambda: self._service.get_session(self._owner, session_id))

    def list_sessions(self, limit: int = 20, offset: int = 0,
                      access_scope: Literal["owned", "accessible"] = "owned") -> APIFuture[types.ListSessionsResponse]:
        return _now(lambda: self._service.list_sessions(self._owner, limit, offset))

    def get_sampler(self, sampler_id: str) -> APIFuture[types.GetSamplerResponse]:
        return _now(lambda: self._service.get_sampler(self._owner, sampler_id))
