"""Optimizer policies: Dimuon equals its formula, resumes bit-identically, scales with LoRA rank
as documented; a params type that does not match the run's optimizer is refused."""

import math

import pytest
import torch
from tinker import types

from ember.engine import TorchEngine
from ember.engine.optimizers import DAMPING, RANK_LR_EXPONENT, AdamW, Dimuon, build_optimizer
from helpers.datums import random_sft_datums

DIMUON = types.DimuonOptimizerConfig()
PARAMS = types.DimuonParams(learning_rate=1e-2, beta1=0.8, grad_clip_norm=0.5)


def _lora(tiny_model_dir, rank=4, optimizer=DIMUON):
    return TorchEngine.from_pretrained(tiny_model_dir, lora_config=types.LoraConfig(rank=rank, seed=0),
                                       optimizer_config=optimizer)


def _reference_direction(m: torch.Tensor) -> torch.Tensor:
    """The documented formula, written out: diag preconditioners, SVD polar factor, sqrt(k) norm."""
    m2 = m.reshape(m.shape[0], -1) if m.dim() >= 2 else m.reshape(1, -1)
    if not m2.any():
        return torch.zeros_like(m)
    rows, cols = (m2**2).mean(dim=1), (m2**2).mean(dim=0)
    r = torch.diag((rows / rows.mean() + DAMPING) ** -0.5)
    c = torch.diag((cols / cols.mean() + DAMPING) ** -0.5)
    u, s, vh = torch.linalg.svd(r @ m2 @ c, full_matrices=False)
    keep = s > s.max() * min(m2.shape) * torch.finfo(torch.float32).eps
    o = u[:, keep] @ vh[keep]
    k = min(m2.shape)
    return (o * math.sqrt(k) / torch.linalg.matrix_norm(o)).reshape(m.shape)


def test_dimuon_step_equals_the_formula_on_the_same_gradient(tiny_model_dir):
    engine = _lora(tiny_model_dir, rank=4)
    datums = random_sft_datums(4, vocab=84, seed=3)
    names = list(engine.state_tensors())
    weights = {n: p.detach().clone().float() for n, p in engine.state_tensors().items()}
    momentum = {n: torch.zeros_like(w) for n, w in weights.items()}
    rho = (32 / 4) ** RANK_LR_EXPONENT
    for _ in range(3):  # step 1 moves only B (A's gradient is zero while B is zero); then both
        engine.forward_backward(datums, "cross_entropy")
        grads = {n: engine.state_tensors()[n].grad.detach().clone().float() for n in names}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = min(1.0, PARAMS.grad_clip_norm / (float(norm) + 1e-6))
        for n in names:
            momentum[n] = PARAMS.beta1 * momentum[n] + (1 - PARAMS.beta1) * grads[n] * clip
            weights[n] = weights[n] - PARAMS.learning_rate * rho * _reference_direction(momentum[n])
        metrics = engine.optim_step(PARAMS)
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-6)
    moved_a = False
    for n, p in engine.state_tensors().items():
        torch.testing.assert_close(p.detach().float(), weights[n], rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        moved_a |= "lora_A" in n and not torch.equal(engine.optimizer.state[p]["momentum"], torch.zeros_like(p))
    assert moved_a and engine.step == 3


def _train(engine, datums, steps):
    for _ in range(steps):
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(PARAMS)


def test_dimuon_save_load_is_bit_identical(tiny_model_dir, tmp_path):
    datums = random_sft_datums(3, vocab=84, seed=5)
    a = _lora(tiny_model_dir)
    _train(a, datums, 2)
    a.save_state(tmp_path / "ck")
    b = _lora(tiny_model_dir)
    b.load_state(tmp_path / "ck")
    for pa, pb in zip(a.state_tensors().values(), b.state_tensors().values()):
        assert torch.equal(a.optimizer.state[pa]["momentum"], b.optimizer.state[pb]["momentum"])
    _train(a, datums, 1)
    _train(b, datums, 1)
    assert b.step == a.step == 3
    for (n, pa), pb in zip(a.state_tensors().items(), b.state_tensors().values()):
        assert torch.equal(pa.detach(), pb.detach()), n


def test_checkpoint_of_one_optimizer_does_not_load_into_the_other(tiny_model_dir, tmp_path):
    a = _lora(tiny_model_dir)
    _train(a, random_sft_datums(2, vocab=84, seed=1), 1)
    a.save_state(tmp_path / "ck")
    adam = _lora(tiny_model_dir, optimizer=None)
    with pytest.raises(ValueError, match="dimuon optimizer state; this run's optimizer is adamw"):
        adam.load_state(tmp_path / "ck")
    adam.load_state(tmp_path / "ck", optimizer=False)  # weights alone load into any optimizer


@pytest.mark.parametrize("rank", [8, 32])
def test_lora_rank_scaling_as_documented(tiny_model_dir, rank):
    """First step: only B moves, each by lr·(32/r)^γ·sqrt(min(m, n)) in Frobenius norm."""
    engine = _lora(tiny_model_dir, rank=rank)
    before = {n: p.detach().clone() for n, p in engine.state_tensors().items()}
    engine.forward_backward(random_sft_datums(4, vocab=84, seed=2), "cross_entropy")
    engine.optim_step(types.DimuonParams(learning_rate=1e-3))
    for n, p in engine.state_tensors().items():
        delta = float(torch.linalg.matrix_norm(p.detach() - before[n]))
        if "lora_A" in n:
            assert delta == 0.0, n
            continue
        expected = 1e-3 * (32 / rank) ** RANK_LR_EXPONENT * math.sqrt(min(p.shape))
        assert delta == pytest.approx(expected, rel=1e-4), n


def test_mismatched_params_type_names_both(tiny_model_dir):
    dimuon = _lora(tiny_model_dir)
    with pytest.raises(TypeError, match="AdamParams.*dimuon.*DimuonParams"):
        dimuon.optim_step(types.AdamParams())
    adam = _lora(tiny_model_dir, optimizer=types.AdamOptimizerConfig())
    with pytest.raises(TypeError, match="DimuonParams.*adamw.*AdamParams"):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3))


@pytest.mark.parametrize("field,value", [("learning_rate", -1.0), ("learning_rate", math.nan),
                                         ("learning_rate", math.inf), ("beta1", 1.0), ("beta1", -0.1),
                                         ("grad_clip_norm", math.nan), ("damping", 0.0),
                                         ("rank_lr_correction_exponent", math.inf)])
def test_hostile_dimuon_params_are_refused_before_anything_changes(tiny_model_dir, field, value):
    engine = _lora(tiny_model_dir)
    engine.forward_backward(random_sft_datums(2, vocab=84, seed=1), "cross_entropy")
    before = {k: v.clone() for k, v in engine.named_weights()}
    params = PARAMS.model_copy()
    object.__setattr__(params, field, value)  # damping/exponent: fields of newer SDKs, read if present
    with pytest.raises(ValueError, match=f"DimuonParams.{field}="):
        engine.optim_step(params)
    assert all(torch.equal(v, before[k]) for k, v in engine.named_weights())


def test_registry_and_vector_rule():
    p = torch.nn.Parameter(torch.zeros(5))
    assert isinstance(build_optimizer(None, [p], None), AdamW)
    assert isinstance(build_optimizer({"type": "dimuon"}, [p], None), Dimuon)
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer({"type": "sgd"}, [p], None)
    opt = build_optimizer(DIMUON, [p], None)
    p.grad = torch.tensor([3.0, 0.0, -4.0, 0.0, 0.0])
    opt.step(types.DimuonParams(learning_rate=1.0, beta1=0.0))
    assert float(torch.linalg.vector_norm(p.detach())) == pytest.approx(1.0)  # a vector is a rank-1 matrix
