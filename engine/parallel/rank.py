"""A tensor-parallel rank: its share of the model, loaded the same way on
every rank, and the loop of ranks 1..N-1.

Rank 0 decides what every rank must agree on (``ShardPlan``: the resolved
checkpoint, the pool's block count, the model length, the kernel path) and
starts ranks 1..N-1 with it, each through a launcher (local processes for
the offline API, Ray actors for a serving worker). A rank loads its share,
says it is ready in the rendezvous store (or writes its error there), joins
the groups (proving the engine's secret, which its spec carries and the
store never holds: engine/parallel/auth.py), then runs rank 0's passes
until told to stop, answering KV reads and writes on a second thread.

``python -m engine.parallel.rank`` runs one rank whose ``RankSpec`` comes
pickled on stdin (engine/parallel/local.py starts it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelSpec
from engine.gpu.paged_attention import use_kernel as use_gpu_kernel
from engine.kernels import select as select_kernels
from engine.kv_cache import KVCache, KVLayout
from engine.loader import load_hf_config, load_weights
from engine.models.llama import LlamaModel
from engine.parallel import kv
from engine.parallel.group import RankGroup, Rendezvous
from engine.parallel.sharding import rank_spec, shard_state
from engine.parallel.steps import run_step


@dataclass(frozen=True)
class ShardPlan:
    """What every rank of one engine shares; rank 0's choices."""

    config: EngineConfig  # cpu_kernels "on" or "off": rank 0's path, on every rank
    model_dir: str
    layout: KVLayout  # tp_size ranks
    num_blocks: int
    max_model_len: int
    vocab_size: int  # the whole vocabulary's (each rank's head holds a share)


@dataclass(frozen=True)
class RankSpec:
    plan: ShardPlan
    rendezvous: Rendezvous
    rank: int
    device: str  # this rank's torch device, as this rank's process names it
    secret: bytes = field(repr=False)  # the engine's (auth.py): never logged, never stored


def load_shard(plan: ShardPlan, rank: int, device: torch.device) -> LlamaModel:
    """Rank ``rank``'s share of the model (it reads the whole checkpoint, keeps its share)."""
    config = plan.config
    torch.manual_seed(config.seed)
    model_dir = Path(plan.model_dir)
    hf_config = load_hf_config(model_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    tp = config.tensor_parallel_size
    state = load_weights(config, model_dir, spec, hf_config)
    state = shard_state(state, spec, rank, tp, config.quantization)
    dtype = getattr(torch, config.dtype)
    gpu_attention = use_gpu_kernel(config.attention, device, config.deterministic)
    kernels = None if gpu_attention else select_kernels(config.cpu_kernels, device, dtype)
    return LlamaModel(
        rank_spec(spec, tp), state, hf_config, plan.max_model_len, dtype, device, kernels,
        greedy_screen=False, quantization=config.quantization, gpu_attention=gpu_attention,
        matrix_units=config.matrix_units,
    )  # fmt: skip


def run_rank(spec: RankSpec) -> None:
    """Ranks 1..N-1: load, join, run rank 0's passes until it stops them."""
    plan, rank = spec.plan, spec.rank
    store = spec.rendezvous.store()
    try:
        if plan.config.num_threads:
            torch.set_num_threads(plan.config.num_threads)
        device = torch.device(spec.device)
        model = load_shard(plan, rank, device)
        cache = KVCache(plan.layout, plan.num_blocks, device)
        store.set(f"ready/{rank}", b"1")
        group = RankGroup(spec.rendezvous, rank, store, device, spec.secret)
    except BaseException:
        _say_error(spec.rendezvous, store, rank)
        raise
    model.reduce = group.all_reduce
    transfers = threading.Thread(target=kv.serve, args=(group, cache), name="tp-kv", daemon=True)
    transfers.start()
    while run_step(model, group, cache, plan.vocab_size, group.broadcast(group.steps)):
        pass
    transfers.join(timeout=30)


def _say_error(rendezvous: Rendezvous, store, rank: int) -> None:
    """Leave this rank's error for rank 0 (wait_ready, setup.start) while the
    store is there (rank 0 removes it once joined, or failed: a store call
    would then wait for the file to come back)."""
    if not os.path.isdir(rendezvous.directory):
        return
    with contextlib.suppress(RuntimeError):  # the store went meanwhile: the raise says it
        store.set(f"error/{rank}", traceback.format_exc()[-4000:].encode())


def main() -> None:
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    _die_with_parent()
    run_rank(spec)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the one that started it ends."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
