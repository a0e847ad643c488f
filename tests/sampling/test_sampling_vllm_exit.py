"""A process that used the vLLM sampler exits cleanly: no traceback from vLLM's
`AsyncLLM.__del__` at interpreter exit, whether or not it closed the sampler.

One child process proves both endings: it samples from two samplers, closes one (the
model in a worker process of its own, `SamplerConfig.cpu_worker="process"`; the other
tests run the default "inline" engine) and exits with the other ("inline") still running.
Each child pays for importing vLLM (about as much CPU as an engine start), so the two
endings share one child rather than one child each."""

from __future__ import annotations

import subprocess
import sys

import pytest


pytestmark = [pytest.mark.slow,  # two vLLM engine starts (20-50 s idle each; minutes on a loaded machine)
              pytest.mark.timeout(1200),
              pytest.mark.needs_vllm]

SCRIPT = '''
import sys

from tinker import types


def main():
    from ember.sampling import SamplerConfig, VLLMSampler

    # both engines start in the background on construction, side by side
    samplers = {worker: VLLMSampler.from_pretrained(sys.argv[1], SamplerConfig(
        backend="vllm", max_slots=2, max_len=64, cpu_worker=worker)) for worker in ("process", "inline")}
    for worker, sampler in samplers.items():
        out = sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2), timeout=900)
        print("sampled:", worker, out.sequences[0].tokens)
    samplers["process"].close()
    # "inline" is never closed by its owner: the process exits with that engine running


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing
    main()
'''


# endings: "close" (the process-worker sampler is closed before exit), "exit" (the inline
# one is left running at exit); both in the one child above
def test_a_process_that_sampled_with_vllm_exits_without_a_traceback(tiny_vllm_model_dir, tmp_path):
    script = tmp_path / "sample_with_vllm.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_vllm_model_dir)],
                          capture_output=True, text=True, timeout=1100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sampled:" in proc.stdout, proc.stdout[-2000:]
    assert proc.stdout.count("sampled:") == 2, proc.stdout[-2000:]  # both endings' samplers sampled
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
