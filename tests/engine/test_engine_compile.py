"""`EngineConfig.compile` (`ember.engine.compile`): regional compilation equals eager to
fp32 rounding (rtol 1e-5: losses, gradients, parameters after steps) on one device and under
TP (with LoRA) and CP (with FSDP2 over its ranks) at world 2; after the start's warm-up a new
sequence length, or a micro-batch of one row or of several, compiles nothing new; the compile
time is reported and inductor's cache lands in the configured directory.

Compiling takes one to two minutes of a 2-core host per layout on a 1-layer model (three to
four under `.ci/run`'s load). `make test` runs TP + LoRA and CP + FSDP2 at world 2, which
cover LoRA, FSDP2, the warm-up and the cache; the one-device and plain FSDP2 layouts run under
`make test-compile` (every layout)."""

import os

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.compile import check_compile_layout
from ember.engine.parallel import ParallelismConfig
from helpers.datums import assert_tensors_close, random_rl_datums, random_sft_datums

RTOL = 1e-5
ADAM = types.AdamParams(learning_rate=1e-3)


def sft_batches() -> list:
    """Three steps of new lengths: micro-batches of several rows (budget 64 tokens), then one
    datum alone (one row)."""
    return [random_sft_datums(5, vocab=84, min_len=3, max_len=30, seed=s) for s in (1, 2)] + \
        [random_sft_datums(1, vocab=84, min_len=35, max_len=50, seed=3)]


EXTRA_LAYOUTS = pytest.mark.skipif(os.environ.get("EMBER_COMPILE_TESTS") != "all",
                                   reason="covered by the TP + LoRA and CP + FSDP2 tests; one to three minutes "
                                          "of CPU each: run with EMBER_COMPILE_TESTS=all (make test-compile)")


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory):
    from ember.models.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-1layer"), family="qwen3", seed=0, num_layers=1)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


def test_compile_with_activation_checkpointing_is_refused():
    with pytest.raises(ValueError, match="compile with activation_checkpointing"):
        EngineConfig(compile=True, activation_checkpointing=True)


def test_compile_refuses_expert_parallelism():
    with pytest.raises(ValueError, match=r"expert parallelism \(ep=2\) is not"):
        check_compile_layout(2)
    check_compile_layout(1)


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def _params(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.state_tensors().items()}


def _steps(engine: TorchEngine, batches: list, loss_fn: str) -> tuple[list[float], list[dict], list[int]]:
    """forward_backward + optim_step per batch: the losses, gradients and graph counts seen."""
    losses, grads, graphs = [], [], []
    for batch in batches:
        losses.append(engine.forward_backward(batch, loss_fn).metrics["loss:sum"])
        grads.append(_grads(engine))
        engine.optim_step(ADAM)
        if engine.compile_stats is not None:
            graphs.append(engine.compile_stats.graphs)
    return losses, grads, graphs


def _compare(model_dir, cache_dir, batches, loss_fn, lora=None) -> tuple[int, list[int]]:
    """Eager vs compiled on one device: the graphs compiled by the start's warm-up, then after each step."""
    eager = TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=64), lora_config=lora)
    compiled = TorchEngine.from_pretrained(
        model_dir, EngineConfig(micro_batch_tokens=64, compile=True, compile_cache_dir=str(cache_dir)), lora_config=lora)
    info = compiled.info().extra["compile"]
    assert info["compiled_layers"] == 1 and info["warmup_seconds"] > 0 and info["cache_dir"] == str(cache_dir)
    want_losses, want_grads, _ = _steps(eager, batches, loss_fn)
    losses, grads, graphs = _steps(compiled, batches, loss_fn)
    assert losses == pytest.approx(want_losses, rel=RTOL)
    for got, want in zip(grads, want_grads):
        assert_tensors_close(got, want, rtol=RTOL)
    assert_tensors_close(_params(compiled), _params(eager), rtol=RTOL)
    return info["graphs"], graphs


def _rows(engine: TorchEngine, batches: list) -> set[int]:
    """The row counts of the micro-batches `batches` are laid out in (one row and several must both
    occur); the engine packs rows of several datums (sdpa: no varlen single row)."""
    from ember.engine.batching import build_micro_batch, plan_micro_batches, prepare_datums
    from ember.losses import get_loss

    rows = set()
    for batch in batches:
        prepared = prepare_datums(batch, get_loss("cross_entropy"), 84)
        for group in plan_micro_batches([p.num_tokens for p in prepared], engine.config.micro_batch_tokens):
            mb = build_micro_batch([prepared[i] for i in group], engine.info().packing == "packed")
            rows.add(mb.input_ids.shape[0])
    return rows


@pytest.mark.slow
@EXTRA_LAYOUTS
def test_compiled_full_fine_tuning_equals_eager_without_recompiling_per_length(one_layer_dir, cache_dir):
    warm, graphs = _compare(one_layer_dir, cache_dir, sft_batches(), "cross_entropy")
    assert warm >= 2, f"the warm-up compiled {warm} graphs: a layer for one row and for several, the head"
    # the first call compiles its loss function, nothing else: every shape was warmed up
    assert graphs == [warm + 1] * 3, f"after the warm-up's {warm} graphs, steps of new lengths compiled: {graphs}"
    assert any(cache_dir.rglob("*")), "inductor wrote nothing to the configured cache directory"


def test_the_compared_batches_have_one_row_and_several(one_layer_dir):
    """What the no-recompilation tests rely on: `sft_batches` makes micro-batches of both row counts."""
    engine = TorchEngine.from_pretrained(one_layer_dir, EngineConfig(micro_batch_tokens=64))
    rows = _rows(engine, sft_batches())
    assert 1 in rows and max(rows) > 1, rows


@pytest.mark.slow
@EXTRA_LAYOUTS
def test_compiled_lora_equals_eager(one_layer_dir, cache_dir):
    batches = [random_rl_datums(4, vocab=84, min_len=3, max_len=25, seed=s) for s in (4, 5)]
    warm, graphs = _compare(one_layer_dir, cache_dir, batches, "importance_sampling",
                            lora=types.LoraConfig(rank=4, seed=1))
    assert graphs == [warm + 1] * 2, f"after the warm-up's {warm} graphs, steps of new lengths compiled: {graphs}"


def test_serve_puts_the_compile_cache_under_the_data_dir(tmp_path):
    from ember.service.config import ServiceConfig

    config = ServiceConfig(data_dir=tmp_path, engine=EngineConfig(compile=True))
    assert config.engine.compile_cache_dir == str(tmp_path.resolve() / "compile-cache")
    mine = ServiceConfig(data_dir=tmp_path, engine=EngineConfig(compile=True, compile_cache_dir="/elsewhere"))
    assert mine.engine.compile_cache_dir == "/elsewhere"
    assert ServiceConfig(data_dir=tmp_path).engine.compile_cache_dir == ""


def _compare_layout(model_dir, cache_dir, layout: ParallelismConfig, lora=None) -> None:
    """Compiled at world 2 under `layout` vs one eager process: outputs, gradients and
    parameters after SGD steps (the layout tolerances of tests/engine/test_engine_parallel.py:
    rtol 1e-5, atol 1e-5 of the scale near zero), and no graph compiled after the warm-up but
    the loss function's."""
    from ember.workers import EngineSpec, GroupEngine, WorkerGroup
    from helpers import ranks as wt
    from helpers.layouts import close_dicts, close_outputs

    config = EngineConfig(micro_batch_tokens=64, compile=True, compile_cache_dir=str(cache_dir))
    ref = TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=64), lora_config=lora)
    group = WorkerGroup.create("process", world_size=2, call_timeout_s=1800)  # compiling on a loaded host
    try:
        eng = GroupEngine.create(group, "compiled", EngineSpec(str(model_dir), config, layout, lora_config=lora))
        info = eng.info().extra["compile"]  # rank 0's
        assert info["compiled_layers"] == 1 and info["warmup_seconds"] > 0 and info["cache_dir"] == str(cache_dir)
        graphs = []
        for datums in sft_batches():
            close_outputs(eng.forward_backward(datums, "cross_entropy"), ref.forward_backward(datums, "cross_entropy"))
            close_dicts(group.run("compiled", wt.full_grads), wt.full_grads(ref), "grad")
            group.run("compiled", wt.sgd_step, 1e-3)
            wt.sgd_step(ref, 1e-3)
            graphs.append(eng.info().extra["compile"]["graphs"])
        close_dicts(group.run("compiled", wt.full_params), wt.full_params(ref), "params")
        # the first call compiles its loss function, nothing else: every shape was warmed up
        assert graphs == [info["graphs"] + 1] * 3, \
            f"after the warm-up's {info['graphs']} graphs, steps of new lengths compiled: {graphs}"
        assert any(cache_dir.rglob("*")), "inductor wrote nothing to the configured cache directory"
    finally:
        group.shutdown()


@pytest.mark.slow
def test_compiled_tp2_lora_equals_eager_world1(one_layer_dir, cache_dir):
    """TP's DTensor projections (and LoRA's A/B beside them) traced inside the compiled layer."""
    _compare_layout(one_layer_dir, cache_dir, ParallelismConfig(tp=2), lora=types.LoraConfig(rank=4, seed=1))


@pytest.mark.slow
def test_compiled_cp2_equals_eager_world1(one_layer_dir, cache_dir):
    """CP's Ulysses all-to-alls inside the compiled layer, FSDP2 over the two cp ranks around it."""
    _compare_layout(one_layer_dir, cache_dir, ParallelismConfig(cp=2))


@pytest.mark.slow
@EXTRA_LAYOUTS
def test_compiled_fsdp2_at_world2_equals_eager_world1(one_layer_dir, cache_dir):
    """Layers compiled after `fully_shard` (torchtitan's order) on 2 gloo ranks."""
    _compare_layout(one_layer_dir, cache_dir, ParallelismConfig(dp_shard=2))
