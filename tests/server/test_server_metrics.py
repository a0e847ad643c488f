"""`GET /metrics`: a real `ember serve`, the official SDK, and the scrape parsed with
prometheus-client's own parser. Every count is checked against an independent source
(the SDK's results or the server's request log), as a delta around what the test did."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import tinker
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from helpers.server import API_KEY, MODEL_NAME, sft_datum, start_server, wait_until

# `slow`: left out of `make test-fast` (see README, "Developing: the tests").
pytestmark = pytest.mark.slow

FB_ROUTE = "/api/v1/forward_backward"
REQUEST_ID = re.compile(r"req-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # A short gap timeout: the queue-depth test parks a request behind a missing seq_id.
    srv = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("ember-metrics"),
                       extra_args=["--seq-gap-timeout-s", "3"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sc(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


def scrape(base_url: str, **headers: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one authenticated scrape."""
    resp = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": API_KEY, **headers}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return parse(resp.text)


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def fb_requests(samples: dict) -> float:
    return value(samples, "ember_http_requests_total", route=FB_ROUTE, method="POST", status="200")


def test_counts_match_what_the_sdk_did(server, sc):
    steps = 3
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1).result()
    before = scrape(server.base_url)
    mark = server.log_mark()
    for _ in range(steps):
        tc.forward_backward([sft_datum([5, 17, 30, 42, 8])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    resp = sampler.sample(types.ModelInput.from_ints([5, 17, 30]), num_samples=2, sampling_params=params).result()
    after = scrape(server.base_url)

    sent = len([e for e in server.requests_since(mark, "/forward_backward") if e["status"] == 200])
    assert sent >= steps
    assert fb_requests(after) - fb_requests(before) == sent  # the request log saw the same requests
    hist = "ember_http_request_duration_seconds_count"
    assert value(after, hist, route=FB_ROUTE, method="POST") - value(before, hist, route=FB_ROUTE, method="POST") \
        == sent
    assert value(after, "ember_optim_steps_total") - value(before, "ember_optim_steps_total") == steps
    tokens = sum(len(s.tokens) for s in resp.sequences)
    assert tokens > 0
    assert value(after, "ember_sampled_tokens_total") - value(before, "ember_sampled_tokens_total") == tokens
    assert value(after, "ember_samples_total") - value(before, "ember_samples_total") == 2
    sync = "ember_weight_sync_seconds_count"  # the snapshot: one version handed to the sampler
    assert value(after, sync, mode="memory") - value(before, sync, mode="memory") == 1
    done = value(after, "ember_futures", state="complete") - value(before, "ember_futures", state="complete")
    assert done >= 2 * steps + 2  # fb + optim per step, the sampler snapshot, the sample
    finished = "ember_futures_finished_total"
    assert value(after, finished, request_type="OptimStep", state="complete") \
        - value(before, finished, request_type="OptimStep", state="complete") == steps


def test_gauges_process_and_labels(server, sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result()
    model_id = tc.get_info().model_id
    auth = {"X-API-Key": API_KEY}
    assert httpx.get(f"{server.base_url}/api/v1/training_runs/{model_id}", headers=auth).status_code == 200
    assert httpx.get(f"{server.base_url}/api/v1/no-such-route-{model_id}", headers=auth).status_code == 404
    samples = scrape(server.base_url)

    states = {dict(labels)["state"] for name, labels in samples if name == "ember_futures"}
    assert states == {"pending", "complete", "failed"}
    assert value(samples, "ember_futures", state="pending") == 0  # every request so far has been answered
    assert value(samples, "process_resident_memory_bytes") > 50e6  # a Python + torch server
    assert value(samples, "ember_run_queue_depth", run_id=model_id) == 0  # live run, idle
    routes = {dict(labels).get("route") for name, labels in samples if name == "ember_http_requests_total"}
    assert {"/api/v1/training_runs/{run_id}", "unmatched", "/api/v1/retrieve_future"} <= routes
    label_values = [v for _, labels in samples for _, v in labels]
    assert not [v for v in label_values if REQUEST_ID.search(v)]
    assert not [r for r in routes if model_id in r]  # ids in paths never become labels


def test_queue_depth_counts_a_request_waiting_for_its_seq_id(server, sc):
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
    model_id = tc.get_info().model_id
    body = {"model_id": model_id, "seq_id": 1000, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"}
    resp = httpx.post(f"{server.base_url}/api/v1/optim_step", json=body, headers={"X-API-Key": API_KEY})
    assert resp.status_code == 200, resp.text
    # seq_ids below 1000 never arrive: the request waits in the sequencer until the gap timeout
    assert value(scrape(server.base_url), "ember_run_queue_depth", run_id=model_id) == 1
    wait_until(lambda: value(scrape(server.base_url), "ember_run_queue_depth", run_id=model_id) == 0,
               timeout=30, message="the gap timeout to release the parked request")


def test_scrape_needs_a_key_by_default(server):
    url = f"{server.base_url}/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200  # Prometheus style


def _app(tmp_path: Path, **server_kwargs):
    from ember.server.app import create_app
    from ember.server.config import ServerConfig
    from ember.service import Service, ServiceConfig

    service = Service(ServiceConfig(data_dir=tmp_path))
    return create_app(service, ServerConfig(api_keys={API_KEY: "alice"}, **server_kwargs), close_service=True)


def test_open_scrape_under_a_prefix_and_one_registry_per_app(tmp_path):
    with TestClient(_app(tmp_path / "a", metrics_auth=False, path_prefix="pfx")) as a, \
            TestClient(_app(tmp_path / "b")) as b:  # two apps in one process must not clash
        assert a.get("/pfx/api/v1/healthz").status_code == 200
        assert a.get("/pfx/api/v1/training_runs/run-xyz", headers={"X-API-Key": API_KEY}).status_code == 404
        resp = a.get("/pfx/metrics")  # no key needed with metrics_auth off
        assert resp.status_code == 200
        samples = parse(resp.text)
        assert value(samples, "ember_http_requests_total", route="/api/v1/healthz", method="GET", status="200") == 1
        assert value(samples, "ember_http_requests_total", route="/api/v1/training_runs/{run_id}", method="GET",
                     status="404") == 1
        assert b.get("/metrics").status_code == 401
        other = parse(b.get("/metrics", headers={"X-API-Key": API_KEY}).text)
        assert value(other, "ember_http_requests_total", route="/api/v1/healthz", method="GET", status="200") == 0
