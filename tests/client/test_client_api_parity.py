"""ember's in-process clients expose the official SDK's methods with the same parameters."""

from __future__ import annotations

import inspect

import pytest
import tinker

import ember
from ember.client import RestClient, SamplingClient, TrainingClient

PAIRS = [
    (tinker.ServiceClient, ember.ServiceClient, [
        "create_lora_training_client", "create_lora_training_client_async",
        "create_training_client_from_state", "create_training_client_from_state_async",
        "create_training_client_from_state_with_optimizer", "create_training_client_from_state_with_optimizer_async",
        "create_sampling_client", "create_sampling_client_async", "get_server_capabilities",
        "get_server_capabilities_async", "create_rest_client", "close",
    ]),
    (tinker.TrainingClient, TrainingClient, [
        "forward", "forward_async", "forward_backward", "forward_backward_async", "forward_backward_custom",
        "forward_backward_custom_async", "optim_step", "optim_step_async", "save_state", "save_state_async",
        "load_state", "load_state_async", "load_state_with_optimizer", "load_state_with_optimizer_async",
        "save_weights_for_sampler", "save_weights_for_sampler_async", "save_weights_and_get_sampling_client",
        "save_weights_and_get_sampling_client_async", "create_sampling_client", "create_sampling_client_async",
        "get_info", "get_info_async", "get_tokenizer",
    ]),
    (tinker.SamplingClient, SamplingClient, [
        "sample", "sample_async", "compute_logprobs", "compute_logprobs_async", "get_tokenizer", "get_base_model",
        "get_base_model_async",
    ]),
    (tinker.RestClient, RestClient, [
        "get_server_capabilities", "get_training_run", "get_training_run_by_tinker_path",
        "get_weights_info_by_tinker_path", "list_training_runs", "list_checkpoints", "list_user_checkpoints",
        "delete_checkpoint", "delete_checkpoint_from_tinker_path", "get_session", "list_sessions", "get_sampler",
    ]),
]
CASES = [(sdk, ours, name) for sdk, ours, names in PAIRS for name in names]


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(inspect.unwrap(fn))
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("sdk,ours,name", CASES, ids=[f"{s.__name__}.{n}" for s, _, n in CASES])
def test_same_method_parameters_as_the_sdk(sdk, ours, name):
    assert hasattr(ours, name), f"{ours.__name__} lacks {name}"
    sdk_fn, our_fn = getattr(sdk, name), getattr(ours, name)
    assert _params(our_fn) == _params(sdk_fn)
    assert inspect.iscoroutinefunction(inspect.unwrap(our_fn)) == inspect.iscoroutinefunction(inspect.unwrap(sdk_fn))
