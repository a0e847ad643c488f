"""Scalar-head (value) runs on the same engine: values, gradients (contract 2), checkpoints,
export, and the head/loss seam (docs/architecture.md#roles-one-engine-several-heads)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.heads import HEAD_METADATA_KEY, HEADS, PolicyHead, ValueHead, build_head, head_from_metadata
from helpers.datums import assert_tensors_close, random_sft_datums

RTOL = 1e-5
V = 84
LORA = types.LoraConfig(rank=4, seed=3)


def value_datums(n=6, seed=0, min_len=2, max_len=13, targets=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        toks = torch.randint(0, V, (length,), generator=g)
        inputs = {"returns": torch.randn(length, generator=g), "weights": torch.rand(length, generator=g) + 0.1}
        if targets:
            inputs["target_tokens"] = torch.randint(0, V, (length,), generator=g)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks.tolist()), loss_fn_inputs=inputs))
    return out


def _engine(model_dir, lora=None, budget=10_000, packing=True, head="value"):
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=packing),
                                       lora_config=lora, head=head)


def _grads(engine):
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def _weights(engine):
    return {n: p.detach().clone() for n, p in engine.state_tensors().items()}


def _values(out):
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def _direct_values(engine, datum):
    """score(last hidden state) of one sequence, with the HF model alone (no packing)."""
    ids = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        out = engine.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        return engine.head.score(out.hidden_states[-1][0].float()).squeeze(-1)


def _train(engine, datums, steps, loss_fn="value_mse"):
    for _ in range(steps):
        engine.forward_backward(datums, loss_fn)
        engine.optim_step(types.AdamParams(learning_rate=1e-2))


# ---------------------------------------------------------------- heads module
def test_heads_registry_and_metadata(tiny_model_dir):
    assert set(HEADS) == {"policy", "value"}
    assert head_from_metadata(None) == "policy" and head_from_metadata({}) == "policy"
    assert head_from_metadata({HEAD_METADATA_KEY: "value"}) == "value"
    with pytest.raises(ValueError, match=re.escape("user_metadata['ember.head'] must be one of policy, value; got 'critic'")):
        head_from_metadata({"ember.head": "critic"})
    with pytest.raises(ValueError, match=re.escape("user_metadata['ember.head'] must be a string, one of policy, value; got int 1")):
        head_from_metadata({"ember.head": 1})
    with pytest.raises(ValueError, match="head must be one of policy, value; got 'q'"):
        _engine(tiny_model_dir, head="q")


def test_value_head_init_is_seeded_and_non_zero():
    a, b, c = ValueHead(64, 1), ValueHead(64, 1), ValueHead(64, 2)
    assert torch.equal(a.score.weight, b.score.weight) and not torch.equal(a.score.weight, c.score.weight)
    assert a.score.weight.dtype == torch.float32 and a.score.weight.abs().sum() > 0
    assert torch.equal(a.score.bias, torch.zeros(1))
    assert sorted(a.hf_state()) == ["score.bias", "score.weight"] and PolicyHead().hf_state() == {}


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_value_forward_equals_direct_computation(tiny_model_dir, lora, packing):
    engine = _engine(tiny_model_dir, lora=lora, budget=30, packing=packing)
    datums = value_datums(seed=1)
    if lora is not None:  # a non-zero adapter, so the adapter's path is exercised
        _train(engine, datums, 1)
    out = engine.forward(datums, "value_mse")
    assert engine.info().head == "value"
    for d, v in zip(datums, _values(out)):
        ref = _direct_values(engine, d)
        assert v.shape == (d.model_input.length,)
        torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-5)
        r, w = d.loss_fn_inputs["returns"].to_torch(), d.loss_fn_inputs["weights"].to_torch()
    # elementwise loss of the last datum: ½·w·(V−R)²
    torch.testing.assert_close(out.loss_fn_outputs[-1]["elementwise_loss"].to_torch(), 0.5 * w * (v - r) ** 2,
                               rtol=1e-5, atol=1e-6)


def test_value_mse_gradient_equals_autograd_of_formula(tiny_model_dir):
    engine = _engine(tiny_model_dir, lora=LORA, budget=25)
    datums = value_datums(seed=2)
    _train(engine, datums, 1)  # LoRA B ≠ 0
    ref_model, ref_head = copy.deepcopy(engine.model), copy.deepcopy(engine.head)
    out = engine.forward_backward(datums, "value_mse")
    total = 0.0
    for d in datums:
        ids = torch.tensor([d.model_input.to_ints()])
        h = ref_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        v = ref_head.score(h.float()).squeeze(-1)
        r, w = d.loss_fn_inputs["returns"].to_torch(), d.loss_fn_inputs["weights"].to_torch()
        total = total + (0.5 * w * (v - r) ** 2).sum()
    total.backward()
    ref = {n.replace(".default.", "."): p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    ref.update({"head." + n: p.grad for n, p in ref_head.named_parameters()})
    got = _grads(engine)
    assert set(got) == set(ref) and any(k.startswith("head.") for k in got) and any("lora_B" in k for k in got)
    assert_tensors_close(got, ref, rtol=RTOL)  # rtol 1e-5 per element and of each tensor's scale
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-6)


# `make test-fast` runs the full variant here and the LoRA one of the checkpoint test below.
@pytest.mark.parametrize("lora", [None, pytest.param(LORA, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_value_gradient_invariance(tiny_model_dir, lora):
    datums = value_datums(7, seed=3)
    ref = _engine(tiny_model_dir, lora=lora, budget=10**6)
    ref_out = ref.forward_backward(datums, "value_mse")
    g_ref = _grads(ref)
    assert "head.score.weight" in g_ref
    for budget, packing in ((1, True), (7, True), (64, True), (7, False), (10**6, False)):
        e = _engine(tiny_model_dir, lora=lora, budget=budget, packing=packing)
        out = e.forward_backward(datums, "value_mse")
        assert_tensors_close(_grads(e), g_ref, rtol=RTOL)
        assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=RTOL)
    split = _engine(tiny_model_dir, lora=lora, budget=7)
    split.forward_backward(datums[:3], "value_mse")
    split.forward_backward(datums[3:], "value_mse")
    assert_tensors_close(_grads(split), g_ref, rtol=RTOL)


def test_custom_surrogate_is_exact(tiny_model_dir):
    """cross_entropy with weights −dC/dV on a value head gives ∇C (forward_backward_custom's path)."""
    datums = value_datums(4, seed=4, targets=True)
    engine = _engine(tiny_model_dir, lora=LORA, budget=20)
    _train(engine, datums, 1)
    # what the SDK sends: target_tokens (zero weights) only
    datums = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                                     "weights": torch.zeros(d.model_input.length)})
              for d in datums]
    ref_model, ref_head = copy.deepcopy(engine.model), copy.deepcopy(engine.head)

    def loss_c(values):  # a nonlinear, cross-datum loss (Bradley–Terry on the last positions)
        return torch.nn.functional.softplus(-(values[0][-1] - values[1][-1])) + torch.nn.functional.softplus(
            -(values[2][-1] - values[3][-1])) + (values[1] ** 2).sum()

    values = [v.requires_grad_() for v in _values(engine.forward(datums, "cross_entropy"))]
    loss_c(values).backward()
    custom = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": -v.grad}) for d, v in zip(datums, values)]
    engine.forward_backward(custom, "cross_entropy")
    ref_values = []
    for d in datums:
        h = ref_model(input_ids=torch.tensor([d.model_input.to_ints()]), output_hidden_states=True,
                      use_cache=False).hidden_states[-1][0]
        ref_values.append(ref_head.score(h).squeeze(-1))
    loss_c(ref_values).backward()
    ref = {n.replace(".default.", "."): p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    ref.update({"head." + n: p.grad for n, p in ref_head.named_parameters()})
    assert_tensors_close(_grads(engine), ref, rtol=RTOL)


# ---------------------------------------------------------------- the seam: heads and losses
def test_head_and_loss_must_match(tiny_model_dir):
    value, policy = _engine(tiny_model_dir, lora=LORA), _engine(tiny_model_dir, lora=LORA, head="policy")
    with pytest.raises(ValueError, match=re.escape("loss_fn 'value_mse' consumes values, but this run has a policy head")):
        policy.forward_backward(value_datums(2), "value_mse")
    rl = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={
        "target_tokens": torch.tensor([2, 3]), "logprobs": torch.zeros(2), "advantages": torch.ones(2)})]
    with pytest.raises(ValueError, match=re.escape(
            "loss_fn 'ppo' consumes logprobs, but this run has a value head (user_metadata {'ember.head': 'value'})")):
        value.forward_backward(rl, "ppo")
    top_k = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={
        "target_tokens": torch.tensor([[2, 3], [4, 5]]), "weights": torch.ones(2, 2)})]
    with pytest.raises(ValueError, match=re.escape("datum 0: loss_fn_inputs['target_tokens'] has shape (2, 2); a value "
                                                   "head has one output per position, use (2,)")):
        value.forward_backward(top_k, "cross_entropy")
    for e in (value, policy):
        assert e.status().accumulated_micro_batches == 0
        assert all(p.grad is None for p in e.state_tensors().values())


def test_policy_head_is_unchanged(tiny_model_dir):
    """head="policy" (the default) computes what it always did; CE values are log-probs."""
    datums = random_sft_datums(4, vocab=V, seed=5)
    a, b = _engine(tiny_model_dir, head="policy"), TorchEngine.from_pretrained(tiny_model_dir)
    out_a, out_b = a.forward_backward(datums, "cross_entropy"), b.forward_backward(datums, "cross_entropy")
    for x, y in zip(_values(out_a), _values(out_b)):
        assert torch.equal(x, y) and bool((x <= 0).all())
    assert all(torch.equal(p, q) for p, q in zip(_grads(a).values(), _grads(b).values()))
    assert a.head_weights() == {} and a.info().head == "policy"
    assert not any(n.startswith("head.") for n in a.state_tensors())


# ---------------------------------------------------------------- parameters
def test_value_lora_never_targets_lm_head(tiny_model_dir):
    lora = types.LoraConfig(rank=4, seed=1, train_unembed=True)
    value, policy = _engine(tiny_model_dir, lora=lora), _engine(tiny_model_dir, lora=lora, head="policy")
    assert any("lm_head" in n for n in policy.state_tensors())
    assert not any("lm_head" in n for n in value.state_tensors())
    assert not any("lm_head" in n for n, _ in value.named_weights())
    assert sorted(n for n in value.state_tensors() if n.startswith("head.")) == ["head.score.bias", "head.score.weight"]


def test_value_full_ft_excludes_output_embedding(tiny_model_dir):
    value, policy = _engine(tiny_model_dir), _engine(tiny_model_dir, head="policy")
    assert "lm_head.weight" in policy.state_tensors() and "lm_head.weight" not in value.state_tensors()
    assert not value.model.get_output_embeddings().weight.requires_grad
    assert set(value.state_tensors()) == (set(policy.state_tensors()) - {"lm_head.weight"}) | {
        "head.score.weight", "head.score.bias"}
    # named_weights is the backbone only (sampler-sync contract); the head comes separately
    assert {n for n, _ in value.named_weights()} == {n for n, _ in policy.named_weights()}
    heads = value.head_weights()
    assert sorted(heads) == ["score.bias", "score.weight"] and heads["score.weight"].shape == (1, 64)
    assert value.info().num_trainable_parameters == policy.info().num_trainable_parameters - V * 64 + 65


def test_offload_onload_value_bit_identical(tiny_model_dir):
    datums = value_datums(4, seed=6)
    a, b = _engine(tiny_model_dir, lora=LORA), _engine(tiny_model_dir, lora=LORA)
    for e in (a, b):
        _train(e, datums, 1)
        e.forward_backward(datums, "value_mse")
    b.offload()
    b.onload()
    for e in (a, b):
        e.optim_step(types.AdamParams(learning_rate=1e-2))
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("lora", [pytest.param(None, marks=pytest.mark.slow), LORA], ids=["full", "lora"])
def test_save_load_next_step_identical(tiny_model_dir, tmp_path, lora):
    datums = value_datums(5, seed=7)
    a = _engine(tiny_model_dir, lora=lora)
    _train(a, datums, 2)
    a.save_state(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "ember_state.json").read_text())
    assert meta["head"] == "value" and meta["head_config"] == {"type": "linear", "hidden_size": 64, "bias": True}
    b = _engine(tiny_model_dir, lora=lora)
    b.load_state(tmp_path / "ckpt")
    _train(a, datums, 1)
    _train(b, datums, 1)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    va, vb = _values(a.forward(datums, "value_mse")), _values(b.forward(datums, "value_mse"))
    assert all(torch.equal(x, y) for x, y in zip(va, vb))


def test_load_policy_checkpoint_into_value_run_refused(tiny_model_dir, tmp_path):
    policy = _engine(tiny_model_dir, lora=LORA, head="policy")
    policy.save_state(tmp_path / "p")
    value = _engine(tiny_model_dir, lora=LORA)
    with pytest.raises(ValueError, match="holds a policy-head run; this run has a value head"):
        value.load_state(tmp_path / "p")
    value.save_state(tmp_path / "v")
    with pytest.raises(ValueError, match="holds a value-head run; this run has a policy head"):
        policy.load_state(tmp_path / "v")
    meta_file = tmp_path / "p" / "ember_state.json"  # an old checkpoint without "head" reads as a policy
    meta = json.loads(meta_file.read_text())
    del meta["head"]
    meta_file.write_text(json.dumps(meta))
    policy.load_state(tmp_path / "p")
    with pytest.raises(ValueError, match="holds a policy-head run"):
        value.load_state(tmp_path / "p")


# ---------------------------------------------------------------- export
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_export_loads_back_same_values(tiny_model_dir, tmp_path, lora):
    from transformers import AutoModelForTokenClassification

    datums = value_datums(3, seed=8)
    engine = _engine(tiny_model_dir, lora=lora)
    _train(engine, datums, 2)
    engine.export_hf(tmp_path / "out")
    if lora is None:
        model = AutoModelForTokenClassification.from_pretrained(tmp_path / "out")
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["architectures"] == ["Qwen3ForTokenClassification"] and config["id2label"] == {"0": "VALUE"}
        import safetensors.torch

        names = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors")).keys()
        assert "lm_head.weight" not in names and {"score.weight", "score.bias"} <= set(names)
    else:
        from peft import PeftModel

        adapter_cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        assert adapter_cfg["task_type"] == "TOKEN_CLS" and adapter_cfg["modules_to_save"] == ["score"]
        base = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
        model = PeftModel.from_pretrained(base, tmp_path / "out")
    model.eval()
    values = _values(engine.forward(datums, "value_mse"))
    for d, v in zip(datums, values):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([d.model_input.to_ints()])).logits
        torch.testing.assert_close(logits[0, :, 0], v, rtol=1e-5, atol=1e-5)


def test_build_head_names_known_heads(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match="head must be one of policy, value; got 'x'"):
        build_head("x", engine.hf_config, 0)
    assert build_head("value", engine.hf_config, 0).score.in_features == 64


def test_value_head_on_llama_and_any_adapter_name(tiny_llama_dir):
    from ember.models import add_lora_adapter, load_model

    engine = _engine(tiny_llama_dir, lora=LORA, budget=20)
    datums = value_datums(3, seed=9)
    for d, v in zip(datums, _values(engine.forward(datums, "value_mse"))):
        torch.testing.assert_close(v, _direct_values(engine, d), rtol=1e-5, atol=1e-5)
    # an adapter named like the head's module keeps the head's state names intact
    model = add_lora_adapter(load_model(tiny_llama_dir, "float32", "cpu", "sdpa"), "score", LORA, unembed=False)
    named = TorchEngine(model, EngineConfig(), lora_config=LORA, adapter_name="score", head="value")
    assert {"head.score.weight", "head.score.bias"} <= set(named.state_tensors())
