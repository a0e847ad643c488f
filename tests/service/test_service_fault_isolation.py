"""One tenant's failing request never fails another tenant's work.

Sampling: two owners sample the same base model at once (one shared TorchSampler step);
bob's request fails inside the step, alice's complete as if alone.
Training: alice's and bob's LoRA runs share one base model and so one lane; bob's ops
fail (bad input, and engine faults that are not ValueErrors, one after a real backward
left bob's adapter with gradients), and every op alice queued before and after completes
with exactly the results of alice training alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from ember import failpoints
from ember.engine import EngineConfig, TorchEngine
from ember.engine.registry import ENGINE_BACKENDS
from helpers.datums import sft_datum
from ember.service import Service, ServiceConfig
from ember.service.engines import LocalEngineFactory, adapter_name

from .conftest import new_run, result, wait

ADAM = types.AdamParams(learning_rate=2e-2)
BOB_SEED = 13  # bob's LoRA seed: FaultyFactory gives his runs a FaultyEngine


# ------------------------------------------------------------------ sampling
def _sampling_session(svc: Service, owner: str) -> str:
    sid = svc.create_session(owner).session_id
    return svc.create_sampling_session(owner, sid, 0, base_model="tiny").sampling_session_id


def _alice_sample(svc, sampler_id, seq):
    return svc.sample("alice", sampler_id, seq, types.ModelInput.from_ints([5, 6, 7, 8]), 2,
                      types.SamplingParams(max_tokens=16, temperature=0.9, seed=21, stop=[]), topk_sample_logprobs=2)


def test_one_owners_failing_sample_leaves_the_other_owners_samples_alone(make_service):
    svc = make_service()
    alice, bob = _sampling_session(svc, "alice"), _sampling_session(svc, "bob")
    alone = result(svc, "alice", _alice_sample(svc, alice, 0))
    # only bob's request has stop strings: only bob's text is decoded (3 samples a step), and
    # it fails once bob's first sample has 3 tokens
    failpoints.arm("sampler.stop_strings", "decodeerror", skip=6)
    try:
        bob_params = types.SamplingParams(max_tokens=16, seed=3, stop=["}}}}"])
        subs = [_alice_sample(svc, alice, 1),
                svc.sample("bob", bob, 0, types.ModelInput.from_ints([9, 10, 11]), 3, bob_params),
                _alice_sample(svc, alice, 2)]
        got = [result(svc, "alice", subs[0]), result(svc, "alice", subs[2])]
        failed = wait(svc, "bob", subs[1])
    finally:
        failpoints.disarm("sampler.stop_strings")

    assert failed.status == "failed" and failed.category == "server", failed
    assert "sampling failed for this request: UnicodeDecodeError" in failed.error, failed.error
    for word in ("alice", alice, subs[0].request_id, subs[2].request_id, "(4,", "(6,"):
        assert word not in failed.error, (word, failed.error)
    for resp in got:
        for seq, ref in zip(resp.sequences, alone.sequences):
            assert seq.tokens == ref.tokens
            np.testing.assert_allclose(seq.logprobs, ref.logprobs, rtol=0, atol=1e-5)
            np.testing.assert_allclose(seq.topk_logprobs_np.logprobs, ref.topk_logprobs_np.logprobs, rtol=0,
                                       atol=1e-5)
    # Both owners are served afterwards.
    assert result(svc, "bob", svc.sample("bob", bob, 1, types.ModelInput.from_ints([9, 10, 11]), 1, bob_params))
    assert result(svc, "alice", _alice_sample(svc, alice, 3)).sequences[0].tokens == alone.sequences[0].tokens


# ------------------------------------------------------------------ training
class FaultyEngine:
    """Bob's engine: the real one, but forward_backward raises after its real backward has
    run (leaving gradients on bob's adapter and the shared model's active adapter his), and
    optim_step raises a non-ValueError before doing anything."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward_backward(self, datums, loss_fn, loss_fn_config=None):
        self._inner.forward_backward(datums, loss_fn, loss_fn_config)  # a bad datum raises ValueError here
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    def optim_step(self, adam_params):
        raise KeyError("exp_avg (injected: optimizer state lost)")


class FaultyFactory(LocalEngineFactory):
    def create(self, spec):
        engine = super().create(spec)
        return FaultyEngine(engine) if spec.lora_config.seed == BOB_SEED else engine


@pytest.fixture
def make_faulty_service(tmp_path, tiny_model_dir):
    services: list[Service] = []

    def make(name: str) -> Service:
        cfg = ServiceConfig(data_dir=tmp_path / name, models={"tiny": str(tiny_model_dir)})
        svc = Service(cfg, engine_factory=FaultyFactory(cfg.engine))
        services.append(svc)
        return svc

    yield make
    for svc in services:
        svc.close()


DATA = [sft_datum([5, 9, 14, 22, 31]), sft_datum([7, 8, 40, 41])]
PROBE = [sft_datum([5, 9, 14, 22, 31, 40, 7])]


def _alice_ops(svc: Service, mid: str, first: int, count: int) -> list:
    """Queue alice's ops seq first..first+count-1: forward_backward, optim_step, forward, ..."""
    subs = []
    for seq in range(first, first + count):
        kind = (seq - 1) % 3
        if kind == 0:
            subs.append(svc.forward_backward("alice", mid, seq, DATA, "cross_entropy"))
        elif kind == 1:
            subs.append(svc.optim_step("alice", mid, seq, ADAM))
        else:
            subs.append(svc.forward_backward("alice", mid, seq, PROBE, "cross_entropy", forward_only=True))
    return subs


def _outputs(svc: Service, subs: list) -> list:
    out = []
    for sub in subs:
        r = result(svc, "alice", sub)
        if isinstance(r, types.OptimStepResponse):
            out.append(r.metrics)
        else:
            out.append([d["logprobs"].to_numpy() for d in r.loss_fn_outputs])
    return out


def _assert_same(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if isinstance(r, dict):
            assert g.keys() == r.keys()
            np.testing.assert_allclose([g[k] for k in r], [r[k] for k in r], rtol=1e-6, atol=1e-7)
        else:
            for a, b in zip(g, r):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_one_runs_failing_ops_never_fail_another_runs_queued_ops_on_the_lane(make_faulty_service):
    ref_svc = make_faulty_service("alone")
    _, ref_mid = new_run(ref_svc, "alice", seed=0)
    reference = _outputs(ref_svc, _alice_ops(ref_svc, ref_mid, 1, 9))

    svc = make_faulty_service("shared")
    _, mid = new_run(svc, "alice", seed=0)
    _, bob = new_run(svc, "bob", seed=BOB_SEED)
    runs = svc.debug_state().runs
    assert runs[mid].lane is runs[bob].lane  # one base model: one lane
    before = _alice_ops(svc, mid, 1, 4)
    bad = svc.forward_backward("bob", bob, 1, [sft_datum([5, 6, 9999])], "cross_entropy")  # token outside vocab
    crash = svc.forward_backward("bob", bob, 2, DATA, "cross_entropy")
    lost = svc.optim_step("bob", bob, 3, ADAM)
    after = _alice_ops(svc, mid, 5, 5)
    bob_forward = svc.forward_backward("bob", bob, 4, PROBE, "cross_entropy", forward_only=True)

    _assert_same(_outputs(svc, before + after), reference)
    states = [wait(svc, "bob", s) for s in (bad, crash, lost)]
    assert [(s.status, s.category) for s in states] == [("failed", "user"), ("failed", "server"), ("failed", "server")]
    assert "9999" in states[0].error
    assert "RuntimeError" in states[1].error and "KeyError" in states[2].error
    for s in states:
        assert mid not in s.error and "alice" not in s.error
    assert result(svc, "bob", bob_forward).loss_fn_outputs  # bob's run keeps working too


class RefusingEngine(TorchEngine):
    """An engine backend whose construction fails for bob's runs, after his adapter was
    added to the shared model and activated."""

    def __init__(self, model, config=None, **kw) -> None:
        super().__init__(model, config, **kw)
        if kw.get("lora_config") is not None and kw["lora_config"].seed == BOB_SEED:
            raise RuntimeError("engine construction failed (injected)")


def test_a_failed_creation_leaves_the_shared_model_and_the_other_run_alone(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(ENGINE_BACKENDS, "refusing-test", f"{__name__}:RefusingEngine")
    cfg = ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)},
                        engine=EngineConfig(backend="refusing-test"))
    factory = LocalEngineFactory(cfg.engine)
    with Service(cfg, engine_factory=factory) as svc:
        _, mid = new_run(svc, "alice", seed=0)
        before = _alice_ops(svc, mid, 1, 2)
        sid = svc.create_session("bob").session_id
        bob = svc.create_model("bob", sid, 0, "tiny", types.LoraConfig(rank=4, seed=BOB_SEED))
        after = _alice_ops(svc, mid, 3, 1)
        alice_out = _outputs(svc, before + after)
        state = wait(svc, "bob", bob)
        assert state.status == "failed" and "engine construction failed" in state.error
        shared = factory.debug_state()["shared_models"][svc.debug_state().runs[mid].spec.base.directory]
        assert list(shared.peft_config) == [adapter_name(mid)]  # bob's half-made adapter is gone
    with Service(ServiceConfig(data_dir=tmp_path / "ref", models={"tiny": str(tiny_model_dir)})) as ref_svc:
        _, ref_mid = new_run(ref_svc, "alice", seed=0)
        _assert_same(alice_out, _outputs(ref_svc, _alice_ops(ref_svc, ref_mid, 1, 3)))
