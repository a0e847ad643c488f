"""`ember hub-link ID DIR` (ember.models.hub_link): a local model directory answers to a hub id
in the Hugging Face cache, offline, without being copied; bad ids, directories and real
downloads are refused naming what was wrong."""

from __future__ import annotations

import os

import pytest
from transformers import AutoConfig, AutoTokenizer

from ember.cli import main
from ember.models.hub_link import HubLinkError, link_into_cache, revision_of
from ember.models.testing import build_tiny_model

REPO = "Qwen/Qwen3.5-9B-Base"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hub") / "model", tokenizer="bytes", head_dim=32)


def load_offline(cache, repo=REPO):
    """What a recipe's `get_tokenizer(repo)` does with HF_HUB_OFFLINE=1 (local files only)."""
    tok = AutoTokenizer.from_pretrained(repo, cache_dir=str(cache), local_files_only=True)
    return tok, AutoConfig.from_pretrained(repo, cache_dir=str(cache), local_files_only=True)


def test_the_hub_id_resolves_to_the_directory_offline(model_dir, tmp_path):
    snapshot = link_into_cache(REPO, model_dir, tmp_path / "cache")
    tok, config = load_offline(tmp_path / "cache")
    direct = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.encode("Sum the digits of 42: <|im_end|>") == direct.encode("Sum the digits of 42: <|im_end|>")
    assert config.vocab_size == AutoConfig.from_pretrained(str(model_dir)).vocab_size
    links = sorted(p.name for p in snapshot.iterdir())
    assert "config.json" in links and all((snapshot / n).is_symlink() for n in links)  # nothing copied
    assert os.path.realpath(snapshot / "config.json") == str((model_dir / "config.json").resolve())


def test_linking_again_is_idempotent_and_another_directory_replaces_it(model_dir, tmp_path):
    cache = tmp_path / "cache"
    first = link_into_cache(REPO, model_dir, cache)
    assert link_into_cache(REPO, model_dir, cache) == first
    other = build_tiny_model(tmp_path / "other", tokenizer="bytes", head_dim=32, hidden_size=96, num_heads=3)
    second = link_into_cache(REPO, other, cache)
    assert second.name == revision_of(other.resolve()) != first.name and not first.exists()
    assert load_offline(cache)[1].hidden_size == 96


@pytest.mark.parametrize("repo_id", ["Qwen", "../Qwen/x", "Qwen/../x", "a/b/c", "/abs/x", "Qwen/x y", ".hidden/x"])
def test_a_bad_hub_id_is_refused(model_dir, tmp_path, repo_id):
    with pytest.raises(HubLinkError, match="hub id must look like ORG/NAME"):
        link_into_cache(repo_id, model_dir, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(HubLinkError, match="does not exist"):
        link_into_cache(REPO, tmp_path / "missing", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HubLinkError, match="has no config.json"):
        link_into_cache(REPO, tmp_path / "empty", tmp_path / "cache")


def test_a_real_download_in_the_cache_is_never_replaced(model_dir, tmp_path):
    snap = tmp_path / "cache" / "models--Qwen--Qwen3.5-9B-Base" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")  # a real file, as a download leaves it
    with pytest.raises(HubLinkError, match="downloaded from the hub"):
        link_into_cache(REPO, model_dir, tmp_path / "cache")
    assert (snap / "config.json").read_text() == "{}"


def test_the_command_links_and_says_how_to_serve(model_dir, tmp_path, capsys):
    assert main(["hub-link", REPO, str(model_dir), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert f"ember serve --model {REPO}=" in out and "HF_HUB_OFFLINE=1" in out
    assert load_offline(tmp_path / "cache")[0] is not None
    assert main(["hub-link", "not-an-id", str(model_dir), "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "hub id must look like ORG/NAME" in capsys.readouterr().err
