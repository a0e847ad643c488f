"""The console in a real browser: headless Debian chromium driven by Playwright against a
real `ember serve` (default loopback mode: any `tml-` key, each its own tenant), while
the official SDK trains in the same test module.

One server and one browser for the module. Screenshots of every page are written under
the module's temporary directory (`console-screens/`), never committed.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import tinker
from tinker import types

from helpers.server import MODEL_NAME, sft_datum, start_server

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY_A, KEY_B = "tml-console-alice", "tml-console-bob"
XSS_NOTE = "<script>window.__xss = 1</script>"
XSS_IMG = '"><img src=x onerror="window.__xss = 2">'
STEPS = 3
SEED = 1234

pytestmark = pytest.mark.slow


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(reason="playwright (the Python package) is not installed: pip install -e '.[test]'")
    if not Path(CHROMIUM).exists():
        pytest.skip(reason=f"no {CHROMIUM}: install Debian's chromium (apt-get install chromium; .ci/run does)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _playwright()
    pw = sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, browser):
    srv = start_server(Path(tiny_model_dir), tmp_path_factory.mktemp("console-serve"), keys=())
    yield srv
    srv.stop()
    assert srv.proc.returncode in (0, -15), srv.stderr_tail()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("console-screens")


@pytest.fixture(scope="module")
def trained(server):
    """Key A: a LoRA run with hostile user_metadata, STEPS steps, a sampler and a training
    checkpoint. Key B: a run of its own. What the SDK received is kept for comparison."""
    sc_a = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    sc_b = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B)
    tc = sc_a.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=0,
                                          user_metadata={"note": XSS_NOTE, "img": XSS_IMG}).result()
    losses = []
    for i in range(STEPS):
        fb = tc.forward_backward([sft_datum([1 + i, 5, 9, 13, 17, 21, 25])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss:sum"])
    sampler_path = tc.save_weights_for_sampler("console-s").result().path
    training_path = tc.save_state("console-t").result().path
    tc_b = sc_b.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1).result()
    tc_b.forward_backward([sft_datum([3, 4, 5, 6])], "cross_entropy").result()
    b_path = tc_b.save_weights_for_sampler("b-s").result().path
    yield dict(sc_a=sc_a, rest_a=tinker.RestClient(base_url=server.base_url, api_key=KEY_A), tc=tc, run=tc.model_id, losses=losses,
               sampler_path=sampler_path, training_path=training_path, run_b=tc_b.model_id, b_path=b_path)
    sc_a.close("success").result(timeout=30)
    sc_b.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def page_a(browser, server, trained):
    """A browser context signed in as key A (through the login form)."""
    context = browser.new_context(base_url=server.base_url, viewport={"width": 1366, "height": 900})
    context.set_default_timeout(180_000)  # a loaded CI machine: the playground's first sample loads a sampler
    page = context.new_page()
    page.goto("/login")
    page.fill("input[name=api_key]", KEY_A)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/$"))
    yield page
    context.close()


def _shot(page, shots: Path, name: str) -> None:
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)


def _path(tinker_path: str) -> tuple[str, str]:
    run, _, ckpt = tinker_path.removeprefix("tinker://").partition("/")
    return run, ckpt


def test_start_up_prints_the_console_address(server):
    assert any(line == f"ember serve: console at {server.base_url}/ (sign in with an API key)"
               for line in server.stdout_lines), server.stdout_lines


def test_wrong_key_gets_a_clear_message_and_no_cookie(browser, server, shots):
    context = browser.new_context(base_url=server.base_url)
    page = context.new_page()
    resp = page.goto("/training_runs")
    assert page.url.endswith("/login?next=/training_runs") and resp.ok
    _shot(page, shots, "login")
    page.fill("input[name=api_key]", "not-a-tinker-key")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.click("button[type=submit]")
    assert posted.value.status == 401
    assert page.get_by_role("alert").inner_text() == "That API key is not accepted by this server."
    assert context.cookies() == []
    assert "not-a-tinker-key" not in page.content()
    context.close()


def test_sign_in_cookie_flags_and_tenancy(page_a, server, trained, shots):
    cookie, = page_a.context.cookies()
    assert cookie["name"] == "ember_console" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert KEY_A not in cookie["value"]
    _shot(page_a, shots, "overview")
    resp = page_a.goto("/training_runs")
    assert "default-src 'none'" in resp.headers["content-security-policy"]
    assert not re.search(r"https?:", resp.headers["content-security-policy"])
    listed = page_a.locator("tr[data-run-id]").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert trained["run"] in listed and trained["run_b"] not in listed
    _shot(page_a, shots, "training_runs")
    run_b, ckpt_b = _path(trained["b_path"])
    session_b = run_b.split(":")[0]
    for url in (f"/training_runs/{run_b}", f"/training_runs/{quote(run_b, safe='')}",
                f"/training_runs/{run_b.replace(':', '%3a')}", f"/sessions/{session_b}",
                f"/checkpoints/{run_b}/{ckpt_b}", f"/checkpoints/{quote(run_b, safe='')}/{quote(ckpt_b, safe='')}",
                f"/playground?mode=checkpoint&checkpoint={quote(trained['b_path'])}"):
        resp = page_a.goto(url)
        assert resp.status == 404, url
        assert page_a.locator("h1").inner_text() == "Not found", url
    _shot(page_a, shots, "not_found")


def test_loss_curve_has_the_sdk_steps_and_values(page_a, trained, shots):
    page_a.goto(f"/training_runs/{quote(trained['run'], safe='')}")
    curve = page_a.locator('figure[data-series="forward_backward/loss:sum"]')
    points = curve.locator("circle").evaluate_all(
        "cs => cs.map(c => [Number(c.dataset.step), Number(c.dataset.value)])")
    assert [s for s, _ in points] == list(range(STEPS))
    for (_, got), want in zip(points, trained["losses"]):
        assert got == pytest.approx(want, rel=1e-6)
    table = curve.locator("table.values tr[data-step]").evaluate_all(
        "rs => rs.map(r => [Number(r.dataset.step), Number(r.dataset.value)])")
    assert table == points
    steps = page_a.locator("#run-facts dd[data-name=steps]").inner_text()
    assert steps == str(STEPS)
    series = page_a.locator("figure[data-series]").evaluate_all("fs => fs.map(f => f.dataset.series)")
    assert {"optim_step/learning_rate:mean", "optim_step/grad_norm:mean"} <= set(series)
    _shot(page_a, shots, "training_run")
    # selectable: one curve drawn, the others listed with their values only
    page_a.goto(f"/training_runs/{quote(trained['run'], safe='')}?metric=optim_step/grad_norm:mean")
    assert page_a.locator("svg.chart").count() == 1


def test_user_metadata_renders_as_text_and_runs_nothing(page_a, trained):
    dialogs = []
    page_a.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page_a.goto(f"/training_runs/{quote(trained['run'], safe='')}")
    cells = page_a.locator("#user-metadata td").all_inner_texts()
    assert XSS_NOTE in cells and XSS_IMG in cells
    assert page_a.evaluate("window.__xss") is None and dialogs == []
    assert page_a.locator("#user-metadata img, #user-metadata script").count() == 0


def test_post_without_csrf_token_is_refused(page_a, trained):
    run, ckpt = _path(trained["training_path"])
    url = f"/checkpoints/{quote(run, safe='')}/{ckpt}"
    resp = page_a.request.post(url, form={"action": "delete"})  # the signed-in cookie, no token
    assert resp.status == 403 and "CSRF" in resp.text()
    resp = page_a.request.post(url, form={"action": "delete", "csrf": "forged"})
    assert resp.status == 403
    paths = [c.tinker_path for c in trained["rest_a"].list_user_checkpoints().result().checkpoints]
    assert trained["training_path"] in paths


def test_publish_and_delete_from_the_page(page_a, trained, shots):
    rest = trained["rest_a"]

    def public(path: str) -> bool | None:
        found = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path]
        return found[0].public if found else None

    assert public(trained["sampler_path"]) is False
    page_a.goto(f"/training_runs/{quote(trained['run'], safe='')}")
    row = page_a.locator(f'tr[data-checkpoint="{trained["sampler_path"]}"]')
    row.get_by_role("button", name="Publish").click()
    page_a.wait_for_load_state()
    assert public(trained["sampler_path"]) is True
    assert page_a.locator(f'tr[data-checkpoint="{trained["sampler_path"]}"] td[data-name=public]').inner_text() == "yes"
    run, ckpt = _path(trained["sampler_path"])
    page_a.goto(f"/checkpoints/{quote(run, safe='')}/{ckpt}")
    _shot(page_a, shots, "checkpoint")
    page_a.goto(f"/training_runs/{quote(trained['run'], safe='')}")
    page_a.locator(f'tr[data-checkpoint="{trained["training_path"]}"]').get_by_role("button", name="Delete").click()
    page_a.wait_for_load_state()
    assert public(trained["training_path"]) is None
    assert page_a.locator(f'tr[data-checkpoint="{trained["training_path"]}"]').count() == 0


def test_playground_with_a_seed_matches_the_sdk(page_a, trained, tiny_model_dir, shots):
    from ember.models import load_tokenizer

    prompt = "hello"
    ids = load_tokenizer(tiny_model_dir).encode(prompt, add_special_tokens=False)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=SEED)
    sampler = trained["sc_a"].create_sampling_client(model_path=trained["sampler_path"])
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    want = sampler.sample(types.ModelInput.from_ints(ids), 1, params).result().sequences[0]
    page_a.goto(f"/playground?mode=checkpoint&checkpoint={quote(trained['sampler_path'])}")
    assert page_a.locator("#checkpoint").input_value() == trained["sampler_path"]
    page_a.fill("#prompt", prompt)
    page_a.fill("input[name=max_tokens]", "8")
    page_a.fill("input[name=temperature]", "1.0")
    page_a.fill("input[name=seed]", str(SEED))
    page_a.get_by_role("button", name="Sample").click()
    page_a.wait_for_selector("article.sample")
    got = page_a.locator("article.sample li.tok").evaluate_all(
        "ts => ts.map(t => [Number(t.dataset.tokenId), Number(t.dataset.logprob)])")
    assert [t for t, _ in got] == list(want.tokens)
    for (_, lp), want_lp in zip(got, want.logprobs):
        assert lp == pytest.approx(want_lp, abs=1e-4)
    _shot(page_a, shots, "playground")


def test_every_other_page_renders(page_a, trained, shots):
    for name, url in (("sessions", "/sessions"), ("overview_after", "/")):
        resp = page_a.goto(url)
        assert resp.status == 200, url
        _shot(page_a, shots, name)
    page_a.goto("/sessions")
    session = trained["run"].split(":")[0]
    page_a.locator(f'tr[data-session-id="{session}"] a').click()
    assert page_a.locator("h1").inner_text().startswith("Session")
    assert page_a.locator(f'a:has-text("{trained["run"]}")').count() == 1
    _shot(page_a, shots, "session")
    assert page_a.locator("#server-state").count() == 0  # the overview's, not here
    page_a.goto("/")
    assert int(page_a.locator("#server-state dd[data-name=runs_loaded]").inner_text()) >= 1


def test_key_never_in_a_url_page_or_log_line(page_a, server):
    page_a.goto("/")
    assert KEY_A not in page_a.content()
    log = server.log_path.read_text()
    assert "/login" in log and KEY_A not in log and KEY_B not in log
    assert KEY_A not in server.stderr_tail(1 << 20)


def test_logout_clears_the_cookie(browser, server, trained, shots):
    context = browser.new_context(base_url=server.base_url)
    page = context.new_page()
    page.goto("/login")
    page.fill("input[name=api_key]", KEY_B)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/$"))
    listed = page.locator("tr[data-run-id]").evaluate_all("rows => rows.map(r => r.dataset.runId)")
    assert listed == [trained["run_b"]]  # B's own tenant in any-key mode
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r".*/login$"))
    assert context.cookies() == []
    assert page.goto("/training_runs").url.endswith("/login?next=/training_runs")
    context.close()


def test_metric_history_rest_route(server, trained):
    rows = httpx.get(f"{server.base_url}/api/v1/training_runs/{trained['run']}/metrics",
                     headers={"X-API-Key": KEY_A}).json()["rows"]
    assert [r["metrics"]["loss:sum"] for r in rows if r["kind"] == "forward_backward"] == pytest.approx(trained["losses"])
    other = httpx.get(f"{server.base_url}/api/v1/training_runs/{trained['run']}/metrics", headers={"X-API-Key": KEY_B})
    assert other.status_code == 404

