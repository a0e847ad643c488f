"""The chunked policy head (`EngineConfig.logprob_chunk_tokens`) equals the unchunked one.

For Qwen3 and Llama, LoRA (lm_head adapted) and full fine-tuning, packed and padded: every
built-in logprob loss, top-K cross-entropy, `forward` and the linear surrogate that
`forward_backward_custom` runs (cross_entropy with signed weights) give the same loss,
per-token outputs and gradients with chunks of 7 tokens (chunks straddle datum and
micro-batch boundaries) as with full logits: rtol 1e-5 fp32 (`assert_tensors_close`).
The memory claim itself is `test_engine_chunked_memory.py`'s.
"""

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine
from ember.engine.heads import chunked_target_logprobs
from helpers.datums import assert_tensors_close, random_rl_datums, random_sft_datums
from ember.losses.registry import LOSSES

VOCAB = 84  # the tiny tokenizer's
CHUNK = 7
LOGPROB_LOSSES = sorted(n for n, s in LOSSES.items() if "logprobs" in s.consumes)


def _datums(loss_fn: str) -> list[types.Datum]:
    if loss_fn == "cross_entropy":
        return random_sft_datums(5, VOCAB, min_len=9, max_len=30, seed=3)
    data = random_rl_datums(5, VOCAB, min_len=9, max_len=30, seed=4, with_mask=loss_fn == "gspo")
    if loss_fn == "stable_reinforce":
        for i, d in enumerate(data):
            n = len(d.loss_fn_inputs["target_tokens"].data)
            d.loss_fn_inputs["sampled_mask"] = types.TensorData.from_torch((torch.arange(n) % (i + 2) > 0).float())
    return data


def _top_k_datum() -> types.Datum:
    g = torch.Generator().manual_seed(5)
    targets = torch.randint(0, VOCAB, (11, 3), generator=g)
    return types.Datum(model_input=types.ModelInput.from_ints(torch.randint(0, VOCAB, (11,), generator=g).tolist()),
                       loss_fn_inputs={"target_tokens": targets, "weights": torch.rand(11, 3, generator=g)})


def _engine(model_dir, chunk: int, lora: bool, packing: bool) -> TorchEngine:
    config = EngineConfig(micro_batch_tokens=40, logprob_chunk_tokens=chunk, packing=packing)
    engine = TorchEngine.from_pretrained(model_dir, config, types.LoraConfig(rank=4) if lora else None)
    if lora:  # B = 0 at init would leave every A (lm_head's included) without a gradient
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in engine.state_tensors().items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return engine


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in engine.state_tensors().items() if p.grad is not None}
    engine.clear_gradients()
    return grads


def _calls():
    """(name, datums, loss_fn, backward) of every call compared."""
    calls = [(loss, _datums(loss), loss, True) for loss in LOGPROB_LOSSES]
    surrogate = random_sft_datums(4, VOCAB, min_len=9, max_len=30, seed=6)
    for d in surrogate:  # forward_backward_custom's surrogate: weights = -dLoss/dlogp, any sign
        w = d.loss_fn_inputs["weights"].to_torch()
        d.loss_fn_inputs["weights"] = types.TensorData.from_torch(w * 2.0 - 1.0)
    calls += [("top-k", [_top_k_datum()], "cross_entropy", True), ("custom-surrogate", surrogate, "cross_entropy", True),
              ("forward", _datums("ppo"), "ppo", False)]
    return calls


def _compare(got: types.ForwardBackwardOutput, want: types.ForwardBackwardOutput, what: str) -> None:
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5), what
    for i, (g, w) in enumerate(zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True)):
        assert_tensors_close({f"{what} datum {i} {k}": g[k].to_torch() for k in ("logprobs", "elementwise_loss")},
                             {f"{what} datum {i} {k}": w[k].to_torch() for k in ("logprobs", "elementwise_loss")})


# `make test-fast` runs two of the eight (each family, LoRA and full, packed and padded once).
FAST_CHUNKED = {("qwen3", True, True), ("llama", False, False)}


@pytest.mark.parametrize("family, lora, packing", [
    pytest.param(f, lo, pa, id=f"{f}-{'lora' if lo else 'full'}-{'packed' if pa else 'padded'}",
                 marks=() if (f, lo, pa) in FAST_CHUNKED else pytest.mark.slow)
    for f in ("qwen3", "llama") for lo in (True, False) for pa in (True, False)])
def test_chunked_equals_unchunked(family, lora, packing, tiny_model_dir, tiny_llama_dir):
    model_dir = tiny_model_dir if family == "qwen3" else tiny_llama_dir
    chunked, full = _engine(model_dir, CHUNK, lora, packing), _engine(model_dir, 0, lora, packing)
    assert chunked.head.chunked and not full.head.chunked
    for what, datums, loss_fn, backward in _calls():
        run = (lambda e: e.forward_backward(datums, loss_fn)) if backward else (lambda e: e.forward(datums, loss_fn))
        _compare(run(chunked), run(full), what)
        if backward:
            got, want = _grads(chunked), _grads(full)
            assert want, f"{what}: no gradient at all"
            assert_tensors_close(got, want)


def test_lm_head_never_sees_more_than_a_chunk(tiny_model_dir):
    """The LM head (peft's LoRA wrapper, which is called, not bypassed) runs on at most
    CHUNK rows at a time, in forward and in backward's recomputation; the HF forward
    computes no logits at all."""
    engine = _engine(tiny_model_dir, CHUNK, lora=True, packing=True)
    lm_head = engine.model.get_output_embeddings()
    assert hasattr(lm_head, "lora_A"), "the policy's LoRA adapter should wrap lm_head"
    rows: list[int] = []
    handle = lm_head.register_forward_hook(lambda _m, args, _o: rows.append(args[0].flatten(0, -2).shape[0]))
    try:
        engine.forward_backward(_datums("cross_entropy"), "cross_entropy")
    finally:
        handle.remove()
    total = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in _datums("cross_entropy"))
    assert max(rows) <= CHUNK
    assert sum(rows) == 2 * total  # every real token once in forward, once recomputed in backward; nothing else


def test_chunked_target_logprobs_without_rows_keeps_shape():
    lm_head = torch.nn.Linear(4, 10)
    out = chunked_target_logprobs(lm_head, torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), 3)
    assert out.shape == (0,)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_chunk_tokens_must_be_a_nonnegative_integer(bad):
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be an integer >= 0"):
        EngineConfig(logprob_chunk_tokens=bad)


@pytest.mark.parametrize("key", ["activation_offload", "optimizer_offload"])
def test_offload_keys_need_cuda(key):
    with pytest.raises(ValueError, match=f"EngineConfig.{key} needs a CUDA device"):
        EngineConfig(device="cpu", **{key: True})


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["activation_offload", "optimizer_offload", "activation_checkpointing"])
def test_offload_and_checkpointing_equal_the_plain_engine_on_cuda(tiny_model_dir, key):
    """Written for a GPU machine (skipped on CPU-only CI): two AdamW steps with the setting
    give the plain engine's outputs, gradients and weights; the optimizer state of
    `optimizer_offload` is on the host between steps."""
    datums = _datums("cross_entropy")
    plain = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda"))
    other = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(device="cuda", **{key: True}))
    for _ in range(2):
        _compare(other.forward_backward(datums, "cross_entropy"), plain.forward_backward(datums, "cross_entropy"), key)
        assert_tensors_close({n: p.grad for n, p in other.state_tensors().items()},
                             {n: p.grad for n, p in plain.state_tensors().items()})
        other.optim_step(types.AdamParams(learning_rate=1e-3)), plain.optim_step(types.AdamParams(learning_rate=1e-3))
    assert_tensors_close(dict(other.named_weights()), dict(plain.named_weights()))
    if key == "optimizer_offload":
        assert all(v.device.type == "cpu" for s in other.optimizer.state.values() for k, v in s.items() if k != "step")


def test_activation_checkpointing_on_the_local_engine(tiny_model_dir):
    """`EngineConfig.activation_checkpointing` without a mesh: every decoder layer is
    checkpointed (once, also when a second engine shares the model), same numbers."""
    from torch.distributed._composable.contract import _get_registry

    from ember.engine.parallel import decoder_layers

    config = EngineConfig(micro_batch_tokens=40, logprob_chunk_tokens=CHUNK, activation_checkpointing=True)
    ac = TorchEngine.from_pretrained(tiny_model_dir, config)
    TorchEngine(ac.model, config)  # a second engine over the same model: applied once, no error
    assert all("checkpoint" in (_get_registry(layer) or {}) for layer in decoder_layers(ac.model))
    plain = _engine(tiny_model_dir, CHUNK, lora=False, packing=True)
    datums = _datums("ppo")
    _compare(ac.forward_backward(datums, "ppo"), plain.forward_backward(datums, "ppo"), "ppo")
    assert_tensors_close(_grads(ac), _grads(plain))
