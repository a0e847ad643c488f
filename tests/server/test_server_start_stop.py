"""What an operator sees of a running `ember serve`: Ctrl-C and SIGTERM end it with exit 0 and
one line, no traceback or teardown noise; one status line every `--log.status_every_s`;
routine sampling-session evictions and third-party progress bars stay out of the INFO log. (A busy port or an unusable
data directory: tests/server/test_server_fail_fast.py.)"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import tinker
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_with_one_line_and_exit_0(tiny_model_dir, tmp_path, sig):
    server = start_server(Path(tiny_model_dir), tmp_path, extra_args=["--log-level", "info"])
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=120)  # something loaded
    server.proc.send_signal(sig)
    assert server.proc.wait(60) == 0, server.stderr_tail()
    err = server.stderr_path.read_text()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "nanobind" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == f"ember serve: stopped ({sig.name})", err[-1000:]


STATUS = re.compile(r"status: (\d+) runs, (\d+) sessions, (\d+) sampling sessions loaded; queued: (.*); "
                    r"(\d+) samples; (\d+) futures pending; (\d+) trained tok/s, (\d+) sampled tok/s \(last (\d+) s\)")


def test_status_lines_and_no_routine_eviction_lines(tiny_model_dir, tmp_path):
    server = start_server(Path(tiny_model_dir), tmp_path, extra_args=[
        "--log-level", "info", "--log.status_every_s", "1", "--max-samplers-per-session", "1"])
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=2).result(timeout=120)
        tc.forward_backward([sft_datum([1, 2, 3, 4, 5, 6])], "cross_entropy").result(timeout=120)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
        first = tc.save_weights_and_get_sampling_client()
        for _ in range(2):  # each new sampling client evicts the previous one (one kept per session)
            tc.save_weights_and_get_sampling_client().sample(
                types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=4)).result(timeout=120)
        with pytest.raises(tinker.RequestFailedError, match="evicted"):  # the eviction did happen
            first.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result(timeout=60)

        def statuses():
            return [STATUS.search(line) for line in server.stderr_path.read_text().splitlines() if "status: " in line]

        # The lines so far (none yet on a fast host: a line comes every second, and all of the
        # above can take less); the next ones see all of the above done. The first line's window
        # (from the server's start) covers any work done before it, so the rates below hold either way.
        before = len(statuses())
        seen = wait_until(lambda: (s := statuses()) and len(s) >= before + 2 and s, timeout=30,
                          message="two status lines more")
        assert all(seen), [line for line in server.stderr_tail().splitlines() if "status" in line]
        runs, sessions, samplers = (int(seen[-1][i]) for i in (1, 2, 3))
        assert (runs, sessions, samplers) == (1, 1, 1), seen[-1][0]
        assert "lane 0 (tiny/qwen3): 1 runs, 0 waiting" in seen[-1][4]
        assert any(int(m[7]) > 0 for m in seen), "no line counted the trained tokens"
        assert any(int(m[8]) > 0 for m in seen), "no line counted the sampled tokens"
        log = server.stderr_path.read_text()
        assert "evicted" not in log  # routine: at debug only
        assert "Loading weights" not in log and "it/s]" not in log  # transformers' bar per run: at debug only
        sc.close("success").result(timeout=30)
    finally:
        server.stop()
