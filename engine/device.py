"""Where the engine runs: device selection and the small pieces that differ
between host memory and an accelerator (synchronization, page-locked host
buffers for KV transfers)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` is ``cuda`` where a GPU is visible, else ``cpu``; anything else is
    a torch device string, checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_buffer(nbytes: int, device: torch.device) -> memoryview:
    """A writable host buffer for copies to and from ``device``: page-locked
    (pinned) for a GPU, so copies are DMA and can run asynchronously; plain
    memory for the host itself."""
    if device.type != "cuda":
        return memoryview(bytearray(nbytes))
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # numpy() shares the memory; the view keeps the tensor (and its pinning) alive.
    return memoryview(pinned.numpy())
