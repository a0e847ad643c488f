"""How ember starts its local child processes: worker ranks (`ember.workers.process`) and
sampler replicas (`ember.sampling.local_replica`) fork from multiprocessing's forkserver.

The forkserver is one clean, single-threaded process per parent that imports `PRELOAD`
once; each child is a fork of it. So a child inherits none of the caller's threads or
locks (a plain fork's hazard) and no CUDA state (the server never touches a device), and
pays none of the 5-10 s of imports (torch, transformers, ember) that `spawn` repeats per
child. The server starts on first use and keeps the environment of that moment: a child
sees `os.environ` as it was then, not as it is when the child starts.
"""

from __future__ import annotations

import multiprocessing

# What a rank or a replica imports first; either kind of child then finds it loaded.
PRELOAD = ("torch", "torch.distributed", "ember.workers.worker", "ember.engine.torch_engine",
           "ember.sampling.replica")


def context(preload: tuple[str, ...] = PRELOAD):
    """The forkserver context; `preload` counts only if the server has not started yet."""
    mp = multiprocessing.get_context("forkserver")
    mp.set_forkserver_preload(list(preload))
    return mp
