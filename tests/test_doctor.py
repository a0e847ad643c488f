"""`ember doctor` (ember.doctor) on this machine's CPU, as CI runs it: every check passes,
`--json` carries each check's numbers, and a device the machine does not have fails the
run (exit 1) naming it, while the checks that need no device still run."""

from __future__ import annotations

import json

from ember.doctor import CHECKS
from ember.models.dtypes import LOGPROB_ATOL
from helpers.cli import run_cli


def test_doctor_passes_on_this_cpu_with_one_line_per_check():
    r = run_cli("doctor", "--device", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "ember doctor: device cpu, dtype float32, sampler torch"
    assert [ln.split()[1] for ln in lines[1:-1]] == list(CHECKS)
    assert all(ln.split()[0] in ("PASS", "SKIP") for ln in lines[1:-1]), r.stdout
    assert lines[-1] == "all checks passed"


def test_doctor_json_reports_each_checks_numbers_in_bf16():
    r = run_cli("doctor", "--device", "cpu", "--dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and report["dtype"] == "bfloat16" and list(checks) == list(CHECKS)
    assert checks["collective"]["data"]["result"] == {"0": [11.0, 22.0], "1": [11.0, 22.0]}
    gap = checks["logprobs"]["data"]
    assert gap["bound"] == LOGPROB_ATOL["bfloat16"] and 0 <= gap["max_abs_gap"] <= gap["bound"]
    assert checks["weight_sync"]["data"]["bytes"] > 0 and checks["memory"]["data"]["relative_error"] <= 0.1


def test_doctor_fails_for_a_device_this_machine_lacks():
    r = run_cli("doctor", "--device", "cuda:3", "--json")
    assert r.returncode == 1
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["devices"]["status"] == "FAIL" and "--device cuda:3 needs one" in checks["devices"]["detail"]
    assert checks["versions"]["status"] == "PASS" and checks["logprobs"]["status"] == "FAIL"
