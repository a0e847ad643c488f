"""A vLLM sampler with `SamplerConfig.weight_sync="memory"`, inside an in-process service.

A full fine-tuning snapshot (`save_weights_and_get_sampling_client`) enters the vLLM
engine through vLLM's weight-transfer API (the `ember_gloo` engine on CPU) and writes no
file; what it samples has the trainer's forward logprobs (contract 5: fp32, 1e-4); a
snapshot taken before the next step still samples its own weights after the engine
held the newer ones (contract 4: the older version is pushed back in from memory). LoRA
versions stay adapter directories (vLLM loads adapters only from a path) and match too.
A `SamplerPool` replica running vLLM gets a version over its gloo channel and pushes it
into its engine the same way. One vLLM engine for the service tests and one in the
pool's replica (each start takes 30-90 s on CPU); the CUDA path (vLLM's `ipc` engine) is
GPU-marked.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

import ember
from ember.sampling import SamplerConfig
from ember.service.config import ServiceConfig
from helpers.datums import sft_datum


pytestmark = [pytest.mark.slow, pytest.mark.needs_vllm]

PROMPTS = [[5, 9, 14], [12, 13, 14, 15]]
DATUM = sft_datum([5, 9, 14, 22, 31, 7, 8])
DB_FILES = (".db", ".db-wal", ".db-shm", ".db-journal", ".sqlite", ".sqlite-wal", ".sqlite-shm", ".sqlite-journal")


@pytest.fixture(scope="module")
def service(tiny_vllm_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("vllm-memory-sync")
    cfg = SamplerConfig(backend="vllm", weight_sync="memory", device="cpu", dtype="float32", max_slots=8,
                        max_len=128, max_loras=2, max_lora_rank=8, kv_cache_gb=1.0)
    sc = ember.ServiceClient(config=ServiceConfig(data_dir=data, models={"tiny": str(tiny_vllm_model_dir)},
                                                  sampler=cfg))
    yield sc, data
    sc.close("success")


def _files(root):
    return {p for p in root.rglob("*") if p.is_file() and not p.name.endswith(DB_FILES)}


def _sample(client):
    """Per prompt, two seeded samples: (prompt, tokens, logprobs) each."""
    out = []
    for i, p in enumerate(PROMPTS):
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11 + i, stop=[])
        for seq in client.sample(types.ModelInput.from_ints(p), 2, params).result().sequences:
            out.append((p, list(seq.tokens), np.asarray(seq.logprobs, np.float32)))
    return out


def _worst_gap(tc, samples) -> float:
    """Largest |sampled logprob - the trainer's forward logprob| over every sampled token."""
    outs = tc.forward([sft_datum(p + t) for p, t, _ in samples], "cross_entropy").result().loss_fn_outputs
    return max(float(np.abs(o["logprobs"].to_numpy()[len(p) - 1:] - lp).max())
               for o, (p, _, lp) in zip(outs, samples))


def _step(tc, lr=5e-2):
    tc.forward_backward([DATUM], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def test_full_snapshots_enter_vllm_in_memory_and_sample_the_trainers_logprobs(service):
    sc, data = service
    tc = sc.create_full_training_client(base_model="tiny").result()
    base = _sample(sc.create_sampling_client(base_model="tiny").result())
    _step(tc)
    before = _files(data)
    first = tc.save_weights_and_get_sampling_client().result()
    got = _sample(first)
    assert _files(data) == before, sorted(map(str, _files(data) - before))  # no weights file for the snapshot
    assert _worst_gap(tc, got) < 1e-4
    assert _worst_gap(tc, base) > 1e-3  # the step changed the model: the comparison is not vacuous

    state = sc.service.debug_state().samplers["backends"]["tiny"].debug_state()
    assert state["weights_in_memory"] and state["weight_swaps"] >= 1  # it went through the weight-transfer API
    _step(tc)
    second = tc.save_weights_and_get_sampling_client().result()
    assert _worst_gap(tc, _sample(second)) < 1e-4
    again = _sample(first)  # pinned (contract 4): the first version pushed back in from memory
    assert [t for _, t, _ in again] == [t for _, t, _ in got]
    assert max(float(np.abs(a[2] - g[2]).max()) for a, g in zip(again, got)) < 1e-5
    assert _files(data) == before, sorted(map(str, _files(data) - before))


def test_lora_snapshots_keep_their_adapter_files_and_match_the_trainer(service):
    sc, data = service
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_unembed=False).result()
    _step(tc)
    before = _files(data)
    snapshot = tc.save_weights_and_get_sampling_client().result()
    assert _worst_gap(tc, _sample(snapshot)) < 1e-4
    written = _files(data) - before
    assert {p.name for p in written} >= {"adapter_config.json", "adapter_model.safetensors"}, written


def test_a_pool_replica_running_vllm_receives_full_versions_in_memory(tiny_vllm_model_dir, tmp_path):
    """`SamplerPool` (one replica process here: the path is the same for any number) over
    vLLM in memory mode: the trainer's tensors reach the replica over its gloo channel and
    its engine through the weight-transfer API; nothing is written under the pool's scratch
    directory, and the samples match the trainer's forward (1e-4). Then in-flight weights: a
    publish the pool forwards is adopted mid-sequence by the replica's engine."""
    from ember.engine import EngineConfig, TorchEngine
    from ember.sampling import SamplingRequest
    from ember.sampling.pool import SamplerPool

    engine = TorchEngine.from_pretrained(tiny_vllm_model_dir, EngineConfig())
    engine.forward_backward([DATUM], "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=5e-2))
    cfg = SamplerConfig(backend="vllm", weight_sync="memory", replicas=1, device="cpu", dtype="float32",
                        max_slots=8, max_len=256, max_loras=2, max_lora_rank=8, replica_timeout_s=120.0)
    pool = SamplerPool(tiny_vllm_model_dir, cfg, scratch_dir=tmp_path)
    try:
        version = pool.load_weights(engine.named_weights())
        requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, version=version,
                                    sampling_params=types.SamplingParams(max_tokens=5, seed=3 + i, stop=[]))
                    for i, p in enumerate(PROMPTS)]
        responses = [f.result(300) for f in pool.submit_many(requests)]
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        assert _followed_swap(pool, version, engine) == 1
    finally:
        pool.close()
    samples = [(p, list(s.tokens), np.asarray(s.logprobs, np.float32))
               for p, r in zip(PROMPTS, responses) for s in r.sequences]
    outs = engine.forward([sft_datum(p + t) for p, t, _ in samples], "cross_entropy").loss_fn_outputs
    worst = max(float(np.abs(o["logprobs"].to_numpy()[len(p) - 1:] - lp).max()) for o, (p, _, lp) in zip(outs, samples))
    assert worst < 1e-4, worst


def _followed_swap(pool, version, engine) -> int:
    """A followed 240-token greedy sequence on the pool's vLLM replica, published to once the
    engine is stepping it (a 1-token request of the same follower has come back): its spans
    name the swap, which the replica's engine adopted between two steps. Returns the
    generation after the swap."""
    from ember.sampling import SamplingRequest
    from ember.sampling.follow import VersionFollower, version_spans

    newer = pool.load_weights([(name, t * 1.05) for name, t in engine.named_weights()])  # other weights
    follow = VersionFollower(version)

    def followed(tokens: list[int], n: int):
        return pool.submit(SamplingRequest(prompt=types.ModelInput.from_ints(tokens), version=version,
                                           follow=follow, session="followed", sampling_params=types.SamplingParams(
                                               max_tokens=n, temperature=0.0, stop=[])))

    held = followed(PROMPTS[0], 240)
    followed(PROMPTS[1], 1).result(300)  # the engine is stepping the held sequence now
    follow.publish(newer)
    spans = version_spans(held.result(300).sequences[0])
    assert spans is not None and len(spans) == 2, f"no swap (the held sequence ended before the publish?): {spans}"
    (first, g0), (swap, g1) = spans
    assert first == 0 and g0 == 0 and 0 < swap < 240, spans
    return g1


def _gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n


@pytest.mark.gpu
@pytest.mark.parametrize("device", [
    "cuda",
    pytest.param("cuda:1", marks=pytest.mark.skipif(not _gpus(2), reason="needs a second CUDA GPU")),
])
def test_cuda_vllm_takes_full_versions_through_its_ipc_engine(tiny_vllm_model_dir, device):
    """CUDA: the kept version lives on the engine's GPU and enters it through vLLM's `ipc`
    weight-transfer engine (CUDA IPC handles, no copy through the host); the samples
    match the trainer's forward within 1e-3 (fp32 on a GPU: TF32-free matmuls differ in
    summation order from the CPU trainer's). On cuda:1 the engine core must run on GPU 1
    (CUDA_VISIBLE_DEVICES): the handles are keyed by that GPU's UUID."""
    from ember.engine import EngineConfig, TorchEngine
    from ember.sampling import VLLMSampler

    engine = TorchEngine.from_pretrained(tiny_vllm_model_dir, EngineConfig())
    engine.forward_backward([DATUM], "cross_entropy")
    engine.optim_step(types.AdamParams(learning_rate=5e-2))
    cfg = SamplerConfig(backend="vllm", weight_sync="memory", device=device, dtype="float32", max_slots=8,
                        max_len=128, gpu_memory_utilization=0.3)
    sampler = VLLMSampler.from_pretrained(tiny_vllm_model_dir, cfg)
    try:
        version = sampler.load_weights(engine.named_weights())
        assert version.path is None and next(iter(version.tensors.values())).is_cuda
        params = types.SamplingParams(max_tokens=5, seed=3, stop=[])
        resp = sampler.sample(types.ModelInput.from_ints(PROMPTS[0]), 2, params, version=version, timeout=300)
    finally:
        sampler.close()
    p = PROMPTS[0]
    outs = engine.forward([sft_datum(p + list(s.tokens)) for s in resp.sequences], "cross_entropy").loss_fn_outputs
    worst = max(float(np.abs(o["logprobs"].to_numpy()[len(p) - 1:] - np.asarray(s.logprobs)).max())
                for o, s in zip(outs, resp.sequences))
    assert worst < 1e-3, worst
