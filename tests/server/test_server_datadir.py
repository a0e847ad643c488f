"""Two `ember serve` on one data directory (hardening item 4): the second exits 2 naming
the first's pid, before it touches the database; the first loses nothing."""

from __future__ import annotations

import pytest

import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, server_env, sft_datum
from helpers.zygote import run_module

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


def test_a_second_server_on_a_data_directory_in_use_exits_2_and_the_first_loses_nothing(tiny_model_dir, ember_server):
    first = ember_server  # the session's shared server (no start of its own): it must lose nothing
    sc = tinker.ServiceClient(base_url=first.base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        datum = sft_datum([1, 2, 3, 4, 5])
        in_flight = [tc.forward_backward([datum], "cross_entropy") for _ in range(3)]
        second = run_module("ember.cli", ["serve", "--model", f"{MODEL_NAME}={tiny_model_dir}", "--data-dir",
                                          str(first.data_dir), "--port", "0", "--api-key", API_KEY],
                            cwd=first.data_dir.parent, env=server_env(), timeout=120)
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith("ember serve: data directory") and f"(pid {first.proc.pid})" in line, second.stderr
        for fut in in_flight:  # a second process once failed these as "the server restarted"
            assert fut.result(timeout=60).loss_fn_outputs
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
        assert first.alive()
    finally:
        sc.close("success").result(timeout=30)
