"""The console's pages, at Tinker's console paths (docs/architecture.md, "Console").

    GET  /login, POST /login, GET|POST /logout      sign-in with an API key (a signed cookie)
    GET  /                                          overview: this key's server state, recent runs
    GET  /sessions, /sessions/{id}                  sessions: runs, samplers, liveness; POST: end it
    GET  /training_runs, /training_runs/{id}        runs; a run's curves and checkpoints; POST: export
    GET  /training_runs/compare?run=A&run=B         runs' curves overlaid (smoothing, log scale)
    GET|POST /admin                                 the operator (--admin-api-key): every key's
                                                    sessions and runs; end one, unload one
    GET  /checkpoints/{run_id}/{checkpoint_id}      a checkpoint; POST: publish, TTL, delete
    GET|POST /playground                            sample a base model or sampler checkpoint

Every page reads and changes through the `ServiceAPI` with the signed-in owner, so the
owner checks are the API's: another key's run, session or checkpoint is the 404 page.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from ember.server.console import auth, playground
from ember.server.console.pages import (
    PageError, PageNotFound, call, operator_of, owner_of, read_form, redirect, render, secure, signed_form, signin_of, state, local_path,
)
from ember.server.routes_admin import usage
from ember.server.console.svg import chart_lines, smooth
from ember.service.metric_history import COMPLETION, SAMPLED, SEQUENCES, TOKENS, derived, series

router = APIRouter(include_in_schema=False)
Owner = Depends(owner_of)
Operator = Depends(operator_of)
STATIC = __file__.rsplit("/", 1)[0] + "/static"


@router.get("/console-static/console.css")
async def stylesheet():
    return secure(FileResponse(f"{STATIC}/console.css", media_type="text/css"))


# ------------------------------------------------------------------ sign-in
@router.get("/login")
async def login_form(request: Request, next: str = "/"):  # noqa: A002 - the query parameter's name
    return render(request, "login.html", next=local_path(next))


@router.post("/login")
async def login(request: Request):
    form = await read_form(request)
    owner = request.app.state.config.owner_for(form.get("api_key", "").strip())
    if owner is None:
        return render(request, "login.html", 401, next=local_path(form.get("next")),
                      error="That API key is not accepted by this server.")
    value, _ = auth.make_cookie(state(request).secret, owner, state(request).session_ttl_s)
    response = redirect(request, local_path(form.get("next")))
    response.set_cookie(auth.COOKIE, value, max_age=int(state(request).session_ttl_s), httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


@router.get("/logout")
async def logout_form(request: Request):
    if signin_of(request) is None:
        return redirect(request, "/login")
    return render(request, "logout.html")


@router.post("/logout")
async def logout(request: Request):
    await signed_form(request)
    response = redirect(request, "/login")
    response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
    return response


# ------------------------------------------------------------------ overview, sessions
@router.get("/")
async def overview(request: Request, owner: str = Owner):
    service = request.app.state.service
    st = await call(service.owner_state, owner)
    runs = (await call(service.list_training_runs, owner, 10, 0))
    facts = await _facts(service, owner, runs.training_runs)
    return render(request, "overview.html", state=st, runs=runs.training_runs, total=runs.cursor.total_count,
                  facts=facts)


@router.get("/sessions")
async def sessions(request: Request, owner: str = Owner, offset: int = Query(0, ge=0, le=1 << 30)):
    service = request.app.state.service
    ids = (await call(service.list_sessions, owner, 50, offset)).sessions
    rows = [await call(service.session_facts, owner, sid) for sid in ids]
    return render(request, "sessions.html", sessions=rows, offset=offset, now=_now())


@router.get("/sessions/{session_id}")
async def session_page(session_id: str, request: Request, owner: str = Owner):
    service = request.app.state.service
    row = await call(service.session_facts, owner, session_id)
    detail = await call(service.get_session, owner, session_id)
    samplers = [await call(service.get_sampler, owner, sid) for sid in detail.sampler_ids]
    return render(request, "session.html", session=row, runs=detail.training_run_ids, samplers=samplers, now=_now(),
                  refresh=row.status == "active")


@router.post("/sessions/{session_id}")
async def session_action(session_id: str, request: Request):
    owner, form = await signed_form(request)
    if form.get("action") != "end":
        raise PageError(f"action: expected 'end', got {form.get('action')!r}")
    await call(request.app.state.service.finish_session, owner, session_id, "interrupted", "ended from the console")
    return redirect(request, f"/sessions/{quote(session_id, safe='')}")


# ------------------------------------------------------------------ the operator (--admin-api-key)
@router.get("/admin")
async def operator_page(request: Request, _: str = Operator):
    service, config = request.app.state.service, request.app.state.config
    view = await call(service.operator_view, sorted(set(config.api_keys.values())))
    return render(request, "admin.html", view=view, usage=usage(request, view), now=_now())


OPERATOR_ACTIONS = ("end_session", "unload_run")


@router.post("/admin")
async def operator_action(request: Request):
    _, form = await signed_form(request)
    operator_of(request)
    service, action, target = request.app.state.service, form.get("action"), form.get("id", "")
    if action not in OPERATOR_ACTIONS or not target:
        raise PageError(f"action: expected one of {', '.join(OPERATOR_ACTIONS)} and an id, got {action!r}")
    if action == "end_session":
        await call(service.operator_end_session, target)
    else:
        await call(service.operator_unload_run, target)
    return redirect(request, "/admin")


# ------------------------------------------------------------------ training runs
@router.get("/training_runs")
async def training_runs(request: Request, owner: str = Owner, offset: int = Query(0, ge=0, le=1 << 30)):
    service = request.app.state.service
    runs = await call(service.list_training_runs, owner, 50, offset)
    facts = await _facts(service, owner, runs.training_runs)
    return render(request, "training_runs.html", runs=runs.training_runs, total=runs.cursor.total_count,
                  offset=offset, facts=facts)


async def _facts(service, owner: str, runs: list) -> dict[str, dict[str, Any]]:
    """`run_facts` plus each run's display name: its user_metadata's `name`, else its session's name."""
    facts = await call(service.run_facts, owner, [r.training_run_id for r in runs])
    sessions: dict[str, str | None] = {}
    for r in runs:
        sid = r.training_run_id.split(":")[0]
        if sid not in sessions:
            try:
                sessions[sid] = (await call(service.session_facts, owner, sid)).display_name
            except PageNotFound:
                sessions[sid] = None
        facts[r.training_run_id]["name"] = (r.user_metadata or {}).get("name") or sessions[sid] or ""
    return facts


class View:
    """How curves are drawn: chosen series, smoothing weight, log scale (query parameters)."""

    def __init__(self, metric: list[str], smooth: float, log: bool):
        self.metric, self.smooth, self.log = metric, smooth, log

    def query(self) -> str:
        return "&".join([*(f"metric={quote(m, safe='')}" for m in self.metric),
                         *([f"smooth={self.smooth:g}"] if self.smooth else []), *(["log=1"] if self.log else [])])


def view_of(metric: list[str] = Query(default=[]), smooth: float = Query(0.0, ge=0.0, le=0.99),
            log: bool = False) -> View:
    return View(metric, smooth, log)


Curves = Depends(view_of)


@router.get("/training_runs/compare")
async def compare_runs(request: Request, owner: str = Owner, run: list[str] = Query(default=[], max_length=8),
                       view: View = Curves):
    if not run:
        raise PageError("choose the runs to compare on the Training runs page")
    service = request.app.state.service
    runs = [await call(service.get_training_run, owner, rid) for rid in dict.fromkeys(run)]
    histories = [(r.training_run_id, (await call(service.metric_history_of, owner, r.training_run_id))["rows"])
                 for r in runs]
    facts = await _facts(service, owner, runs)
    labels = [facts[rid]["name"] or rid for rid, _ in histories]
    curves = await run_in_threadpool(curves_of, [(lab, rows) for lab, (_, rows) in zip(labels, histories)], view)
    return render(request, "compare.html", runs=runs, facts=facts, curves=curves, view=view, labels=labels,
                  refresh=any(f["loaded"] for f in facts.values()))


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, request: Request, owner: str = Owner, view: View = Curves):
    service = request.app.state.service
    run = await call(service.get_training_run, owner, run_id)
    history = await call(service.metric_history_of, owner, run_id)
    checkpoints = (await call(service.list_checkpoints, owner, run_id)).checkpoints
    facts = (await _facts(service, owner, [run]))[run_id]
    curves = await run_in_threadpool(curves_of, [(facts["name"] or run_id, history["rows"])], view)
    return render(request, "training_run.html", run=run, facts=facts, history=history, curves=curves,
                  checkpoints=checkpoints, selected=set(view.metric), view=view, head=_head(run, facts),
                  refresh=facts["loaded"])


@router.post("/training_runs/{run_id}")
async def training_run_action(run_id: str, request: Request):
    owner, form = await signed_form(request)
    if form.get("action") != "export":
        raise PageError(f"action: expected 'export', got {form.get('action')!r}")
    await call(request.app.state.service.export_weights, owner, run_id)
    return redirect(request, f"/training_runs/{quote(run_id, safe='')}")


class _Row:
    __slots__ = ("step", "kind", "metrics")

    def __init__(self, d: dict[str, Any]):
        self.step, self.kind, self.metrics = d["step"], d["kind"], d["metrics"]


# the series worth seeing first, in this order; the rest follow by name
FIRST = ("forward_backward/loss:sum", "tokens trained", "trained tokens/s", "tokens sampled", "mean completion length",
         "forward_backward/sampler_logprob_diff:mean",
         "forward_backward/sampler_logprob_diff:max", "forward_backward/sampler_mismatch_kl:mean")
# the server's own counts, drawn per step under their plain names (`derived`)
HIDDEN = {f"{kind}/{TOKENS}" for kind in ("forward_backward", "forward")} | {
    f"optim_step/{name}" for name in (SAMPLED, SEQUENCES, COMPLETION)}


def curves_of(runs: list[tuple[str, list[dict[str, Any]]]], view: View) -> list[dict[str, Any]]:
    """One chart per series (all when none is chosen), each run one line (smoothed when asked),
    with every (step, value) of the first run for the table."""
    per_run = [(label, {**series([_Row(r) for r in rows]), **derived(rows)}) for label, rows in runs]
    names = {n for _, s in per_run for n in s} - HIDDEN
    order = [n for n in FIRST if n in names] + sorted(names - set(FIRST))
    out = []
    for name in order:
        lines = [(label, s.get(name, [])) for label, s in per_run]
        drawn = not view.metric or name in view.metric
        table_of, points = next(((label, pts) for label, pts in lines if pts), lines[0])
        out.append({"name": name, "points": points, "table_of": table_of, "lines": lines,
                    "count": sum(len(pts) for _, pts in lines), "chart": _chart(lines, view) if drawn else None})
    return out


def _chart(lines: list[tuple[str, list]], view: View):
    if view.smooth:
        lines = [*lines, *((f"{label} (smoothed)", smooth(points, view.smooth)) for label, points in lines)]
    return chart_lines(lines, log=view.log)


def _head(run, facts: dict[str, Any]) -> str:
    return facts.get("head") or (run.user_metadata or {}).get("ember.head", "policy")


# ------------------------------------------------------------------ checkpoints
@router.get("/checkpoints/{run_id}/{checkpoint_id:path}")
async def checkpoint_page(run_id: str, checkpoint_id: str, request: Request, owner: str = Owner):
    service = request.app.state.service
    ckpt = await _checkpoint(service, owner, run_id, checkpoint_id)
    links = None
    if ckpt.checkpoint_type == "external":
        found = await call(service.external_weights_links, owner, run_id, checkpoint_id)
        base = f"{str(request.base_url).rstrip('/')}/api/v1/external_weights/{found.token}"
        links = {"files": [(f, f"{base}/{quote(f)}") for f in found.files],
                 "expires": datetime.fromtimestamp(found.expires, tz=timezone.utc)}
    return render(request, "checkpoint.html", run_id=run_id, ckpt=ckpt, links=links)


async def _checkpoint(service, owner: str, run_id: str, checkpoint_id: str):
    for ckpt in (await call(service.list_checkpoints, owner, run_id)).checkpoints:
        if ckpt.checkpoint_id == checkpoint_id:
            return ckpt
    raise PageNotFound(f"unknown checkpoint tinker://{run_id}/{checkpoint_id}")


ACTIONS = ("publish", "unpublish", "ttl", "delete")


@router.post("/checkpoints/{run_id}/{checkpoint_id:path}")
async def checkpoint_action(run_id: str, checkpoint_id: str, request: Request):
    owner, form = await signed_form(request)
    service = request.app.state.service
    action = form.get("action")
    if action not in ACTIONS:
        raise PageError(f"action: expected one of {', '.join(ACTIONS)}, got {action!r}")
    if action in ("publish", "unpublish"):
        await call(service.set_checkpoint_public, owner, run_id, checkpoint_id, action == "publish")
    elif action == "ttl":
        await call(service.set_checkpoint_ttl, owner, run_id, checkpoint_id, _ttl(form.get("ttl_seconds", "")))
    else:
        await call(service.delete_checkpoint, owner, run_id, checkpoint_id)
        return redirect(request, f"/training_runs/{quote(run_id, safe='')}")
    return redirect(request, f"/checkpoints/{quote(run_id, safe='')}/{quote(checkpoint_id)}"
                    if form.get("back") == "checkpoint" else f"/training_runs/{quote(run_id, safe='')}")


def _ttl(text: str) -> int | None:
    text = text.strip()
    if not text:
        return None  # never expires
    if not text.isdigit() or len(text) > 12:
        raise PageError(f"ttl_seconds: expected a whole number of seconds (or empty for no expiry), got {text[:40]!r}")
    return int(text)


# ------------------------------------------------------------------ playground
@router.get("/playground")
async def playground_form(request: Request, owner: str = Owner, mode: str = "base", checkpoint: str = "",
                          base_model: str = ""):
    service = request.app.state.service
    choices = await playground.choices(service, owner)
    form = playground.defaults(mode, checkpoint, base_model, choices)
    if form.checkpoint:  # a link to a checkpoint this key cannot read is the 404 page, like the API
        await call(service.get_weights_info, owner, form.checkpoint)
    return render(request, "playground.html", form=form, choices=choices, results=None)


@router.post("/playground")
async def playground_run(request: Request):
    owner, raw = await signed_form(request)
    service = request.app.state.service
    choices = await playground.choices(service, owner)
    form = playground.parse(raw)
    results = await playground.run(request, owner, service, form)
    return render(request, "playground.html", form=form, choices=choices, results=results)


def _now() -> float:
    return time.time()
