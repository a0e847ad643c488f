"""Expert parallelism on CUDA: the all-to-all dispatch over NCCL and bf16 experts. Marked
`gpu`: skipped on CPU with the reason printed; the ep cases need two GPUs (NCCL refuses two
ranks on one device).

Bounds as tests/engine/test_engine_parallel_gpu.py: fp32 world 2 vs world 1 within rtol 1e-4
(TF32 off; NCCL's reduction order differs from one process); bf16 within 0.1 nats of fp32
for logprobs (`BF16_LOGPROB_ATOL`), and 2e-2 relative for one expert layer's output (bf16's
8-bit mantissa over a two-matmul expert).
"""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.expert_parallel import combine, dispatch_order, expert_modules, run_local_experts
from ember.engine.parallel import ParallelismConfig
from ember.models.families import moe_of
from ember.workers import EngineSpec, GroupEngine, WorkerGroup
from helpers import ranks as wt
from helpers.datums import random_sft_datums

pytestmark = pytest.mark.gpu
BF16_LOGPROB_ATOL = 0.1
EP2 = ParallelismConfig(dp_shard=2, ep=2)
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for NCCL world 2"
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe-ep-gpu"), family="qwen3_moe", num_heads=2, num_kv_heads=2,
                            head_dim=32)


@pytest.fixture(scope="module")
def nccl_group():
    torch.backends.cuda.matmul.allow_tf32 = False
    g = WorkerGroup.create("process", world_size=2, device="cuda", call_timeout_s=300)
    yield g
    g.shutdown()


@two_gpus
@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4, seed=1)], ids=["full", "lora"])
def test_nccl_ep2_fp32_matches_world1(nccl_group, moe_dir, lora):
    cfg = EngineConfig(device="cuda", micro_batch_tokens=16)
    datums = random_sft_datums(6, vocab=80, seed=1)
    ref = TorchEngine.from_pretrained(moe_dir, cfg, lora_config=lora)
    eng = GroupEngine.create(nccl_group, "ep-exact", EngineSpec(str(moe_dir), cfg, EP2, lora_config=lora))
    try:
        a, b = eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy")
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-4)
        got, want = nccl_group.run("ep-exact", wt.full_grads), wt.full_grads(ref)
        scale = max(float(t.abs().max()) for t in want.values())
        for n in want:
            torch.testing.assert_close(got[n], want[n].cpu(), rtol=1e-4, atol=1e-4 * scale)
    finally:
        eng.close()


@two_gpus
def test_nccl_ep2_bf16_mixed_precision_trains(nccl_group, moe_dir):
    """FSDP2 casts what it shards to bf16; the expert weights, which it leaves out, are cast
    by the dispatch to the activations' dtype; master weights stay fp32."""
    cfg = EngineConfig(device="cuda", autocast_dtype="bfloat16")
    datums = random_sft_datums(6, vocab=80, seed=2)
    ref = TorchEngine.from_pretrained(moe_dir, EngineConfig(device="cuda"))
    eng = GroupEngine.create(nccl_group, "ep-bf16", EngineSpec(str(moe_dir), cfg, EP2))
    try:
        a, b = eng.forward_backward(datums, "cross_entropy"), ref.forward(datums, "cross_entropy")
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            torch.testing.assert_close(x["logprobs"].to_torch(), y["logprobs"].to_torch(), rtol=0,
                                       atol=BF16_LOGPROB_ATOL)
        metrics = eng.optim_step(types.AdamParams(learning_rate=1e-3))
        assert torch.isfinite(torch.tensor(metrics["grad_norm:mean"]))
        params = nccl_group.run("ep-bf16", wt.full_params)
        assert all(p.dtype == torch.float32 for p in params.values())
    finally:
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_expert_arithmetic_on_cuda_is_within_bf16_of_fp32(moe_dir):
    """One rank's dispatch arithmetic (sort, each expert on its block, weighted combine) with
    bf16 experts on CUDA against the fp32 transformers experts module."""
    engine = TorchEngine.from_pretrained(moe_dir, EngineConfig(device="cuda"))
    layout = moe_of(engine.hf_config)
    experts = expert_modules(engine.model, layout.experts)[0][0]
    num = int(getattr(engine.hf_config, layout.num_experts))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, int(engine.hf_config.hidden_size), generator=g).cuda()
    top_k = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(64)]).cuda()
    weights = torch.softmax(torch.randn(64, 2, generator=g), dim=-1).cuda()
    with torch.no_grad():
        want = experts(hidden, top_k, weights)
        order, counts = dispatch_order(top_k, num)
        w = {n: p.detach().to(torch.bfloat16) for n, p in experts.named_parameters()}
        rows = run_local_experts(experts, w, hidden[order // 2].to(torch.bfloat16), counts.tolist())
        got = combine(rows, order, weights).float()
    assert got.dtype == torch.float32 and rows.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
