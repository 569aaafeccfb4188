"""``tandem serve``: start Ray (or join a cluster), the pools and the router;
drain and stop everything on SIGINT/SIGTERM. A named deployment's router
(``--deployment NAME``) drains its own requests and leaves the pools, and
the local Ray cluster they run on, to the other routers and the next one
(``tandem down`` stops them)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

import yaml
from pydantic import ValidationError

from router.auth import ADMIN_KEYS_ENV, ApiKeys
from router.backend import Backend
from router.config import ServeConfig, describe_errors
from router.limits import TRANSPORT_BYTES_PER_TOKEN, generate_message_limit
from router.service import HttpSettings, RouterServer, Settled, check_keys
from router.tenancy import CacheDomains
from tandem_cli import ray_auth
from tandem_cli.ray_init import init_ray, ray_is_up
from worker.cpu_binding import (
    CoreLayout,
    available_cores,
    bind_process,
    nvidia_gpus_visible,
    plan_layout,
)
from worker.heap import freeze_startup_heap
from worker.logfmt import configure_logging

log = logging.getLogger(__name__)

# The flags of `tandem serve` (argparse dests) and the config path each sets.
SERVE_FLAGS = {
    "model": "engine.model",
    "load_format": "engine.load_format",
    "simulate": "engine.simulate",
    "deterministic": "engine.deterministic",
    "prefill": "pools.prefill",
    "decode": "pools.decode",
    "prefill_tp": "pools.prefill_resources.tensor_parallel_size",
    "decode_tp": "pools.decode_resources.tensor_parallel_size",
    "mode": "pools.mode",
    "ray_address": "pools.ray_address",
    "host": "server.host",
    "port": "server.port",
    "http_port": "server.http_port",
    "http_host": "server.http_host",
    "chat_template": "server.chat_template",
    "served_model_name": "server.served_model_name",
    "log_format": "server.log_format",
    "redis_url": "routing.redis_url",
    "grace_period_s": "limits.grace_period_s",
    "deployment": "deployment.name",
    "attach": "deployment.attach",
    "autoscale": "autoscale.enabled",
}
# `--slo ttft_ms=T,tpot_ms=P` (a dict from tandem_cli.plan_cmd's parser): the keys it sets.
SLO_FLAG_KEYS = {"ttft_ms": "autoscale.ttft_ms", "tpot_ms": "autoscale.tpot_ms"}


def command(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError, yaml.YAMLError) as e:  # ValidationError is a ValueError
        print(f"tandem serve: invalid configuration:\n{describe_config_error(e)}", file=sys.stderr)
        return 2
    configure_logging(config.server.log_format)
    return run(config)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """``--config`` YAML plus the flags that were given (flags win)."""
    flags = {path: getattr(args, dest) for dest, path in SERVE_FLAGS.items()}
    slo = getattr(args, "slo", None) or {}
    flags.update({SLO_FLAG_KEYS[key]: value for key, value in slo.items()})
    config = ServeConfig.load(args.config, flags)
    ray_auth.check_token_file()
    check_keys(api_keys(config), admin_keys(config), cache_domains(config))
    return config


def describe_config_error(e: Exception) -> str:
    if not isinstance(e, ValidationError):
        return f"  {e}"
    return "\n".join(f"  {line}" for line in describe_errors(e))


def model_name(config: ServeConfig) -> str:
    """What /v1/models lists: served_model_name, else the model argument."""
    return config.served_name()


def api_keys(config: ServeConfig) -> ApiKeys:
    """The config's keys, its keys file's and $TANDEM_API_KEYS, together."""
    security = config.security
    return ApiKeys.load([k.get_secret_value() for k in security.api_keys], security.api_keys_file)


def admin_keys(config: ServeConfig) -> ApiKeys:
    """The config's admin keys, its admin keys file's and $TANDEM_ADMIN_KEYS, together."""
    security = config.security
    keys = [k.get_secret_value() for k in security.admin_keys]
    return ApiKeys.load(
        keys,
        security.admin_keys_file,
        env_name=ADMIN_KEYS_ENV,
        file_setting="security.admin_keys_file",
    )


def cache_domains(config: ServeConfig) -> CacheDomains:
    """The prefix-cache domains, their salts keyed by the cluster secret."""
    security = config.security
    return CacheDomains.of(security.cache_domain, security.cluster_security())


def http_settings(config: ServeConfig, *, local: bool = False) -> HttpSettings | None:
    """The HTTP front's settings; None when server.http_port is unset (no HTTP
    front). ``local`` binds 127.0.0.1 on a free port (tests)."""
    server = config.server
    if server.http_port is None:
        return None
    tls = config.security.http_tls()
    return HttpSettings(
        host="127.0.0.1" if local else server.http_host or server.host,
        port=0 if local else server.http_port,
        model_name=model_name(config),
        chat_template_file=server.chat_template,
        tls_cert=tls[0] if tls else None,
        tls_key=tls[1] if tls else None,
    )


def transport_message_limit(config: ServeConfig) -> int:
    """The largest message the router's gRPC port takes, fixed when it binds:
    ``limits.max_message_mb``, lowered to what a request can use when
    ``engine.max_model_len`` is set (the model's own limit is known only once the
    workers are up; then Generate requests are held to it exactly)."""
    cap = config.limits.max_message_mb << 20
    max_model_len = config.engine.max_model_len
    if max_model_len is None:
        return cap
    limits = config.limits.request_limits()
    return generate_message_limit(max_model_len, TRANSPORT_BYTES_PER_TOKEN, limits, cap)


def server_for(config: ServeConfig, backend: Backend, *, local: bool = False) -> RouterServer:
    """The router server of a config; ``local`` binds both fronts to 127.0.0.1 on free
    ports (tests)."""
    return RouterServer(
        backend,
        host="127.0.0.1" if local else config.server.host,
        port=0 if local else config.server.port,
        max_queued_requests=config.limits.max_queued_requests,
        request_timeout_s=config.limits.request_timeout_s,
        drain_timeout_s=config.limits.grace_period_s,
        max_message_bytes=transport_message_limit(config),
        tls_cert=config.security.tls_cert,
        tls_key=config.security.tls_key,
        api_keys=api_keys(config),
        admin_keys=admin_keys(config),
        cache_domains=cache_domains(config),
        max_pool_workers=config.pools.max_workers,
        http=http_settings(config, local=local),
        limits=config.limits.request_limits(),
        settle=lambda: settled(joined_config(backend, config)),
    )


def joined_config(backend: Backend, config: ServeConfig) -> ServeConfig:
    """The config a started backend serves with (a RayBackend's: its deployment's
    shared settings and secret), else ``config``."""
    joined = getattr(backend, "config", None)
    return joined if isinstance(joined, ServeConfig) else config


def settled(config: ServeConfig) -> Settled:
    """The model name and cache domains of the config a backend joined: a named
    deployment's model, its salts keyed by the deployment's cluster secret."""
    return Settled(model_name(config), cache_domains(config))


def plan_cores(config: ServeConfig) -> CoreLayout | None:
    """The cores of the local cluster's decode workers and of everything else
    (worker/cpu_binding.py); None when nothing is to be bound."""
    pools = config.pools
    if not pools.cpu_binding or pools.ray_address:
        return None
    resources = pools.decode_resources
    if resources.num_gpus is None:
        if nvidia_gpus_visible():  # Ray gives each worker a GPU
            return None
    elif resources.num_gpus > 0:
        return None
    if resources.tensor_parallel_size > 1:
        log.info("cpu binding: off (decode workers have %d ranks)", resources.tensor_parallel_size)
        return None
    cores, threads = available_cores(), resources.num_threads
    layout = plan_layout(cores, pools.decode, threads)
    if layout is None:
        log.info(
            "cpu binding: off (%d cores cannot give %d decode workers %d each and keep one)",
            len(cores),
            pools.decode,
            threads,
        )
    return layout


def run(config: ServeConfig) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code (1 when startup failed)."""
    if config.pools.batch_scheduling:  # before Ray and the server start their threads
        from worker.sched_policy import set_policy

        set_policy(batch=True)
    try:
        asyncio.run(serve(config))
    except Exception:
        log.exception("tandem serve failed")
        name = config.deployment.name
        if name is not None:
            print(
                f"tandem serve: deployment {name!r} did not start; `tandem down --deployment "
                f"{name}` removes what is left of it",
                file=sys.stderr,
            )
        return 1
    return 0


async def serve(
    config: ServeConfig, *, backend: Backend | None = None, stop: asyncio.Event | None = None
) -> None:
    """Serve until ``stop`` is set or a SIGINT/SIGTERM arrives, then drain and stop.

    With no ``backend``, starts Ray (see init_ray) and a ``RayBackend``, and
    stops both on the way out.
    """
    stop = stop or asyncio.Event()
    server: RouterServer | None = None

    def cut_grace() -> None:
        if server is not None:
            server.cut_grace()

    own_backend = backend is None
    cores = None
    if own_backend and not ray_is_up():
        cores = plan_cores(config)
        if cores is not None and bind_process(cores.shared):  # Ray's processes inherit it
            log.info("cpu binding: %s", cores.describe())
        else:
            cores = None
    started_ray = own_backend and init_ray(config)
    # Installed after ray.init (Ray's core worker sets a SIGTERM handler that
    # must not wrap ours) and kept through ray.shutdown(), so that a second
    # signal never lands as a KeyboardInterrupt in the middle of it.
    with _signals_set(stop, cut_grace, config.limits.grace_period_s):
        try:
            if backend is None:
                from router.ray_backend import RayBackend

                backend = RayBackend(config, cores)
            server = server_for(config, backend)
            await server.start()
            if own_backend:  # this process is `tandem serve` itself, not a test's
                freeze_startup_heap()
            http = f", HTTP on {server.http.url}" if server.http is not None else ""
            auth = f", {len(server.api_keys)} API keys" if server.api_keys.enabled else ""
            if server.admin_keys.enabled:
                auth += f", {len(server.admin_keys)} admin keys"
            model, pools = _served(backend, config)
            print(f"tandem: serving {model} on {server.address}{http} ({pools}{auth})", flush=True)
            autoscaling = start_autoscaler(config, backend, server)
            try:
                await stop.wait()
            finally:
                if autoscaling is not None:
                    autoscaling.cancel()
                    await asyncio.gather(autoscaling, return_exceptions=True)
                await server.stop(config.limits.grace_period_s)  # shuts the backend down too
        finally:
            if started_ray:
                import ray

                ray.shutdown()


def start_autoscaler(
    config: ServeConfig, backend: Backend, server: RouterServer
) -> asyncio.Task | None:
    """The autoscaler's loop (router/autoscaler_runner.py) when autoscale.enabled."""
    if not config.autoscale.enabled:
        return None
    from router.autoscaler_model import model_for
    from router.autoscaler_runner import AutoscaleRunner, lifecycle_arrivals

    joined = joined_config(backend, config)
    profile = config.autoscale.profile or joined.engine.simulate
    model = model_for(profile, joined)
    arrived = lifecycle_arrivals(server.lifecycle)
    runner = AutoscaleRunner(backend, server.metrics, arrived, model)  # type: ignore[arg-type]
    log.info("autoscaling: %s", config.autoscale.model_dump())
    return asyncio.create_task(runner.run())


def _served(backend: Backend, config: ServeConfig) -> tuple[str, str]:
    """The model and the pools the backend serves: a joined deployment's."""
    joined = joined_config(backend, config)
    pools = joined.pools
    prefill, decode = pools.prefill, pools.decode
    if hasattr(backend, "prefill") and hasattr(backend, "decode"):
        prefill, decode = len(backend.prefill.workers), len(backend.decode.workers)
    model = joined.engine.model or "the default model"
    if joined.engine.simulate is not None:
        model = f"the simulated model of profile {joined.engine.simulate}"
    return model, f"prefill {prefill}, decode {decode}, {pools.mode}"


@contextlib.contextmanager
def _signals_set(stop: asyncio.Event, cut_grace: Callable[[], None], grace_s: float):
    """SIGINT/SIGTERM set ``stop``; a second one calls ``cut_grace``."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            print("tandem: second signal, stopping now", file=sys.stderr, flush=True)
            cut_grace()
            return
        print(
            f"tandem: {signal.Signals(signum).name}, draining (up to {grace_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        stop.set()

    signums = (signal.SIGINT, signal.SIGTERM)
    for signum in signums:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in signums:
            loop.remove_signal_handler(signum)
