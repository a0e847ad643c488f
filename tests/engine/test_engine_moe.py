"""Mixture-of-experts training (`ember.engine.moe`): contract 2 with routed experts and
expert LoRA, what trains (router frozen under LoRA, trained in full fine-tuning), the
routing metrics over real tokens only, the auxiliary loss's gradient, the HF export."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from ember.engine import EngineConfig, TorchEngine
from ember.models.families import moe_of
from ember.models.testing import target_logprobs
from helpers.datums import assert_tensors_close, random_sft_datums

RTOL = 1e-5
LORA = types.LoraConfig(rank=4, seed=1)


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def _engine(model_dir, budget=10_000, packing=True, lora=LORA, coef=0.0) -> TorchEngine:
    config = EngineConfig(micro_batch_tokens=budget, packing=packing, moe_aux_loss_coef=coef)
    return TorchEngine.from_pretrained(model_dir, config, lora_config=lora)


@pytest.fixture(scope="module")
def datums():
    return random_sft_datums(5, vocab=80, min_len=2, max_len=12, seed=2)


def _random_b(engine: TorchEngine, seed: int = 3) -> None:
    """A fresh adapter's B is 0, which would leave A's gradient 0: give it values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.state_tensors().items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_expert_lora_gradient_is_invariant_to_budgets_packing_and_splits(tiny_moe_dir, datums):
    """The fast suite's tiny-MoE exactness test: one call at a large budget, then per-token
    micro-batches split over two calls, and padding instead of packing."""
    ref = _engine(tiny_moe_dir)
    _random_b(ref)
    out = ref.forward_backward(datums, "cross_entropy")
    expected = _grads(ref)
    assert any(".mlp.experts." in n for n in expected) and len(expected) == len(ref.state_tensors())
    split = _engine(tiny_moe_dir, budget=1)
    _random_b(split)
    first = split.forward_backward(datums[:2], "cross_entropy")
    second = split.forward_backward(datums[2:], "cross_entropy")
    assert_tensors_close(_grads(split), expected, rtol=RTOL)
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=RTOL)
    padded = _engine(tiny_moe_dir, budget=25, packing=False)
    _random_b(padded)
    padded.forward_backward(datums, "cross_entropy")
    assert_tensors_close(_grads(padded), expected, rtol=RTOL)


@pytest.mark.slow
def test_full_fine_tuning_gradient_is_invariant_and_trains_the_router(tiny_moe_dir, datums):
    ref = _engine(tiny_moe_dir, lora=None)
    ref.forward_backward(datums, "cross_entropy")
    expected = _grads(ref)
    layout = moe_of(ref.hf_config)
    routers = [n for n in expected if f".{layout.router}." in n]
    assert routers and all(expected[n].abs().sum() > 0 for n in routers)
    small = _engine(tiny_moe_dir, budget=7, lora=None)
    small.forward_backward(datums[:3], "cross_entropy")
    small.forward_backward(datums[3:], "cross_entropy")
    assert_tensors_close(_grads(small), expected, rtol=RTOL)


def test_lora_adapts_attention_and_every_expert_and_freezes_the_router(tiny_moe_dir):
    engine = _engine(tiny_moe_dir)
    layout = moe_of(engine.hf_config)
    names = list(engine.state_tensors())
    layers = engine.hf_config.num_hidden_layers
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == layers * len(layout.params) * 2  # A and B of each expert weight, every layer
    assert sum(".self_attn.q_proj." in n for n in names) == 2 * layers
    assert not any(f".{layout.router}." in n for n in names)
    e = getattr(engine.hf_config, layout.num_experts)
    a = engine.state_tensors()[next(n for n in experts if ".lora_A." in n)]
    assert a.shape[0] == LORA.rank * e  # per-expert factors: rank rows for each of the E experts
    router = engine.model.get_submodule(f"base_model.model.model.layers.0.{layout.router}")
    assert not any(p.requires_grad for p in router.parameters())


def _reference_routing(model_dir, datums):
    """Per datum, alone (no padding, no packing): transformers' own router logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for d in datums:
        with torch.no_grad():
            res = model(input_ids=torch.tensor([d.model_input.to_ints()]), output_router_logits=True)
        out.append(torch.stack([r.reshape(-1, r.shape[-1]) for r in res.router_logits]))
    return model, out


def test_routing_metrics_count_real_tokens_only(tiny_moe_dir, datums):
    """Padding (padded layout) and packing give the metrics of each datum run alone."""
    _, logits = _reference_routing(tiny_moe_dir, datums)
    all_logits = torch.cat(logits, dim=1)  # (layers, T, E)
    k = 2
    counts = torch.zeros(all_logits.shape[0], all_logits.shape[-1])
    chosen = all_logits.topk(k, dim=-1).indices.flatten(1)
    counts.scatter_add_(1, chosen, torch.ones(chosen.shape))
    imbalance = float((counts.max(dim=1).values / counts.mean(dim=1)).max())
    p = torch.softmax(all_logits, -1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    for packing in (True, False):
        m = _engine(tiny_moe_dir, budget=25, packing=packing).forward_backward(datums, "cross_entropy").metrics
        assert m["moe_load_imbalance:max"] == pytest.approx(imbalance, rel=1e-6)
        assert m["moe_router_entropy:mean"] == pytest.approx(entropy, rel=1e-5)
        assert "moe_aux_loss:sum" not in m


def test_aux_loss_gradient_is_the_sequence_balance_loss_s(tiny_moe_dir, datums):
    """Full fine-tuning with the auxiliary loss: the gradient equals autograd's of
    Σ cross-entropy + coef x Σ_seq Σ_layer (transformers' Switch loss of that sequence and
    layer) / k (`load_balancing_loss_func` counts an expert's assignments over T, not k x T:
    k times ember's normalisation, under which balanced routing scores 1)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coef = 0.3
    engine = _engine(tiny_moe_dir, budget=9, lora=None, coef=coef)
    metrics = engine.forward_backward(datums, "cross_entropy").metrics
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    cfg, layout = model.config, moe_of(model.config)
    e, k = getattr(cfg, layout.num_experts), getattr(cfg, layout.top_k)
    total, aux_total = 0.0, 0.0
    for d in datums:
        ids = torch.tensor([d.model_input.to_ints()])
        res = model(input_ids=ids, output_router_logits=True)
        targets = d.loss_fn_inputs["target_tokens"].to_torch()[:, None]
        logp = torch.log_softmax(res.logits[0].float(), -1).gather(-1, targets)[:, 0]
        ce = -(logp * d.loss_fn_inputs["weights"].to_torch()).sum()
        aux = sum(load_balancing_loss_func((r.reshape(-1, e),), e, k) / k for r in res.router_logits)
        (ce + coef * aux).backward()
        total, aux_total = total + float(ce.detach()), aux_total + coef * float(aux.detach())
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got = {n: g for n, g in _grads(engine).items() if n in expected}
    assert got.keys() == expected.keys()
    assert_tensors_close(got, expected, rtol=RTOL)
    assert metrics["loss:sum"] == pytest.approx(total, rel=RTOL)
    assert metrics["moe_aux_loss:sum"] == pytest.approx(aux_total, rel=RTOL)


def test_a_negative_aux_loss_coefficient_is_refused():
    with pytest.raises(ValueError, match=r"EngineConfig.moe_aux_loss_coef must be a finite number >= 0 "
                                         r"\(0 = off\), got -0.1"):
        EngineConfig(moe_aux_loss_coef=-0.1)


@pytest.mark.slow
def test_full_fine_tuning_export_loads_with_the_trained_logprobs(tiny_moe_dir, datums, tmp_path):
    engine = _engine(tiny_moe_dir, lora=None)
    engine.forward_backward(datums, "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-2))
    engine.export_hf(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = datums[0].model_input.to_ints() + [int(datums[0].loss_fn_inputs["target_tokens"].to_torch()[-1])]
    got = engine.forward([datums[0]], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(target_logprobs(loaded, tokens), got, rtol=0, atol=1e-5)


def test_gpt_oss_packed_rows_keep_each_sequence_and_sliding_window_apart(tmp_path):
    """gpt-oss's model builds its masks without position_ids, so the engine passes packed
    rows their masks: block-diagonal, and windowed for its sliding-window layers (as the
    published checkpoints alternate them). Packed logprobs equal each datum run alone,
    with sequences longer than the window of 4."""
    from ember.models.testing import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", family="gpt_oss", num_heads=2, num_kv_heads=2, head_dim=32)
    config = json.loads((model_dir / "config.json").read_text())
    config |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    data = random_sft_datums(5, vocab=80, min_len=6, max_len=12, seed=4)
    packed = _engine(model_dir, lora=None).forward(data, "cross_entropy").loss_fn_outputs
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for d, out in zip(data, packed):
        tokens = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_torch()[-1])]
        torch.testing.assert_close(out["logprobs"].to_torch(), target_logprobs(model, tokens), rtol=0, atol=1e-5)
    config["sliding_window"] = 64  # the window changes the function (the check above is not vacuous)
    (model_dir / "config.json").write_text(json.dumps(config))
    wide = _engine(model_dir, lora=None).forward(data, "cross_entropy").loss_fn_outputs
    assert max(float((a["logprobs"].to_torch() - b["logprobs"].to_torch()).abs().max())
               for a, b in zip(packed, wide)) > 1e-3


def test_a_lora_checkpoint_with_expert_factors_resumes_exactly(tiny_moe_dir, datums, tmp_path):
    engine = _engine(tiny_moe_dir)
    engine.forward_backward(datums, "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=1e-2))
    engine.save_state(tmp_path / "ckpt")
    resumed = _engine(tiny_moe_dir)
    resumed.load_state(tmp_path / "ckpt")
    for name, t in engine.state_tensors().items():
        assert torch.equal(resumed.state_tensors()[name], t), name
    a = engine.forward(datums, "cross_entropy").loss_fn_outputs
    b = resumed.forward(datums, "cross_entropy").loss_fn_outputs
    for x, y in zip(a, b):
        torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=0, atol=0)


def test_lora_tenants_on_one_moe_base_keep_their_own_experts(tiny_moe_dir):
    """Two adapters on one shared model (as LoRA runs on one base share it): one adapts the
    experts, one does not (train_mlp=False); each computes what it would alone."""
    from ember.models import add_lora_adapter, load_model

    shared = add_lora_adapter(load_model(tiny_moe_dir), "t1", LORA)
    shared = add_lora_adapter(shared, "t2", types.LoraConfig(rank=2, seed=5, train_mlp=False))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in shared.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.tensor([[5, 9, 14, 22, 31, 40]])
    outs = {}
    for name in ("t1", "t2"):
        shared.set_adapter(name)
        with torch.no_grad():
            outs[name] = shared(input_ids=ids).logits
    assert not any(".mlp.experts." in n and ".t2." in n for n, _ in shared.named_parameters())
    alone = add_lora_adapter(load_model(tiny_moe_dir), "t1", LORA)
    alone.load_state_dict({n: p for n, p in shared.state_dict().items() if ".t2." not in n and "lora_" in n},
                          strict=False)
    with torch.no_grad():
        torch.testing.assert_close(alone(input_ids=ids).logits, outs["t1"], rtol=0, atol=1e-6)
    assert float((outs["t1"] - outs["t2"]).abs().max()) > 1e-4
