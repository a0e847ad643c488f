"""Reduction across ranks: two gloo processes give what one process recording everything gives."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.metrics import MetricAccumulator, MetricsLogger

VALUES = {0: [1.0, 2.0, 3.0], 1: [10.0]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        logger = MetricsLogger(sync_ranks=True)
        for v in VALUES[rank]:  # micro-batches on this rank
            logger.record("loss", v, "mean")
            logger.record("tokens", v, "sum")
            logger.record("lo", v, "min")
            logger.record("hi", v, "max")
        if rank == 1:
            logger.record("only_rank1", 5.0, "max")
        summary = logger.flush(0)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(repr(sorted(summary.items())))
    finally:
        dist.destroy_process_group()


def test_all_reduce_matches_single_process(tmp_path):
    # fork: the children reuse the imported torch (spawn would re-import it, ~10 s on 2 busy cores)
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    expected = MetricAccumulator()
    for values in VALUES.values():
        for v in values:
            for key, reduce in (("loss", "mean"), ("tokens", "sum"), ("lo", "min"), ("hi", "max")):
                expected.record(key, v, reduce)
    expected.record("only_rank1", 5.0, "max")
    want = sorted(expected.summary().items())
    assert dict(want)["loss"] == pytest.approx(4.0)  # (1+2+3+10)/4, not the mean of rank means (6.0)
    for rank in (0, 1):
        got = eval((tmp_path / f"rank{rank}.txt").read_text())
        assert [k for k, _ in got] == [k for k, _ in want]
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-12)


def test_without_a_process_group_it_is_local():
    acc = MetricAccumulator()
    acc.record("x", 2.0)
    from ember.metrics import all_reduce_metrics

    assert all_reduce_metrics(acc).summary() == {"x": 2.0}
