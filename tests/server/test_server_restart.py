"""kill -9 mid-training, restart `ember serve` on the same data directory and port, resume
from the last checkpoint; every accepted future is accounted for (docs/architecture.md contract 6)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

DATA = [sft_datum([3, 1, 4, 1, 5, 9, 2, 6]), sft_datum([2, 7, 1, 8, 2, 8])]
ADAM = types.AdamParams(learning_rate=2e-2)
# A small body limit lets a real SDK submission be rejected at HTTP level (413): its seq_id
# is consumed, so the next requests wait for the gap (60 s here) and are in flight at the kill.
FLAGS = ["--max-body-mb", "1", "--seq-gap-timeout-s", "60"]


def fwd(tc) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy().copy() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]


def accepted_request_ids(server) -> dict[str, str]:
    """request_id -> path for every submission the server answered with a future."""
    return {e["response"]["request_id"]: e["path"] for e in server.requests()
            if e.get("status") == 200 and isinstance(e.get("response"), dict) and "request_id" in e["response"]
            and not e["path"].endswith("/retrieve_future")}


def accepted_seq_ids(server) -> set[int]:
    seqs = set()
    for e in server.requests():
        if e.get("status") == 200 and e["path"].endswith(("/optim_step", "/forward_backward")):
            seqs.add((e["extra"] or {}).get("seq_id"))
    return seqs


def final_answer(base_url: str, request_id: str) -> tuple[int, str]:
    r = httpx.post(f"{base_url}/api/v1/retrieve_future", json={"request_id": request_id},
                   headers={"X-API-Key": API_KEY, "Accept": "application/x-protobuf"}, timeout=60)
    return r.status_code, r.headers.get("content-type", "") + " " + (r.text if "json" in r.headers.get(
        "content-type", "") else "<protobuf>")


def test_kill9_restart_resume(tiny_model_dir, tmp_path, database_url):
    """On SQLite and PostgreSQL (the database outlives the killed server in both)."""
    data_dir, flags = tmp_path / "data", [*FLAGS, "--database-url", database_url]
    first = start_server(Path(tiny_model_dir), tmp_path / "run1", data_dir=data_dir, extra_args=flags)
    second = None
    try:
        sc = tinker.ServiceClient(base_url=first.base_url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=8).result()
        for _ in range(2):
            tc.forward_backward(DATA, "cross_entropy").result()
            tc.optim_step(ADAM).result()
        path = tc.save_state("last").result().path
        at_save = fwd(tc)

        huge = types.Datum(model_input=types.ModelInput.from_ints([1] * 100_000),
                           loss_fn_inputs={"target_tokens": [2] * 100_000, "weights": [1.0] * 100_000})
        rejected = tc.forward_backward([huge], "cross_entropy")
        with pytest.raises(tinker.APIStatusError) as too_big:
            rejected.result()
        assert too_big.value.status_code == 413
        in_flight = [tc.optim_step(ADAM), tc.forward(DATA, "cross_entropy")]
        # seq ids: 1-4 steps, 5 save, 6 forward, 7 rejected (413), 8 optim_step, 9 forward
        wait_until(lambda: accepted_seq_ids(first) >= {8, 9}, timeout=30, message="seq 8 and 9 to be accepted")
        accepted = accepted_request_ids(first)
        first.kill9()

        second = start_server(Path(tiny_model_dir), tmp_path / "run2", data_dir=data_dir, port=first.port,
                              extra_args=flags)
        answers = {rid: final_answer(second.base_url, rid) for rid in accepted}
        assert all(status == 200 for status, _ in answers.values()), answers
        assert not [a for _, a in answers.values() if "try_again" in a], "an accepted future was left pending"
        restarted = [rid for rid, (_, a) in answers.items() if '"category":"server"' in a and "restarted" in a]
        assert len(restarted) == 2, answers  # exactly the optim_step and forward that were waiting
        assert len(answers) - len(restarted) >= 7  # create_model, 4 steps, save_state, forward: results kept

        for future in in_flight:  # the SDK's own futures, polling across the restart, resolve too
            with pytest.raises(tinker.RequestFailedError) as failed:
                future.result(timeout=120)
            assert failed.value.category == types.RequestErrorCategory.Server
            assert "restarted" in str(failed.value)

        fresh = tinker.ServiceClient(base_url=second.base_url, api_key=API_KEY)
        try:
            rc = tinker.RestClient(base_url=second.base_url, api_key=API_KEY)
            assert tc.get_info().model_id in [r.training_run_id for r in rc.list_training_runs().result().training_runs]
            assert path in [c.tinker_path for c in rc.list_checkpoints(tc.get_info().model_id).result().checkpoints]
            resumed = fresh.create_training_client_from_state_with_optimizer(path).result()
            for a, b in zip(fwd(resumed), at_save, strict=True):
                np.testing.assert_array_equal(a, b)
            resumed.forward_backward(DATA, "cross_entropy").result()
            resumed.optim_step(ADAM).result()
            assert not np.allclose(fwd(resumed)[0], at_save[0], atol=1e-5)
        finally:
            fresh.close("success").result(timeout=30)
            sc.close("interrupted").result(timeout=30)
    finally:
        first.stop()
        if second is not None:
            second.stop()
