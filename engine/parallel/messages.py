"""The messages rank 0 sends the other ranks of a tensor-parallel engine,
and how they are encoded.

A message travels as torch.save's bytes and is read back with
``torch.load(weights_only=True)``, which builds tensors, plain values and
the classes of ``ALLOWED`` only: even what reaches a rank from a peer that
holds the engine's secret (engine/parallel/auth.py) is data, not code to run.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillSlice
from engine.gpu.paged_attention import PagedBatch


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor  # [N], on the host
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata  # its tensors on the host


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor  # [M, hidden] rows to take logits of, on the host


@dataclass(frozen=True)
class Stop:
    pass


StepMessage = Forward | Logits | Stop


@dataclass(frozen=True)
class ReadKV:
    block_ids: list[int]
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class WriteKV:
    block_ids: list[int]
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class StopKV:
    pass


KVMessage = ReadKV | WriteKV | StopKV
# Every class a message may hold (a class added to AttentionMetadata's fields
# belongs here too, or the other ranks refuse the message).
ALLOWED = [
    *(Forward, Logits, Stop, ReadKV, WriteKV, StopKV),
    *(AttentionMetadata, DecodeGroup, PrefillSlice, PagedBatch),
]
torch.serialization.add_safe_globals(ALLOWED)  # once per process, for every thread's loads


def encode(message: StepMessage | KVMessage) -> bytes:
    buf = io.BytesIO()
    torch.save(message, buf, _use_new_zipfile_serialization=False)  # the smaller, faster form
    return buf.getvalue()


def decode(data: bytes) -> StepMessage | KVMessage:
    return torch.load(io.BytesIO(data), weights_only=True)
