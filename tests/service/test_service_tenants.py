"""Many tenants on one base model: isolation of training and of sampler snapshots."""

from __future__ import annotations


import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from helpers.datums import random_sft_datums, sft_datum
from helpers.server import wait_until
from ember.service.engines import adapter_name

from .conftest import new_run, result

VOCAB = 84
ADAM = types.AdamParams(learning_rate=2e-2)
PROBE = [5, 9, 14, 22, 31, 40, 7]


def _fwd_logprobs(svc, owner, mid, seq) -> torch.Tensor:
    out = result(svc, owner, svc.forward_backward(owner, mid, seq, [sft_datum(PROBE)], "cross_entropy", forward_only=True))
    return out.loss_fn_outputs[0]["logprobs"].to_torch()


def _sampler_logprobs(svc, owner, sampler_id, seq) -> torch.Tensor:
    sub = svc.sample(owner, sampler_id, seq, types.ModelInput.from_ints(PROBE), 1, types.SamplingParams(max_tokens=1),
                     include_prompt_logprobs=True)
    resp = result(svc, owner, sub)
    assert len(resp.sequences) == 1 and resp.sequences[0].sequence_id == sub.sample_sequence_ids[0]
    return torch.tensor(resp.prompt_logprobs[1:])


def test_two_tenants_share_one_base_model_and_see_only_their_own_updates(make_service, tiny_model_dir):
    svc = make_service()
    _, alice = new_run(svc, "alice", seed=1)
    _, bob = new_run(svc, "bob", seed=2)
    # One base model in memory, carrying both adapters.
    shared = list(svc.debug_state().engine_factory.debug_state()["shared_models"].values())
    assert len(shared) == 1 and {adapter_name(alice), adapter_name(bob)} <= set(shared[0].peft_config)

    # Reference: alice's training alone, on a standalone engine.
    ref = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(), types.LoraConfig(rank=4, seed=1))
    batches_a = [random_sft_datums(3, VOCAB, seed=10 + i) for i in range(3)]
    batches_b = [random_sft_datums(3, VOCAB, seed=20 + i) for i in range(3)]
    ref_losses = []
    for batch in batches_a:
        ref_losses.append(ref.forward_backward(batch, "cross_entropy").metrics["loss:sum"])
        ref.optim_step(ADAM)

    # Interleaved tenants on the shared model.
    subs, seq = [], 1
    for a, b in zip(batches_a, batches_b):
        subs.append((svc.forward_backward("alice", alice, seq, a, "cross_entropy"),
                     svc.forward_backward("bob", bob, seq, b, "cross_entropy")))
        svc.optim_step("bob", bob, seq + 1, ADAM)
        svc.optim_step("alice", alice, seq + 1, ADAM)
        seq += 2
    alice_losses = [result(svc, "alice", sa).metrics["loss:sum"] for sa, _ in subs]
    torch.testing.assert_close(torch.tensor(alice_losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)

    ref_lp = ref.forward([sft_datum(PROBE)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
    lp_a, lp_b = _fwd_logprobs(svc, "alice", alice, seq), _fwd_logprobs(svc, "bob", bob, seq)
    torch.testing.assert_close(lp_a, ref_lp, rtol=1e-5, atol=1e-5)
    assert (lp_a - lp_b).abs().max() > 1e-3  # they really trained different things

    # Snapshot samplers: each equals its own trainer (contract 5) and never the other's.
    sa = result(svc, "alice", svc.save_weights_for_sampler("alice", alice, seq + 1, None, sampling_session_seq_id=0))
    sb = result(svc, "bob", svc.save_weights_for_sampler("bob", bob, seq + 1, None, sampling_session_seq_id=0))
    samp_a = _sampler_logprobs(svc, "alice", sa.sampling_session_id, 0)
    samp_b = _sampler_logprobs(svc, "bob", sb.sampling_session_id, 0)
    torch.testing.assert_close(samp_a, lp_a, rtol=0, atol=1e-4)
    torch.testing.assert_close(samp_b, lp_b, rtol=0, atol=1e-4)
    assert (samp_a - lp_b).abs().max() > 1e-3

    # Immutability: alice trains on; her old snapshot keeps the old distribution.
    result(svc, "alice", svc.forward_backward("alice", alice, seq + 2, batches_a[0], "cross_entropy"))
    result(svc, "alice", svc.optim_step("alice", alice, seq + 3, ADAM))
    lp_a2 = _fwd_logprobs(svc, "alice", alice, seq + 4)
    assert (lp_a2 - lp_a).abs().max() > 1e-3
    torch.testing.assert_close(_sampler_logprobs(svc, "alice", sa.sampling_session_id, 1), lp_a, rtol=0, atol=1e-4)
    # Bob's run and sampler did not move.
    torch.testing.assert_close(_fwd_logprobs(svc, "bob", bob, seq + 2), lp_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_sampler_logprobs(svc, "bob", sb.sampling_session_id, 1), lp_b, rtol=0, atol=1e-4)


def test_finishing_a_session_frees_its_adapter_and_the_other_tenant_trains_on(make_service):
    svc = make_service()
    alice_sid, alice = new_run(svc, "alice", seed=1)
    _, bob = new_run(svc, "bob", seed=2)
    batch = random_sft_datums(3, VOCAB, seed=30)
    queued = svc.forward_backward("alice", alice, 1, batch, "cross_entropy")
    svc.finish_session("alice", alice_sid, "success")
    assert result(svc, "alice", queued).metrics["loss:sum"] > 0  # queued work still completes
    shared = list(svc.debug_state().engine_factory.debug_state()["shared_models"].values())[0]
    # the release runs on the lane after the queued work
    wait_until(lambda: adapter_name(alice) not in shared.peft_config, 10, interval=0.05,
               message="alice's adapter to be released")
    assert set(shared.peft_config) == {adapter_name(bob)}
    late = svc.retrieve("alice", svc.optim_step("alice", alice, 2, ADAM).request_id, 30)
    assert late.status == "failed" and late.category == types.RequestErrorCategory.Server
    # Bob is unaffected: his training equals a solo reference.
    lp0 = _fwd_logprobs(svc, "bob", bob, 1)
    result(svc, "bob", svc.forward_backward("bob", bob, 2, batch, "cross_entropy"))
    result(svc, "bob", svc.optim_step("bob", bob, 3, ADAM))
    assert (_fwd_logprobs(svc, "bob", bob, 4) - lp0).abs().max() > 1e-3
    assert svc.list_training_runs("alice").training_runs[0].training_run_id == alice  # still listed


@pytest.mark.gpu
def test_service_on_cuda_trains_and_samples_consistently(tmp_path, tiny_model_dir):
    from ember.engine import EngineConfig as EC
    from ember.sampling import SamplerConfig
    from ember.service import Service, ServiceConfig

    cfg = ServiceConfig(data_dir=tmp_path / "gpu", models={"tiny": str(tiny_model_dir)},
                        engine=EC(device="cuda"), sampler=SamplerConfig(device="cuda"))
    with Service(cfg) as svc:
        _, mid = new_run(svc, "alice", seed=1)
        result(svc, "alice", svc.forward_backward("alice", mid, 1, random_sft_datums(3, VOCAB, seed=1), "cross_entropy"))
        result(svc, "alice", svc.optim_step("alice", mid, 2, ADAM))
        lp = _fwd_logprobs(svc, "alice", mid, 3)
        snap = result(svc, "alice", svc.save_weights_for_sampler("alice", mid, 4, None, sampling_session_seq_id=0))
        torch.testing.assert_close(_sampler_logprobs(svc, "alice", snap.sampling_session_id, 0), lp, rtol=0, atol=1e-3)
        path = result(svc, "alice", svc.save_weights("alice", mid, 5, "gpu-ck")).path
        assert svc.list_checkpoints("alice", mid).checkpoints[0].tinker_path == path


def test_a_shared_training_lane_serves_owners_round_robin(make_service, tmp_path):
    """Alice keeps four LoRA runs busy on the base model's lane; Bob's one op waits for at
    most one of hers (docs/architecture.md, trust boundaries), not one per run of hers."""
    import sqlite3

    from ember import failpoints

    svc = make_service()
    alice_runs = [new_run(svc, "alice", seed=s) for s in range(4)]
    _, bob = new_run(svc, "bob", seed=9)
    # Hold the shared lane (a fifth run being created) until everything has queued: an event,
    # not a sleep, so the test waits no longer than the submissions take.
    failpoints.arm("run.create_engine", "hold", times=1)
    try:
        gate = svc.create_model("alice", alice_runs[0][0], 1, "tiny", types.LoraConfig(rank=4))
        wait_until(lambda: not failpoints.pending("run.create_engine"), 30, interval=0.01,
                   message="the creation to reach the lane")
        subs = [svc.forward_backward("alice", mid, s, random_sft_datums(2, VOCAB, seed=s), "cross_entropy")
                for s in (1, 2, 3) for _, mid in alice_runs]
        bob_sub = svc.forward_backward("bob", bob, 1, random_sft_datums(2, VOCAB, seed=7), "cross_entropy")
        failpoints.release("run.create_engine")
        for sub in [gate, *subs, bob_sub]:
            result(svc, "alice" if sub is not bob_sub else "bob", sub)
    finally:
        failpoints.disarm()
    with sqlite3.connect(tmp_path / "data" / "ember.db") as db:
        finished = dict(db.execute("SELECT request_id, finished_at FROM futures"))
    before_bob = [s for s in subs if finished[s.request_id] < finished[bob_sub.request_id]]
    assert len(before_bob) <= 1, f"{len(before_bob)} of alice's ops ran before bob's one"
