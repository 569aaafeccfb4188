"""The attacker: one attack per run, in a process of its own, with no
credential but what its command line gives it (an insider, with
``--secret-stdin``, reads the cluster secret from stdin, never from argv).
Prints the outcome as one JSON line (``{"status": ..., "detail": ...}``;
see attack_outcome.Outcome); the reserve attack prints one when its header is
answered and one at the end. benchkit/attacks.py runs it with an environment stripped of every
TANDEM_* and RAY_* variable.

    python -m benchkit.attacker pull --kv HOST:PORT --layout JSON --tokens 1,2,3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from benchkit import attacker_api as api
from benchkit import attacker_streams as streams
from benchkit.attack_outcome import NO_SECRET, Outcome
from engine.kv_layout import KVLayout


def emit(outcome: Outcome) -> None:
    print(json.dumps(dataclasses.asdict(outcome)), flush=True)


def _tokens(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _layout(text: str) -> KVLayout:
    return KVLayout(**json.loads(text))


def _insider_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-stdin", action="store_true", help="an insider: the cluster secret (hex) on stdin"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchkit.attacker")
    sub = parser.add_subparsers(dest="attack", required=True)
    for name in ("pull", "push", "reserve"):
        p = sub.add_parser(name)
        p.add_argument("--kv", required=True, help="a worker's KV transfer address")
        p.add_argument("--layout", required=True, type=_layout, help="the model's KV layout (JSON)")
        if name == "reserve":
            p.add_argument("--blocks", required=True, type=int)
            p.add_argument("--hold-s", type=float, default=10.0)
        else:
            p.add_argument("--tokens", required=True, type=_tokens, help="the prompt's token ids")
        if name != "pull":
            p.add_argument("--outputs", required=True, help="the worker's output streams")
            p.add_argument("--router-id", required=True, help="the real router's id")
        _insider_flag(p)
    p = sub.add_parser("stream", help="log in to an output stream")
    p.add_argument("--outputs", required=True, help="host:port or unix-abstract:NAME")
    p.add_argument("--router-id", default="router-attacker")
    p.add_argument("--read-s", type=float, default=3.0)
    _insider_flag(p)
    p = sub.add_parser("scale")
    p.add_argument("--target", required=True)
    p.add_argument("--key", default=None)
    p.add_argument("--prefill", type=int, required=True)
    p.add_argument("--decode", type=int, required=True)
    p = sub.add_parser("body")
    p.add_argument("--http", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--mb", type=int, default=100)
    for name in ("stops", "stops-http"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True, help="gRPC address; HTTP URL for stops-http")
        p.add_argument("--key", required=True)
        p.add_argument("--requests", type=int, default=64)
        p.add_argument("--distinct", type=int, default=1, help="different stop lists among them")
    for name in ("nan", "nan-prompt"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True)
        p.add_argument("--key", required=True)
    p.add_argument("--late", action="store_true", help="NaN after two decode tokens")
    return parser


def _secret(args: argparse.Namespace) -> bytes | None:
    """The insider's cluster secret: one hex line on stdin."""
    return bytes.fromhex(sys.stdin.readline().strip()) if args.secret_stdin else None


def run(args: argparse.Namespace) -> Outcome:
    match args.attack:
        case "pull":
            from benchkit import attacker_kv as kv  # torch, for the KV attacks alone

            return asyncio.run(kv.pull(args.kv, args.layout, args.tokens, _secret(args)))
        case "push" | "reserve":
            from benchkit import attacker_kv as kv

            secret = _secret(args)
            key = NO_SECRET if secret is None else secret
            router_id, stream = streams.login_for_pushes(args.outputs, args.router_id, key)
            try:
                if args.attack == "push":
                    attack = kv.push(args.kv, args.layout, args.tokens, router_id, secret)
                else:
                    attack = kv.reserve(
                        args.kv, args.layout, args.blocks, args.hold_s, router_id, emit, secret
                    )
                return asyncio.run(attack)
            finally:
                if stream is not None:
                    stream.close()
        case "stream":
            key = _secret(args) or NO_SECRET
            return streams.stream_login(args.outputs, args.router_id, args.read_s, key)
        case "scale":
            return asyncio.run(api.scale(args.target, args.key, args.prefill, args.decode))
        case "body":
            return api.big_body(args.http, args.key, args.mb)
        case "stops":
            return asyncio.run(api.stop_flood(args.target, args.key, args.requests, args.distinct))
        case "stops-http":
            flood = api.stop_flood_http(args.target, args.key, args.requests, args.distinct)
            return asyncio.run(flood)
        case "nan":
            return asyncio.run(api.extreme_sampling(args.target, args.key))
        case "nan-prompt":
            return asyncio.run(api.poisoned_prompt(args.target, args.key, args.late))
    raise AssertionError(args.attack)


def main(argv: list[str] | None = None) -> int:
    try:
        emit(run(_parser().parse_args(argv)))
    except (ConnectionError, TimeoutError) as e:
        emit(Outcome("dropped", f"{type(e).__name__}: {e}"[:200]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
