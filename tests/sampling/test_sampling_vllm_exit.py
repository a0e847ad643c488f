"""A process that used the vLLM sampler exits cleanly: no traceback from vLLM's
`AsyncLLM.__del__` at interpreter exit, whether or not it closed the sampler."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember.sampling.registry import backend_missing

pytestmark = [pytest.mark.slow,  # two vLLM engine starts (20-50 s each)
              pytest.mark.skipif(backend_missing("vllm") is not None, reason=str(backend_missing("vllm")))]

SCRIPT = '''
import sys

from tinker import types


def main():
    from ember.sampling import SamplerConfig, VLLMSampler

    cfg = SamplerConfig(backend="vllm", max_slots=2, max_len=64)
    params = types.SamplingParams(max_tokens=2)
    closed = VLLMSampler.from_pretrained(sys.argv[1], cfg)
    print("closed sampler:", closed.sample(types.ModelInput.from_ints([5, 6]), 1, params, timeout=600).sequences[0].tokens)
    closed.close()
    left_open = VLLMSampler.from_pretrained(sys.argv[1], cfg)  # its owner never closes it
    print("open sampler:", left_open.sample(types.ModelInput.from_ints([5, 6]), 1, params, timeout=600).sequences[0].tokens)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing
    main()
'''


def test_a_process_that_sampled_with_vllm_exits_without_a_traceback(tiny_vllm_model_dir, tmp_path):
    script = tmp_path / "sample_with_vllm.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_vllm_model_dir)], capture_output=True, text=True,
                          timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "closed sampler:" in proc.stdout and "open sampler:" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-4000:]
