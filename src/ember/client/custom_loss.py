"""The SDK's client-side custom-loss algorithm (`TrainingClient.forward_backward_custom`).

1. forward (cross_entropy, forward_only) with `target_tokens` and `weights` (zeros when
   the datum has none) gives per-datum logprobs;
2. the user's `loss_fn(data, logprobs_list) -> (loss, metrics)` runs in torch on leaf
   copies of those logprobs and is back-propagated: g_i = dC/dlogprobs_i;
3. a cross_entropy forward_backward with `weights = -g_i` follows. Because
   CE = -Σ w·logp, its parameter gradient equals dC/dθ.

`loss_fn` may also be a `LossHandle` from `ServiceClient.create_custom_loss` (a per-datum
loss traced by the SDK); it runs here the same way, as the SDK runs it client-side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs, run_loss_handle


def check_loss_handle(handle: LossHandle, data: list[types.Datum], session_id: str) -> None:
    """As the SDK: a handle serves only its own session's clients, and every datum must
    carry each input it reads at the declared rank."""
    if handle.session_id != session_id:
        raise ValueError(f"LossHandle {handle.name!r} was created in session {handle.session_id}; it can "
                         "only be used by clients of that session")
    check_loss_inputs(handle, data)


def custom_forward_data(data: list[types.Datum]) -> list[types.Datum]:
    out = []
    for i, datum in enumerate(data):
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None:
            raise ValueError(f"datum {i}: forward_backward_custom needs loss_fn_inputs['target_tokens']")
        weights = datum.loss_fn_inputs.get("weights")
        if weights is None:
            weights = types.TensorData(data=[0.0] * len(targets.data), dtype="float32", shape=targets.shape)
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights}))
    return out


def evaluate_custom_loss(
    data: list[types.Datum], loss_fn: Callable, forward: types.ForwardBackwardOutput
) -> tuple[float, Mapping[str, Any], list[torch.Tensor]]:
    """Run the user's loss on the forward logprobs; return (loss sum, metrics, dC/dlogprobs)."""
    logprobs_list = []
    for out in forward.loss_fn_outputs:
        lp = torch.tensor(out["logprobs"].data)
        if out["logprobs"].shape is not None:
            lp = lp.reshape(out["logprobs"].shape)
        logprobs_list.append(lp.clone().detach().requires_grad_(True))
    if isinstance(loss_fn, LossHandle):  # from ServiceClient.create_custom_loss: the traced graph runs
        loss, metrics = run_loss_handle(loss_fn, data, logprobs_list)
    else:
        loss, metrics = loss_fn(data, logprobs_list)
    loss_sum = float(loss.detach().sum().item())
    loss.backward()
    grads = []
    for i, lp in enumerate(logprobs_list):
        if lp.grad is None:
            raise ValueError(f"custom loss: no gradient reached the logprobs of datum {i}")
        grads.append(lp.grad)
    return loss_sum, metrics, grads


def backward_data(data: list[types.Datum], grads: list[torch.Tensor]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": -grad},
        )
        for datum, grad in zip(data, grads, strict=True)
    ]
