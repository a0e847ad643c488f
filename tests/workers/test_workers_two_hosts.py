"""The trainer's worker group across two hosts (two network namespaces on this machine,
a Ray node in each; `helpers.netns`): one FSDP2 rank per host equals world 1.

Tolerance (fp32): rtol 1e-5, atol 1e-5 · the largest reference magnitude (as
tests/engine/test_engine_parallel.py: a sum over two ranks changes fp32 rounding).
The Ray driver runs in the head's namespace (`helpers.two_hosts_jobs`); the world-1
reference and every assertion run here.
"""

import sys

import pytest
import torch

from ember.engine import EngineConfig, TorchEngine
from helpers import ranks as wt
from helpers.netns import TwoHosts, namespaces_with_suffix
from helpers.two_hosts_jobs import SGD_LR, fsdp_batches

pytestmark = pytest.mark.slow


def close(got, want, what: str, scale: float | None = None) -> None:
    atol = 1e-5 * max(float(want.abs().max()) if scale is None else scale, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def close_dicts(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    scale = max(float(t.abs().max()) for t in want.values())
    for name in want:
        close(got[name], want[name], f"{what} {name}", scale)


def test_fsdp_rank_on_each_host_equals_world1(two_hosts: TwoHosts, tiny_model_dir, tmp_path):
    out = tmp_path / "fsdp.pt"
    job = two_hosts.run([sys.executable, "-m", "helpers.two_hosts_jobs", "fsdp", str(tiny_model_dir), str(out)])
    assert job.returncode == 0, job.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert sorted(got["nodes"]) == sorted([two_hosts.head.address, two_hosts.worker.address])

    ref = TorchEngine.from_pretrained(tiny_model_dir, EngineConfig(micro_batch_tokens=16))
    for step, (datums, loss) in zip(got["steps"], fsdp_batches()):
        want = ref.forward_backward(datums, loss)
        assert step["output"].metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        for i, (g, w) in enumerate(zip(step["output"].loss_fn_outputs, want.loss_fn_outputs)):
            close(g["logprobs"].to_torch(), w["logprobs"].to_torch(), f"{loss} datum {i} logprobs")
        close_dicts(step["grads"], wt.full_grads(ref), f"{loss} grad")
        wt.sgd_step(ref, SGD_LR)
    close_dicts(got["params"], wt.full_params(ref), "param after SGD")


def test_teardown_removes_namespaces_even_when_the_body_raises():
    from helpers.netns import unavailable_reason

    if unavailable_reason():
        pytest.skip(reason=unavailable_reason())
    hosts = TwoHosts.create()
    with pytest.raises(KeyboardInterrupt):
        with hosts:
            hosts._make_network()
            assert len(namespaces_with_suffix(hosts.suffix)) == 2
            raise KeyboardInterrupt
    assert namespaces_with_suffix(hosts.suffix) == []
