"""Checkpoint names and paths, the base-model registry, and full fine-tuning runs."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from tinker import types

from helpers.datums import random_sft_datums, sft_datum
from ember.service import UserError
from ember.service.checkpoint_files import TinkerPath, checkpoint_dir, parse_tinker_path, validate_name
from ember.service.config import ServiceConfig, load_models_toml
from ember.service.model_registry import ModelRegistry

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
    (tmp_path / "unregistered").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "unregistered")
    with pytest.raises(UserError, match="unknown base model .*needs the operator's --model-root"):
        reg.resolve(str(tmp_path / "unregistered"))  # no model root: a path is not a name
    # ... except the directory a model was registered with, which names that model
    # (tinker-cookbook loads the tokenizer from model_name: a directory, not a served name)
    for spelling in (str(tiny_model_dir), str(tiny_model_dir) + "/./"):
        by_dir = reg.resolve(spelling)
        assert by_dir.directory == tiny_model_dir and by_dir.name in ("org/tiny", "x")  # both registered there
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


# ---------------------------------------------------------------------- crash consistency
def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_startup_sweep_removes_unreferenced_entries_and_keeps_the_rest(tmp_path):
    from ember.service.sweep import sweep_data_dir

    data = tmp_path / "data"
    weights = data / "checkpoints" / "run_a" / "weights"
    kept = ["ck", "ck.0a1b2c3d", "moved.00000000"]  # old layout, new layout, named from a moved data dir
    garbage = ["ck.deadbeef", ".ck.12345678.tmp", ".ck.tmp-abcdef01"]  # orphan, temp, old-style temp
    for name in kept + garbage + ["odd name"]:
        (weights / name).mkdir(parents=True)
        (weights / name / "f").write_text("x")
    (weights / "notes.txt").write_text("operator's")
    (data / "checkpoints" / "run_a" / "sampler_weights" / "s.11111111").mkdir(parents=True)
    (data / "checkpoints" / "run_a" / "other" / "x").mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "precious").mkdir(parents=True)
    (weights / "link.22222222").symlink_to(outside / "precious")
    (data / "checkpoints" / "run_link").symlink_to(outside)
    for name in ["sampler-0123abcd", "sampler-x", "mine"]:
        (data / "scratch" / name).mkdir(parents=True)
    referenced = [str(weights / "ck"), str(weights / "ck.0a1b2c3d"),
                  "/elsewhere/old-data/checkpoints/run_a/weights/moved.00000000", str(tmp_path / "unrelated")]

    removed = sweep_data_dir(data, referenced)

    assert sorted(p.name for p in removed) == sorted(garbage + ["s.11111111", "sampler-0123abcd"])
    assert sorted(p.name for p in weights.iterdir()) == sorted(kept + ["link.22222222", "notes.txt", "odd name"])
    assert (weights / "ck" / "f").read_text() == "x" and (outside / "precious").is_dir()
    assert (data / "checkpoints" / "run_a" / "other" / "x").is_dir()
    assert sorted(p.name for p in (data / "scratch").iterdir()) == ["mine", "sampler-x"]
    assert sweep_data_dir(tmp_path / "empty", []) == []


def test_saves_write_fresh_directories_and_every_use_goes_through_the_row(make_service):
    svc = make_service()
    _, mid = new_run(svc, "alice")
    path = result(svc, "alice", svc.save_weights("alice", mid, 1, "ck")).path
    first = svc.checkpoints.row(path).directory
    segment = Path(first).parent
    assert Path(first).name.startswith("ck.") and len(Path(first).name) == len("ck.") + 8
    lp = _probe_lp(svc, "alice", mid, 2)
    result(svc, "alice", svc.save_weights("alice", mid, 3, "ck", overwrite=True))
    second = svc.checkpoints.row(path).directory
    assert second != first and [p.name for p in segment.iterdir()] == [Path(second).name]
    # A row of the old layout (directory == <name>) keeps working: load, overwrite, delete.
    old = segment / "ck"
    Path(second).rename(old)
    with sqlite3.connect(svc.config.data_dir / "ember.db") as db:  # as an older ember wrote it
        assert db.execute("UPDATE checkpoints SET directory = ? WHERE tinker_path = ?", (str(old), path)).rowcount == 1
    sid = svc.create_session("alice").session_id
    again = result(svc, "alice", svc.load_weights("alice", path, True, session_id=sid, model_seq_id=0)).model_id
    torch.testing.assert_close(_probe_lp(svc, "alice", again, 1), lp, rtol=0, atol=0)
    result(svc, "alice", svc.save_weights("alice", mid, 4, "ck", overwrite=True))
    assert not old.exists() and len(list(segment.iterdir())) == 1
    svc.delete_checkpoint("alice", mid, "weights/ck")
    assert list(segment.iterdir()) == [] and svc.checkpoints.row(path) is None


@pytest.mark.parametrize("point", ["checkpoint.before_write", "checkpoint.after_write", "checkpoint.after_commit"])
def test_a_failed_save_leaves_rows_naming_complete_directories_after_restart(make_service, tmp_path, point):
    from ember import failpoints

    svc = make_service()
    _, mid = new_run(svc, "alice")
    path = result(svc, "alice", svc.save_weights("alice", mid, 1, "ck")).path
    failpoints.arm(point, "raise")
    try:
        for seq, name in [(2, "ck"), (3, "new")]:
            state = svc.retrieve("alice", svc.save_weights("alice", mid, seq, name, overwrite=True).request_id, 60)
            assert state.status == "failed" and f"fail point {point}" in state.error
    finally:
        failpoints.disarm()
    segment = Path(svc.checkpoints.row(path).directory).parent
    assert len(list(segment.iterdir())) == (1 if point == "checkpoint.before_write" else 3)  # leftovers
    svc.close()
    svc = make_service()  # the same data directory: the start-up sweep runs
    rows = [svc.checkpoints.row(p) for p in (path, path.replace("/ck", "/new"))]
    dirs = {r.directory for r in rows if r is not None}
    assert (rows[1] is not None) == (point == "checkpoint.after_commit")
    assert {str(p) for p in segment.iterdir()} == dirs
    assert all(ckpt_read(d) for d in dirs)


def ckpt_read(directory):
    from ember.service.checkpoint_files import read_state_weights

    return len(read_state_weights(Path(directory))) > 0
