"""`name:reduction` keys: one helper builds, reads and repairs them (ember.metrics.keys)."""

import pytest

from ember.metrics import join_metric_key, sdk_metric_key, split_metric_key


@pytest.mark.parametrize("key, want", [
    ("loss:sum", ("loss", "sum")), ("a:b:max", ("a:b", "max")), ("grad_norm:mean", ("grad_norm", "mean")),
    ("plain", ("plain", None)), ("x:median", ("x:median", None)), (":sum", (":sum", None)),
])
def test_split_reads_only_known_reductions(key, want):
    assert split_metric_key(key) == want


def test_join_and_split_round_trip_and_sdk_keys_have_one_colon():
    for reduce in ("mean", "sum", "min", "max"):
        assert split_metric_key(join_metric_key("clip/frac", reduce)) == ("clip/frac", reduce)
    for key in ("loss", "a:b:c", ":x", "x:", "::"):
        assert sdk_metric_key(key).count(":") == 1, key
