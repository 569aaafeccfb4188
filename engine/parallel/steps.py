"""Rank 0's model: each pass broadcast to the other ranks, then run here.

``ShardedModel`` stands in for the engine's LlamaModel on rank 0 (same
``forward`` and ``logits``): it sends the pass's inputs on the steps group
before running its own share, so every rank runs the same pass over the same
slots of its own cache (block ids are rank 0's pool's on every rank). The
LM head's shares are gathered to rank 0 and put side by side: the logits
are the full vocabulary's, and the sampler picks from them exactly as it
does at tensor_parallel_size 1.

A pass that fails half-way leaves the ranks out of step (one is waiting in
a collective the others left): the group is marked broken and every later
pass raises GroupBroken.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.parallel.group import GroupBroken, RankGroup
from engine.parallel.messages import Forward, Logits, StepMessage, Stop


class ShardedModel:
    """Rank 0's share of the model, driving the other ranks' shares."""

    screen_head = None  # the greedy screen needs the whole head

    def __init__(self, local: LlamaModel, group: RankGroup, vocab_size: int) -> None:
        self.local = local
        self.group = group
        self.vocab_size = vocab_size
        self.spec = local.spec  # one rank's share
        self.kernels = local.kernels

    @property
    def fused(self) -> bool:
        return self.local.fused

    @property
    def gpu_attention(self) -> bool:
        return self.local.gpu_attention

    @property
    def after_layer(self):
        """Rank 0's hook after each layer (LlamaModel.after_layer): past each
        layer's reduce, so every rank has written that layer's KV."""
        return self.local.after_layer

    @after_layer.setter
    def after_layer(self, hook) -> None:
        self.local.after_layer = hook

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        msg = Forward(on_host(input_ids), on_host(positions), on_host(meta))
        return self._run(msg, lambda: self.local.forward(input_ids, positions, meta, cache))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, vocab]
        def local() -> torch.Tensor:
            logits = gather_logits(self.local, self.group, hidden, self.vocab_size)
            assert logits is not None  # rank 0's
            return logits

        return self._run(Logits(on_host(hidden)), local)

    def _run(self, msg: StepMessage, local: Any) -> torch.Tensor:
        self.group.broadcast(self.group.steps, msg)
        try:
            return local()
        except GroupBroken:
            raise
        except BaseException as exc:  # the other ranks are somewhere in this pass
            self.group.fail(f"rank 0's pass raised {exc!r}")
            raise

    def stop(self) -> None:
        """Tell the other ranks to end (their step loops return)."""
        if self.group.broken is None:
            self.group.broadcast(self.group.steps, Stop())


def gather_logits(
    model: LlamaModel, group: RankGroup, hidden: torch.Tensor, vocab_size: int
) -> torch.Tensor | None:
    """Each rank's share of the logits of ``hidden``; at rank 0 the whole
    vocabulary's, [M, vocab_size] (the last share's padding cut), else None."""
    shares = group.gather(group.model, model.logits(hidden))
    if shares is None:
        return None
    return torch.cat(shares, dim=1)[:, :vocab_size]


def run_step(
    model: LlamaModel, group: RankGroup, cache: KVCache, vocab_size: int, msg: StepMessage
) -> bool:
    """Ranks 1..N-1: run one message of rank 0's; False for Stop."""
    if isinstance(msg, Stop):
        return False
    device = model.cos.device
    if isinstance(msg, Forward):
        meta = on_device(msg.meta, device)
        model.forward(msg.input_ids.to(device), msg.positions.to(device), meta, cache)
    else:
        gather_logits(model, group, msg.hidden.to(device), vocab_size)
    return True


def on_host(value: Any) -> Any:
    return _moved(value, torch.device("cpu"))


def on_device(value: Any, device: torch.device) -> Any:
    return _moved(value, device)


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (dataclass fields, lists) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _moved(getattr(value, f.name), device) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value
