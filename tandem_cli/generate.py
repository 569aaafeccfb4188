"""``tandem generate``: stream one completion to stdout, usage and timings to stderr."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from protos.tandem.v1 import generate_pb2 as pb
from router.client import TandemClient
from tandem_cli.tls_ca import read_tls_ca

# Every GenerateRequest field but the prompt is a flag of the same name (the
# client sets resume_token_ids itself when it moves a stream to another router);
# read strictly, so that a new field without a flag fails tests/unit/test_cli.py.
SAMPLING_ARGS = tuple(
    f.name
    for f in pb.GenerateRequest.DESCRIPTOR.fields
    if f.name not in ("prompt", "prompt_token_ids", "resume_token_ids")
)


def command(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_token_ids is None):
        print("tandem generate: give a prompt or --prompt-token-ids (not both)", file=sys.stderr)
        return 2
    prompt = args.prompt if args.prompt is not None else args.prompt_token_ids
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    if not targets:
        print("tandem generate: --target needs a router address", file=sys.stderr)
        return 2
    sampling = {name: getattr(args, name) for name in SAMPLING_ARGS}
    ca = read_tls_ca(args.tls_ca)
    wrote: list[str] = []
    try:
        final = asyncio.run(_stream(targets, args.timeout, ca, prompt, sampling, wrote))
    except grpc.aio.AioRpcError as e:
        if wrote:  # end the partial output's line
            print(flush=True)
        print(f"tandem: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(summary(final), file=sys.stderr)
    return 0


async def _stream(
    targets: list[str],
    timeout_s: float | None,
    ca: bytes | None,
    prompt: str | list[int],
    sampling: dict,
    wrote: list[str],
) -> pb.GenerateFinal:
    out = sys.stdout
    logprobs: list[pb.TokenLogprob] = []
    async with TandemClient(targets, timeout_s, root_certificates=ca) as client:
        async for response in client.generate(prompt, **sampling):
            if response.HasField("chunk"):
                out.write(response.chunk.text)
                out.flush()
                wrote.append(response.chunk.text)
                logprobs.extend(response.chunk.logprobs)
            elif response.HasField("final"):
                out.write("\n")
                out.flush()
                for lp in logprobs:
                    print(format_logprob(lp), file=sys.stderr)
                return response.final
    raise RuntimeError("the stream ended without a final message")


def format_logprob(lp: pb.TokenLogprob) -> str:
    top = ", ".join(f"{t.token_id}: {t.logprob:.3f}" for t in lp.top_logprobs)
    return f"  token {lp.token_id}: {lp.logprob:.3f}" + (f"  (top {top})" if top else "")


def summary(final: pb.GenerateFinal) -> str:
    u, t = final.usage, final.timings
    return (
        f"[{final.finish_reason}] {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
        f"{u.completion_tokens} completion tokens; TTFT {t.ttft_s * 1e3:.1f} ms, "
        f"TPOT {t.mean_tpot_s * 1e3:.1f} ms; prefill {t.prefill_worker or '-'}, "
        f"decode {t.decode_worker or '-'}; request {final.request_id}"
    )
