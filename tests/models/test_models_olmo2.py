"""OLMo 2, the family that is not Llama-shaped (`src/ember/models/families/olmo2.py`: norms
after each sublayer, q/k norms over the whole projection): a tiny random model built in code
and loaded through `from_pretrained` trains (full and LoRA: the loss falls, contract 2's
gradient invariance holds at rtol 1e-5) and samples with contract 5 (sampled logprobs equal
the engine's forward logprobs, fp32 CPU abs 1e-4) on TorchSampler's direct decoder and
transformers forward, and on vLLM where it runs; tensor parallelism and the value-head
model export refuse it with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from tinker import types

from ember.engine import EngineConfig, TorchEngine, hf_export
from ember.engine.parallel import check_tp_divisibility
from helpers.datums import assert_tensors_close, random_rl_datums, random_sft_datums, sft_datum
from ember.models import load_model, lora_target_modules
from ember.models.families import FAMILIES, family_of
from ember.models.testing import build_tiny_model
from ember.sampling import SamplerConfig, SamplingRequest, TorchSampler

RTOL = 1e-5
LORA = types.LoraConfig(rank=4, seed=1)
LORA_BODY = types.LoraConfig(rank=4, seed=1, train_unembed=False)  # what vLLM's transformers backend serves
KINDS = {"full": None, "lora": LORA, "lora-body": LORA_BODY}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [30]]


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory):
    """head_dim 32 (vLLM's CPU attention needs >= 32); hidden 64 != 4 heads x 32, which OLMo 2
    allows once `head_dim` is in the config."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-olmo2"), family="olmo2", seed=0, head_dim=32)


@pytest.fixture(scope="module")
def vocab(olmo2_dir):
    return json.loads((olmo2_dir / "config.json").read_text())["vocab_size"]


def _engine(model_dir, budget=10_000, packing=True, lora=None):
    return TorchEngine.from_pretrained(model_dir, EngineConfig(micro_batch_tokens=budget, packing=packing),
                                       lora_config=lora)


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def test_loads_as_olmo2_through_from_pretrained(olmo2_dir):
    model = load_model(olmo2_dir)
    assert type(model).__name__ == "Olmo2ForCausalLM" and family_of(model.config) is FAMILIES["olmo2"]
    attn, layer = model.model.layers[0].self_attn, model.model.layers[0]
    assert attn.head_dim == 32 and attn.q_norm.weight.shape == (4 * 32,)  # a norm over all heads
    assert hasattr(layer, "post_feedforward_layernorm") and not hasattr(layer, "input_layernorm")
    targets = lora_target_modules(model, types.LoraConfig(rank=4))
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_training_lowers_the_loss(olmo2_dir, vocab, lora):
    engine = _engine(olmo2_dir, lora=lora)
    datums = random_sft_datums(4, vocab=vocab, seed=2)
    losses = []
    for _ in range(6):
        losses.append(engine.forward_backward(datums, "cross_entropy").metrics["loss:sum"])
        engine.optim_step(types.AdamParams(learning_rate=1e-2))
    assert losses[-1] < 0.7 * losses[0], losses


# `make test-fast` runs the LoRA variant (full fine-tuning: `make test`).
@pytest.mark.parametrize("lora", [pytest.param(None, marks=pytest.mark.slow), LORA], ids=["full", "lora"])
def test_gradient_is_invariant_to_micro_batches_packing_and_split(olmo2_dir, vocab, lora):
    datums = random_sft_datums(7, vocab=vocab, min_len=2, max_len=15, seed=1)
    ref = _engine(olmo2_dir, lora=lora)
    ref_loss = ref.forward_backward(datums, "cross_entropy").metrics["loss:sum"]
    for budget, packing in ((1, True), (9, True), (40, False)):
        e = _engine(olmo2_dir, budget=budget, packing=packing, lora=lora)
        assert e.forward_backward(datums, "cross_entropy").metrics["loss:sum"] == pytest.approx(ref_loss, rel=RTOL)
        assert_tensors_close(_grads(ref), _grads(e), rtol=RTOL)
    split = _engine(olmo2_dir, budget=5, lora=lora)
    split.forward_backward(datums[:3], "cross_entropy")
    split.forward_backward(datums[3:], "cross_entropy")
    assert_tensors_close(_grads(ref), _grads(split), rtol=RTOL)


def test_rl_loss_gradient_is_invariant_too(olmo2_dir, vocab):
    datums = random_rl_datums(5, vocab=vocab, seed=3)
    ref, small = _engine(olmo2_dir, lora=LORA), _engine(olmo2_dir, budget=5, lora=LORA)
    ref.forward_backward(datums, "ppo")
    small.forward_backward(datums[:2], "ppo")
    small.forward_backward(datums[2:], "ppo")
    assert_tensors_close(_grads(ref), _grads(small), rtol=RTOL)


@pytest.fixture(scope="module")
def trained(olmo2_dir, vocab):
    """A full fine-tuning engine and LoRA engines (with and without lm_head), two optimizer
    steps each (weights moved)."""
    datums = random_sft_datums(4, vocab=vocab, seed=4)
    engines = {}
    for name, lora in KINDS.items():
        e = _engine(olmo2_dir, lora=lora)
        for _ in range(2):
            e.forward_backward(datums, "cross_entropy")
            e.optim_step(types.AdamParams(learning_rate=1e-2))
        engines[name] = e
    return engines


def assert_contract_5(sampler, engine: TorchEngine, lora: types.LoraConfig | None, timeout: float = 120) -> None:
    """Sampled-token logprobs of a version made from `engine`'s weights equal the engine's
    `forward` logprobs of the same tokens (abs 1e-4)."""
    version = sampler.load_weights(engine.named_weights(), lora_config=lora)
    requests = [SamplingRequest(prompt=types.ModelInput.from_ints(p), num_samples=2, version=version,
                                sampling_params=types.SamplingParams(max_tokens=8, seed=i, temperature=1.0))
                for i, p in enumerate(PROMPTS)]
    worst = 0.0
    for p, resp in zip(PROMPTS, sampler.sample_many(requests, timeout=timeout)):
        for seq in resp.sequences:
            assert seq.tokens, "no token sampled"
            out = engine.forward([sft_datum(p + seq.tokens)], "cross_entropy")
            ref = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(p) - 1:]
            worst = max(worst, float((torch.tensor(seq.logprobs) - ref).abs().max()))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("forward", ["direct", "transformers"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_torch_sampler_agrees_with_the_engine(olmo2_dir, trained, forward, kind):
    # forward="direct" raises unless the direct decoder serves the family (families.olmo2's layer)
    with TorchSampler.from_pretrained(olmo2_dir, SamplerConfig(max_slots=8, max_len=64, forward=forward)) as s:
        assert_contract_5(s, trained[kind], KINDS[kind])


@pytest.fixture(scope="module")
def olmo2_vllm(olmo2_dir):
    """One vLLM engine for the module (it takes minutes to start on a loaded 2-core machine)."""
    from ember.sampling.registry import backend_missing

    reason = backend_missing("vllm")
    if reason:
        pytest.skip(reason=reason)
    from ember.sampling import VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_slots=8, max_len=64, max_logprobs=16, max_loras=2, max_lora_rank=8)
    s = VLLMSampler.from_pretrained(olmo2_dir, cfg)
    yield s
    s.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora-body"])
def test_vllm_sampler_agrees_with_the_engine(olmo2_vllm, trained, kind):
    """vLLM serves OLMo 2 through its transformers backend (no native OLMo 2 model)."""
    assert_contract_5(olmo2_vllm, trained[kind], KINDS[kind], timeout=900)


@pytest.mark.slow
def test_vllm_refuses_an_lm_head_adapter_it_cannot_serve_and_keeps_serving(olmo2_vllm, trained):
    """vLLM's transformers backend has no LoRA on lm_head (loading one would kill its engine):
    the version is refused with the reason, and the sampler keeps serving."""
    with pytest.raises(ValueError, match=r"vLLM serves Olmo2ForCausalLM through its transformers backend, which "
                                         r"has no LoRA on \['lm_head'\]; train with LoraConfig\(train_unembed=False\)"):
        olmo2_vllm.load_weights(trained["lora"].named_weights(), lora_config=LORA)
    assert_contract_5(olmo2_vllm, trained["lora-body"], LORA_BODY, timeout=900)


def test_tensor_parallelism_and_value_model_export_refuse_it_with_the_reason(olmo2_dir):
    config = load_model(olmo2_dir).config
    with pytest.raises(ValueError, match=r"tensor parallelism supports \('llama', 'mistral', 'qwen2', 'qwen3'\); "
                                         r"this model is 'olmo2'"):
        check_tp_divisibility(config, 2)
    with pytest.raises(ValueError, match="model family 'olmo2' has no transformers token-classification class"):
        hf_export.token_classification_config(json.loads((olmo2_dir / "config.json").read_text()))


@pytest.mark.slow  # imports vLLM (10-20 s of the worker); `make test-fast` never does
def test_vllm_lora_limits_are_read_from_vllms_registry(olmo2_dir, tiny_model_dir):
    """OLMo 2 has no native vLLM model (transformers backend: no lm_head LoRA); Qwen3 has one."""
    from ember.sampling.registry import backend_missing

    reason = backend_missing("vllm")
    if reason:
        pytest.skip(reason=reason)
    from ember.sampling.vllm_versions import lora_refused_modules

    assert lora_refused_modules(load_model(olmo2_dir).config) == ("lm_head",)
    assert lora_refused_modules(load_model(tiny_model_dir).config) == ()
