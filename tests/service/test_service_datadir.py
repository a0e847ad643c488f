"""One process per data directory (hardening item 4): the second user of a data directory
is refused with the holder's pid, and the first loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tinker import types

from helpers.datums import sft_datum
from ember.service import Service, ServiceConfig
from ember.service.datadir import DataDirInUseError

from .conftest import new_run, result

HOLD = """
import sys, time
from ember.service import Service, ServiceConfig
svc = Service(ServiceConfig(data_dir=sys.argv[1]))
print("holding", flush=True)
time.sleep(120)
"""


def test_a_second_service_on_the_data_directory_is_refused_naming_the_holder(make_service, tmp_path, tiny_model_dir):
    first = make_service()
    sid, mid = new_run(first, "alice")
    with pytest.raises(DataDirInUseError, match=f"in use by another ember process \\(pid {os.getpid()}\\)"):
        Service(ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)}))
    # the refused one touched nothing: the first still trains, its futures are intact
    out = result(first, "alice", first.forward_backward("alice", mid, 1, [sft_datum([1, 2, 3])], "cross_entropy"))
    assert out.loss_fn_outputs
    result(first, "alice", first.optim_step("alice", mid, 2, types.AdamParams(learning_rate=1e-3)))
    first.close()
    again = Service(ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)}))
    again.close()  # released on close


@pytest.mark.slow
def test_another_process_holding_the_directory_is_named_and_its_death_releases_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "d")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(DataDirInUseError, match=f"pid {holder.pid}\\)"):
            Service(ServiceConfig(data_dir=tmp_path / "d"))
    finally:
        holder.kill()  # like kill -9: the kernel drops the lock
        holder.wait(10)
    Service(ServiceConfig(data_dir=tmp_path / "d")).close()
