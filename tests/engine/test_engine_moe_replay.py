"""Routing replay in the trainer (`ember.engine.moe.RouteReplay`): a datum's recorded
routes (`loss_fn_inputs["routed_experts"]`) replace the router's top-k choice, the
weights still come from the current router; contract 2 holds with replay on; bad routes
are refused naming the datum and the field."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.moe import ROUTES_KEY
from ember.errors import UserError
from ember.models.families import moe_of
from helpers.datums import assert_tensors_close, random_sft_datums

RTOL = 1e-5
LORA = types.LoraConfig(rank=4, seed=1)


def _engine(model_dir, budget=10_000, packing=True, lora=LORA) -> TorchEngine:
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=packing),
                                       lora_config=lora)


def _experts_modules(engine: TorchEngine) -> list[torch.nn.Module]:
    suffix = "." + moe_of(engine.hf_config).experts
    return [m for n, m in engine.model.named_modules() if n.endswith(suffix) and not n.endswith("base_layer")]


@contextlib.contextmanager
def _routes_seen(engine: TorchEngine):
    """What each experts module is handed (its top-k index argument), per forward: the
    routes the model actually used, whoever chose them."""
    seen: list[torch.Tensor] = []
    mods = _experts_modules(engine)[: engine.hf_config.num_hidden_layers]
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].detach().clone())) for m in mods]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _routes_of(engine: TorchEngine, datum: types.Datum) -> torch.Tensor:
    """(N, layers, k) routes of one datum alone, as the current router chooses them."""
    with _routes_seen(engine) as seen:
        engine.forward([datum], "cross_entropy")
    return torch.stack(seen, dim=1)


def _with_routes(datum: types.Datum, routes: torch.Tensor) -> types.Datum:
    inputs = dict(datum.loss_fn_inputs) | {ROUTES_KEY: types.TensorData.from_torch(routes)}
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def _perturb_router(engine: TorchEngine, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    name = "." + moe_of(engine.hf_config).router + "."
    with torch.no_grad():
        for n, p in engine.model.named_parameters():
            if name in n:
                p.add_(torch.randn(p.shape, generator=g) * 2.0)


@pytest.fixture(scope="module")
def datums():
    return random_sft_datums(4, vocab=80, min_len=6, max_len=12, seed=4)


def test_replay_follows_the_record_after_the_router_moved(tiny_moe_dir, datums):
    engine = _engine(tiny_moe_dir)
    recorded = [_routes_of(engine, d) for d in datums]
    own = engine.forward([_with_routes(d, r) for d, r in zip(datums, recorded)], "cross_entropy")
    plain = engine.forward(datums, "cross_entropy")
    for a, b in zip(own.loss_fn_outputs, plain.loss_fn_outputs):  # replaying the router's own choice changes nothing
        torch.testing.assert_close(a["logprobs"].to_torch(), b["logprobs"].to_torch(), rtol=1e-6, atol=1e-6)
    _perturb_router(engine)
    moved = [_routes_of(engine, d) for d in datums]
    assert any(not torch.equal(m, r) for m, r in zip(moved, recorded)), "the perturbation left every route as it was"
    for d, r in zip(datums, recorded):
        assert torch.equal(_routes_of(engine, _with_routes(d, r)), r)


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_replay_keeps_the_gradient_invariant_to_micro_batching(tiny_moe_dir, datums, lora):
    """Half the datums replayed, half routed by the (moved) router; under full fine-tuning
    the router's gradient flows through the replayed experts' weights."""
    engine = _engine(tiny_moe_dir, lora=lora)
    recorded = [_routes_of(engine, d) for d in datums]
    partial = [_with_routes(d, r) if i % 2 == 0 else d for i, (d, r) in enumerate(zip(datums, recorded))]

    def grads(budget: int, packing: bool, splits: list[slice]) -> dict[str, torch.Tensor]:
        e = _engine(tiny_moe_dir, budget=budget, packing=packing, lora=lora)
        _perturb_router(e)
        for part in splits:
            e.forward_backward(partial[part], "cross_entropy")
        return {n: p.grad.detach().clone() for n, p in e.state_tensors().items() if p.grad is not None}

    expected = grads(10_000, True, [slice(None)])
    router = [n for n in expected if f".{moe_of(engine.hf_config).router}." in n]
    assert bool(router) == (lora is None) and all(expected[n].abs().sum() > 0 for n in router)
    assert_tensors_close(grads(1, True, [slice(0, 2), slice(2, None)]), expected, rtol=RTOL)
    assert_tensors_close(grads(25, False, [slice(None)]), expected, rtol=RTOL)


def test_bad_routes_are_refused_naming_datum_and_field(tiny_moe_dir, datums):
    engine = _engine(tiny_moe_dir)
    routes = _routes_of(engine, datums[1])
    with pytest.raises(UserError, match=rf"datum 1: loss_fn_inputs\['{ROUTES_KEY}'\] has shape"):
        engine.forward([datums[0], _with_routes(datums[1], routes[:-1])], "cross_entropy")
    with pytest.raises(UserError, match=r"datum 0: .* has shape .*MoE layers"):
        engine.forward([_with_routes(datums[1], routes[:, :1])], "cross_entropy")
    bad = routes.clone()
    bad[2, 0, 0] = 99
    with pytest.raises(UserError, match=r"datum 0: .*position 2 holds"):
        engine.forward([_with_routes(datums[1], bad)], "cross_entropy")


def test_routes_on_a_dense_model_are_refused(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), lora_config=LORA)
    datum = random_sft_datums(1, vocab=80, min_len=4, max_len=4, seed=1)[0]
    routes = torch.zeros((4, 2, 2), dtype=torch.int64)
    with pytest.raises(UserError, match=rf"datum 0: loss_fn_inputs\['{ROUTES_KEY}'\]: routing replay needs a "
                                        "mixture-of-experts model"):
        engine.forward([_with_routes(datum, routes)], "cross_entropy")
