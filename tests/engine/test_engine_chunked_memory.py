"""A datum that fits only with the chunked policy head does fit: the engine runs in a fresh
process (`ember.engine.memory_probe`) whose address space is capped, as `prlimit --as`
would, at its size after the imports plus a budget between the estimated peaks of the two
paths; the unchunked path fails with an out-of-memory error, the chunked one completes.

Model: vocabulary 32,000, hidden 128, one layer; one 2,048-token datum, LoRA rank 4.
Unchunked, the (T, vocab) logits, their fp32 log-softmax and gradients take ~0.9 GB;
chunked by 512 tokens ~0.22 GB (each chunk tensor over glibc's 32 MiB mmap threshold, so
a freed chunk goes back to the system rather than fragmenting the heap). A smaller case
(1,024 tokens) left too little room for the address space's own overhead.
"""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from ember.engine import EngineConfig
from ember.engine.estimate import estimate_memory
from ember.models.testing import tiny_config

pytestmark = pytest.mark.slow
TOKENS, CHUNK = 2048, 512


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("wide-vocab")
    cfg = tiny_config("qwen3", vocab_size=32000, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=64, max_position_embeddings=4096)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def probe(model_dir, chunk: int, as_extra: int) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "ember.engine.memory_probe", "--model", str(model_dir), "--tokens", str(TOKENS),
           "--chunk", str(chunk), "--lora-rank", "4", "--steps", "1", "--as-extra", str(as_extra)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = r.stdout.strip().splitlines()
    assert lines, f"probe printed nothing (rc {r.returncode}): {r.stderr[-2000:]}"
    return r.returncode, json.loads(lines[-1])


def test_long_datum_fits_only_when_chunked(wide_vocab_dir):
    est = {c: estimate_memory(wide_vocab_dir, engine=EngineConfig(logprob_chunk_tokens=c), tokens=TOKENS,
                              lora_rank=4).peak for c in (0, CHUNK)}
    assert est[0] > 2.5 * est[CHUNK], est
    budget = (est[0] + est[CHUNK]) // 2
    rc, chunked = probe(wide_vocab_dir, CHUNK, budget)
    assert rc == 0 and "oom" not in chunked, chunked
    assert chunked["model_peak"] < budget
    rc, unchunked = probe(wide_vocab_dir, 0, budget)
    assert rc == 3 and unchunked["oom"], (rc, unchunked)


def _own_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_probe_peak_is_its_own_not_its_parents(tiny_model_dir):
    """Linux carries ru_maxrss across execve, so a probe whose peak were `ru_maxrss` would
    report at least this (pytest) process's peak; with 768 MB more touched here first, the
    probe's own peak (a tiny model, 16 tokens) must stay well below it."""
    ballast = bytearray(768 << 20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # resident, not just reserved
    parent_peak = _own_hwm()
    cmd = [sys.executable, "-m", "ember.engine.memory_probe", "--model", str(tiny_model_dir), "--tokens", "16",
           "--chunk", "8", "--steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    del ballast
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rss_before_load"] <= got["peak_rss"] < parent_peak - (512 << 20), (got, parent_peak)
