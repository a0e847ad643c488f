"""`ember serve --sampler.replicas 2 --sampler.placement ray` on two hosts (two network
namespaces on this machine, a Ray node in each; `helpers.netns`), through the official SDK.

The server, its clients and the Ray driver run in the head's namespace
(`helpers.two_hosts_jobs sdk`: the namespaces have no route to this process's); the job
reports what it saw and every assertion is made here:

* one replica actor on each host; LoRA and full fine-tuning runs'
  `save_weights_and_get_sampling_client` samples equal the trainer's `forward` within
  1e-4 (fp32; contract 5) — the sessions that later fail with the remote replica were
  served by it, the others by the head's, so both hosts' samples are checked;
* the worker host's replica SIGKILLed mid-request: its sessions' requests fail with
  category `server`, the head's finish (and still match forward); a replacement starts on
  the worker host and serves those sessions' next requests — while the head's replica is
  stopped (SIGSTOP) holding a request, so the router (`--sampler.max_imbalance 0`) sends
  every newly placed session to the replacement, and no other replica could answer.

* the GRPO recipe against the same server: `ember train sft`, then `ember train grpo` from
  that state, its reward rising (the calibration is in `helpers.two_hosts_jobs`; 11-15 s of
  the job; EMBER_TWO_HOSTS_GRPO=0 leaves it out, and the test says so in its skip reason).
"""

import json
import os
import statistics
import sys

import pytest

from helpers.netns import TwoHosts
from helpers.two_hosts_jobs import GRPO_STEPS

# the whole job runs in the module's fixture: over the suite's 600 s per test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOL = 1e-4
WITH_GRPO = os.environ.get("EMBER_TWO_HOSTS_GRPO", "1") != "0"
GRPO_SKIP = "EMBER_TWO_HOSTS_GRPO=0 in the environment: the job ran without its GRPO phase"


@pytest.fixture(scope="module")
def report(two_hosts: TwoHosts, tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("two-hosts-sdk")
    out = work / "report.json"
    job = two_hosts.run([sys.executable, "-m", "helpers.two_hosts_jobs", "sdk", str(tiny_model_dir),
                         str(work / "server"), two_hosts.head.netns, two_hosts.worker.netns, str(out),
                         "1" if WITH_GRPO else "0"], timeout=1500)
    assert out.exists(), f"the job wrote no report (exit {job.returncode}):\n{job.stderr[-4000:]}"
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


def test_one_replica_on_each_host(report):
    assert len(report["actors"]["head"]) == 1 and len(report["actors"]["worker"]) == 1, report["actors"]
    assert sorted(report["up"].values()) == sorted(report["actors"]["head"] + report["actors"]["worker"])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_samples_equal_the_trainer_forward(report, mode):
    worst = report[mode]["worst"]
    assert len(worst) >= 2 and max(worst) < TOL, worst


def test_remote_replica_killed_mid_request(report):
    kill = report["kill"]
    assert len(kill["remote_slots"]) == 1 and len(kill["local_slots"]) == 1, kill
    outcomes = kill["outcomes"]
    failed = [o for o in outcomes if not o["ok"]]
    assert failed, "no session was on the killed replica (both hosts must have served sessions)"
    assert len(failed) < len(outcomes), "every session failed: the head's replica must keep going"
    assert all(o["category"] == "server" for o in failed), failed
    assert kill["finished_worst"] and max(kill["finished_worst"]) < TOL, kill["finished_worst"]
    assert kill["replacement_on_worker"], kill
    assert [o["ok"] for o in kill["next"]] == [True] * len(failed), kill["next"]
    assert max(kill["next_worst"]) < TOL, kill["next_worst"]
    assert kill["blocker_ok"]  # the head's replica, resumed, finished what it held


@pytest.mark.skipif(not WITH_GRPO, reason=GRPO_SKIP)
def test_grpo_recipe_reward_rises_against_the_two_host_server(report):
    rewards = report["grpo"]["rewards"]
    assert len(rewards) == GRPO_STEPS, rewards
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    assert last > first + 0.03, (first, last, rewards)  # the margin: see the calibration in two_hosts_jobs
