"""A process that used the vLLM sampler exits cleanly: no traceback from vLLM's
`AsyncLLM.__del__` at interpreter exit, whether or not it closed the sampler."""

from __future__ import annotations

import subprocess
import sys

import pytest


pytestmark = [pytest.mark.slow,  # a vLLM engine start (20-50 s idle; minutes on a loaded machine)
              pytest.mark.timeout(1200),
              pytest.mark.needs_vllm]

SCRIPT = '''
import sys

from tinker import types


def main():
    from ember.sampling import SamplerConfig, VLLMSampler

    config = SamplerConfig(backend="vllm", max_slots=2, max_len=64, cpu_worker=sys.argv[3])
    sampler = VLLMSampler.from_pretrained(sys.argv[1], config)
    out = sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2), timeout=900)
    print("sampled:", out.sequences[0].tokens)
    if sys.argv[2] == "close":
        sampler.close()  # else its owner never closes it: the process exits with the engine running


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing
    main()
'''


# the model in a worker process of its own on one of them (SamplerConfig.cpu_worker; the
# other tests run the default "inline" engine)
@pytest.mark.parametrize("ending,cpu_worker", [("close", "process"), ("exit", "inline")])
def test_a_process_that_sampled_with_vllm_exits_without_a_traceback(ending, cpu_worker, tiny_vllm_model_dir,
                                                                     tmp_path):
    script = tmp_path / "sample_with_vllm.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_vllm_model_dir), ending, cpu_worker],
                          capture_output=True, text=True, timeout=1100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sampled:" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
