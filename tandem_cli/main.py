"""The ``tandem`` console script: argument parsing and dispatch only."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tandem_cli.plan_cmd import _slo as slo_targets
from tandem_cli.tls_ca import UsageError, add_tls_ca

DEFAULT_TARGET = "127.0.0.1:50051"


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.add_argument(
        "--prompt-token-ids",
        type=_int_list,
        metavar="ID,ID,...",
        help="send token ids instead of text",
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        metavar="ADDR[,ADDR...]",
        help="router address (%(default)s), or several: a stream whose router is lost "
        "goes on at the next one",
    )
    p.add_argument("--timeout", type=float, metavar="S", help="deadline for the whole request")
    p.add_argument("--request-id")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="S", help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        action="append",
        type=int,
        metavar="ID",
        help="stop token id (repeatable)",
    )
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--logprobs", type=int, metavar="N", help="top alternatives per token")
    p.add_argument("--cache-salt", metavar="S", help="prefix-cache domain (vLLM's cache_salt)")
    p.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="place among requests waiting for KV room: higher first (default 0)",
    )
    add_tls_ca(p)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    # Every default is None so that a value from --config wins over an unset flag.
    p = sub.add_parser("serve", help="start the pools and the router")
    p.add_argument("--config", metavar="FILE", help="YAML deployment config; flags override it")
    p.add_argument(
        "--model",
        metavar="ID_OR_PATH",
        help="checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct "
        "when installed, else the embedded tiny model)",
    )
    p.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="run the simulated model of this profile (a file or a shipped name, "
        "`tandem plan --profiles`) in every worker: profile step times, deterministic tokens",
    )
    p.add_argument("--prefill", type=int, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, metavar="M", help="decode workers")
    p.add_argument(
        "--prefill-tp", type=int, metavar="A", help="ranks of each prefill worker (tensor parallel)"
    )
    p.add_argument(
        "--decode-tp", type=int, metavar="B", help="ranks of each decode worker (tensor parallel)"
    )
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--host", metavar="H")
    p.add_argument("--port", type=int, metavar="P")
    p.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster")
    p.add_argument(
        "--deployment",
        metavar="NAME",
        help="name the deployment: its pools (and local Ray cluster) outlive this router, "
        "and a later `tandem serve --deployment NAME` attaches to them",
    )
    p.add_argument(
        "--attach",
        action="store_true",
        default=None,
        help="only attach to the running pools of --deployment NAME (another router)",
    )
    p.add_argument(
        "--redis-url",
        metavar="URL",
        help="keep the block index in Redis (shared by several routers)",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="dummy: random weights of the model's config (benchmarks)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        metavar="P",
        help="serve the OpenAI-compatible HTTP API and /metrics on port P (default: off)",
    )
    p.add_argument("--http-host", metavar="H", help="HTTP front address (default: --host)")
    p.add_argument(
        "--chat-template", metavar="FILE", help="Jinja chat template (default: the tokenizer's)"
    )
    p.add_argument(
        "--served-model-name", metavar="NAME", help="model name of the HTTP API (/v1/models)"
    )
    p.add_argument("--log-format", choices=["text", "json"], help="log lines (default: text)")
    p.add_argument(
        "--grace-period",
        dest="grace_period_s",
        type=float,
        metavar="S",
        help="seconds given to requests in flight on shutdown",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="outputs bit-identical whatever else is in the batch (slower; docs/deterministic.md)",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        default=None,
        help="resize the pools to meet --slo (bounds: the config's autoscale section)",
    )
    p.add_argument(
        "--slo",
        type=slo_targets,
        metavar="ttft_ms=T,tpot_ms=P",
        help="latency targets of --autoscale (default ttft_ms=1000,tpot_ms=100)",
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated LLM serving: prefill and decode pools."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    for name in _PLUGGED:
        importlib.import_module(f"tandem_cli.{name}_cmd").add_parser(sub)
    return parser


# Commands whose module defines both add_parser(sub) and command(args).
_PLUGGED = ("bench", "down", "plan", "scale")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        from tandem_cli import generate

        return generate.command(args)
    if args.command == "serve":
        from tandem_cli import serve

        return serve.command(args)
    if args.command in _PLUGGED:
        return importlib.import_module(f"tandem_cli.{args.command}_cmd").command(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
