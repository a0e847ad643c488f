"""docs/protocol.md §9 training items (12-14, 16-20, 34, 35, 39, 40, 43) with the
unmodified official SDK against `ember serve`, plus in-process vs HTTP parity."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, OTHER_KEY, sft_datum

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

LR = types.AdamParams(learning_rate=2e-2)
METRIC_KEY = re.compile(r"^[^:]+:[^:]+$")
SEEN_METRIC_KEYS: set[str] = set()


def new_client(sc, seed: int = 0, rank: int = 4):
    return sc.create_lora_training_client(base_model=MODEL_NAME, rank=rank, seed=seed).result()


def batch() -> list[types.Datum]:
    return [sft_datum([5, 6, 7, 8, 9, 10], [0.0, 1.0, 1.0, 0.5, 2.0]), sft_datum([11, 12, 13, 14])]


def logprobs_of(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    SEEN_METRIC_KEYS.update(out.metrics)
    return [o["logprobs"].to_numpy().copy() for o in out.loss_fn_outputs]


def fwd(tc, data) -> list[np.ndarray]:
    return logprobs_of(tc.forward(data, "cross_entropy").result())


def ce_from(out: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    return -sum(float((d.loss_fn_inputs["weights"].to_numpy() * o["logprobs"].to_numpy()).sum())
                for d, o in zip(data, out.loss_fn_outputs, strict=True))


def step(tc, params: types.AdamParams = LR) -> None:
    resp = tc.optim_step(params).result()
    SEEN_METRIC_KEYS.update(resp.metrics or {})


def test_sft_two_rounds(served):
    """On SQLite and PostgreSQL: every request's future is persisted and read back."""
    ember_server, sc = served, tinker.ServiceClient(base_url=served.base_url, api_key=API_KEY)
    try:
        _sft_two_rounds(ember_server, sc)
    finally:
        sc.close("success").result(timeout=30)


def _sft_two_rounds(ember_server, sc):
    tc = new_client(sc)
    model_id = tc.get_info().model_id
    data = batch()
    losses = []
    for _ in range(2):
        out = tc.forward_backward(data, "cross_entropy").result()
        for d, o in zip(data, out.loss_fn_outputs, strict=True):
            assert o["logprobs"].shape == d.loss_fn_inputs["target_tokens"].shape
        assert out.metrics["loss:sum"] == pytest.approx(ce_from(out, data), rel=1e-5)
        losses.append(out.metrics["loss:sum"])
        SEEN_METRIC_KEYS.update(out.metrics)
        step(tc)
    assert losses[1] < losses[0]
    fb = [e for e in ember_server.requests("/forward_backward") if (e["extra"] or {}).get("model_id") == model_id]
    opt = [e for e in ember_server.requests("/optim_step") if e["json"].get("model_id") == model_id]
    assert [e["extra"]["seq_id"] for e in fb] == [1, 3] and [e["json"]["seq_id"] for e in opt] == [2, 4]
    assert all(e["headers"]["content-type"] == "application/x-protobuf" for e in fb)
    assert opt[0]["json"]["adam_params"] == {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                                             "weight_decay": 0.0, "grad_clip_norm": 0.0}
    polls = [e for e in ember_server.requests("/retrieve_future")
             if e["headers"].get("x-tinker-request-type") == "ForwardBackward" and e["extra"].get("status") == "complete"]
    assert polls and all(e["response_type"] == "application/x-protobuf" for e in polls)
    for e in ember_server.requests():  # §9 item 40: every JSON id is a string
        for key in ("request_id", "model_id", "session_id", "sampling_session_id"):
            if isinstance(e["response"], dict) and key in e["response"]:
                assert isinstance(e["response"][key], str)


def test_forward_is_forward_only_and_changes_nothing(ember_server, sc):
    tc = new_client(sc, seed=1)
    data = batch()
    mark = ember_server.log_mark()
    first = fwd(tc, data)
    np.testing.assert_array_equal(first[0], fwd(tc, data)[0])
    step(tc)  # nothing accumulated: no change
    np.testing.assert_array_equal(first[1], fwd(tc, data)[1])
    tc.forward_backward(data, "cross_entropy").result()
    step(tc)
    assert not np.allclose(first[0], fwd(tc, data)[0], atol=1e-4)
    sent = [e["extra"]["forward_only"] for e in ember_server.requests_since(mark, "/forward_backward")]
    assert sent == [True, True, True, False, True]


def test_gradient_accumulation_equals_one_batch(sc):
    data = batch() + [sft_datum([20, 21, 22, 23, 24, 25, 26])]
    split, whole = new_client(sc, seed=7), new_client(sc, seed=7)
    for a, b in zip(fwd(split, data), fwd(whole, data), strict=True):
        np.testing.assert_array_equal(a, b)  # same seed -> same LoRA init
    split.forward_backward(data[:1], "cross_entropy").result()
    split.forward_backward(data[1:], "cross_entropy").result()
    whole.forward_backward(data, "cross_entropy").result()
    step(split)
    step(whole)
    for a, b in zip(fwd(split, data), fwd(whole, data), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_topk_cross_entropy_numpy_n_by_k(sc):
    tc = new_client(sc)
    n, k = 5, 3
    rng = np.random.default_rng(0)
    targets = rng.integers(1, 80, size=(n, k)).astype(np.int64)
    weights = rng.random((n, k)).astype(np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 3 + n))),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    out = tc.forward_backward([datum], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.shape == [n, k]
    assert out.metrics["loss:sum"] == pytest.approx(-float((weights * lp.to_numpy()).sum()), rel=1e-5)


def test_sparse_csr_inputs_match_dense(ember_server, sc):
    tc = new_client(sc)
    n, k = 6, 8
    targets = torch.zeros(n, k, dtype=torch.int64)
    targets[:, 0] = torch.arange(30, 30 + n)
    targets[2, 3] = 44
    weights = torch.zeros(n, k)
    weights[:, 0] = 1.0
    weights[2, 3] = 0.25
    tokens = types.ModelInput.from_ints(list(range(10, 10 + n)))
    sparse = types.Datum(model_input=tokens, loss_fn_inputs={"target_tokens": targets, "weights": weights})
    dense = types.Datum(model_input=tokens, loss_fn_inputs={"target_tokens": targets.numpy(),
                                                            "weights": weights.numpy()})
    assert sparse.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    mark = ember_server.log_mark()
    a = tc.forward([sparse], "cross_entropy").result()
    b = tc.forward([dense], "cross_entropy").result()
    np.testing.assert_array_equal(a.loss_fn_outputs[0]["logprobs"].to_numpy(), b.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    assert [e["extra"]["sparse_inputs"] for e in ember_server.requests_since(mark, "/forward_backward")] == [2, 0]


def _rl_datum(tokens, q, adv):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": q, "advantages": adv})


def _rl_expected(loss_fn, lp, q, adv, cfg) -> float:
    r = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return float(-(r * adv).sum())
    if loss_fn == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return float(-np.minimum(r * adv, np.clip(r, lo, hi) * adv).sum())
    if loss_fn == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return float(-(np.clip(r, lo, hi) * lp * adv).sum())
    assert loss_fn == "dro"
    return float(-(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum())


RL_CASES = [
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.5}),
]


@pytest.mark.parametrize("loss_fn, cfg", RL_CASES)
def test_rl_losses_match_formulas(ember_server, sc, loss_fn, cfg):
    tc = new_client(sc)
    tokens = [3, 9, 27, 41, 7, 15, 60]
    base = fwd(tc, [sft_datum(tokens)])[0]
    rng = np.random.default_rng(1)
    q = (base + rng.normal(0, 0.5, size=base.shape)).astype(np.float32)  # ratios well outside the clips
    adv = rng.normal(0, 1, size=base.shape).astype(np.float32)
    mark = ember_server.log_mark()
    out = tc.forward_backward([_rl_datum(tokens, q, adv)], loss_fn, loss_fn_config=cfg or None).result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(lp, base, rtol=1e-5, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(_rl_expected(loss_fn, lp, q, adv, cfg), rel=1e-4, abs=1e-5)
    SEEN_METRIC_KEYS.update(out.metrics)
    assert ember_server.requests_since(mark, "/forward_backward")[0]["extra"]["loss_fn"] == loss_fn


def test_adam_weight_decay_and_clipping_change_the_update(ember_server, sc):
    data = batch()
    variants = {"plain": LR, "decay": types.AdamParams(learning_rate=2e-2, weight_decay=5.0),
                "clip": types.AdamParams(learning_rate=2e-2, grad_clip_norm=1e-3)}
    after = {}
    mark = ember_server.log_mark()
    for name, params in variants.items():
        tc = new_client(sc, seed=3)
        for _ in range(2):  # Adam's first step is scale-invariant; clipping shows from step 2 on
            tc.forward_backward(data, "cross_entropy").result()
            step(tc, params)
        after[name] = fwd(tc, data)[0]
    assert np.abs(after["plain"] - after["decay"]).max() > 1e-4
    assert np.abs(after["plain"] - after["clip"]).max() > 1e-4
    sent = [e["json"]["adam_params"] for e in ember_server.requests_since(mark, "/optim_step")]
    assert [s["weight_decay"] for s in sent] == [0.0, 0.0, 5.0, 5.0, 0.0, 0.0]
    assert [s["grad_clip_norm"] for s in sent] == [0, 0, 0, 0, 1e-3, 1e-3]


def test_forward_backward_custom(ember_server, sc):
    tc = new_client(sc)
    data = batch()

    def loss_fn(data, logprobs_list):
        loss = sum((lp ** 2).sum() for lp in logprobs_list)
        return loss, {"sq:sum": float(loss.detach())}

    expected = sum(float((lp ** 2).sum()) for lp in fwd(tc, data))
    mark = ember_server.log_mark()
    out = tc.forward_backward_custom(data, loss_fn).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert "surrogate_loss:sum" in out.metrics and out.metrics["sq:sum"] == pytest.approx(expected, rel=1e-5)
    sent = [e["extra"] for e in ember_server.requests_since(mark, "/forward_backward")]
    assert [(s["forward_only"], s["loss_fn"]) for s in sent] == [(True, "cross_entropy"), (False, "cross_entropy")]
    assert sent[1]["seq_id"] == sent[0]["seq_id"] + 1


@pytest.mark.parametrize("bad, words", [
    ([sft_datum([1, 2, 500, 3])], ["datum 0", "vocab"]),  # token id out of the 84-token vocabulary
    ("unknown_config", ["unknown"]),
    ("missing_advantages", ["advantages"]),
])
def test_user_errors_are_failed_futures_and_the_client_keeps_working(sc, bad, words):
    tc = new_client(sc)
    if bad == "unknown_config":
        call = tc.forward_backward(batch(), "ppo", loss_fn_config={"no_such_key": 1.0})
    elif bad == "missing_advantages":
        d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-1.0, -1.0, -1.0]})
        call = tc.forward_backward([d], "importance_sampling")
    else:
        call = tc.forward_backward(bad, "cross_entropy")
    with pytest.raises(tinker.RequestFailedError) as info:
        call.result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert all(w.lower() in str(info.value).lower() for w in words), str(info.value)
    out = tc.forward_backward(batch(), "cross_entropy").result()  # the client is not poisoned
    assert out.metrics["loss:sum"] > 0
    step(tc)


def test_two_tenants_each_see_only_their_own_updates(ember_server, sc):
    other = tinker.ServiceClient(base_url=ember_server.base_url, api_key=OTHER_KEY)
    try:
        mine, theirs = new_client(sc, seed=5), new_client(other, seed=5)
        data = batch()
        before = fwd(theirs, data)
        for _ in range(3):  # interleaved submissions on one base model
            f1 = mine.forward_backward(data, "cross_entropy")
            f2 = theirs.forward(data, "cross_entropy")
            mine.optim_step(LR)
            f1.result(), f2.result()
        after_theirs, after_mine = fwd(theirs, data), fwd(mine, data)
        for a, b in zip(before, after_theirs, strict=True):
            np.testing.assert_array_equal(a, b)
        assert not np.allclose(after_mine[0], before[0], atol=1e-4)
        rc = tinker.RestClient(base_url=ember_server.base_url, api_key=OTHER_KEY)
        listed = [r.training_run_id for r in rc.list_training_runs(limit=1000).result().training_runs]
        assert theirs.get_info().model_id in listed and mine.get_info().model_id not in listed
        with pytest.raises(tinker.NotFoundError):
            rc.get_training_run(mine.get_info().model_id).result()
    finally:
        other.close("success").result(timeout=30)


def test_in_process_and_http_give_identical_losses(ember_server, sc, tiny_model_dir, tmp_path):
    import ember

    def sft(client) -> list[float]:
        tc = client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result()
        losses = []
        for _ in range(3):
            losses.append(tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(LR).result()
        return losses

    local = ember.ServiceClient(models={MODEL_NAME: str(tiny_model_dir)}, data_dir=tmp_path)
    try:
        in_process = sft(local)
    finally:
        local.close("success")
    over_http = sft(sc)
    # bit-identical on this machine; rtol 1e-6 tolerates a different torch thread count in the server
    np.testing.assert_allclose(over_http, in_process, rtol=1e-6, atol=0)
    assert over_http[2] < over_http[0]


def _record_metric_keys_of_every_call(sc) -> None:
    """Forward, SFT forward_backward, optim_step and each RL loss once, their metric keys into
    SEEN_METRIC_KEYS: the check below sees every kind of call even when it runs alone."""
    tc = new_client(sc)
    tokens = [3, 9, 27, 41, 7, 15, 60]
    base = fwd(tc, [sft_datum(tokens)])[0]
    logprobs_of(tc.forward_backward(batch(), "cross_entropy").result())
    step(tc)
    adv = np.ones_like(base)
    for loss_fn, cfg in RL_CASES:
        logprobs_of(tc.forward_backward([_rl_datum(tokens, base, adv)], loss_fn, loss_fn_config=cfg or None).result())


def test_every_metric_key_has_exactly_one_colon(sc):
    _record_metric_keys_of_every_call(sc)
    assert SEEN_METRIC_KEYS and "loss:sum" in SEEN_METRIC_KEYS
    assert all(METRIC_KEY.match(k) for k in SEEN_METRIC_KEYS), SEEN_METRIC_KEYS
