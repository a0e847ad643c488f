"""An optimizer is one `OPTIMIZERS` entry: registering a test optimizer (SGD) in this test
is enough for it to be accepted in process (`ember.ServiceClient`) and over HTTP (the
unmodified SDK against the real app on a real socket): its config at run creation, its
params at optim_step, and refusal of another optimizer's params."""

from __future__ import annotations

import threading
from typing import Literal

import pytest
import tinker
import torch
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase

import ember
from ember.engine.optimizers import OPTIMIZERS, Optimizer, OptimizerEntry
from helpers.datums import random_sft_datums

LR = 1e-2


class SGDConfig(OptimizerConfigBase, frozen=True, extra="forbid"):
    type: Literal["sgd"] = "sgd"
    damp: float = 0.0  # a field of the family's own: reaches the policy only via the entry's config type


class SGDParams(OptimParamsBase, frozen=True, extra="forbid"):
    type: Literal["sgd"] = "sgd"
    learning_rate: float
    grad_clip_norm: float = 0.0  # every params type has it: the engine clips before any policy


class SGD(Optimizer):
    """p <- p - lr * grad, a step counter as its only state."""

    slots = ("step",)

    def __init__(self, params, lora_rank=None) -> None:
        self.params = list(params)
        self._state = {p: {} for p in self.params}

    @property
    def state(self):
        return self._state

    def init_state(self, p):
        return {"step": torch.tensor(0.0)}

    def validate(self, params) -> None:
        if not params.learning_rate >= 0:
            raise ValueError(f"SGDParams.learning_rate={params.learning_rate} is out of range")

    @torch.no_grad()
    def step(self, params) -> None:
        for p in self.params:
            if p.grad is not None:
                self._state[p].setdefault("step", torch.tensor(0.0))
                self._state[p]["step"] += 1
                p.sub_(p.grad, alpha=params.learning_rate)


@pytest.fixture
def sgd(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "sgd", OptimizerEntry(SGD, SGDConfig, SGDParams))


def _train(tc) -> tuple[float, float, dict]:
    datums = random_sft_datums(2, vocab=84, seed=5)
    first = tc.forward_backward(datums, "cross_entropy").result()
    step = tc.optim_step(SGDParams(learning_rate=LR)).result()
    second = tc.forward(datums, "cross_entropy").result()
    return first.metrics["loss:sum"], second.metrics["loss:sum"], step.metrics


def test_a_registered_optimizer_works_in_process(sgd, tiny_model_dir, tmp_path):
    sc = ember.ServiceClient(models={"tiny": str(tiny_model_dir)}, data_dir=tmp_path / "data")
    try:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, optimizer=SGDConfig(damp=0.5)).result()
        before, after, metrics = _train(tc)
        assert metrics["step:max"] == 1.0 and after < before  # a small gradient step lowers the loss
        with pytest.raises(tinker.RequestFailedError, match="AdamParams.*sgd.*SGDParams"):
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        with pytest.raises(tinker.RequestFailedError, match="optimizer 'sgd': .*damp"):
            sc.create_lora_training_client(base_model="tiny", rank=4,
                                           optimizer=OptimizerConfigBase(type="sgd", damp="lots")).result()
    finally:
        sc.close("success")


def test_a_registered_optimizer_works_over_http(sgd, tiny_model_dir, tmp_path):
    import uvicorn

    from ember.server.app import create_app
    from ember.server.cli import bind_socket
    from ember.server.config import ServerConfig
    from ember.service import Service, ServiceConfig

    service = Service(ServiceConfig(data_dir=tmp_path / "data", models={"tiny": str(tiny_model_dir)}))
    app = create_app(service, ServerConfig(api_keys={"tml-sgd": "sgd-user"}), close_service=True)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", api_key="tml-sgd")
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, optimizer=SGDConfig()).result()
        before, after, metrics = _train(tc)
        assert metrics["step:max"] == 1.0 and after < before
        with pytest.raises(tinker.RequestFailedError, match="AdamParams.*sgd.*SGDParams"):
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    finally:
        server.should_exit = True
        thread.join(30)
