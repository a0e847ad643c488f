"""ParallelismConfig validation, TP plans and single-process pieces of ember.engine.parallel
(no process group needed; the multi-rank behaviour is in test_engine_parallel.py)."""

import pytest
import torch
from tinker import types
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from ember.engine import EngineConfig, TorchEngine
from ember.engine.parallel import (
    mixed_precision_policy,
    ParallelismConfig,
    check_cp_heads,
    check_tp_divisibility,
    build_mesh,
    decoder_layers,
    layer_tp_plan,
    parallelize_model,
)
from helpers.datums import random_sft_datums
from ember.models import add_lora_adapter, load_model
from helpers import ranks as wt


@pytest.mark.parametrize("field", ["dp_replicate", "dp_shard", "tp", "cp"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_config_rejects_bad_degrees_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=rf"ParallelismConfig\.{field} must be an integer >= 1, got"):
        ParallelismConfig(**{field: bad})


def test_config_layout_arithmetic():
    p = ParallelismConfig(dp_replicate=2, dp_shard=3, tp=2)
    assert (p.world_size, p.dp_size) == (12, 6)
    assert [p.dp_rank(r) for r in range(12)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert p.as_dict() == {"world_size": 12, "dp_replicate": 2, "dp_shard": 3, "tp": 2}
    assert ParallelismConfig.for_world(4) == ParallelismConfig(dp_shard=4)
    with pytest.raises(ValueError, match="outside the world"):
        p.dp_rank(12)
    with pytest.raises(ValueError, match="cpu_offload needs FSDP2"):
        ParallelismConfig(tp=2, cpu_offload=True)


def test_config_cp_layout():
    p = ParallelismConfig(dp_shard=2, cp=2)
    assert (p.world_size, p.dp_size, p.fsdp) == (4, 2, True)
    assert [p.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # the cp ranks of a dp rank share its datums
    assert p.as_dict() == {"world_size": 4, "dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2}
    assert ParallelismConfig(cp=2).fsdp and not ParallelismConfig(tp=2).fsdp
    both = ParallelismConfig(cp=2, tp=2)  # a 2-D (cp, tp) mesh: Ulysses over each TP rank's heads
    assert (both.world_size, both.dp_size, both.fsdp, [both.dp_rank(r) for r in range(4)]) == (4, 1, True, [0] * 4)


def test_cp_with_tp_must_divide_each_tp_ranks_heads():
    from ember.models.testing import tiny_config

    config = tiny_config("qwen3", vocab_size=84)  # 4 attention heads
    check_cp_heads(config, 2, tp=2)  # 2 heads per TP rank, 1 per cp rank
    with pytest.raises(ValueError, match=r"cp=4 must divide the attention heads of each tp=2 rank "
                                         r"\(config.num_attention_heads=4 / 2"):
        check_cp_heads(config, 4, tp=2)


def test_cp_refuses_a_non_sdpa_attention_before_loading(tiny_model_dir):
    config = EngineConfig(attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match=r"cp=2 .* must be 'sdpa' or 'eager', got 'flash_attention_2'"):
        TorchEngine.from_pretrained(tiny_model_dir, config, parallelism=ParallelismConfig(cp=2))


def test_build_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        build_mesh(ParallelismConfig(dp_shard=2))


def test_tp_divisibility_and_family_checks(tiny_model_dir):
    cfg = load_model(tiny_model_dir).config  # 4 heads, 2 kv heads, intermediate 128
    check_tp_divisibility(cfg, 2)
    with pytest.raises(ValueError, match=r"tp=4 must divide config.num_key_value_heads=2"):
        check_tp_divisibility(cfg, 4)
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="tensor parallelism supports"):
        check_tp_divisibility(cfg, 2)


def test_layer_tp_plan_plain_and_lora(tiny_model_dir):
    model = load_model(tiny_model_dir)
    plan = layer_tp_plan(decoder_layers(model)[0])
    col = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    assert {k for k, v in plan.items() if isinstance(v, ColwiseParallel)} == col
    assert {k for k, v in plan.items() if isinstance(v, RowwiseParallel)} == {"self_attn.o_proj", "mlp.down_proj"}
    assert {k for k, v in plan.items() if isinstance(v, SequenceParallel)} == {"self_attn.q_norm", "self_attn.k_norm"}

    peft = add_lora_adapter(model, "t", types.LoraConfig(rank=2))
    plan = layer_tp_plan(decoder_layers(peft)[0])
    assert isinstance(plan["self_attn.q_proj.base_layer"], ColwiseParallel)
    assert isinstance(plan["self_attn.q_proj.lora_B.t"], ColwiseParallel)  # A stays replicated
    assert isinstance(plan["self_attn.o_proj.base_layer"], RowwiseParallel)
    assert isinstance(plan["self_attn.o_proj.lora_A.t"], RowwiseParallel)  # B stays replicated
    assert "self_attn.q_proj.lora_A.t" not in plan and "self_attn.o_proj.lora_B.t" not in plan


def test_parallelize_model_validates_mesh(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert parallelize_model(model, None, ParallelismConfig()) is model
    with pytest.raises(ValueError, match="needs a DeviceMesh"):
        parallelize_model(model, None, ParallelismConfig(tp=2))


def test_activation_checkpointing_keeps_names_and_gradients(tiny_model_dir):
    """The composable checkpoint adds no wrapper module: same names, same gradient."""
    datums = random_sft_datums(4, vocab=84, seed=3)
    plain = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig())
    model = parallelize_model(load_model(tiny_model_dir), None, ParallelismConfig(activation_checkpointing=True))
    ac = TorchEngine(model, EngineConfig())
    a, b = plain.forward_backward(datums, "cross_entropy"), ac.forward_backward(datums, "cross_entropy")
    assert a.metrics == b.metrics
    ga, gb = wt.full_grads(plain), wt.full_grads(ac)
    assert list(ga) == list(gb)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fsdp2_computes_in_a_half_precision_autocast_dtype_on_cuda(dtype):
    """Under FSDP2 on GPU the engine leaves casting to FSDP2's policy: fp16 autocast must get
    one too (it silently ran fp32 before); gradients are reduced in fp32."""
    policy = mixed_precision_policy("cuda", dtype)
    assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    assert mixed_precision_policy("cuda", torch.float32).param_dtype is None
    assert mixed_precision_policy("cpu", dtype).param_dtype is None  # FSDP2 on CPU computes in the params' dtype
