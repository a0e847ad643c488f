"""Metrics: `record_metric(key, value, reduce)` with exact reductions, timing spans, sinks.

Reductions ("mean", "sum", "min", "max") compose across micro-batches, ranks and steps
because each key keeps (sum, count, min, max); see `ember.metrics.accumulator`.
Keys of Tinker results carry their reduction (`loss:sum`): `ember.metrics.keys`.
Sinks: console, JSONL, TensorBoard (optional `tensorboard`), W&B (optional `wandb`, off
unless configured).
"""

from ember.metrics.accumulator import REDUCTIONS, MetricAccumulator, Reduction, Stat
from ember.metrics.config import MetricsConfig, build_sinks
from ember.metrics.distributed import all_reduce_metrics
from ember.metrics.keys import join_metric_key, sdk_metric_key, split_metric_key
from ember.metrics.logger import MetricsLogger, get_logger, metric_prefix, record_metric, set_logger, span, use_logger
from ember.metrics.sinks import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink, WandbSink, read_jsonl

__all__ = [
    "REDUCTIONS",
    "ConsoleSink",
    "JsonlSink",
    "MetricAccumulator",
    "MetricSink",
    "MetricsConfig",
    "MetricsLogger",
    "Reduction",
    "Stat",
    "TensorBoardSink",
    "WandbSink",
    "all_reduce_metrics",
    "build_sinks",
    "get_logger",
    "join_metric_key",
    "metric_prefix",
    "read_jsonl",
    "record_metric",
    "sdk_metric_key",
    "set_logger",
    "span",
    "split_metric_key",
    "use_logger",
]
