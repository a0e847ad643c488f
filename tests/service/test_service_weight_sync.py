"""`SamplerConfig.weight_sync="memory"` in the service: an ephemeral snapshot
(`save_weights_and_get_sampling_client`) writes no file, and `save_weights_for_sampler(name)`
writes its checkpoint (for restarts) yet hands the sampler its tensors, so sampling from the
saved path reads no file back. Each new version is reported to the sync listeners (the
server's `ember_weight_sync_seconds{mode}`)."""

from __future__ import annotations

import pytest
from tinker import types

import ember
from ember.sampling import SamplerConfig
from ember.service.config import ServiceConfig
from helpers.datums import sft_datum

PARAMS = types.SamplingParams(max_tokens=4, seed=3, stop=[])
PROMPT = types.ModelInput.from_ints([5, 9, 14])
DB_FILES = (".db", ".db-wal", ".db-shm", ".db-journal", ".sqlite", ".sqlite-wal", ".sqlite-shm", ".sqlite-journal")


def _files(root):
    return {p for p in root.rglob("*") if p.is_file() and not p.name.endswith(DB_FILES)}


def test_memory_mode_snapshots_write_nothing_and_saved_paths_are_not_read_back(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    sc = ember.ServiceClient(config=ServiceConfig(data_dir=data, models={"tiny": str(tiny_model_dir)},
                                                  sampler=SamplerConfig(weight_sync="memory")))
    syncs: list[str] = []
    try:
        sc.service.samplers.add_sync_listener(lambda mode, seconds: syncs.append(mode))
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        tc.forward_backward([sft_datum([5, 9, 14, 22, 31])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        before = _files(data)
        snapshot = tc.save_weights_and_get_sampling_client().result()
        from_snapshot = snapshot.sample(PROMPT, 1, PARAMS).result().sequences[0]
        assert _files(data) == before, sorted(map(str, _files(data) - before))
        assert syncs == ["memory"]

        path = tc.save_weights_for_sampler("step-1").result().path
        written = _files(data) - before
        assert any(p.suffix == ".safetensors" for p in written), written  # the checkpoint survives a restart
        from_path = sc.create_sampling_client(model_path=path).result().sample(PROMPT, 1, PARAMS).result().sequences[0]
        assert syncs == ["memory", "memory"]  # no "files" load: the saved path was not read back
        assert from_path.tokens == from_snapshot.tokens and from_path.logprobs == from_snapshot.logprobs
    finally:
        sc.close("success")


def test_files_mode_reads_a_saved_path_back(tmp_path, tiny_model_dir):
    """The default is today's path: sampling from a saved path loads its files."""
    sc = ember.ServiceClient(config=ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)}))
    syncs: list[str] = []
    try:
        sc.service.samplers.add_sync_listener(lambda mode, seconds: syncs.append(mode))
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        path = tc.save_weights_for_sampler("step-0").result().path
        sc.create_sampling_client(model_path=path).result().sample(PROMPT, 1, PARAMS).result()
        assert syncs == ["files"]
    finally:
        sc.close("success")


def test_memory_mode_releases_a_saved_paths_tensors_with_its_checkpoint_or_session(tmp_path, tiny_model_dir):
    """The tensors `save_weights_for_sampler(name)` hands the sampler are held only while its
    checkpoint exists and its run's session lasts: deleting the checkpoint (as its files go)
    or ending the session lets the sampler free the version; a sampling client made from
    the path before keeps its version alive (it holds it itself, as with files)."""
    import gc

    sc = ember.ServiceClient(config=ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)},
                                                  sampler=SamplerConfig(weight_sync="memory")))
    try:
        samplers = sc.service.samplers
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        kept = tc.save_weights_for_sampler("kept").result().path
        client = sc.create_sampling_client(model_path=kept).result()
        sampler = sc.service.debug_state().samplers["backends"]["tiny"]  # started by the sampling client
        assert samplers.synced_paths() == [kept] and sampler.live_versions() == 1
        sc.create_rest_client().delete_checkpoint_from_tinker_path(kept).result()
        assert samplers.synced_paths() == []
        gc.collect()
        assert client is not None and sampler.live_versions() == 1  # the sampling client's own reference

        gone = tc.save_weights_for_sampler("gone").result().path
        assert samplers.synced_paths() == [gone] and sampler.live_versions() == 2
        sc.create_rest_client().delete_checkpoint_from_tinker_path(gone).result()
        gc.collect()
        assert samplers.synced_paths() == [] and sampler.live_versions() == 1  # nothing else held it

        ended = tc.save_weights_for_sampler("ended").result().path
        assert samplers.synced_paths() == [ended] and sampler.live_versions() == 2
        sc.service.finish_session(sc.owner, sc.context.session_id(), "success")
        gc.collect()
        assert samplers.synced_paths() == [] and sampler.live_versions() == 0  # the session's clients went too
    finally:
        sc.close("success")


def _moe_case(lora: bool, sync: str):
    return pytest.param(lora, sync, marks=[] if (lora, sync) == (True, "memory") else [pytest.mark.slow],
                        id=f"{'lora' if lora else 'full'}-{sync}")


@pytest.mark.parametrize("lora,sync", [_moe_case(lora, sync) for lora in (True, False) for sync in ("memory", "files")])
def test_a_mixture_of_experts_run_s_expert_weights_reach_the_sampler(tmp_path, tiny_moe_dir, lora, sync):
    """A LoRA run adapts every expert, a full run changes the expert weights themselves: a
    snapshot (tensors handed over) and a saved path (`weight_sync` memory: tensors; files:
    the export read back, per-expert names for Qwen3-MoE) both sample with the trainer's
    own logprobs (contract 5)."""
    sc = ember.ServiceClient(config=ServiceConfig(data_dir=tmp_path / "data", models={"moe": str(tiny_moe_dir)},
                                                  sampler=SamplerConfig(weight_sync=sync)))
    try:
        tc = (sc.create_lora_training_client(base_model="moe", rank=4, seed=0) if lora else
              sc.create_full_training_client(base_model="moe")).result()
        for step in range(2):
            tc.forward_backward([sft_datum([5, 9, 14, 22, 31, 40 + step])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        snapshot = tc.save_weights_and_get_sampling_client().result()
        path = tc.save_weights_for_sampler("step-2").result().path
        from_path = sc.create_sampling_client(model_path=path).result()
        for client in (snapshot, from_path):
            seq = client.sample(PROMPT, 1, types.SamplingParams(max_tokens=6, seed=3, stop=[])).result().sequences[0]
            tokens = PROMPT.to_ints() + seq.tokens
            out = tc.forward([sft_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]
            trained = out["logprobs"].to_numpy()[PROMPT.length - 1:]
            assert abs(trained - seq.logprobs).max() < 1e-4
    finally:
        sc.close("success")
