"""Sub-clients work from a `ClientContext`; the shared Service is keyed on its whole config;
`create_custom_loss` handles run client-side as over HTTP."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tinker import types

import ember
from ember.client import context as context_module
from ember.client.context import ClientContext
from ember.service.config import ServiceConfig

MODEL = "ember-test/tiny-qwen3"
CLIENT_DIR = Path(context_module.__file__).parent


@pytest.mark.parametrize("module", ["training.py", "sampling.py", "rest.py"])
def test_sub_clients_never_touch_service_client_privates(module):
    tree = ast.parse((CLIENT_DIR / module).read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "_sc" not in names
    assert not any(isinstance(n, ast.Name) and n.id == "ServiceClient" for n in ast.walk(tree))


def test_sub_clients_share_the_service_clients_context(make_client):
    sc = make_client()
    ctx = sc.context
    assert isinstance(ctx, ClientContext) and ctx.service is sc.service and ctx.owner == "local"
    with pytest.raises(AttributeError):
        ctx.owner = "other"  # frozen
    rest = sc.create_rest_client()
    assert rest.context is ctx
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    assert tc.context is ctx
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert sampler.context is ctx and sampler.get_base_model() == MODEL


def test_an_equal_configuration_shares_the_service(make_client, tmp_path):
    a = make_client(data_dir=tmp_path / "d")
    b = make_client(data_dir=str(tmp_path / "d"))  # same directory, other spelling
    assert a.service is b.service


def test_a_different_configuration_is_refused_naming_the_field(make_client, tmp_path, tiny_model_dir):
    a = make_client(data_dir=tmp_path / "d")
    config = ServiceConfig(data_dir=tmp_path / "d", models={MODEL: str(tiny_model_dir)}, model_roots=["/"],
                           seq_gap_timeout_s=9.0)
    with pytest.raises(ValueError, match=r"another configuration: seq_gap_timeout_s=9\.0 \(running: 5\.0\)"):
        ember.ServiceClient(config=config)
    with pytest.raises(ValueError, match=r"sampler="):
        make_client(data_dir=tmp_path / "d", sampler={"max_len": 77})
    assert a.service is make_client(data_dir=tmp_path / "d").service  # still serving


def test_a_model_name_may_not_change_directory_on_a_shared_service(make_client, tmp_path, tiny_llama_dir):
    make_client(data_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="models="):
        ember.ServiceClient(models={MODEL: str(tiny_llama_dir)}, data_dir=tmp_path / "d")
    other = ember.ServiceClient(models={"ember-test/llama": str(tiny_llama_dir)}, data_dir=tmp_path / "d")
    other.close("success")  # more models on a shared service are fine: the registry is additive


def _datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                                       "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def test_create_custom_loss_runs_like_a_callable(make_client):
    sc = make_client()
    handle = sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert handle.name == "neg_ll" and handle.loss_id is None  # runs client-side, as over ember serve
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    data = [_datum([3, 5, 7, 9, 11]), _datum([4, 6, 8])]
    by_handle = tc.forward_backward_custom(data, handle).result()

    def as_callable(batch, logprobs_list):
        losses = [neg_ll(lp, torch.tensor(d.loss_fn_inputs["weights"].data))[0] for d, lp in zip(batch, logprobs_list)]
        total = torch.stack(losses).sum()
        return total, {"custom/neg_ll:sum": total}

    by_callable = tc.forward_backward_custom(data, as_callable).result()
    assert by_handle.metrics["loss:sum"] == pytest.approx(by_callable.metrics["loss:sum"], rel=1e-5)
    assert by_handle.metrics["custom/neg_ll:sum"] == pytest.approx(by_handle.metrics["loss:sum"], rel=1e-5)


def test_a_loss_handle_checks_its_session_and_inputs(make_client, tmp_path):
    sc = make_client()
    handle = sc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    bare = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3], dtype="int64", shape=[2])})
    with pytest.raises(ValueError, match="has no loss_fn_inputs\\['weights'\\]"):
        tc.forward_backward_custom([bare], handle)
    other = make_client(data_dir=tmp_path / "other")
    other_tc = other.create_lora_training_client(base_model=MODEL, rank=4).result()
    with pytest.raises(ValueError, match="only be used by clients of that session"):
        other_tc.forward_backward_custom([_datum([3, 5, 7])], handle)
