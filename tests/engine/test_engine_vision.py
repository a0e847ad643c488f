"""Training with images (a tiny Qwen3-VL, fp32 CPU): through `ember.ServiceClient` with the
SDK's types (`ImageChunk` of PNG bytes), and the engine's exactness contracts with images:
the gradient is the same for any micro-batch budget, packing on or off, or a batch split
over calls (rtol 1e-5); checkpoints, resume and exports carry the whole model."""

from __future__ import annotations

import pytest
import torch
from tinker import types

import ember
from ember.engine import EngineConfig, TorchEngine
from ember.models import load_tokenizer
from ember.models.testing import build_tiny_model
from helpers.datums import assert_tensors_close, sft_datum
from helpers.vision import COLORS, image_datum, png_bytes

RTOL = 1e-5
ADAM = types.AdamParams(learning_rate=3e-3)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A tiny Qwen3-VL: hidden 64, 2 decoder layers, a 2-block tower; char tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-vl"), family="qwen3_vl", seed=0)


@pytest.fixture(scope="module")
def tok(vl_dir):
    return load_tokenizer(vl_dir)


@pytest.fixture(scope="module")
def datums(tok):
    """Two images of different sizes (4 and 16 tokens), a striped one, and a text datum."""
    return [image_datum(tok, png_bytes(COLORS["red"]), "Q:", "red", 4),
            image_datum(tok, png_bytes(COLORS["blue"], 112), "Colour?", "blue", 16, weights=0.5),
            sft_datum(tok.encode("plain text here")),
            image_datum(tok, png_bytes(COLORS["green"], stripe=True), "", "green", 4)]


@pytest.fixture(scope="module")
def service(vl_dir, tmp_path_factory):
    sc = ember.ServiceClient(models={"vl": str(vl_dir)}, data_dir=tmp_path_factory.mktemp("data"))
    yield sc
    sc.close("success")


def _grads(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.state_tensors().items() if p.grad is not None}


def _engine(model_dir, budget=8192, packing=True, lora=None, train_vision=False) -> TorchEngine:
    config = EngineConfig(micro_batch_tokens=budget, packing=packing, train_vision=train_vision)
    return TorchEngine.from_pretrained(model_dir, config, lora_config=lora)


def test_an_image_datum_trains_through_the_client(service, datums):
    tc = service.create_lora_training_client(base_model="vl", rank=8).result()
    losses = []
    for _ in range(6):
        out = tc.forward_backward(datums[:2], "cross_entropy").result()
        tc.optim_step(ADAM).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses
    assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [d.model_input.length for d in datums[:2]]


def test_forward_backward_custom_takes_image_datums(service, datums):
    """The SDK's client-side custom loss (forward, user loss on the log-probs, weighted CE
    backward) with images: a loss equal to cross-entropy gives cross-entropy's sum."""
    tc = service.create_lora_training_client(base_model="vl", rank=4).result()
    want = tc.forward(datums, "cross_entropy").result().metrics["loss:sum"]

    def ce(data, logprobs):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs))
        return loss, {}

    out = tc.forward_backward_custom(datums, ce).result()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)


def test_wrong_expected_tokens_is_a_user_error_naming_the_chunk(service, tok, datums):
    tc = service.create_lora_training_client(base_model="vl", rank=4).result()
    bad = image_datum(tok, png_bytes(COLORS["red"]), "Q:", "red", 5)
    with pytest.raises(Exception, match=r"datum 1: model_input chunk 1 \(image\) has expected_tokens=5, but this "
                                        r"model makes 4 tokens of it"):
        tc.forward_backward([datums[0], bad], "cross_entropy").result()
    assert tc.forward(datums[:1], "cross_entropy").result().loss_fn_outputs  # the run keeps working


# `make test-fast` runs the LoRA variant; full fine-tuning of the tower is slow.
@pytest.mark.parametrize("lora", [types.LoraConfig(rank=4), pytest.param(None, marks=pytest.mark.slow)],
                         ids=["lora", "full-ft-tower"])
def test_gradient_is_the_same_for_any_budget_packing_or_split(vl_dir, datums, lora):
    """LoRA on the language model, and full fine-tuning with the tower trained
    (`train_vision`): every parameter's gradient, images in every micro-batch layout."""
    vision = lora is None
    ref = _engine(vl_dir, lora=lora, train_vision=vision)
    ref_out = ref.forward_backward(datums, "cross_entropy")
    want = _grads(ref)
    assert not vision or any(".visual." in n for n in want)
    for budget, packing in [(1, True), (20, True), (8192, False), (30, False)]:
        e = _engine(vl_dir, budget, packing, lora, vision)
        out = e.forward_backward(datums, "cross_entropy")
        assert_tensors_close(want, _grads(e), rtol=RTOL)
        assert out.metrics["loss:sum"] == pytest.approx(ref_out.metrics["loss:sum"], rel=RTOL)
    split = _engine(vl_dir, 8192, True, lora, vision)
    for part in (datums[:1], datums[1:3], datums[3:]):
        split.forward_backward(part, "cross_entropy")
    assert_tensors_close(want, _grads(split), rtol=RTOL)


def test_packed_logprobs_equal_one_sequence_forwards(vl_dir, datums):
    """Each sequence in a packed row sees its own M-RoPE positions and its own image."""
    from transformers import Qwen3VLForConditionalGeneration

    from ember.models.vision import expand_model_input, load_vision_spec

    engine = _engine(vl_dir)
    out = engine.forward(datums, "cross_entropy")
    model = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, local_files_only=True).eval()
    spec = load_vision_spec(vl_dir)
    for i, d in enumerate(datums):
        ex = expand_model_input(d.model_input, spec, where=f"datum {i}")
        with torch.no_grad():
            logits = model(input_ids=ex.input_ids[None], **ex.model_kwargs()).logits[0].float()
        targets = d.loss_fn_inputs["target_tokens"].to_torch()
        want = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(out.loss_fn_outputs[i]["logprobs"].to_torch(), want, rtol=1e-5, atol=1e-5)


def test_the_tower_is_frozen_unless_train_vision(vl_dir, datums):
    def tower(engine):
        return {n: p.detach().clone() for n, p in engine.model.named_parameters() if ".visual." in n}

    frozen = _engine(vl_dir)
    before = tower(frozen)
    frozen.forward_backward(datums, "cross_entropy")
    frozen.optim_step(ADAM)
    assert all(torch.equal(before[n], t) for n, t in tower(frozen).items())
    assert frozen.info().num_trainable_parameters < frozen.info().num_parameters
    trained = _engine(vl_dir, train_vision=True)
    trained.forward_backward(datums, "cross_entropy")
    trained.optim_step(ADAM)
    assert any(not torch.equal(before[n], t) for n, t in tower(trained).items())
    with pytest.raises(ValueError, match="train_vision trains the vision tower's own weights"):
        _engine(vl_dir, lora=types.LoraConfig(rank=4), train_vision=True)


def test_a_full_checkpoint_resumes_only_with_the_same_train_vision(vl_dir, datums, tmp_path):
    trained = _engine(vl_dir, train_vision=True)
    trained.forward_backward(datums, "cross_entropy")
    trained.optim_step(ADAM)
    trained.save_state(tmp_path / "ckpt")
    again = _engine(vl_dir, train_vision=True)
    again.load_state(tmp_path / "ckpt")
    assert_tensors_close(dict(trained.named_weights()), dict(again.named_weights()), rtol=0)
    with pytest.raises(ValueError, match=r"saved with train_vision=True \(its vision tower trained\); this engine "
                                         r"has train_vision=False"):
        _engine(vl_dir).load_state(tmp_path / "ckpt")


def _export_dir(service, path: str):
    from pathlib import Path

    return Path(service.service.checkpoints.row(path).directory)


def test_checkpoint_resume_and_exports_load_back_in_transformers(service, vl_dir, datums):
    """save_state → a new client resumes with equal log-probs; the adapter, the merged and
    the full exports load with transformers (and the image processor from the export)."""
    from peft import PeftModel
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration

    from ember.models.vision import expand_model_input, load_vision_spec

    tc = service.create_lora_training_client(base_model="vl", rank=4, seed=3).result()
    for _ in range(2):
        tc.forward_backward(datums, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    want = [o["logprobs"].to_torch() for o in tc.forward(datums, "cross_entropy").result().loss_fn_outputs]
    resumed = service.create_training_client_from_state(tc.save_state("ckpt").result().path).result()
    got = [o["logprobs"].to_torch() for o in resumed.forward(datums, "cross_entropy").result().loss_fn_outputs]
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    adapter = _export_dir(service, tc.save_weights_external("ad").result().path)
    merged = _export_dir(service, tc.save_weights_external("ad.merged").result().path)
    base = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, local_files_only=True)
    models = {"adapter": PeftModel.from_pretrained(base, adapter).eval(),
              "merged": Qwen3VLForConditionalGeneration.from_pretrained(merged, local_files_only=True).eval()}
    assert type(AutoImageProcessor.from_pretrained(merged, local_files_only=True)).__name__ == "Qwen2VLImageProcessorPil"
    spec = load_vision_spec(merged)
    for name, model in models.items():
        for i, d in enumerate(datums):
            ex = expand_model_input(d.model_input, spec, where=f"datum {i}")
            with torch.no_grad():
                logits = model(input_ids=ex.input_ids[None], **ex.model_kwargs()).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
            torch.testing.assert_close(lp, want[i], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} datum {i}: {m}")


def test_full_fine_tuning_export_and_sampler_weights_carry_the_whole_model(service, vl_dir, datums):
    from transformers import Qwen3VLForConditionalGeneration

    tc = service.create_full_training_client(base_model="vl").result()
    tc.forward_backward(datums, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    want = [o["logprobs"].to_torch() for o in tc.forward(datums[:1], "cross_entropy").result().loss_fn_outputs]
    out = _export_dir(service, tc.save_weights_external("full").result().path)
    sampler = _export_dir(service, tc.save_weights_for_sampler("s").result().path)
    base = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, local_files_only=True)
    tower = dict(base.model.visual.named_parameters())
    from ember.models.vision import expand_model_input, load_vision_spec

    ex = expand_model_input(datums[0].model_input, load_vision_spec(out), where="datum 0")
    for directory in (out, sampler):
        model = Qwen3VLForConditionalGeneration.from_pretrained(directory, local_files_only=True).eval()
        assert all(torch.equal(p, tower[n]) for n, p in model.model.visual.named_parameters())  # frozen, exported
        with torch.no_grad():
            logits = model(input_ids=ex.input_ids[None], **ex.model_kwargs()).logits[0].float()
        targets = datums[0].loss_fn_inputs["target_tokens"].to_torch()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(lp, want[0], rtol=1e-4, atol=1e-4)


def test_qwen2_5_vl_packs_exactly_and_trains_with_an_image(tmp_path):
    """Qwen2.5-VL's windowed tower: images packed in one row (the long text datum sets the
    row width) give each sequence's own log-probs; a LoRA run on an image datum learns."""
    model_dir = build_tiny_model(tmp_path / "q25", family="qwen2_5_vl", seed=0)
    tok25 = load_tokenizer(model_dir)
    data = [image_datum(tok25, png_bytes(COLORS["yellow"]), "Q:", "yellow", 4),
            image_datum(tok25, png_bytes(COLORS["green"], 112, stripe=True), "Q:", "green", 16),
            image_datum(tok25, png_bytes(COLORS["red"]), "", "red", 4),
            sft_datum(tok25.encode("a long text datum that is as wide as two image datums"))]
    assert data[0].model_input.length + data[2].model_input.length <= data[3].model_input.length
    engine = _engine(model_dir, lora=types.LoraConfig(rank=4))
    packed = engine.forward(data, "cross_entropy").loss_fn_outputs
    for i, d in enumerate(data):
        alone = engine.forward([d], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_torch()
        torch.testing.assert_close(packed[i]["logprobs"].to_torch(), alone, rtol=1e-5, atol=1e-6)
    first = engine.forward_backward(data[:1], "cross_entropy").metrics["loss:sum"]
    for _ in range(3):
        engine.optim_step(ADAM)
        last = engine.forward_backward(data[:1], "cross_entropy").metrics["loss:sum"]
    assert last < first


def test_a_vision_model_on_several_ranks_is_refused(vl_dir):
    """FSDP2 gathers the tower's shards in its forward, which only ranks with images would run."""
    from ember.engine.parallel import ParallelismConfig

    with pytest.raises(ValueError, match="qwen3_vl is a vision-language model; ember trains it on one rank"):
        TorchEngine.from_pretrained(vl_dir, EngineConfig(), parallelism=ParallelismConfig(dp_shard=2))


def test_estimate_builds_the_vision_model_on_the_meta_device(vl_dir, capsys):
    from ember.cli import main

    assert main(["estimate", "--model", str(vl_dir), "--tokens", "64"]) == 0
    assert "peak" in capsys.readouterr().out
