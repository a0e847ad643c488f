"""Metrics: `record_metric(key, value, reduce)` with exact reductions, timing spans, sinks.

Reductions ("mean", "sum", "min", "max") compose across micro-batches, ranks and steps
because each key keeps (sum, count, min, max); see `ember.metrics.accumulator`.
Keys of Tinker results carry their reduction (`loss:sum`): `ember.metrics.keys`.
Sinks: console, JSONL, TensorBoard (optional `tensorboard`), W&B (optional `wandb`, off
unless configured).

Each name is imported on first use (`ember.registry.lazy_exports`): `ember.metrics.keys`
loads without torch.
"""

from ember.registry import lazy_exports

_EXPORTS = {
    "REDUCTIONS": "ember.metrics.accumulator",
    "ConsoleSink": "ember.metrics.sinks",
    "JsonlSink": "ember.metrics.sinks",
    "MetricAccumulator": "ember.metrics.accumulator",
    "MetricSink": "ember.metrics.sinks",
    "MetricsConfig": "ember.metrics.config",
    "MetricsLogger": "ember.metrics.logger",
    "Reduction": "ember.metrics.accumulator",
    "Stat": "ember.metrics.accumulator",
    "TensorBoardSink": "ember.metrics.sinks",
    "WandbSink": "ember.metrics.sinks",
    "all_reduce_metrics": "ember.metrics.distributed",
    "build_sinks": "ember.metrics.config",
    "get_logger": "ember.metrics.logger",
    "join_metric_key": "ember.metrics.keys",
    "metric_prefix": "ember.metrics.logger",
    "read_jsonl": "ember.metrics.sinks",
    "record_metric": "ember.metrics.logger",
    "sdk_metric_key": "ember.metrics.keys",
    "set_logger": "ember.metrics.logger",
    "span": "ember.metrics.logger",
    "split_metric_key": "ember.metrics.keys",
    "use_logger": "ember.metrics.logger",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
