"""Checkpoint names and paths, the base-model registry, and full fine-tuning runs."""

from __future__ import annotations

import shutil

import pytest
import torch
from tinker import types

from ember.engine.testing import random_sft_datums, sft_datum
from ember.service import UserError
from ember.service.checkpoints import TinkerPath, checkpoint_dir, parse_tinker_path, validate_name
from ember.service.config import ServiceConfig, load_models_toml
from ember.service.engines import ModelRegistry

from .conftest import new_run, result

PROBE = [5, 9, 14, 22, 31, 40, 7]


@pytest.mark.parametrize("name", ["ck", "step-0001", "a.b_c", "_x", "A" * 128])
def test_valid_checkpoint_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "..", "../x", "a/../b", "/abs", "a/b", "a b", ".hidden", "-x", "a\\b",
                                  "x" * 129, "ü", "a..b", None, 3])
def test_invalid_checkpoint_names_are_user_errors(name):
    with pytest.raises(UserError, match="invalid checkpoint name"):
        validate_name(name)


def test_tinker_paths_parse_and_stay_inside_the_data_dir(tmp_path):
    tp = parse_tinker_path("tinker://sess-1:train:0/weights/ck")
    assert tp == TinkerPath("sess-1:train:0", "training", "ck") and tp.uri == "tinker://sess-1:train:0/weights/ck"
    assert parse_tinker_path("tinker://r/sampler_weights/s").kind == "sampler"
    d = checkpoint_dir(tmp_path, tp)
    assert (tmp_path / "checkpoints").resolve() in d.parents and ":" not in d.parent.parent.name
    for bad in ["file:///x", "tinker://r/weights", "tinker://r/other/x", "tinker://r/weights/../x", "tinker:///weights/x"]:
        with pytest.raises(UserError):
            parse_tinker_path(bad)


def test_models_toml_and_registry(tmp_path, tiny_model_dir):
    (tmp_path / "models.toml").write_text(f'[models]\n"org/tiny" = "{tiny_model_dir}"\n"rel/model" = "sub/dir"\n')
    models = load_models_toml(tmp_path / "models.toml")
    assert models == {"org/tiny": str(tiny_model_dir), "rel/model": str(tmp_path / "sub" / "dir")}
    with pytest.raises(ValueError, match="model 'rel/model': directory .*sub/dir' does not exist"):
        ServiceConfig(data_dir=tmp_path / "d", models_toml=tmp_path / "models.toml")
    (tmp_path / "sub" / "dir").mkdir(parents=True)
    with pytest.raises(ValueError, match="model 'rel/model': .*is not a model directory \\(no config.json\\)"):
        ServiceConfig(data_dir=tmp_path / "d", models_toml=tmp_path / "models.toml")
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "sub" / "dir")
    cfg = ServiceConfig(data_dir=tmp_path / "d", models={"x": str(tiny_model_dir)}, models_toml=tmp_path / "models.toml")
    reg = ModelRegistry(cfg.models)
    assert reg.names() == ["org/tiny", "rel/model", "x"]
    assert reg.resolve("org/tiny").directory == tiny_model_dir
    with pytest.raises(UserError, match="unknown base model .*needs the operator's --model-root"):
        reg.resolve(str(tiny_model_dir))  # no model root: a path is not a name
    rooted = ModelRegistry(cfg.models, roots=[tiny_model_dir.parent])
    assert rooted.resolve(str(tiny_model_dir)).directory == tiny_model_dir.resolve()
    with pytest.raises(UserError, match="unknown base model 'nope'.*org/tiny"):
        reg.resolve("nope")
    with pytest.raises(ValueError):
        ServiceConfig(data_dir=tmp_path, seq_gap_timeout_s=0)


def _probe_lp(svc, owner, mid, seq):
    out = result(svc, owner, svc.forward_backward(owner, mid, seq, [sft_datum(PROBE)], "cross_entropy", forward_only=True))
    return out.loss_fn_outputs[0]["logprobs"].to_torch()


def _sampler_lp(svc, owner, sampler_id):
    sub = svc.sample(owner, sampler_id, 0, types.ModelInput.from_ints(PROBE), 1, types.SamplingParams(max_tokens=1),
                     include_prompt_logprobs=True)
    return torch.tensor(result(svc, owner, sub).prompt_logprobs[1:])


def test_full_fine_tuning_run_checkpoints_and_samplers(make_service):
    svc = make_service()
    _, lora = new_run(svc, "alice")
    lora_before = _probe_lp(svc, "alice", lora, 1)
    sid = svc.create_session("alice").session_id
    full = result(svc, "alice", svc.create_model("alice", sid, 0, "tiny", None)).model_id
    info = svc.get_info("alice", full)
    assert info.is_lora is False and info.lora_rank is None and info.model_data.arch == "qwen3"
    for i in range(2):
        result(svc, "alice", svc.forward_backward("alice", full, 2 * i + 1, random_sft_datums(3, 84, seed=i), "cross_entropy"))
        result(svc, "alice", svc.optim_step("alice", full, 2 * i + 2, types.AdamParams(learning_rate=1e-3)))
    trained = _probe_lp(svc, "alice", full, 5)
    assert (trained - lora_before).abs().max() > 1e-3
    # The full copy is private: the shared base under the LoRA run did not move.
    torch.testing.assert_close(_probe_lp(svc, "alice", lora, 2), lora_before, rtol=0, atol=0)
    state = result(svc, "alice", svc.save_weights("alice", full, 6, "full-ck")).path
    sampler_path = result(svc, "alice", svc.save_weights_for_sampler("alice", full, 7, "full-s")).path
    snap = result(svc, "alice", svc.save_weights_for_sampler("alice", full, 8, None, sampling_session_seq_id=0))
    for sampler_id in (
        snap.sampling_session_id,
        svc.create_sampling_session("alice", sid, 1, model_path=sampler_path).sampling_session_id,
        svc.create_sampling_session("alice", sid, 2, model_path=state).sampling_session_id,
    ):
        torch.testing.assert_close(_sampler_lp(svc, "alice", sampler_id), trained, rtol=0, atol=1e-4)
    assert svc.get_sampler("alice", snap.sampling_session_id).base_model == "tiny"
    again = result(svc, "alice", svc.load_weights("alice", state, True, session_id=sid, model_seq_id=1))
    torch.testing.assert_close(_probe_lp(svc, "alice", again.model_id, 1), trained, rtol=0, atol=1e-6)
    assert svc.get_weights_info("alice", state).is_lora is False


def test_engines_on_a_worker_group_plug_in_through_the_factory_seam(tmp_path, tiny_model_dir):
    from ember.workers import WorkerGroup

    group = WorkerGroup.create("inline", world_size=1)
    cfg = ServiceConfig(data_dir=tmp_path / "wg", models={"tiny": str(tiny_model_dir)})
    try:
        _run_on_group(group, cfg)
    finally:
        group.shutdown()


def _run_on_group(group, cfg):
    from ember.service import Service
    from ember.service.engines import WorkerGroupEngineFactory

    with Service(cfg, engine_factory=WorkerGroupEngineFactory(group)) as svc:
        _, mid = new_run(svc, "alice")
        before = _probe_lp(svc, "alice", mid, 1)
        result(svc, "alice", svc.forward_backward("alice", mid, 2, random_sft_datums(3, 84, seed=1), "cross_entropy"))
        result(svc, "alice", svc.optim_step("alice", mid, 3, types.AdamParams(learning_rate=1e-2)))
        after = _probe_lp(svc, "alice", mid, 4)
        assert (after - before).abs().max() > 1e-3
        snap = result(svc, "alice", svc.save_weights_for_sampler("alice", mid, 5, None, sampling_session_seq_id=0))
        torch.testing.assert_close(_sampler_lp(svc, "alice", snap.sampling_session_id), after, rtol=0, atol=1e-4)
        assert result(svc, "alice", svc.save_weights("alice", mid, 6, "wg-ck")).path.endswith("/weights/wg-ck")
        assert group.names == [f"run_{mid}".replace("-", "_").replace(":", "_")]
