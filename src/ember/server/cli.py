"""`ember serve`: Tinker's HTTP protocol for the unmodified official `tinker` SDK.

    ember serve --model Qwen/Qwen3-0.6B=/models/qwen3 --data-dir ./ember-data --api-key tml-secret

Then, in the client: `tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-secret")`
(or `TINKER_BASE_URL` / `TINKER_API_KEY`). Cheap to import: heavy imports live in `run`.

Scale out: `--workers.runtime process --workers.world_size 2` runs every training run as
one engine on a worker group of 2 local ranks (FSDP2 over both unless `--parallel.*`
says otherwise); `--workers.runtime ray [--workers.ray_address ADDR]` does the same on
Ray actors. The group is shut down when the server stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from typing import Any

def _key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ember.server.serve_config import add_component_flags

    p = parser
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below (examples/serve.toml "
                   "lists every key); flags given on the command line win")
    p.add_argument("--model", action="append", type=_key_value, default=[], metavar="NAME=DIR",
                   help="register a base model (repeatable; DIR must hold a config.json)")
    p.add_argument("--models-toml", help="TOML file with more NAME = \"DIR\" registrations")
    p.add_argument("--model-root", action="append", default=[], metavar="DIR",
                   help="also accept the path of any model directory under DIR as a base_model (repeatable; "
                        "off by default: only registered names; the data directory is never reachable)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = pick a free one; the line "
                   "'ember serve: listening on URL' on stdout says which)")
    p.add_argument("--data-dir", default="./ember-data", help="checkpoints and the default SQLite database")
    p.add_argument("--database-url", help="SQLAlchemy URL (default sqlite:///<data-dir>/ember.db)")
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable, 'tml-...')")
    p.add_argument("--api-keys-file", help="file with one 'KEY [OWNER]' per line")
    p.add_argument("--long-poll-s", type=float, default=20.0, help="retrieve_future hold time (< 35 s)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest accepted request body")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="close a connection whose request headers take longer (slowloris)")
    p.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="408 and close when the request body stalls this long between chunks")
    p.add_argument("--body-deadline-s", type=float, default=600.0,
                   help="408 and close when the whole request body takes longer")
    p.add_argument("--max-requests-per-key", type=int, default=4096,
                   help="in-flight HTTP requests per API key; more get 429 + Retry-After")
    p.add_argument("--seq-gap-timeout-s", type=float, default=5.0, help="wait for a missing seq_id this long")
    p.add_argument("--session-timeout-s", type=float, default=None, help="expire sessions without heartbeat")
    p.add_argument("--path-prefix", default="", help="serve under /PREFIX/api/v1 (behind a proxy)")
    p.add_argument("--client-config", action="append", type=_key_value, default=[], metavar="FLAG=JSON",
                   help="override a flag of /api/v1/client/config, e.g. fwdbwd_max_chunk_len=256")
    p.add_argument("--request-log", help="append one short JSON line per HTTP request to this file (rotated "
                                         "past 64 MB to FILE.1)")
    p.add_argument("--request-log-bodies", default="off", choices=["on", "off"],
                   help="the request log also holds headers and small JSON bodies (debugging; large)")
    p.add_argument("--metrics-auth", default="on", choices=["on", "off"],
                   help="GET /metrics needs an API key (default on: it names every tenant's runs); "
                        "off = open to anyone reaching the port (Prometheus convention)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_component_flags(p, "engine", "training engine")
    add_worker_arguments(p)
    add_component_flags(p, "sampler", "sampling (unset device, dtype and max_len follow the engine and the model)")
    add_component_flags(p, "limits", "per-request limits (each refused as a user error naming the field)")
    add_component_flags(p, "durability", "futures under database and disk faults (lock waits, finish retries, sweep)")
    add_component_flags(p, "stability", "records of record_stability_info=True samples, for stable_reinforce")
    add_component_flags(p, "checkpoints", "checkpoint TTL sweep and user_metadata bounds")


def sampler_config_from_args(args: argparse.Namespace):
    """The SamplerConfig of `[sampler]` and `--sampler.*`; its backend must be installed."""
    from ember.sampling.registry import backend_missing
    from ember.server.serve_config import component_config

    config = component_config(args, "sampler")
    reason = backend_missing(config.backend)  # fail at start-up, not at the first sample
    if reason:
        raise ValueError(f"sampler.backend: {reason}")
    return config


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """`--workers.*` / `--parallel.*`: where training engines run (ember.service.config.WorkersConfig)."""
    w = p.add_argument_group("scale-out", "run every training engine on a worker group (default: in process)")
    from ember.service.config import worker_runtimes

    w.add_argument("--workers.runtime", dest="workers__runtime", default="local",
                   choices=list(worker_runtimes()),
                   help="local = in-process engines, LoRA adapters share one base model (default); "
                        "inline | process | ray = one SPMD engine per run on a worker group")
    w.add_argument("--workers.world_size", dest="workers__world_size", type=int, default=1, metavar="N",
                   help="ranks in the worker group (process: local processes; ray: actors)")
    w.add_argument("--workers.ray_address", dest="workers__ray_address", default=None, metavar="ADDR",
                   help="join this Ray cluster ('auto', 'ray://host:10001'); default: start a local Ray")
    w.add_argument("--workers.call_timeout_s", dest="workers__call_timeout_s", type=float, default=600.0,
                   metavar="S", help="a group call running longer stops the group (hung rank)")
    for dim, what in (("dp_replicate", "replicas (HSDP / DDP-style)"), ("dp_shard", "FSDP2 degree (default: "
                      "the ranks left over, i.e. FSDP2 over all ranks)"), ("tp", "tensor-parallel degree")):
        w.add_argument(f"--parallel.{dim}", dest=f"parallel__{dim}", type=int, default=None, metavar="N",
                       help=f"ParallelismConfig.{dim}: {what}")


def _json_value(text: Any) -> Any:
    if not isinstance(text, str):  # from a config file: already typed
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def server_config_from_args(args: argparse.Namespace):
    from ember.server.config import ServerConfig, load_api_keys_file

    keys = {k: _owner(k) for k in args.api_key}
    if args.api_keys_file:
        keys.update(load_api_keys_file(args.api_keys_file))
    return ServerConfig(
        host=args.host, port=args.port, api_keys=keys, long_poll_s=args.long_poll_s,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024), request_log=args.request_log,
        request_log_bodies=_on_off("request_log_bodies", args.request_log_bodies),
        path_prefix=args.path_prefix, client_config={k: _json_value(v) for k, v in args.client_config},
        metrics_auth=_on_off("metrics_auth", args.metrics_auth), header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s, body_deadline_s=args.body_deadline_s,
        max_requests_per_key=args.max_requests_per_key,
    )


def _on_off(name: str, value: str) -> bool:
    if value not in ("on", "off"):  # a config file skips argparse's choices
        raise ValueError(f"{name}: expected 'on' or 'off', got {value!r}")
    return value == "on"


def _owner(key: str) -> str:
    from ember.server.config import key_identity

    return key_identity(key)


def service_config_from_args(args: argparse.Namespace):
    from ember.server.serve_config import component_config
    from ember.service import ServiceConfig

    return ServiceConfig(
        data_dir=args.data_dir, models=dict(args.model), models_toml=args.models_toml, model_roots=args.model_root,
        database_url=args.database_url, engine=component_config(args, "engine"),
        sampler=sampler_config_from_args(args), limits=component_config(args, "limits"),
        durability=component_config(args, "durability"), stability=component_config(args, "stability"),
        checkpoints=component_config(args, "checkpoints"),
        seq_gap_timeout_s=args.seq_gap_timeout_s, session_timeout_s=args.session_timeout_s,
        retrieve_max_wait_s=args.long_poll_s,
    )


def workers_config_from_args(args: argparse.Namespace):
    from ember.service.config import WorkersConfig

    return WorkersConfig(
        runtime=getattr(args, "workers__runtime", "local"), world_size=getattr(args, "workers__world_size", 1),
        ray_address=getattr(args, "workers__ray_address", None),
        call_timeout_s=getattr(args, "workers__call_timeout_s", 600.0),
        **{dim: getattr(args, f"parallel__{dim}", None) for dim in ("dp_replicate", "dp_shard", "tp")},
    )


def build_app(args: argparse.Namespace):
    """(app, server config) from parsed arguments; the service (and its worker group, if
    any) is closed at app shutdown."""
    from ember.server.app import create_app
    from ember.service import build_service

    workers = workers_config_from_args(args)  # first: a bad layout fails before anything starts
    server_config = server_config_from_args(args)
    service = build_service(service_config_from_args(args), workers)
    try:
        check_memory(service, workers)
    except ValueError:
        service.close()
        raise
    return create_app(service, server_config, close_service=True), server_config


def check_memory(service, workers) -> None:
    """Log each registered model's memory estimate; ValueError (with the numbers) for one that
    cannot fit this machine even as the smallest run (`ember.engine.estimate.check_fits`)."""
    from ember.engine.estimate import check_fits
    from ember.engine.parallel import ParallelismConfig

    parallel = ParallelismConfig(**workers.parallel_dims()) if workers.runtime != "local" else None
    models = {n: service.registry.resolve(n).directory for n in service.registry.names()}
    check_fits(models, service.config.engine, parallel, log=logging.getLogger("ember.serve").info)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, host: str, port: int, log_level: str = "info", header_timeout_s: float = 10.0) -> int:
    """Run `app` with uvicorn on host:port (0 = any free port), announcing the URL on stdout.

    The HTTP protocol is h11 (uvicorn's one hard dependency), never "auto": the header
    timeout lives in its subclass, so behaviour does not depend on httptools being
    installed. No global `limit_concurrency` (it would count every tenant's idle
    keep-alive connections together); the per-key bound is PerKeyLimitMiddleware."""
    import uvicorn

    from ember.server.client_limits import header_timeout_protocol

    sock = bind_socket(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"ember serve: listening on http://{shown}:{actual}", flush=True)
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=5, lifespan="on",
                            http=header_timeout_protocol(header_timeout_s))
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def default_arguments() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`ember serve` arguments with the `--config` file applied (raises ValueError naming a
    bad key): what `run` starts from, for tools and tests that build configs."""
    from ember.server.serve_config import apply_config_file

    parser = argparse.ArgumentParser(prog="ember serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    apply_config_file(args, default_arguments())
    return args


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from ember.server.serve_config import apply_config_file
    from ember.service.faults import public_message
    from ember.workers import WorkerError

    try:
        apply_config_file(args, default_arguments())
    except ValueError as exc:
        print(f"ember serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a line per plugin, every start
    try:
        app, server_config = build_app(args)
    except (ValueError, OSError, WorkerError) as exc:
        print(f"ember serve: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:  # a corrupt or unreachable database: one line, no traceback
        print(f"ember serve: cannot open the database ({public_message(exc)}); see `ember db current`",
              file=sys.stderr)
        return 2
    try:
        return serve(app, server_config.host, server_config.port, args.log_level, server_config.header_timeout_s)
    finally:
        app.state.service.close()  # idempotent; covers a uvicorn that never ran its lifespan


def main(argv: list[str] | None = None) -> int:
    """`python -m ember.server.cli ...` == `ember serve ...` (same arguments, same code)."""
    parser = argparse.ArgumentParser(prog="ember serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
