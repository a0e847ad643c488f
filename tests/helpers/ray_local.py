"""One local Ray cluster per pytest worker, for the test files that run Ray actors.

`ray.init` of a local cluster costs ~10 s (its GCS, raylet and agent processes on a 2-core
machine), and four files used to start and stop their own. The session fixture
`ray_cluster` (tests/conftest.py) hands them this object: `start()` brings the cluster up
on first use (a file whose Ray cases are deselected starts nothing). `helpers.scheduling`
keeps those files on one worker, one after another, so one cluster serves all; it is
stopped after the last test that takes it (`helpers.scheduling.stop_finished`: its daemons
would otherwise idle on for the rest of the worker's run), or at the session's end. Each
file still removes what it made (its actors, worker groups and pools).
"""

from __future__ import annotations

NUM_CPUS = 2  # one per rank or replica; the files ask for at most two at a time


class LocalRay:
    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
        self.started = True

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
