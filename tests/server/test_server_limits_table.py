"""One table of every bound the server enforces, generated from the code: README's copy
is that output, every `Limits` field is in it with its doc, and max_lora_rank is one value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ember.config import field_docs
from ember.sampling.config import MAX_LORA_RANK, SamplerConfig
from ember.server.limits_table import limit_rows, markdown, readme_table
from ember.service.config import ServiceConfig
from ember.service.limits import Limits
from helpers.cli import run_cli

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_table_is_the_generated_one():
    assert readme_table(README.read_text()) == markdown(), \
        "README's limits table differs from the code: paste `ember limits --markdown` between its markers"


def test_every_limits_field_is_in_the_table_with_its_doc():
    docs = field_docs(Limits)
    rows = {name: (default, what) for name, default, what in limit_rows()}
    for f in dataclasses.fields(Limits):
        assert docs.get(f.name), f"Limits.{f.name} has no `name: text` docstring entry"
        assert rows[f"`--limits.{f.name}`"][0] == ("none" if f.default is None else str(f.default)), f.name
    for other in ("--max-body-mb", "--max-requests-per-key", "--checkpoints.max_ttl_s", "--sampler.max_len"):
        assert f"`{other}`" in rows, other


def test_ember_limits_prints_the_table():
    out = run_cli("limits", "--markdown")
    assert out.returncode == 0 and out.stdout == markdown(), out.stderr


def test_max_lora_rank_is_one_value(tmp_path):
    """The limit on a new run's rank and the sampler's adapter size are the same number."""
    assert Limits().max_lora_rank == SamplerConfig().max_lora_rank == MAX_LORA_RANK
    config = ServiceConfig(data_dir=tmp_path, limits=Limits(max_lora_rank=16))
    assert config.sampler.max_lora_rank == 16
