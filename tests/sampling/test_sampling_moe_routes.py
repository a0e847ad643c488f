"""TorchSampler's routing records (`ember.sampling.experts.RouteRecorder`): each sequence of
a mixture-of-experts model carries the experts every layer chose for its prompt tokens and
for each sampled token fed back; those are the routes the trainer's router picks for the
datum `prompt + sampled[:-1]` under the same weights; replaying them after the router
moved brings the trainer's logprobs back to the sampler's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.moe import ROUTES_KEY
from ember.models.families import moe_of
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.experts import RoutedSequence
from helpers.datums import sft_datum

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14]]


def _trainer_routes(engine: TorchEngine, datum: types.Datum) -> np.ndarray:
    """(N, layers, k) experts the trainer's routers chose for one datum."""
    layout = moe_of(engine.hf_config)
    suffix = "." + layout.experts
    mods = [m for n, m in engine.model.named_modules() if n.endswith(suffix)]
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for m in mods]
    try:
        engine.forward([datum], "cross_entropy")
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1).numpy()


def _sample(sampler: TorchSampler) -> list[tuple[list[int], RoutedSequence]]:
    requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=6, seed=3 + i, stop=[]))
                for i, p in enumerate(PROMPTS)]
    out = []
    for p, resp in zip(PROMPTS, sampler.sample_many(requests, timeout=120)):
        out += [(p, seq) for seq in resp.sequences]
    return out


def _routed_datum(prompt: list[int], seq: RoutedSequence, replay: bool) -> types.Datum:
    datum = sft_datum(prompt + list(seq.tokens))
    if not replay:
        return datum
    routes = np.concatenate([seq.prompt_routes_np, seq.routes_np]).astype(np.int64)
    inputs = dict(datum.loss_fn_inputs) | {ROUTES_KEY: types.TensorData.from_numpy(routes)}
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def test_sampled_routes_are_the_trainers_routes_and_replay_closes_the_gap(tiny_moe_dir):
    engine = TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig())
    with TorchSampler.from_pretrained(tiny_moe_dir, SamplerConfig(max_slots=8)) as sampler:
        sampled = _sample(sampler)
    layers, k = engine.hf_config.num_hidden_layers, engine.hf_config.num_experts_per_tok
    for prompt, seq in sampled:
        assert isinstance(seq, RoutedSequence)
        n = len(seq.tokens)
        assert seq.prompt_routes_np.shape == (len(prompt), layers, k) and seq.routes_np.shape == (n - 1, layers, k)
        recorded = np.concatenate([seq.prompt_routes_np, seq.routes_np])
        np.testing.assert_array_equal(_trainer_routes(engine, _routed_datum(prompt, seq, False)), recorded)

    def gap(replay: bool) -> float:
        worst = 0.0
        for prompt, seq in sampled:
            out = engine.forward([_routed_datum(prompt, seq, replay)], "cross_entropy").loss_fn_outputs[0]
            got = out["logprobs"].to_numpy()[len(prompt) - 1:]
            worst = max(worst, float(np.abs(got - seq.logprobs_np).max()))
        return worst

    assert gap(False) < 1e-4 and gap(True) < 1e-4  # the same weights: the contract holds both ways
    name = "." + moe_of(engine.hf_config).router + "."
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the router moves (as after a training step); the experts stay
        for n, p in engine.model.named_parameters():
            if name in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    without, with_replay = gap(False), gap(True)
    assert with_replay < without, (with_replay, without)


def test_a_prompt_prefix_from_the_prefix_cache_has_no_routes(tiny_moe_dir):
    """The cached prefix's tokens are not run: -1 (the trainer's router chooses there);
    the rest of the prompt has the routes a full prefill gave it."""
    prompt = list(range(3, 14))
    request = SamplingRequest(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=3, seed=1, stop=[]))
    with TorchSampler.from_pretrained(tiny_moe_dir, SamplerConfig(max_slots=4, prefix_cache_block=4)) as sampler:
        first = sampler.sample_many([request], timeout=120)[0]
        second = sampler.sample_many([request], timeout=120)[0]
    hit = second.prompt_cache_hit_tokens
    assert first.prompt_cache_hit_tokens == 0 and 0 < hit < len(prompt)
    full, partial = first.sequences[0].prompt_routes_np, second.sequences[0].prompt_routes_np
    assert (partial[:hit] == -1).all() and (full >= 0).all()
    np.testing.assert_array_equal(partial[hit:], full[hit:])
