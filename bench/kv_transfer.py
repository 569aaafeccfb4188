"""KV transfer throughput against raw TCP, and against prefill time.

    python bench/kv_transfer.py [--mib 256] [--reps 3] [--skip-model]

Between two processes on 127.0.0.1, in the same run:
1. push MiB of KV blocks with tandem's transfer (checksummed, into the
   receiver's pool; chunks over the raw TCP data connection the gRPC call
   negotiates, the default), the same over the gRPC stream alone
   (``data_channel=False``), and send the same number of bytes over a raw
   TCP socket (sendall / recv_into);
2. push the KV of a 2,048-token prompt of a SmolLM2-135M-shaped model
   (random weights) and compare with that model's prefill of the prompt;
3. with ``--tls``: the push again with cluster TLS (mutual, throwaway
   certificates made with openssl) and a cluster secret, over the gRPC
   stream (the default under TLS) and over the data connection
   (``tls_data_channel``: TLS via Python's ssl module); and the median time
   of a small (2-block) push, plaintext and both ways under TLS;
4. with ``--auth-cost``: the bulk push and the 2-block push with the
   internal gRPC calls' MAC (net/call_auth.py, the default) and without it
   (benchkit/no_call_auth.py, a baseline only this script builds), with
   their ratios.
The last line is a JSON object with the figures (medians over --reps).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit.kv_peer import Peer, PeerSpec
from engine.kv_cache import KVLayout
from kv_transfer import TransferConfig

LAYOUT = KVLayout("bench", "float32", 8, 16, 4, 64)  # 256 KiB per block
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    architectures=["LlamaForCausalLM"],
)


def _tcp_receiver(port_queue, nbytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    buf = memoryview(bytearray(nbytes))
    while True:
        conn, _ = listener.accept()
        got = 0
        while got < nbytes:
            n = conn.recv_into(buf[got:])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
        conn.close()


def raw_tcp_mb_s(nbytes: int, reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_tcp_receiver, args=(ports, nbytes), daemon=True)
    proc.start()
    port = ports.get(timeout=60)
    payload = memoryview(bytearray(nbytes))
    out = []
    try:
        for _ in range(reps + 1):  # the first run warms up
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(payload)
                conn.recv(1)
            out.append(nbytes / (time.perf_counter() - start) / 1e6)
    finally:
        proc.kill()
        proc.join()
    return out[1:]


def tandem_mb_s(num_blocks: int, reps: int, config: TransferConfig) -> list[float]:
    sender = Peer(PeerSpec(num_blocks, LAYOUT, seed=1, config=config))
    receiver = Peer(PeerSpec(num_blocks, LAYOUT, seed=2, config=config))
    out = []
    try:
        _ = sender.address, receiver.address
        blocks = sender.call("allocate", num_blocks)
        for i in range(reps + 1):
            remote, nbytes, seconds = sender.call("push", receiver.address, f"r{i}", blocks)
            receiver.call("release", receiver.call("claim", f"r{i}"))
            out.append(nbytes / seconds / 1e6)
        if receiver.call("digest", remote) != sender.call("digest", blocks):
            raise SystemExit("transfer corrupted the data")
    finally:
        sender.close()
        receiver.close()
    return out[1:]


def smollm2_prompt(prompt_len: int) -> dict:
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(**SMOLLM2_135M).save_pretrained(tmp)
        num_blocks = prompt_len // 16 + 16
        spec = PeerSpec(num_blocks, model=tmp, load_format="dummy", num_threads=2)
        prefill, decode = Peer(spec), Peer(spec)
        try:
            prompt = [(i * 7919) % 49000 + 10 for i in range(prompt_len)]
            params = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
            prefill.call("prefill_and_push", decode.address, "warmup", prompt[:64], params)
            decode.call("release", decode.call("claim", "warmup"))
            _, prefill_s, push_s = prefill.call(
                "prefill_and_push", decode.address, "r", prompt, params, timeout_s=900
            )
            decode.call("release", decode.call("claim", "r"))
        finally:
            prefill.close()
            decode.close()
    per_token = 2 * 30 * 3 * 64 * 4
    kv_bytes = -(-prompt_len // 16) * 16 * per_token
    return {
        "prompt_tokens": prompt_len,
        "kv_mb": round(kv_bytes / 1e6, 1),
        "prefill_s": round(prefill_s, 3),
        "transfer_s": round(push_s, 3),
        "transfer_over_prefill": round(push_s / prefill_s, 4),
    }


def small_push_ms(config: TransferConfig, n: int = 60) -> float:
    """Median time of a 2-block push (what a short prompt sends)."""
    sender = Peer(PeerSpec(64, LAYOUT, seed=1, config=config))
    receiver = Peer(PeerSpec(64, LAYOUT, seed=2, config=config))
    times = []
    try:
        _ = sender.address, receiver.address
        blocks = sender.call("allocate", 2)
        for i in range(n + 5):  # the first few warm up
            _, _, seconds = sender.call("push", receiver.address, f"s{i}", blocks)
            receiver.call("release", receiver.call("claim", f"s{i}"))
            times.append(seconds)
    finally:
        sender.close()
        receiver.close()
    return statistics.median(times[5:]) * 1e3


def tls_figures(num_blocks: int, reps: int, raw_mb_s: float) -> dict:
    from net.security import ClusterSecurity, TLSFiles
    from tests.tls_certs import make_certs

    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp), "bench")
        tls = TLSFiles(str(certs.cert), str(certs.key), str(certs.ca))
        security = ClusterSecurity(b"bench-secret", tls)
        data = tandem_mb_s(
            num_blocks, reps, TransferConfig(security=security, tls_data_channel=True)
        )
        grpc_only = tandem_mb_s(num_blocks, reps, TransferConfig(security=security))
        small = {
            "plain_data_channel": small_push_ms(TransferConfig()),
            "tls_grpc": small_push_ms(TransferConfig(security=security)),
            "tls_data_channel": small_push_ms(
                TransferConfig(security=security, tls_data_channel=True)
            ),
        }
    print(f"TLS data channel MB/s:   {[round(x) for x in data]}")
    print(f"TLS gRPC (default) MB/s: {[round(x) for x in grpc_only]}")
    print(f"2-block push, median ms: { {k: round(v, 2) for k, v in small.items()} }")
    tls_mb_s, tls_grpc_mb_s = statistics.median(data), statistics.median(grpc_only)
    return {
        "small_push_ms": {k: round(v, 2) for k, v in small.items()},
        "tls_mb_s": round(tls_mb_s),
        "tls_ratio": round(tls_mb_s / raw_mb_s, 3),
        "tls_grpc_only_mb_s": round(tls_grpc_mb_s),
        "tls_grpc_only_ratio": round(tls_grpc_mb_s / raw_mb_s, 3),
    }


def auth_cost_figures(num_blocks: int, reps: int) -> dict:
    """The call MAC on (the default) and off, in the same run."""
    from benchkit.no_call_auth import NoCallAuth
    from net.security import ClusterSecurity

    on = TransferConfig(security=ClusterSecurity.generate())
    off = TransferConfig(security=NoCallAuth(ClusterSecurity.generate().secret))
    bulk_on, bulk_off = tandem_mb_s(num_blocks, reps, on), tandem_mb_s(num_blocks, reps, off)
    small_on, small_off = small_push_ms(on), small_push_ms(off)
    figures = {
        "auth_bulk_mb_s": round(statistics.median(bulk_on)),
        "no_auth_bulk_mb_s": round(statistics.median(bulk_off)),
        "auth_small_push_ms": round(small_on, 3),
        "no_auth_small_push_ms": round(small_off, 3),
    }
    figures["auth_bulk_ratio"] = round(statistics.median(bulk_on) / statistics.median(bulk_off), 3)
    figures["auth_small_push_ratio"] = round(small_on / small_off, 3)
    rounded_on, rounded_off = [round(x) for x in bulk_on], [round(x) for x in bulk_off]
    print(f"call MAC on/off, bulk MB/s: {rounded_on} / {rounded_off}")
    print(f"call MAC on/off, 2-block push ms: {small_on:.3f} / {small_off:.3f}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--tls", action="store_true", help="also measure with cluster TLS")
    parser.add_argument(
        "--auth-cost", action="store_true", help="also measure the call MAC against none"
    )
    args = parser.parse_args()
    num_blocks = args.mib * (1 << 20) // LAYOUT.block_bytes
    nbytes = num_blocks * LAYOUT.block_bytes
    tandem = tandem_mb_s(num_blocks, args.reps, TransferConfig())
    raw = raw_tcp_mb_s(nbytes, args.reps)
    grpc_only = tandem_mb_s(num_blocks, args.reps, TransferConfig(data_channel=False))
    print(f"tandem push MB/s: {[round(x) for x in tandem]}")
    print(f"raw TCP MB/s:     {[round(x) for x in raw]}")
    print(f"gRPC only MB/s:   {[round(x) for x in grpc_only]}")
    result: dict = {
        "bytes": nbytes,
        "tandem_mb_s": round(statistics.median(tandem)),
        "raw_tcp_mb_s": round(statistics.median(raw)),
    }
    result["ratio"] = round(result["tandem_mb_s"] / result["raw_tcp_mb_s"], 3)
    result["target_ratio"] = 0.6
    result["grpc_only_mb_s"] = round(statistics.median(grpc_only))
    result["grpc_only_ratio"] = round(result["grpc_only_mb_s"] / result["raw_tcp_mb_s"], 3)
    if args.tls:
        result.update(tls_figures(num_blocks, args.reps, result["raw_tcp_mb_s"]))
    if args.auth_cost:
        result.update(auth_cost_figures(num_blocks, args.reps))
    if not args.skip_model:
        result["smollm2_135m_2048"] = smollm2_prompt(2048)
        print(f"SmolLM2-135M shape: {result['smollm2_135m_2048']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
