"""Loss values and gradients against independent references (docs/protocol.md §5).

Two references per loss, both written independently of `ember.losses.functions`:
* numpy (float64): per-token loss and the *closed-form* d loss / d logp, which pins the
  stop-gradient semantics (cispo: −clip(r)·A; gspo: −s·A or 0 when clipped; ...);
* plain torch written per datum the way Tinker's docs write it, differentiated by autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.losses import LOSSES, compute_loss, get_loss, resolve_config

LENGTHS = (7, 13, 1, 19)  # a packed micro-batch of four datums
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")


def make_batch(seed: int = 0, lengths=LENGTHS) -> dict[str, np.ndarray]:
    """Random float64 inputs; q = logp shifted per datum so ratios land on both sides."""
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    seg = np.repeat(np.arange(len(lengths)), lengths)
    logp = np.log(rng.uniform(0.05, 1.0, T))
    seq_shift = np.array([0.5, -0.5, 0.0, 0.05])[seg]  # s > 1.2, s < 0.8, s ~ 1, s ~ 1
    q = logp - seq_shift + rng.normal(0.0, 0.3, T)
    adv = rng.normal(0.0, 1.0, T)
    adv[rng.uniform(size=T) < 0.2] = 0.0
    mask = (rng.uniform(size=T) < 0.7).astype(np.float64)
    mask *= rng.choice([0.5, 1.0, 3.0], T)  # non-binary values: Tinker uses `mask != 0`
    mask[seg == 2] = 0.0  # a datum whose mask is all zero: s = 1
    weights = rng.normal(0.5, 1.0, T)  # real-valued weights, not just 0/1
    # value losses read `logp` as the values V: returns R, and old values V_old with
    # V − V_old on both sides of the default clip 0.2
    returns = logp + rng.normal(0.0, 0.5, T)
    old_values = logp + rng.normal(0.0, 0.3, T)
    return dict(logp=logp, q=q, adv=adv, mask=mask, weights=weights, seg=seg, returns=returns,
                old_values=old_values)


# ---------------------------------------------------------------- numpy references
def _clipped_min(ratio, adv, low, high):
    """Per-token loss −min(rA, clip(r)A) and its closed-form d/dratio-weighted gradient."""
    unclipped, clipped = ratio * adv, np.clip(ratio, low, high) * adv
    loss = -np.minimum(unclipped, clipped)
    # unclipped branch active (ties included: then r is inside the bounds) -> −r·A; else 0.
    grad = np.where(unclipped <= clipped, -ratio * adv, 0.0)
    return loss, grad


def np_reference(name: str, b: dict, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """(per-token loss, d loss_t / d logp_t) in float64."""
    logp, q, adv = b["logp"], b["q"], b["adv"]
    r = np.exp(logp - q)
    if name == "cross_entropy":
        return -b["weights"] * logp, -b["weights"]
    if name == "value_mse":
        return 0.5 * b["weights"] * (logp - b["returns"]) ** 2, b["weights"] * (logp - b["returns"])
    if name == "ppo_value":
        return _np_ppo_value(logp, b, cfg["value_clip"])
    if name == "importance_sampling":
        return -r * adv, -r * adv
    if name == "ppo":
        return _clipped_min(r, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    if name == "cispo":
        c = np.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -c * logp * adv, -c * adv
    if name == "dro":
        beta = cfg["beta"]
        return -(logp * adv - 0.5 * beta * (logp - q) ** 2), -(adv - beta * (logp - q))
    if name == "stable_reinforce":  # ember's formula (functions.stable_reinforce)
        keep = (b["mask"] != 0) & (r >= cfg["clip_low_threshold"]) & (r <= cfg["clip_high_threshold"])
        return -(keep * r * adv), -(keep * r * adv)
    assert name == "gspo"
    s = np.ones_like(logp)
    for d in np.unique(b["seg"]):
        tok = b["seg"] == d
        inside = tok & (b["mask"] != 0)
        s[tok] = np.exp(np.mean(logp[inside] - q[inside])) if inside.any() else 1.0
    return _clipped_min(s, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])


def _np_ppo_value(v, b, eps):
    w, ret, old = b["weights"], b["returns"], b["old_values"]
    inside = np.abs(v - old) < eps
    v_clip = old + np.clip(v - old, -eps, eps)
    plain, clipped = (v - ret) ** 2, (v_clip - ret) ** 2
    loss = 0.5 * w * np.maximum(plain, clipped)
    # the larger branch carries the gradient; the clipped one only inside the band
    grad = np.where(plain >= clipped, w * (v - ret), np.where(inside, w * (v_clip - ret), 0.0))
    return loss, grad


# ---------------------------------------------------------------- torch (docs-style) refs
def torch_doc_reference(name: str, logp: torch.Tensor, b: dict, cfg: dict) -> torch.Tensor:
    """Total loss written per datum as in Tinker's docs; autograd gives the gradient."""
    total = logp.new_zeros(())
    for d in np.unique(b["seg"]):
        tok = torch.from_numpy(b["seg"] == d)
        lp = logp[tok]
        q, adv = (torch.from_numpy(b[k][tok.numpy()]).to(logp) for k in ("q", "adv"))
        total = total + _doc_datum_loss(name, lp, q, adv, b, tok.numpy(), cfg)
    return total


def _doc_datum_loss(name, lp, q, adv, b, tok, cfg):
    low, high = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    ratio = torch.exp(lp - q)
    w = torch.from_numpy(b["weights"][tok]).to(lp)
    if name == "cross_entropy":
        return -(w * lp).sum()
    if name in ("value_mse", "ppo_value"):
        ret, old = (torch.from_numpy(b[k][tok]).to(lp) for k in ("returns", "old_values"))
        if name == "value_mse":
            return (0.5 * w * (lp - ret) ** 2).sum()
        eps = cfg["value_clip"]
        v_clip = old + torch.clamp(lp - old, -eps, eps)
        return (0.5 * w * torch.max((lp - ret) ** 2, (v_clip - ret) ** 2)).sum()
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
    if name == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * lp * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if name == "stable_reinforce":
        sampled = torch.from_numpy(b["mask"][tok] != 0)
        keep = sampled & (ratio.detach() >= low) & (ratio.detach() <= high)
        return -(ratio * adv)[keep].sum()
    in_ratio = torch.from_numpy(b["mask"][tok] != 0)
    log_ratio = (lp.detach() - q)[in_ratio].mean() if in_ratio.any() else lp.new_zeros(())
    s = torch.exp(log_ratio + lp - lp.detach())
    return -torch.min(s * adv, torch.clamp(s, low, high) * adv).sum()


# ---------------------------------------------------------------- helpers
def packed_inputs(b: dict, dtype=torch.float64) -> dict[str, torch.Tensor]:
    t = {k: torch.from_numpy(b[k]).to(dtype) for k in ("weights", "adv", "q", "mask")}
    t.update({k: torch.from_numpy(b[k]).to(dtype) for k in ("returns", "old_values") if k in b})
    return {
        "target_tokens": torch.zeros(len(b["logp"]), dtype=torch.long),
        "weights": t["weights"],
        "logprobs": t["q"],
        "advantages": t["adv"],
        "sequence_ratio_mask": t["mask"],
        "sampled_mask": t["mask"],
        **{k: t[k] for k in ("returns", "old_values") if k in t},
    }


def run_loss(name, b, dtype=torch.float64, config=None):
    spec = get_loss(name)
    logp = torch.from_numpy(b["logp"]).to(dtype).requires_grad_()
    inputs = {k: v for k, v in packed_inputs(b, dtype).items() if k in spec.accepted_inputs}
    loss_T = compute_loss(name, logp, inputs, config, torch.from_numpy(b["seg"]))
    loss_T.sum().backward()
    return loss_T, logp.grad


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_grad_match_numpy_reference_fp64(name):
    b = make_batch()
    cfg = resolve_config(name, None)
    loss_T, grad_T = run_loss(name, b)
    ref_loss, ref_grad = np_reference(name, b, cfg)
    assert loss_T.shape == (len(b["logp"]),) and loss_T.dtype == torch.float64
    np.testing.assert_allclose(loss_T.detach().numpy(), ref_loss, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(float(loss_T.detach().sum()), ref_loss.sum(), rtol=1e-12)
    np.testing.assert_allclose(grad_T.numpy(), ref_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(LOSSES))
def test_fp32_sum_and_grad_match_reference(name):
    b = make_batch(seed=1)
    cfg = resolve_config(name, None)
    loss_T, grad_T = run_loss(name, b, dtype=torch.float32)
    ref_loss, ref_grad = np_reference(name, b, cfg)
    assert loss_T.dtype == torch.float32
    scale = np.abs(ref_loss).sum()
    assert abs(float(loss_T.detach().sum()) - ref_loss.sum()) <= 2e-6 * scale
    np.testing.assert_allclose(grad_T.numpy(), ref_grad, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", list(LOSSES))
def test_grad_matches_autograd_of_docs_formula(name):
    b = make_batch(seed=2)
    cfg = resolve_config(name, {"beta": 0.3} if name == "dro" else None)
    _, grad_T = run_loss(name, b, config=cfg)
    logp = torch.from_numpy(b["logp"]).requires_grad_()
    ref_total = torch_doc_reference(name, logp, b, cfg)
    ref_total.backward()
    torch.testing.assert_close(grad_T, logp.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo", "cispo", "dro", "gspo", "stable_reinforce", "ppo_value"])
def test_custom_config_changes_result(name):
    b = make_batch(seed=3)
    cfg = (
        {"beta": 2.0}
        if name == "dro"
        else {"value_clip": 0.05}
        if name == "ppo_value"
        else {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}
    )
    default_T, _ = run_loss(name, b)
    custom_T, custom_grad = run_loss(name, b, config=cfg)
    ref_loss, ref_grad = np_reference(name, b, resolve_config(name, cfg))
    np.testing.assert_allclose(custom_T.detach().numpy(), ref_loss, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(custom_grad.numpy(), ref_grad, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(default_T, custom_T)


def test_batch_exercises_both_clip_regimes():
    """Guard: the random batch really hits clipped and unclipped tokens for ppo and gspo."""
    b = make_batch()
    for name in ("ppo", "gspo"):
        _, grad_T = run_loss(name, b)
        active = b["adv"] != 0
        assert (grad_T.numpy()[active] == 0).sum() >= 2, name  # clipped -> no gradient
        assert (grad_T.numpy()[active] != 0).sum() >= 2, name


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage():
    b = make_batch(seed=4)
    _, grad_T = run_loss("cispo", b, config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    ratio = np.exp(b["logp"] - b["q"])
    assert ((ratio < 0.9) | (ratio > 1.1)).sum() >= 5  # clipping actually happens
    np.testing.assert_allclose(grad_T.numpy(), -np.clip(ratio, 0.9, 1.1) * b["adv"], rtol=1e-12)


@pytest.mark.parametrize("name", list(LOSSES))
def test_packed_equals_per_datum(name):
    """Contract 2 at the loss level: packing datums changes nothing, per token."""
    b = make_batch(seed=5)
    packed_T, packed_grad = run_loss(name, b)
    start = 0
    for n in LENGTHS:
        one = {k: v[start : start + n] for k, v in b.items()}
        one["seg"] = np.zeros(n, dtype=np.int64)
        single_T, single_grad = run_loss(name, one)
        torch.testing.assert_close(packed_T[start : start + n], single_T, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(
            packed_grad[start : start + n], single_grad, rtol=1e-13, atol=1e-13
        )
        start += n


def test_gspo_sequence_ratio_per_datum_and_any_segment_labels():
    b = make_batch(seed=6)
    loss_T, _ = run_loss("gspo", b)
    relabelled = dict(b, seg=np.array([5, 9, 11, 42])[b["seg"]])
    relabelled_T, _ = run_loss("gspo", relabelled)
    torch.testing.assert_close(loss_T, relabelled_T, rtol=0, atol=0)
    merged = dict(b, seg=np.zeros_like(b["seg"]))  # one big datum: a different s
    merged_T, _ = run_loss("gspo", merged)
    assert not torch.allclose(loss_T, merged_T)


def test_gspo_empty_mask_gives_ratio_one_and_masked_tokens_still_count():
    adv = np.array([1.0, -2.0, 0.5])
    b = dict(
        logp=np.log([0.2, 0.5, 0.9]),
        q=np.log([0.1, 0.1, 0.1]),
        adv=adv,
        mask=np.zeros(3),
        weights=np.ones(3),
        seg=np.zeros(3, dtype=np.int64),
    )
    loss_T, grad_T = run_loss("gspo", b)
    np.testing.assert_allclose(loss_T.detach().numpy(), -adv, rtol=1e-12)  # s = 1 inside [0.8, 1.2]
    np.testing.assert_allclose(grad_T.numpy(), -adv, rtol=1e-12)  # d s_t/d logp_t = s = 1
    shifted_T, _ = run_loss(
        "gspo", b, config={"clip_low_threshold": 1.1, "clip_high_threshold": 1.2}
    )
    np.testing.assert_allclose(shifted_T.detach().numpy(), -np.minimum(adv, 1.1 * adv), rtol=1e-12)
    # Only token 0 defines s, but tokens 1 and 2 (mask 0) still contribute their term.
    b["mask"] = np.array([1.0, 0.0, 0.0])
    loss_T, _ = run_loss("gspo", b)
    s = 2.0  # exp(log 0.2 - log 0.1)
    expected = -np.minimum(s * adv, np.clip(s, 0.8, 1.2) * adv)
    np.testing.assert_allclose(loss_T.detach().numpy(), expected, rtol=1e-12)
    assert np.all(expected[1:] != 0)


def test_top_k_cross_entropy():
    gen = torch.Generator().manual_seed(7)
    T, K, V = 9, 4, 30
    logprobs_T_V = torch.log_softmax(torch.randn(T, V, generator=gen, dtype=torch.float64), -1)
    tokens_T_K = torch.randint(0, V, (T, K), generator=gen)
    weights_T_K = torch.rand(T, K, generator=gen, dtype=torch.float64)
    weights_T_K[weights_T_K < 0.3] = 0.0  # sparse-style implicit cells: weight 0
    logp_T_K = torch.gather(logprobs_T_V, 1, tokens_T_K).requires_grad_()
    loss_T = compute_loss(
        "cross_entropy", logp_T_K, {"target_tokens": tokens_T_K, "weights": weights_T_K}, None, None
    )
    assert loss_T.shape == (T,)
    expected_T = -(weights_T_K * logp_T_K.detach()).sum(1)
    torch.testing.assert_close(loss_T.detach(), expected_T, rtol=1e-12, atol=1e-12)
    loss_T.sum().backward()
    torch.testing.assert_close(logp_T_K.grad, -weights_T_K, rtol=0, atol=0)


def test_bf16_logprobs_are_upcast_and_graph_kept():
    b = make_batch(seed=8)
    logp = torch.from_numpy(b["logp"]).to(torch.bfloat16).requires_grad_()
    inputs = {k: v.float() for k, v in packed_inputs(b).items() if k != "target_tokens"}
    loss_T = compute_loss("ppo", logp, inputs, None, torch.from_numpy(b["seg"]))
    assert loss_T.dtype == torch.float32
    loss_T.sum().backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["cross_entropy", "ppo", "gspo"])
def test_misaligned_tensors_raise(name):
    b = make_batch()
    inputs = packed_inputs(b)
    inputs = {k: v[:-1] if k != "target_tokens" else v for k, v in inputs.items()}
    logp = torch.from_numpy(b["logp"])
    with pytest.raises(ValueError, match="has shape .*expected"):
        compute_loss(name, logp, inputs, None, torch.from_numpy(b["seg"]))


def test_gspo_segment_ids_shape_checked():
    b = make_batch()
    with pytest.raises(ValueError, match="segment_ids has shape"):
        compute_loss(
            "gspo",
            torch.from_numpy(b["logp"]),
            packed_inputs(b),
            None,
            torch.zeros(3, dtype=torch.long),
        )
