"""Expert parallelism without a process group: the layout's refusals (E not divisible by ep,
a dense model, ep not dividing dp_shard), `--parallel.ep`, and the dispatch's local
arithmetic (sort by expert, each expert on its block, weighted combine) equal to the
transformers experts module it replaces, within fp32 rtol 1e-5. The all-to-all runs in
tests/engine/test_engine_parallel_ep.py (slow: process groups)."""

import pytest
import torch

from ember.engine import EngineConfig, TorchEngine
from ember.engine.expert_parallel import (combine, dispatch_order, expert_modules, inverse, received_expert_ids,
                                          run_local_experts)
from ember.engine.parallel import ParallelismConfig, check_ep_model
from ember.models.families import moe_of
from ember.service.config import WorkersConfig


def test_experts_not_divisible_by_ep_are_refused_at_start_naming_both(tiny_moe_dir):
    with pytest.raises(ValueError, match=r"ep=3 must divide the model's 4 experts"):
        TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig(), parallelism=ParallelismConfig(dp_shard=3, ep=3))


def test_a_dense_model_ignores_ep_and_a_moe_model_takes_it(tiny_model_dir, tiny_moe_dir):
    """One `--parallel.ep` serves dense and MoE models: a dense model's ep ranks are dp_shard ranks."""
    from ember.engine.estimate import load_config

    assert check_ep_model(load_config(tiny_model_dir), 2) is False
    assert check_ep_model(load_config(tiny_moe_dir), 2) is True
    assert check_ep_model(load_config(tiny_moe_dir), 1) is False


def test_ember_serve_refuses_ep_not_dividing_the_experts_before_the_ranks_start(tiny_moe_dir, tiny_model_dir,
                                                                                  tmp_path):
    import ember

    with pytest.raises(ValueError, match=r"model 'moe': ParallelismConfig.ep=3 must divide the model's 4 experts"):
        ember.ServiceClient(models={"dense": str(tiny_model_dir), "moe": str(tiny_moe_dir)}, data_dir=tmp_path,
                            workers={"runtime": "process", "world_size": 3, "ep": 3})


@pytest.mark.parametrize("kwargs, message", [
    ({"dp_shard": 3, "ep": 2}, r"ep=2 must divide dp_shard=3"),
    ({"dp_shard": 2, "tp": 2, "ep": 2}, r"ep=2 needs tp=1 and cp=1"),
    ({"dp_shard": 2, "ep": 0}, r"ep must be an integer >= 1"),
])
def test_layout_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelismConfig(**kwargs)


def test_ep_takes_its_ranks_from_dp_shard():
    layout = ParallelismConfig(dp_shard=4, ep=2)
    assert layout.world_size == 4 and layout.as_dict()["ep"] == 2
    assert "ep" not in ParallelismConfig(dp_shard=2).as_dict()  # layouts without ep read as before
    workers = WorkersConfig(runtime="process", world_size=4, ep=2)
    assert workers.parallel_dims() == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "ep": 2}
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide parallel.dp_shard=4"):
        WorkersConfig(runtime="process", world_size=4, ep=3)


def test_ember_serve_takes_parallel_ep():
    import argparse

    from ember.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--workers.runtime", "process", "--workers.world_size", "2", "--parallel.ep", "2"])
    workers = cli.load_serve_config(args).workers
    assert ParallelismConfig(**workers.parallel_dims()).as_dict() == \
        {"world_size": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}


def test_dispatch_order_and_received_ids():
    top_k = torch.tensor([[2, 0], [1, 2], [0, 3]])
    order, counts = dispatch_order(top_k, 4)
    assert counts.tolist() == [2, 1, 2, 1]
    assert top_k.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 3]
    assert torch.equal(order[inverse(order)], torch.arange(6))
    # two source ranks, two local experts each: (2 rows of expert 0, 1 of 1), then (0, 3)
    assert received_expert_ids(torch.tensor([2, 1, 0, 3]), 2).tolist() == [0, 0, 1, 1, 1, 1]


def test_local_arithmetic_equals_the_transformers_experts(tiny_moe_dir):
    """ep=1's dispatch without the all-to-all: the family's weight layout (gpt-oss's
    transposed, biased experts and its gate) and the combine match the module's forward."""
    engine = TorchEngine.from_pretrained(tiny_moe_dir, EngineConfig())
    layout = moe_of(engine.hf_config)
    experts = expert_modules(engine.model, layout.experts)[0][0]
    num = int(getattr(engine.hf_config, layout.num_experts))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, int(engine.hf_config.hidden_size), generator=g)
    top_k = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(7)])
    weights = torch.softmax(torch.randn(7, 2, generator=g), dim=-1)
    order, counts = dispatch_order(top_k, num)
    w = {n: p.detach() for n, p in experts.named_parameters()}
    rows = run_local_experts(experts, w, hidden[order // 2], counts.tolist())
    with torch.no_grad():
        want = experts(hidden, top_k, weights)
    torch.testing.assert_close(combine(rows, order, weights), want, rtol=1e-5, atol=1e-6)


def test_estimate_splits_experts_over_ep_and_counts_the_dispatch_buffers():
    """A small Qwen3-MoE config (8 experts, 2 per token), full fine-tuning and LoRA, at
    dp_shard=4 with ep=1 and ep=2: the experts' bytes move from /4 (FSDP2) to /2 (ep), the
    rest stays /4; FSDP2's unsharded layers lose their experts; the all-to-all buffers are
    4 (T k, H) fp32 tensors."""
    from transformers import Qwen3MoeConfig

    from ember.engine.estimate import estimate_memory, meta_model

    h, i, e, k, layers, t = 256, 64, 8, 2, 2, 64
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                            vocab_size=1000, intermediate_size=128)
    model = meta_model(config)
    expert_params = layers * e * 3 * h * i  # gate_up (2I x H) + down (H x I) per expert
    a_factors = layers * e * 4 * (h + i)  # rank 4: A of gate_up (r x H) and of down (r x I) per expert

    def est(ep: int, lora_rank=None):
        return estimate_memory(hf_config=config, meta=model, tokens=t, lora_rank=lora_rank,
                               parallel=ParallelismConfig(dp_shard=4, ep=ep))

    fsdp, ep2 = est(1), est(2)
    assert (fsdp.experts_per_rank, ep2.experts_per_rank) == (8, 4)
    assert ep2.parameters - fsdp.parameters == pytest.approx(4 * expert_params * (1 / 2 - 1 / 4), abs=16)
    assert ep2.gradients - fsdp.gradients == pytest.approx(4 * expert_params * (1 / 2 - 1 / 4), abs=16)
    assert (fsdp.dispatch_buffers, ep2.dispatch_buffers) == (0, 4 * t * k * h * 4)
    # FSDP2 gathers two layers at a time, no longer with their experts
    assert fsdp.fsdp_working_set - ep2.fsdp_working_set == 2 * (expert_params // layers) * 4
    lora1, lora2 = est(1, 4), est(2, 4)
    assert lora2.gradients - lora1.gradients == pytest.approx(4 * a_factors * (1 / 2 - 1 / 4), abs=16)
    assert lora2.parameters == ep2.parameters
