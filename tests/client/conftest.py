"""Fixtures for the in-process client tests."""

from __future__ import annotations

import pytest

import ember


@pytest.fixture
def make_client(tmp_path, tiny_model_dir):
    """ember.ServiceClient factory; the base model is registered under an HF-style name."""
    clients = []

    def make(data_dir=None, **kwargs) -> ember.ServiceClient:
        sc = ember.ServiceClient(models={"ember-test/tiny-qwen3": str(tiny_model_dir)},
                                 data_dir=data_dir or tmp_path / "data", **kwargs)
        clients.append(sc)
        return sc

    yield make
    for sc in clients:
        sc.close("success")
