"""ferrox as a Ray Serve application.

    serve run ferrox.server.ray_serve:build_app model=PATH [OPTION=VALUE ...]

or, from Python, `serve.run(build_app({"model": PATH, ...}))`. The arguments
are `ferrox serve`'s options, named as its flags without the leading dashes
(`data-parallel-size=2`, `served-model-name="a b"`; a flag that takes no
value is given `=true`), plus two of the application's own:

  num-replicas   Serve replicas of the server (default 1)
  replica-cpus   CPUs Ray reserves for each (default 1: its frontend and,
                 without data parallelism, its engine process)

Each Serve replica is one ferrox server: the same OpenAI application
`ferrox serve` runs under uvicorn, here behind Serve's HTTP proxy, with its
engine started with the replica (the application's lifespan): a local engine
process, or with `data-parallel-size` N, N engine replicas as Ray actors
behind the replica's prefix-aware router, placed anywhere on the cluster.
Serve's health check asks the replica whether its engine is alive and
making progress; a replica whose engine died is replaced by a new one.
Serve's proxy chooses among several Serve replicas by load alone, so keep
one replica with data parallelism inside it where prefix reuse matters, and
add replicas for more frontends. Host and port are the proxy's
(`serve start --http-host/--http-port`, or `http_options` in a config file),
not options of the application.
"""

from __future__ import annotations

import argparse
from typing import Any

from ferrox.common.errors import InvalidArgumentError, MissingDependencyError
from ferrox.server.launch import ServerApp, build_parser, build_server_app
from ferrox.server.vllm_options import UNSUPPORTED_VLLM_FLAGS

# Options of the application itself, not of `ferrox serve`.
APP_OPTIONS = {"num-replicas": 1, "replica-cpus": 1.0, "health-check-period-s": 10.0}
# `ferrox serve` options that Serve's proxy owns.
PROXY_OPTIONS = ("host", "port", "uvicorn-log-level", "shutdown-timeout")


def serve_argv(options: dict[str, Any]) -> list[str]:
    """`ferrox serve`'s command line for the application's arguments
    (refused, with the reason, if `ferrox serve` would refuse it)."""
    parser = build_parser()
    flags = {
        opt.lstrip("-"): action
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--")
    }
    argv: list[str] = []
    for raw_key, value in options.items():
        key = str(raw_key).replace("_", "-")
        if key in APP_OPTIONS:
            continue
        if key in PROXY_OPTIONS:
            raise InvalidArgumentError(
                f"{key!r} belongs to Serve's HTTP proxy: set it with `serve start` or the "
                "config file's http_options"
            )
        if key == "model-tag":
            key = "model"
        if f"--{key}" in UNSUPPORTED_VLLM_FLAGS:
            raise InvalidArgumentError(
                f"{key} is a vLLM option ferrox does not support: "
                f"{UNSUPPORTED_VLLM_FLAGS['--' + key]}"
            )
        action = flags.get(key)
        if action is None:
            raise InvalidArgumentError(f"unknown option {raw_key!r} (see `ferrox serve --help`)")
        if action.nargs == 0:  # a switch
            if _truth(key, value):
                argv.append(f"--{key}")
        elif action.nargs in ("+", "*"):
            values = value if isinstance(value, list) else str(value).split()
            argv += [f"--{key}", *map(str, values)]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def app_options(options: dict[str, Any]) -> tuple[int, float, float]:
    """(num-replicas, replica-cpus, health-check-period-s) from the
    application's arguments."""
    given = {str(k).replace("_", "-"): v for k, v in options.items()}
    values = {**APP_OPTIONS, **{k: given[k] for k in APP_OPTIONS if k in given}}
    try:
        num_replicas = int(str(values["num-replicas"]))
        cpus = float(values["replica-cpus"])
        period = float(values["health-check-period-s"])
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"num-replicas / replica-cpus / health-check-period-s: {exc}"
        ) from exc
    if not 1 <= num_replicas <= 10_000 or not 0.0 <= cpus <= 1024.0:
        raise InvalidArgumentError(
            "num-replicas must be in [1, 10000] and replica-cpus in [0, 1024], got "
            f"{values['num-replicas']!r} and {values['replica-cpus']!r}"
        )
    if not 0.1 <= period <= 3600.0:
        raise InvalidArgumentError(
            f"health-check-period-s must be in [0.1, 3600], got {values['health-check-period-s']!r}"
        )
    return num_replicas, cpus, period


def _truth(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", ""):
        return True
    if text in ("false", "0", "no"):
        return False
    raise InvalidArgumentError(f"{key} is a switch: give true or false, got {value!r}")


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    parser.exit_on_error = False
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise InvalidArgumentError(f"bad ferrox serve options {argv}: {exc}") from exc


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise MissingDependencyError(
            "the Ray Serve application needs Ray Serve: pip install 'ray[serve]'"
        ) from exc
    return serve


class FerroxServer:
    """One Serve replica: a ferrox server and its engine."""

    def __init__(self, argv: list[str]) -> None:
        # A dead engine is the health check's to report (the client records it).
        self.server: ServerApp = build_server_app(parse_serve_args(argv), lambda _: None)

    def __serve_build_asgi_app__(self) -> Any:
        return self.server.app

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped or stalled
        is unhealthy, and Serve replaces it."""
        client = self.server.ctx.client
        if client.is_dead:
            raise RuntimeError(f"the engine stopped: {client.dead_message}")
        if client.is_stalled:
            raise RuntimeError("the engine has stopped making progress")


def build_app(options: dict[str, Any]) -> Any:
    """The Serve application (`serve run ferrox.server.ray_serve:build_app
    key=value ...` passes the arguments as a dict)."""
    serve = _serve()
    argv = serve_argv(options)
    parse_serve_args(argv)  # refuse bad options here, not on every replica
    num_replicas, cpus, period = app_options(options)
    deployment = serve.deployment(
        serve.ingress()(FerroxServer),
        name="ferrox",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": cpus},
        # Loading a model takes a while; a slow start is not a failed one.
        health_check_period_s=period,
        health_check_timeout_s=30,
    )
    return deployment.bind(argv)
