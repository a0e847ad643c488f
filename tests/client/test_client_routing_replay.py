"""Routing replay through the in-process `ember.ServiceClient` (`ember.service.routing_records`):
a `record_stability_info=True` sample of a mixture-of-experts model keeps its routes; a datum
whose provenance names it is routed through them when replay is on (the serve default
`StabilityConfig.routing_replay`, or `loss_fn_config["routing_replay"]` per request), even
after the router moved; off, the trainer routes by its current router."""

from __future__ import annotations

import contextlib

import pytest
import tinker
import torch
from tinker import types

import ember
from ember.models.families import moe_of
from ember.sampling import SamplerConfig
from ember.sampling.experts import RoutedSequence
from ember.service import Service
from ember.service.config import ServiceConfig
from helpers.server import stable_datum

MODEL = "ember-test/tiny-moe"
PROMPT = [5, 17, 30, 42, 8]


@pytest.fixture
def client(tmp_path, tiny_moe_dir):
    config = ServiceConfig(data_dir=tmp_path / "data", models={MODEL: str(tiny_moe_dir)},
                           stability={"routing_replay": True})
    service = Service(config)
    sc = ember.ServiceClient(service=service)
    yield sc
    sc.close("success")
    service.close()


@contextlib.contextmanager
def _trainer_routes(model: torch.nn.Module, layout):
    """The (tokens, layers, k) experts each forward's experts modules were handed."""
    seen: list[torch.Tensor] = []
    mods = [m for n, m in model.named_modules() if n.endswith("." + layout.experts)]
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for m in mods]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def test_replay_routes_recorded_samples_through_the_recorded_experts(client):
    tc = client.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    assert isinstance(seq, RoutedSequence)
    recorded = torch.cat([torch.as_tensor(seq.prompt_routes_np), torch.as_tensor(seq.routes_np)]).long()
    engine = client.service.debug_state().runs[tc.model_id].require_engine()
    layout = moe_of(engine.hf_config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the router moves after sampling (the lane is idle: every call above returned)
        for n, p in engine.model.named_parameters():
            if f".{layout.router}." in n:
                p.add_(torch.randn(p.shape, generator=g) * 2.0)
    datum = stable_datum(PROMPT, seq)

    def routes(config) -> torch.Tensor:
        with _trainer_routes(engine.model, layout) as seen:
            tc.forward([datum], "stable_reinforce", config).result()
        return torch.stack(seen, dim=1)

    assert torch.equal(routes(None), recorded)  # the serve default: replay
    assert not torch.equal(routes({"routing_replay": 0}), recorded)  # off for this request: the moved router
    assert torch.equal(routes({"routing_replay": 1, "clip_low_threshold": 0.5}), recorded)
    with pytest.raises(tinker.RequestFailedError) as info:
        tc.forward([datum], "stable_reinforce", {"routing_replay": 2}).result()
    assert "loss_fn_config['routing_replay'] must be 0" in str(info.value)
    assert info.value.category == types.RequestErrorCategory.User


@pytest.mark.slow  # the service checks the model against vLLM's support at start
def test_replay_is_refused_with_a_sampler_that_records_no_routes(tmp_path, tiny_vllm_model_dir):
    """Only TorchSampler records routes: asked for with the vLLM backend, replay is the
    caller's error naming the key and the backend (no vLLM engine starts for it)."""
    config = ServiceConfig(data_dir=tmp_path / "data", models={MODEL: str(tiny_vllm_model_dir)},
                           sampler=SamplerConfig(backend="vllm"))
    service = Service(config)
    sc = ember.ServiceClient(service=service)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT), loss_fn_inputs={"target_tokens": PROMPT})
        with pytest.raises(tinker.RequestFailedError) as info:
            tc.forward([datum], "cross_entropy", {"routing_replay": 1}).result()
        assert info.value.category == types.RequestErrorCategory.User
        assert "routing replay replays the routes TorchSampler records" in str(info.value) and "'vllm'" in str(info.value)
        tc.forward([datum], "cross_entropy", {"routing_replay": 0}).result()  # off: fine
    finally:
        sc.close("success")
        service.close()
