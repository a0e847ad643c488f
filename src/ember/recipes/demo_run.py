"""The demo's body (heavy imports live here, so `ember --help` stays fast)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ember.metrics import JsonlSink, MetricsLogger, TensorBoardSink, use_logger
from ember.recipes.demo import DEMO_MODEL_NAME, DemoSettings, settings_dict, write_json
from ember.recipes.digit_sum import ALPHABET, DigitSumEnv, DigitSumTask
from ember.recipes.grpo import GRPOConfig, train_grpo
from ember.recipes.plotting import plot_demo
from ember.recipes.progress import PhaseProgress
from ember.recipes.rl.rollouts import evaluate_greedy
from ember.recipes.sft import SFTConfig, train_sft


def build_demo_model(settings: DemoSettings, out_dir: Path) -> Path:
    """A random-weight Qwen3 (head_dim 32) with a one-token-per-character tokenizer."""
    from ember.models.testing import build_tiny_model

    heads = max(1, settings.hidden_size // 32)
    return build_tiny_model(
        out_dir, family="qwen3", seed=settings.seed, tokenizer_alphabet=ALPHABET,
        hidden_size=settings.hidden_size, num_layers=settings.num_layers,
        num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=32,
    )


def make_service_client(base_model: str, model_dir: Path, run_dir: Path) -> Any:
    """The in-process client; on a machine with CUDA the engine trains there in bf16."""
    import torch

    import ember

    models, data_dir = {base_model: str(model_dir)}, str(run_dir / "ember")
    if not torch.cuda.is_available():
        return ember.ServiceClient(models=models, data_dir=data_dir)
    from ember.engine.config import EngineConfig
    from ember.service.config import ServiceConfig

    engine = EngineConfig(device="cuda", dtype="bfloat16")
    return ember.ServiceClient(config=ServiceConfig(data_dir=data_dir, models=models, engine=engine))


class DemoData:
    """Held-out numbers, the labelled set, the RL environment (disjoint from both)."""

    def __init__(self, tokenizer, s: DemoSettings) -> None:
        self.task = DigitSumTask(tokenizer, s.min_digits, s.max_digits)
        held = self.task.numbers(s.heldout, seed=1_000_003 + s.seed)
        labelled = self.task.numbers(s.labels, seed=s.seed, exclude=held)
        self.examples = self.task.labelled_examples(labelled)
        self.env = DigitSumEnv(self.task, exclude=set(held) | set(labelled))
        self.heldout = [self.task.problem(n) for n in held]
        self.max_tokens = s.max_tokens

    def evaluate(self, sampling_client, step: int = 0) -> dict[str, float]:
        return {"heldout_acc": evaluate_greedy(sampling_client, self.env, self.heldout, self.max_tokens)}

    def accuracy(self, training_client) -> float:
        return self.evaluate(training_client.save_weights_and_get_sampling_client().result())["heldout_acc"]


def grpo_config(s: DemoSettings) -> GRPOConfig:
    return GRPOConfig(
        steps=s.grpo_steps, prompts_per_step=s.prompts_per_step, group_size=s.group_size,
        max_tokens=s.max_tokens, temperature=s.temperature, learning_rate=s.grpo_lr,
        lr_schedule=s.grpo_schedule, eval_every=s.eval_every, seed=s.seed, loss_fn=s.loss_fn,
        minibatches=s.minibatches, adam_beta2=s.grpo_beta2, max_staleness=s.max_staleness,
    )


def run_phases(service_client, base_model: str, s: DemoSettings, progress: PhaseProgress, control: bool) -> dict:
    out: dict[str, Any] = {}
    tc = service_client.create_lora_training_client(base_model=base_model, rank=s.lora_rank, seed=s.seed).result()
    data = DemoData(tc.get_tokenizer(), s)
    out["init_accuracy"] = data.accuracy(tc)
    progress.print(f"held-out exact match at random init: {out['init_accuracy']:.3f}")
    warmup = SFTConfig(steps=s.sft_steps, batch_size=s.sft_batch, learning_rate=s.sft_lr, seed=s.seed)
    train_sft(tc, data.examples, warmup, prefix="sft/",
              on_step=progress.phase("SFT warm-up", s.sft_steps, {"sft/loss": "loss"}))
    out["sft_accuracy"] = data.accuracy(tc)
    progress.print(f"held-out exact match after SFT warm-up on {s.labels} labels: {out['sft_accuracy']:.3f}")
    # GRPO and the control both start from the warm-up weights with a fresh optimizer.
    warmup_path = tc.save_state("sft-warmup").result().path
    rl_tc = service_client.create_training_client_from_state(warmup_path).result()
    fields = {"grpo/reward": "reward", "grpo/heldout_acc": "held-out acc", "grpo/loss": "loss"}
    final = train_grpo(rl_tc, data.env, grpo_config(s), on_step=progress.phase("GRPO", s.grpo_steps, fields),
                       evaluate=data.evaluate, prefix="grpo/")
    out["grpo_accuracy"] = data.evaluate(final)["heldout_acc"]
    progress.print(f"held-out exact match after GRPO: {out['grpo_accuracy']:.3f}")
    if control:
        ctc = service_client.create_training_client_from_state(warmup_path).result()
        control_cfg = SFTConfig(steps=s.control_steps, batch_size=s.control_batch, learning_rate=s.control_lr,
                                lr_schedule=s.grpo_schedule, seed=s.seed + 1, eval_every=s.eval_every)
        train_sft(ctc, data.examples, control_cfg, prefix="control/",
                  on_step=progress.phase("SFT-only control", s.control_steps,
                                         {"control/loss": "loss", "control/heldout_acc": "held-out acc"}),
                  evaluate=data.evaluate)
        out["control_accuracy"] = data.accuracy(ctc)
        out["margin_over_control"] = out["grpo_accuracy"] - out["control_accuracy"]
    out["gain_over_sft"] = out["grpo_accuracy"] - out["sft_accuracy"]
    return out


def summary_table(summary: dict[str, Any], s: DemoSettings) -> Table:
    table = Table(title=f"held-out exact match ({s.heldout} numbers, greedy)")
    table.add_column("model")
    table.add_column("accuracy", justify="right")
    rows = [("random init", "init_accuracy"), (f"SFT warm-up ({s.sft_steps} steps, {s.labels} labels)", "sft_accuracy"),
            (f"+ GRPO ({s.grpo_steps} steps, unlabelled prompts)", "grpo_accuracy"),
            (f"+ SFT-only control ({s.control_steps} more steps, same labels)", "control_accuracy")]
    for label, key in rows:
        if key in summary:
            table.add_row(label, f"{summary[key]:.3f}")
    if "margin_over_control" in summary:
        table.add_row("[bold]GRPO margin over the control", f"[bold]{summary['margin_over_control']:+.3f}")
    return table


def run_demo(settings: DemoSettings, run_dir: Path, model_dir: str | None = None, live: bool | None = None,
             control: bool = True, console: Console | None = None) -> dict[str, Any]:
    """Build (or load) the model, run SFT, GRPO and the control; write metrics, plot, summary."""
    console = console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    _quiet_libraries()
    start = time.perf_counter()
    if model_dir is None:
        model_path, base_model = build_demo_model(settings, run_dir / "model"), DEMO_MODEL_NAME
    else:
        model_path, base_model = Path(model_dir).resolve(), Path(model_dir).resolve().name
    write_json(run_dir / "settings.json", {**settings_dict(settings), "model": str(model_path)})
    console.print(f"[bold]ember demo[/]: digit sums with SFT then GRPO; run directory {run_dir}")
    logger = MetricsLogger([JsonlSink(run_dir / "metrics.jsonl"), TensorBoardSink(run_dir / "tensorboard")])
    service_client = make_service_client(base_model, model_path, run_dir)
    try:
        with use_logger(logger), PhaseProgress(console, live=live) as progress:
            summary = run_phases(service_client, base_model, settings, progress, control)
    finally:
        logger.close()
        _close(service_client)
    summary["wall_time_s"] = round(time.perf_counter() - start, 1)
    summary["completed"] = True
    write_json(run_dir / "summary.json", summary)
    plot = plot_demo(run_dir / "metrics.jsonl", run_dir / "plot.png", summary)
    console.print(summary_table(summary, settings))
    console.print(f"wall time {summary['wall_time_s']:.0f} s")
    console.print(f"metrics      {run_dir / 'metrics.jsonl'}\ntensorboard  {run_dir / 'tensorboard'}  "
                  f"(tensorboard --logdir {run_dir / 'tensorboard'})\nplot         {plot}\n"
                  f"summary      {run_dir / 'summary.json'}")
    return summary


def _quiet_libraries() -> None:
    """No per-file progress bars from transformers/huggingface_hub under ours."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")


def _close(service_client) -> None:
    close = getattr(service_client, "close", None)
    if callable(close):
        close("success")
