"""`ember serve --sampler.*`: every SamplerConfig field is a flag, bad values exit 2 naming
the key before anything starts, and the sampler's max_len is what the flag says."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from tinker import types

import ember
from ember.sampling.config import SamplerConfig
from ember.config import settings
from ember.server.cli import add_arguments, load_serve_config

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _help() -> str:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.format_help()


def test_every_sampler_field_is_a_flag_and_reaches_the_service_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # registered models are checked at start-up
    import dataclasses

    # every field but max_lora_rank, which is limits.max_lora_rank in a service (one value),
    # logprob_chunk_tokens, which follows engine.logprob_chunk_tokens (one value), and
    # batch_invariant, which follows engine.batch_invariant (one value)
    keys = {s.key for s in settings(SamplerConfig)}  # a backend's own settings under its section: "vllm.<name>"
    assert {key.rsplit(".", 1)[-1] for key in keys} == (
        {f.name for f in dataclasses.fields(SamplerConfig)} - {"max_lora_rank", "logprob_chunk_tokens",
                                                                "batch_invariant"})
    assert all(f"--sampler.{key}" in _help() for key in keys)
    args = _parse(["--model", f"a={tmp_path}", "--data-dir", str(tmp_path), "--sampler.max_len", "4096",
                   "--sampler.backend", "torch", "--sampler.enable_prefix_caching", "false",
                   "--sampler.device", "none", "--sampler.kv_cache_gb", "2"])
    cfg = load_serve_config(args).service.sampler
    assert cfg == SamplerConfig(max_len=4096, enable_prefix_caching=False, device=None, kv_cache_gb=2.0)


@pytest.mark.parametrize("flag, value, named", [
    ("--sampler.max_len", "abc", "max_len"),          # wrong type
    ("--sampler.max_len", "1", "max_len"),            # bad value
    ("--sampler.logprobs_mode", "fancy", "logprobs_mode"),
    ("--sampler.backend", "sglang", "backend"),       # unknown backend: the known ones are listed
    ("--sampler.cpu_worker", "../../bin/sh", "cpu_worker"),  # only "inline" or "process"
])
def test_bad_sampler_flags_exit_2_naming_the_key(tmp_path, flag, value, named):
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--model", f"a={tmp_path}",
                           "--data-dir", str(tmp_path / "d"), flag, value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ember serve:")]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    if value == "sglang":
        assert "torch" in lines[0] and "vllm" in lines[0]


def test_max_len_lets_a_long_prompt_through(tmp_path):
    from ember.models.testing import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "long", family="qwen3", seed=0, max_position_embeddings=8192)
    sc = ember.ServiceClient(models={"long": str(model_dir)}, data_dir=tmp_path / "data", sampler={"max_len": 4096})
    try:
        sampler = sc.create_sampling_client(base_model="long")
        ok = sampler.sample(types.ModelInput.from_ints([5] * 3000), 1, types.SamplingParams(max_tokens=2)).result()
        seq = ok.sequences[0]  # accepted and sampled; a random model may draw EOS first (CI did, once)
        assert (seq.stop_reason, len(seq.tokens)) in (("length", 2), ("stop", 1), ("stop", 2))
        with pytest.raises(Exception, match=r"fewer than 4096 tokens"):
            sampler.sample(types.ModelInput.from_ints([5] * 4100), 1, types.SamplingParams(max_tokens=2)).result()
    finally:
        sc.close("success")


def test_service_client_sampler_dict_names_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="sampler.bogus"):
        ember.ServiceClient(models={}, data_dir=tmp_path, sampler={"bogus": 1})
