"""Restart semantics: a service process killed with SIGKILL, a new Service on the same files
and database (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
import json
import os
import signal
import subprocess
import sys
import textwrap

import torch
from tinker import types

from helpers.datums import random_sft_datums

from .conftest import result, wait

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

VOCAB = 84

# Runs in a child process: trains a little, checkpoints, leaves one request in flight
# (seq 5 arrives while seq 4 is missing, with a long gap timeout), reports, then waits
# to be killed.
WORKER = textwrap.dedent(
    """
    import json, sys, time
    from tinker import types
    from helpers.datums import random_sft_datums
    from ember.service import Service, ServiceConfig
    data_dir, model_dir, url = sys.argv[1], sys.argv[2], sys.argv[3]
    svc = Service(ServiceConfig(data_dir=data_dir, models={"tiny": model_dir}, database_url=url, seq_gap_timeout_s=600))
    sid = svc.create_session("alice").session_id
    sub = svc.create_model("alice", sid, 0, "tiny", types.LoraConfig(rank=4, seed=3))
    mid = sub.model_id
    fb = svc.forward_backward("alice", mid, 1, random_sft_datums(3, 84, seed=1), "cross_entropy")
    step = svc.optim_step("alice", mid, 2, types.AdamParams(learning_rate=1e-2))
    save = svc.save_weights("alice", mid, 3, "ck1")
    for s in (sub, fb, step, save):
        assert svc.retrieve("alice", s.request_id, 120).status == "complete"
    stuck = svc.forward_backward("alice", mid, 5, random_sft_datums(1, 84, seed=2), "cross_entropy")
    print(json.dumps({"session": sid, "model": mid, "fb": fb.request_id, "stuck": stuck.request_id,
                      "path": svc.retrieve("alice", save.request_id).result.path}), flush=True)
    time.sleep(600)
    """
)


def test_kill_9_then_restart_lists_runs_answers_futures_and_resumes(tmp_path, tiny_model_dir, make_service,
                                                                   database_url):
    data_dir = tmp_path / "data"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(data_dir), str(tiny_model_dir), database_url],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line, "worker died before reporting"
        info = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    svc = make_service(data_dir=data_dir, database_url=database_url)
    # Runs and checkpoints are listed.
    runs = svc.list_training_runs("alice")
    assert [r.training_run_id for r in runs.training_runs] == [info["model"]]
    assert runs.training_runs[0].last_checkpoint.tinker_path == info["path"]
    assert [c.tinker_path for c in svc.list_checkpoints("alice", info["model"]).checkpoints] == [info["path"]]
    # The in-flight future answers category server, saying why.
    stuck = svc.retrieve("alice", info["stuck"])
    assert stuck.status == "failed" and stuck.category == types.RequestErrorCategory.Server
    assert "restarted" in stuck.error
    # A completed future still answers with its stored result.
    done = svc.retrieve("alice", info["fb"])
    assert done.status == "complete" and done.result.metrics["loss:sum"] > 0
    assert len(done.result.loss_fn_outputs) == 3
    # Resubmitting an executed (model_id, seq_id) returns the same future, not a re-run.
    again = svc.forward_backward("alice", info["model"], 1, random_sft_datums(3, VOCAB, seed=1), "cross_entropy")
    assert again.request_id == info["fb"]
    # The old run has no engine any more; a request on it says so.
    st = wait(svc, "alice", svc.optim_step("alice", info["model"], 4, types.AdamParams()))
    assert st.category == types.RequestErrorCategory.Server and "not loaded" in st.error
    # The session survived (heartbeats keep working); the run is recreated from its checkpoint.
    svc.heartbeat("alice", info["session"])
    sub = svc.load_weights("alice", info["path"], True, session_id=info["session"], model_seq_id=1)
    loaded = result(svc, "alice", sub)
    assert loaded.model_id == f"{info['session']}:train:1" and loaded.path == info["path"]
    assert svc.get_info("alice", loaded.model_id).lora_rank == 4
    out = result(svc, "alice", svc.forward_backward("alice", loaded.model_id, 1, random_sft_datums(3, VOCAB, seed=1),
                                                     "cross_entropy"))
    # One optimizer step was taken before the checkpoint: the loss on the same batch is lower.
    assert out.metrics["loss:sum"] < done.result.metrics["loss:sum"]
    assert torch.isfinite(torch.tensor(out.metrics["loss:sum"]))
