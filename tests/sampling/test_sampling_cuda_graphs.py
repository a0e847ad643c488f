"""`SamplerConfig.cuda_graphs`'s static decode path (`ember.sampling.cuda_graphs`). On CPU it
runs eagerly: its logprobs equal the dynamic step's within 1e-5 (fp32) over batches of
varying sizes and KV lengths, slots in and out of order, with base and LoRA rows (a step
of one LoRA version runs static, a switch to another version reloads its factors, several
versions in one batch fall back, counted); the bucket function is pure; the setting is
refused on CPU naming it and the device. The GPU-marked test replays captured
graphs in a TorchSampler and compares them with eager decoding (bf16 tolerance)."""

from __future__ import annotations

import pytest
import torch
from tinker import types
from transformers import AutoModelForCausalLM, Qwen3Config

from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler
from ember.sampling.cuda_graphs import KV_MIN, bucket
from ember.sampling.kv_cache import SlotCache
from ember.sampling.runner import ModelRunner, decode_mask, prefill_inputs
from ember.sampling.weights import LoraDelta, TorchWeightVersion

from .conftest import prompt

ATOL = 1e-5  # fp32 CPU logprobs, static vs dynamic step
SLOTS, MAX_LEN = 6, 160
BF16_ATOL, FIRST_N = 2e-2, 6  # CUDA graphs vs eager, bf16: padded GEMMs may pick other kernels


def test_bucket_is_the_next_power_of_two_capped_at_the_limit():
    assert [bucket(n, 6) for n in range(1, 8)] == [1, 2, 4, 4, 6, 6, None]
    assert [bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket(3, 4096, KV_MIN) == KV_MIN and bucket(65, 4096, KV_MIN) == 128 and bucket(100, 100, KV_MIN) == 100
    assert bucket(3, 6) == bucket(3, 6)  # pure: no state between calls
    with pytest.raises(ValueError, match="n and limit must be >= 1"):
        bucket(0, 4)


def test_cuda_graphs_is_refused_off_cuda_naming_the_setting_and_the_device(tiny_model_dir):
    with pytest.raises(ValueError, match=r"cuda_graphs.*device 'cpu'"):
        SamplerConfig(cuda_graphs=True, device="cpu")
    # an unset device follows the engine's later: the sampler refuses the CPU it runs on
    with pytest.raises(ValueError, match=r"cuda_graphs.*device 'cpu'"):
        TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(cuda_graphs=True, max_len=64))
    for bad, match in ((dict(compile=True), "compile"), (dict(forward="transformers"), "forward='transformers'"),
                       (dict(batch_invariant=True), "batch_invariant")):
        with pytest.raises(ValueError, match=match):
            SamplerConfig(cuda_graphs=True, device="cuda", **bad)


def _model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    return model


def _lora(model, seed: int) -> TorchWeightVersion:
    gen = torch.Generator().manual_seed(seed)
    deltas = {}
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        lin = model.get_submodule(m)
        deltas[m] = LoraDelta(torch.randn(4, lin.in_features, generator=gen) * 0.1,
                              torch.randn(lin.out_features, 4, generator=gen) * 0.1, 8.0)
    return TorchWeightVersion(0, lora=deltas, lora_rank=4)


def _decode(runner, slots, positions, tokens, lora):
    kv_len = int(positions.max()) + 1
    runner.cache.plan_decode(slots, positions, kv_len)
    logits = runner.forward(tokens[:, None], positions[:, None], decode_mask(positions, kv_len), 1, lora=lora)
    return torch.log_softmax(logits[:, -1].float(), -1)


def test_static_decode_equals_the_dynamic_step_for_varying_batches_kv_lengths_and_lora_rows():
    model = _model()
    one, two = _lora(model, 2), _lora(model, 3)  # the same modules and ranks: one set of static buffers
    runners = [ModelRunner(model, SlotCache(2, SLOTS, MAX_LEN, initial_capacity=MAX_LEN), "sdpa", "direct")
               for _ in range(2)]
    stats = runners[1].use_static_decode(SLOTS, torch.device("cpu")).stats
    lengths = [3, 17, 9, 70, 1, 40]  # a KV length past KV_MIN, so two KV buckets are read
    prompts = [tuple((7 * i + j) % 61 for j in range(n)) for i, n in enumerate(lengths)]
    ids, pos, valid, mask = prefill_inputs(prompts, torch.device("cpu"))
    slot_ids = torch.arange(SLOTS)
    for r in runners:
        r.cache.plan_prefill(slot_ids, valid, pos)
        r.forward(ids, pos, mask, 1)
    positions = torch.tensor(lengths)
    tokens = torch.tensor([5, 9, 11, 2, 30, 44])
    # (rows, lora rows): all six, a prefix slice, out-of-order subsets of 3 and 1, LoRA mixed in
    batches = [(slice(0, 6), []), (slice(0, 3), []), (torch.tensor([5, 1, 3]), []), (torch.tensor([4]), []),
               (slice(0, 5), [(torch.tensor([1, 3]), one)]), (torch.tensor([2, 0]), [(None, one)]),
               (slice(0, 4), [(None, two)])]
    for step in range(2):
        for rows, lora in batches:
            idx = torch.arange(rows.stop)[rows] if isinstance(rows, slice) else rows
            out = [_decode(r, rows, positions[idx], tokens[idx], lora) for r in runners]
            torch.testing.assert_close(out[1], out[0], atol=ATOL, rtol=0,
                                       msg=lambda m: f"step {step}, rows {rows}: {m}")
            tokens[idx] = out[0].argmax(-1)
            positions[idx] += 1
    # one LoRA version for every row runs static (its factors copied into static buffers
    # when the version changes); rows of several versions fall back
    assert stats.static_steps == 12 and stats.fallbacks == {"prefill": 1, "lora_mixed": 2}, stats
    assert stats.captured == 0 and stats.replays == 0  # CPU: the static path runs eagerly


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_decode(tiny_model_dir):
    """bf16 on CUDA: the greedy tokens of captured/replayed decode steps equal eager ones and
    their logprobs agree within 2e-2; graphs are captured at most once per bucket."""
    base = dict(device="cuda", dtype="bfloat16", max_slots=8, max_len=256)
    graphs = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(cuda_graphs=True, **base))
    eager = TorchSampler.from_pretrained(tiny_model_dir, SamplerConfig(**base))
    try:
        requests = [SamplingRequest(prompt=prompt((5 * i + j) % 80 + 3 for j in range(3 + 9 * i)), num_samples=1,
                                    sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0, stop=[]))
                    for i in range(5)]
        got, want = graphs.sample_many(requests, timeout=600), eager.sample_many(requests, timeout=600)
        for g, w in zip(got, want):  # the first FIRST_N tokens: later ones may part on a bf16 near-tie
            assert g.sequences[0].tokens[:FIRST_N] == w.sequences[0].tokens[:FIRST_N]
            pairs = zip(g.sequences[0].logprobs[:FIRST_N], w.sequences[0].logprobs[:FIRST_N])
            assert max(abs(a - b) for a, b in pairs) <= BF16_ATOL
        state = graphs.debug_state()["cuda_graphs"]
        batch_buckets, kv_buckets = 4, 3  # 1, 2, 4, 8 rows; KV 64, 128, 256
        assert state["replays"] > 0 and 0 < state["captured"] <= batch_buckets * kv_buckets, state
    finally:
        graphs.close()
        eager.close()
