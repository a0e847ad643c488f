"""Counter-based random numbers: u = f(seed, sample index, step), no RNG state anywhere.

Why not a `torch.Generator` per request: the draw of one sequence must not depend on
which other sequences share its batch, and the decode step must stay one vectorised
operation for the whole batch. A stateless hash of (key, step) gives both: every row
gets its own uniform in one numpy call, and the same (seed, sample, step) always gives
the same number, on CPU and on CUDA alike. SplitMix64 (Steele et al., 2014) is the mixer;
its output passes BigCrush and is the standard seeding function of xoshiro generators.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sample_keys(seed: int, num_samples: int) -> np.ndarray:
    """One uint64 key per sample of a request: sample i of seed s is independent of sample j."""
    base = splitmix64(np.array([seed], dtype=np.uint64))
    return splitmix64(base + np.arange(num_samples, dtype=np.uint64))


def uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A float64 uniform in [0, 1) for each (key, step) pair (53 random bits)."""
    z = splitmix64(keys ^ splitmix64(np.asarray(steps, dtype=np.uint64)))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
