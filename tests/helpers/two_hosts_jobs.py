"""Jobs the two-host tests run *inside* the head's network namespace (`python -m
helpers.two_hosts_jobs <job> ...`): a Ray driver must sit on a host of the cluster, and
the namespaces have no route to the test's own. Each job writes its results (`torch.save`
or JSON) to the path it is given; the test, in its own process, makes the assertions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np

import torch

from helpers import ranks as wt
from helpers.datums import random_rl_datums, random_sft_datums
from helpers.server import wait_until

SGD_LR = 1e-3


def fsdp_batches():
    """Odd sizes, skewed lengths, an RL loss (as tests/engine/test_engine_parallel.py)."""
    return [
        (random_sft_datums(5, vocab=84, min_len=2, max_len=14, seed=1), "cross_entropy"),
        (random_rl_datums(3, vocab=84, seed=5), "importance_sampling"),
    ]


def fsdp(model_dir: str, out: str) -> None:
    """One FSDP2 rank on each host (dp_shard=2, STRICT_SPREAD): per batch the loss outputs
    and full gradients, then an SGD step; finally the full parameters and each rank's node."""
    from ember.engine import EngineConfig
    from ember.engine.parallel import ParallelismConfig
    from ember.workers import EngineSpec, GroupEngine, WorkerGroup

    group = WorkerGroup.create("ray", world_size=2, call_timeout_s=300, address=os.environ["RAY_ADDRESS"],
                               strategy="STRICT_SPREAD", init_kwargs={"log_to_driver": False})
    try:
        spec = EngineSpec(model_dir, EngineConfig(micro_batch_tokens=16), ParallelismConfig(dp_shard=2))
        eng = GroupEngine.create(group, "fsdp", spec)
        results = {"nodes": group.run_per_rank(None, wt.node_ip), "steps": []}
        for datums, loss in fsdp_batches():
            output = eng.forward_backward(datums, loss)
            results["steps"].append({"output": output, "grads": group.run("fsdp", wt.full_grads)})
            group.run("fsdp", wt.sgd_step, SGD_LR)
        results["params"] = group.run("fsdp", wt.full_params)
        torch.save(results, out)
    finally:
        group.shutdown()


# ---------------------------------------------------------------- the server, through the SDK
REPLICA_UP = re.compile(r"sampler replica (\d+) up \(pid (\d+)")
PROMPT = [5, 17, 30, 42, 8, 61]
SESSIONS = 8  # per mode; with --sampler.max_imbalance 0 and concurrent first requests both replicas get some


def replicas_up(server) -> dict[int, int]:
    """slot -> pid of the latest `sampler replica N up (pid P` line of the server's log."""
    return {int(m[1]): int(m[2]) for m in REPLICA_UP.finditer(server.stderr_path.read_text())}


def forward_logprobs(tc, tokens: list[int]) -> np.ndarray:
    from helpers.server import sft_datum

    return tc.forward([sft_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def worst_vs_forward(tc, response) -> float:
    """Largest |sampler logprob - trainer forward logprob| over the response's tokens."""
    worst = 0.0
    for seq in response.sequences:
        want = forward_logprobs(tc, PROMPT + list(seq.tokens))[len(PROMPT) - 1:]
        worst = max(worst, float(np.abs(np.asarray(seq.logprobs) - want).max()))
    return worst


def sample(client, max_tokens: int, seed: int, n: int = 1):
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, seed=seed, stop=[])
    return client.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=n, sampling_params=params)


def outcome(future, timeout: float) -> dict:
    import tinker

    try:
        return {"ok": True, "response": future.result(timeout=timeout)}
    except tinker.RequestFailedError as exc:
        return {"ok": False, "category": str(getattr(exc.category, "value", exc.category)), "message": exc.message}
    except TimeoutError:
        return {"ok": False, "category": "no answer", "message": f"no answer in {timeout} s"}


def train_and_sample(sc, mode: str, base_url: str) -> tuple[object, list, dict]:
    """One SFT step on a LoRA or full run, `SESSIONS` sampling clients of its weights
    (`save_weights_and_get_sampling_client`), their first samples sent together."""
    from tinker import types

    from helpers.server import MODEL_NAME, sft_datum

    tc = (sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=11).result() if mode == "lora"
          else full_training_client(sc, base_url))
    tc.forward_backward([sft_datum([5, 6, 7, 8, 9, 10]), sft_datum([11, 12, 13, 14])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    clients = [tc.save_weights_and_get_sampling_client() for _ in range(SESSIONS)]
    firsts = [sample(c, 8, seed=i, n=2) for i, c in enumerate(clients)]
    worst = [worst_vs_forward(tc, f.result(timeout=300)) for f in firsts]
    return tc, clients, {"worst": worst}


def full_training_client(sc, base_url: str):
    """A full fine-tuning run (the SDK makes only LoRA runs; the protocol allows both)."""
    import httpx
    import tinker
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    from helpers.server import API_KEY, MODEL_NAME

    holder, seq = sc.holder, sc.holder.get_training_client_id()
    body = {"session_id": holder.get_session_id(), "model_seq_id": seq, "base_model": MODEL_NAME}
    with httpx.Client(base_url=base_url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60) as http:
        rid = http.post("/create_model", json=body).json()["request_id"]
        while (res := http.post("/retrieve_future", json={"request_id": rid}).json()).get("type") == "try_again":
            pass
    assert "error" not in res, res
    info = holder.run_coroutine_threadsafe(fetch_training_info(holder, res["model_id"])).result(60)
    return tinker.TrainingClient(holder, model_seq_id=seq, model_id=res["model_id"], info=info)


def kill_remote_mid_request(server, tc, clients, worker_ns: str, head_ns: str) -> dict:
    """Long requests on every session, then SIGKILL of the worker host's replica: which
    sessions failed (and how), which finished; the replacement's start; then each failed
    session's next request while the head's replica is stopped (SIGSTOP) with a request
    of its own in flight, so the router sends it to the replacement, the only one that
    can answer."""
    from helpers.netns import pids_running

    up = replicas_up(server)
    remote = [slot for slot, pid in up.items() if pid in pids_running(worker_ns, "_ReplicaActor")]
    local = [slot for slot, pid in up.items() if pid in pids_running(head_ns, "_ReplicaActor")]
    result = {"up_before": up, "remote_slots": remote, "local_slots": local}
    futures = [sample(c, 900, seed=100 + i, n=4) for i, c in enumerate(clients)]
    time.sleep(2.0)  # every request has reached its replica (4 x 900 tokens take far longer)
    os.kill(up[remote[0]], signal.SIGKILL)
    outcomes = [outcome(f, 300) for f in futures]
    result["outcomes"] = [{k: v for k, v in o.items() if k != "response"} for o in outcomes]
    result["finished_worst"] = [worst_vs_forward(tc, o["response"]) for o in outcomes if o["ok"]]
    new_pid = wait_until(lambda: replicas_up(server).get(remote[0]) not in (None, up[remote[0]])
                         and replicas_up(server)[remote[0]], 300, interval=0.5, message="the replacement replica")
    result["replacement_pid"], result["replacement_on_worker"] = new_pid, new_pid in pids_running(worker_ns, "_ReplicaActor")
    failed = [c for c, o in zip(clients, outcomes) if not o["ok"]]
    on_head = next(c for c, o in zip(clients, outcomes) if o["ok"])  # placed on the head's replica (sticky)
    os.kill(up[local[0]], signal.SIGSTOP)  # the head's replica cannot answer: only the replacement can
    try:
        # A request stuck on the head's replica: with --sampler.max_imbalance 0, every session
        # placed from now on goes to the replacement (its home, or spilled there), failed ones too.
        blocker = sample(on_head, 8, seed=5)
        time.sleep(1.0)
        nexts = [outcome(sample(c, 8, seed=7), 150) for c in failed]  # one at a time
    finally:
        os.kill(up[local[0]], signal.SIGCONT)
    result["blocker_ok"] = outcome(blocker, 150)["ok"]
    result["next"] = [{k: v for k, v in o.items() if k != "response"} for o in nexts]
    result["next_worst"] = [worst_vs_forward(tc, o["response"]) for o in nexts if o["ok"]]
    return result


# GRPO against the two-host server (`ember train sft` then `ember train grpo --init_from`):
# digit sums of 1-2 digit numbers with partial credit (0.3 for a well-formed wrong answer),
# which a short SFT start leaves at a reward of ~0.17-0.19 and GRPO raises as the format
# takes. Calibrated in process (TorchSampler, this model, 2-core CPU) on seeds 0-4: SFT
# 10 steps (loss 4.4 -> 1.3..1.9), then 12 GRPO steps of 8 prompts x 8 samples at LR 1e-3:
# mean of the last 3 steps minus the first 3 = +0.07..+0.11 (per-step sd ~0.03).
GRPO_SFT_STEPS, GRPO_STEPS, GRPO_SEED = 10, 12, 0
GRPO_ENV_ARGS = "{min_digits = 1, max_digits = 2, partial_credit = true}"


def grpo(base_url: str, workdir: Path) -> dict:
    """`ember train sft` (40 labelled digit sums) then `ember train grpo` from its state,
    both through the official SDK against `base_url`: GRPO's per-step rewards, wall times."""
    import contextlib
    import io
    import random

    from ember.cli import main
    from ember.metrics import read_jsonl
    from ember.recipes.digit_sum import digit_sum

    from helpers.server import API_KEY, MODEL_NAME

    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(100 + GRPO_SEED)
    data = workdir / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Sum the digits of {n}:", "completion": f" {digit_sum(n)}"}) + "\n"
                            for n in (rng.randint(1, 99) for _ in range(40))))
    config = workdir / "recipe.toml"
    config.write_text(f'base_model = "{MODEL_NAME}"\nlora_rank = 8\nseed = {GRPO_SEED}\n'
                      f'[client]\nbase_url = "{base_url}"\napi_key = "{API_KEY}"\n'
                      "[metrics]\nconsole = false\ntensorboard = false\n")
    start, out = time.monotonic(), io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "sft", "--config", str(config), "--data_path", str(data), "--steps", str(GRPO_SFT_STEPS),
                     "--batch_size", "16", "--learning_rate", "1e-2", "--run_dir", str(workdir / "sft"),
                     "--save_name", "sft"])
    if code != 0 or "saved " not in out.getvalue():
        raise RuntimeError(f"ember train sft failed (exit {code}): {out.getvalue()[-2000:]}")
    sft_s = time.monotonic() - start
    with contextlib.redirect_stdout(out):
        code = main(["train", "grpo", "--config", str(config), "--init_from", out.getvalue().split("saved ", 1)[1].split()[0],
                     "--steps", str(GRPO_STEPS), "--prompts_per_step", "8", "--group_size", "8", "--max_tokens", "4",
                     "--learning_rate", "1e-3", "--env_args", GRPO_ENV_ARGS, "--run_dir", str(workdir / "grpo"),
                     "--save_name", ""])
    if code != 0:
        raise RuntimeError(f"ember train grpo failed (exit {code}): {out.getvalue()[-2000:]}")
    rewards = [r["grpo/reward"] for r in read_jsonl(workdir / "grpo" / "metrics.jsonl")]
    return {"rewards": rewards, "sft_s": sft_s, "grpo_s": time.monotonic() - start - sft_s}


def sdk(model_dir: str, workdir: str, head_ns: str, worker_ns: str, out: str, with_grpo: str = "0") -> None:
    """`ember serve --sampler.replicas 2 --sampler.placement ray` in this (the head's)
    namespace, driven by the official SDK: LoRA and full runs' samples vs forward from
    both replicas, then the worker host's replica killed mid-request; with `with_grpo` "1",
    then the GRPO recipe against the same server (`grpo`)."""
    import tinker

    from helpers.netns import pids_running
    from helpers.server import API_KEY, start_server

    t0 = time.monotonic()
    server = start_server(Path(model_dir), Path(workdir), timeout=600, extra_args=[
        "--sampler.replicas", "2", "--sampler.placement", "ray", "--sampler.max_imbalance", "0",
        # the head's replica is stopped on purpose below: the pool must not replace it meanwhile
        "--sampler.replica_timeout_s", "300",
        "--log-level", "info"])
    results: dict = {"seconds": {"server_start": time.monotonic() - t0}}
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        for mode in ("lora", "full"):  # the pool starts with the first sampling client
            t0 = time.monotonic()
            tc, clients, results[mode] = train_and_sample(sc, mode, server.base_url)
            results["seconds"][mode] = time.monotonic() - t0
            if mode == "lora":
                results["up"] = replicas_up(server)
                results["actors"] = {"head": pids_running(head_ns, "_ReplicaActor"),
                                     "worker": pids_running(worker_ns, "_ReplicaActor")}
        t0 = time.monotonic()
        results["kill"] = kill_remote_mid_request(server, tc, clients, worker_ns, head_ns)
        results["seconds"]["kill"] = time.monotonic() - t0
        if with_grpo == "1":
            results["grpo"] = grpo(server.base_url, Path(workdir).parent / "grpo")
    except BaseException as exc:
        results["error"] = f"{type(exc).__name__}: {exc}\n--- server stderr ---\n{server.stderr_tail(6000)}"
    finally:
        t0 = time.monotonic()
        server.stop()
        results["seconds"]["server_stop"] = time.monotonic() - t0
        Path(out).write_text(json.dumps(results))


JOBS = {"fsdp": fsdp, "sdk": sdk}

if __name__ == "__main__":
    JOBS[sys.argv[1]](*sys.argv[2:])
