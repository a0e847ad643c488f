"""Jobs the two-host tests run *inside* the head's network namespace (`python -m
helpers.two_hosts_jobs <job> ...`): a Ray driver must sit on a host of the cluster, and
the namespaces have no route to the test's own. Each job writes its results with
`torch.save` to the path it is given; the test, in its own process, makes the assertions.
"""

from __future__ import annotations

import os
import sys

import torch

from helpers import ranks as wt
from helpers.datums import random_rl_datums, random_sft_datums

SGD_LR = 1e-3


def fsdp_batches():
    """Odd sizes, skewed lengths, an RL loss (as tests/engine/test_engine_parallel.py)."""
    return [
        (random_sft_datums(5, vocab=84, min_len=2, max_len=14, seed=1), "cross_entropy"),
        (random_rl_datums(3, vocab=84, seed=5), "importance_sampling"),
    ]


def fsdp(model_dir: str, out: str) -> None:
    """One FSDP2 rank on each host (dp_shard=2, STRICT_SPREAD): per batch the loss outputs
    and full gradients, then an SGD step; finally the full parameters and each rank's node."""
    from ember.engine import EngineConfig
    from ember.engine.parallel import ParallelismConfig
    from ember.workers import EngineSpec, GroupEngine, WorkerGroup

    group = WorkerGroup.create("ray", world_size=2, call_timeout_s=300, address=os.environ["RAY_ADDRESS"],
                               strategy="STRICT_SPREAD", init_kwargs={"log_to_driver": False})
    try:
        spec = EngineSpec(model_dir, EngineConfig(micro_batch_tokens=16), ParallelismConfig(dp_shard=2))
        eng = GroupEngine.create(group, "fsdp", spec)
        results = {"nodes": group.run_per_rank(None, wt.node_ip), "steps": []}
        for datums, loss in fsdp_batches():
            output = eng.forward_backward(datums, loss)
            results["steps"].append({"output": output, "grads": group.run("fsdp", wt.full_grads)})
            group.run("fsdp", wt.sgd_step, SGD_LR)
        results["params"] = group.run("fsdp", wt.full_params)
        torch.save(results, out)
    finally:
        group.shutdown()


JOBS = {"fsdp": fsdp}

if __name__ == "__main__":
    JOBS[sys.argv[1]](*sys.argv[2:])
