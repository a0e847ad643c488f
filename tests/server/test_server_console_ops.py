"""The console worth keeping open, in headless chromium against a real `ember serve` that
the official SDK drives: runs by name and base model; per-step curves of what the server
knows (tokens trained and sampled, completion length, the sampler/trainer log-prob gap,
tokens/s) at the SDK's steps, checked against what the SDK received; runs overlaid,
smoothing, log scale, self-refresh; session liveness and the end-session button; export
and download; the operator's page for `--admin-api-key` only.

Screenshots go under the module's temporary directory (`console-ops-screens/`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import tinker
from tinker import types

from helpers.server import MODEL_NAME, sft_datum, start_server, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
KEY_A, KEY_B = "tml-console-ops-alice", "tml-console-ops-bob"
ADMIN = "tml-console-ops-operator"
CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")  # docs/architecture.md "Console": unchanged
STEPS = 3
PROMPT = [5, 9, 14, 22, 31]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(reason="playwright (the Python package) is not installed: pip install -e '.[test]'")
    if not Path(CHROMIUM).exists():
        pytest.skip(reason=f"no {CHROMIUM}: install Debian's chromium (apt-get install chromium; .ci/run does)")
    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, browser):
    srv = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("console-ops"), keys=(),
                       extra_args=["--admin-api-key", ADMIN])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("console-ops-screens")


def rl_datum(seq: types.SampledSequence) -> types.Datum:
    tokens = PROMPT + seq.tokens
    pad = len(PROMPT) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * pad + seq.logprobs,
                                       "advantages": [0.0] * pad + [1.0] * len(seq.tokens)})


@pytest.fixture(scope="module")
def trained(server):
    """Key A: an RL-style run "rl-alpha" (sample from its own weights, importance_sampling,
    step) and an SFT run "sft-beta"; key B: a session with a run (for the operator)."""
    sc_a = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    rl = sc_a.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=0,
                                          user_metadata={"name": "rl-alpha"}).result()
    want = {"tokens trained": [], "tokens sampled": [], "mean completion length": [], "gap": []}
    for step in range(STEPS):
        sampler = rl.save_weights_and_get_sampling_client().result()
        seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                              types.SamplingParams(max_tokens=5, seed=step, temperature=1.0)).result().sequences
        out = rl.forward_backward([rl_datum(s) for s in seqs], "importance_sampling").result()
        rl.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampled = sum(len(s.tokens) for s in seqs)
        want["tokens trained"].append((step, sum(len(o["logprobs"].data) for o in out.loss_fn_outputs)))
        want["tokens sampled"].append((step, sampled))
        want["mean completion length"].append((step, sampled / len(seqs)))
        want["gap"].append((step, out.metrics["sampler_logprob_diff:mean"]))
    sft = sc_a.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1,
                                           user_metadata={"name": "sft-beta"}).result()
    for i in range(STEPS):
        sft.forward_backward([sft_datum([1 + i, 5, 9, 13, 17])], "cross_entropy").result()
        sft.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sc_b = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B)
    run_b = sc_b.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result()
    yield dict(sc_a=sc_a, rl=rl.model_id, sft=sft.model_id, want=want, run_b=run_b.model_id)
    sc_a.close("success").result(timeout=30)


def signed_in(browser, server, key: str):
    context = browser.new_context(base_url=server.base_url, viewport={"width": 1366, "height": 900})
    context.set_default_timeout(180_000)
    page = context.new_page()
    page.goto("/login")
    page.fill("input[name=api_key]", key)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/$"))
    return page


@pytest.fixture(scope="module")
def page_a(browser, server, trained):
    page = signed_in(browser, server, KEY_A)
    yield page
    page.context.close()


def shot(page, shots: Path, name: str) -> None:
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)


def series(page, name: str, nth: int = 0) -> list[tuple[int, float]]:
    """The (step, value) circles of the nth line of a chart."""
    figure = page.locator(f'figure[data-series="{name}"]')
    return [tuple(p) for p in figure.locator("g.series").nth(nth).locator("circle").evaluate_all(
        "cs => cs.map(c => [Number(c.dataset.step), Number(c.dataset.value)])")]


def run_url(run_id: str) -> str:
    return f"/training_runs/{quote(run_id, safe='')}"


def test_runs_are_listed_by_name_and_base_model(page_a, trained, shots):
    page_a.goto("/training_runs")
    rows = page_a.locator("tr[data-run-id]")
    names = dict(zip(rows.evaluate_all("rs => rs.map(r => r.dataset.runId)"),
                     page_a.locator("tr[data-run-id] td[data-name=name]").all_inner_texts()))
    assert names[trained["rl"]] == "rl-alpha" and names[trained["sft"]] == "sft-beta"
    assert trained["run_b"] not in names
    assert page_a.locator(f'tr[data-run-id="{trained["rl"]}"] td', has_text=MODEL_NAME).count() == 1
    shot(page_a, shots, "runs")


def test_curves_beyond_the_loss_at_the_sdks_steps(page_a, trained, shots):
    resp = page_a.goto(run_url(trained["rl"]))
    assert resp.headers["content-security-policy"] == CSP
    want = trained["want"]
    for name in ("tokens trained", "tokens sampled"):
        assert series(page_a, name) == [(s, float(v)) for s, v in want[name]], name
    got = series(page_a, "mean completion length")
    assert [s for s, _ in got] == list(range(STEPS))
    assert [v for _, v in got] == pytest.approx([v for _, v in want["mean completion length"]], rel=1e-9)
    gap = series(page_a, "forward_backward/sampler_logprob_diff:mean")
    assert [s for s, _ in gap] == list(range(STEPS))
    assert [v for _, v in gap] == pytest.approx([v for _, v in want["gap"]], rel=1e-6, abs=1e-12)
    rate = series(page_a, "trained tokens/s")  # from the second step on: time since the previous step
    assert [s for s, _ in rate] == list(range(1, STEPS)) and all(v > 0 for _, v in rate)
    # the run is loaded: the page refreshes itself (no script: a meta refresh)
    assert page_a.locator('meta[http-equiv="refresh"]').get_attribute("content") == "10"
    shot(page_a, shots, "run_curves")


def test_smoothing_and_log_scale(page_a, trained, shots):
    page_a.goto(run_url(trained["sft"]))
    page_a.select_option("select[name=smooth]", "0.8")
    page_a.check("input[name=log]")
    page_a.click("#curve-form button[type=submit]")
    page_a.wait_for_url(re.compile(r".*smooth=0\.8.*log=1"))
    loss = page_a.locator('figure[data-series="forward_backward/loss:sum"]')
    assert loss.locator("g.series").count() == 2  # the raw line (faint) and the smoothed one
    assert loss.locator("g.series.faint circle").count() == STEPS
    assert "log scale" in loss.locator("figcaption").inner_text()
    shot(page_a, shots, "run_smoothed_log")


def test_runs_overlaid(page_a, trained, shots):
    page_a.goto("/training_runs")
    for run in (trained["rl"], trained["sft"]):
        page_a.check(f'tr[data-run-id="{run}"] input[name=run]')
    page_a.click("#compare-form button[type=submit]")
    page_a.wait_for_url(re.compile(r".*/training_runs/compare\?.*"))
    loss = page_a.locator('figure[data-series="forward_backward/loss:sum"]')
    lines = loss.locator("g.series").evaluate_all("gs => gs.map(g => g.dataset.line)")
    assert sorted(lines) == ["rl-alpha", "sft-beta"]  # in the listing's order: newest first
    assert all(len(series(page_a, "forward_backward/loss:sum", i)) == STEPS for i in (0, 1))
    assert loss.locator("ul.legend li").all_inner_texts() == lines
    shot(page_a, shots, "compare")
    # owner-checked: another key's run in the comparison is the 404 page
    resp = page_a.goto(f"/training_runs/compare?run={quote(trained['rl'])}&run={quote(trained['run_b'])}")
    assert resp.status == 404


def test_export_then_download_from_the_page(page_a, server, trained, shots):
    page_a.goto(run_url(trained["rl"]))
    page_a.click("#export button")
    row = f'tr[data-checkpoint="tinker://{trained["rl"]}/external_weights/console-export"]'

    def exported() -> bool:
        page_a.goto(run_url(trained["rl"]))
        return page_a.locator(row).count() == 1

    wait_until(exported, timeout=120, interval=1.0, message="the export in the checkpoint list")
    page_a.click(f"{row} a:has-text('Download HF export')")
    links = page_a.locator("a[href*='/api/v1/external_weights/']")
    hrefs = dict(zip(links.all_inner_texts(), links.evaluate_all("as => as.map(a => a.href)")))
    shot(page_a, shots, "export")
    config = httpx.get(hrefs["adapter_config.json"], timeout=60)
    assert config.status_code == 200 and json.loads(config.content)["r"] == 4
    assert httpx.get(hrefs["adapter_model.safetensors"], timeout=60).content[:8]  # safetensors header length


def test_session_liveness_and_end_button(page_a, server, trained, shots):
    session = trained["rl"].split(":")[0]
    page_a.goto(f"/sessions/{session}")
    assert page_a.locator("dd[data-name=status] [data-live]").get_attribute("data-live") == "alive"
    other = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    run = other.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
    page_a.goto(f"/sessions/{run.model_id.split(':')[0]}")
    shot(page_a, shots, "session_alive")
    page_a.click("#end-session button")
    assert page_a.locator("dd[data-name=status]").inner_text().startswith("finished (interrupted)")
    page_a.goto(run_url(run.model_id))
    assert page_a.locator("#run-facts").get_by_text("no (recreate it").count() == 1
    shot(page_a, shots, "session_ended")


def test_operator_page_for_the_admin_key_only(browser, server, page_a, trained, shots):
    resp = page_a.goto("/admin")
    assert resp.status == 403 and "--admin-api-key" in page_a.locator("main").inner_text()
    assert page_a.locator("nav a", has_text="Operator").count() == 0
    resp = page_a.request.post("/admin", form={"action": "unload_run", "id": trained["run_b"]})
    assert resp.status == 403 and "CSRF" in resp.text()  # no token
    csrf = page_a.locator("form.signout input[name=csrf]").get_attribute("value")
    resp = page_a.request.post("/admin", form={"action": "unload_run", "id": trained["run_b"], "csrf": csrf})
    assert resp.status == 403 and "--admin-api-key" in resp.text()  # a valid token, not the operator

    op = signed_in(browser, server, ADMIN)
    op.click("nav a:has-text('Operator')")
    session_b = trained["run_b"].split(":")[0]
    assert op.locator(f'#op-sessions tr[data-session-id="{session_b}"]').count() == 1
    assert op.locator(f'#op-runs tr[data-run-id="{trained["rl"]}"]').count() == 1  # every key's runs
    shot(op, shots, "operator")
    op.click(f'#op-runs tr[data-run-id="{trained["run_b"]}"] button')
    assert op.locator(f'#op-runs tr[data-run-id="{trained["run_b"]}"] td', has_text="not loaded").count() == 1
    op.click(f'#op-sessions tr[data-session-id="{session_b}"] button')
    assert op.locator(f'#op-sessions tr[data-session-id="{session_b}"]').count() == 0
    shot(op, shots, "operator_after")
    op.context.close()
