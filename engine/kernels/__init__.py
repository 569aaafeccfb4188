"""Fused CPU kernels (the .cpp files here), built on first use.

A decode step on CPU spends more time dispatching the ~35 small ATen ops
of each layer than in their arithmetic. The kernels fuse them into four per
layer (RMSNorm with the residual add, rotary embedding with the KV store,
paged decode attention, SiLU-and-multiply) plus a row argmax, a causal
prefill attention over the paged cache, matmuls over packed weights, matmuls
over quantized weights (quant_linear.cpp, engine/quant.py) and a screened
greedy head; docs/cpu-kernels.md describes them.

The extension is compiled with the machine's C++ compiler through
torch.utils.cpp_extension, once per CPU type, source and torch version, and
cached (engine/kernels/build.py: where, and how a failed build is
remembered); later processes load it in milliseconds. ``make setup`` builds
it ahead of time (``python -m engine.kernels``). ``EngineConfig.cpu_kernels``:
"auto" uses it when it builds and falls back to the PyTorch reference with
one warning when it cannot; "on" makes a failed build an error; "off" never
builds it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

from engine import hugepages
from engine.kernels import build

log = logging.getLogger(__name__)

PANEL_WIDTH = 32  # common.h's kPanel: columns per panel of a packed weight

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # by module name
_errors: dict[str, str] = {}


def cpu_ops(required: bool = False, rebuild: bool = False) -> ModuleType | None:
    """The compiled kernels for ``TANDEM_KERNEL_ISA`` (default: this CPU's),
    or None when they cannot be built (``required``: raise). A failure is
    logged once per process, and remembered in the build directory for later
    ones; ``rebuild`` forgets it (and the objects) and compiles again."""
    with _lock:
        name = (target := build.target()).name
        if rebuild:
            build.forget(target)
            _loaded.pop(name, None)
        if name not in _loaded:
            try:
                _loaded[name] = _build(target)
            except Exception as exc:  # no compiler, no headers, a compile error
                _errors[name] = build.describe(exc)
                _loaded[name] = None
                log.warning("CPU kernels unavailable, using the PyTorch path: %s", _errors[name])
        module = _loaded[name]
    if module is None and required:
        raise RuntimeError(
            f"cpu_kernels is 'on' but the CPU kernels did not build: {_errors.get(name)}"
        )
    return module


def _build(target: build.Target) -> ModuleType:
    return build.load(target)


def select(setting: str, device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernels for an engine with this ``cpu_kernels`` setting, or None."""
    if setting == "off" or device.type != "cpu" or dtype != torch.float32:
        if setting == "on" and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError("cpu_kernels 'on' needs device cpu and dtype float32")
        return None
    return cpu_ops(required=setting == "on")


def matrix_units(ops: ModuleType) -> bool:
    """Whether torch's bfloat16 matmul runs on matrix tiles here (the CPU has
    AMX-BF16, torch has oneDNN) and ``ops`` dequantizes into bfloat16 in vectors
    (an AVX-512 build): engine/quant.py's dense prefill path."""
    flags = build.cpu_isa_flags()
    return (
        ops.ISA == "avx512"
        and {"amx_tile", "amx_bf16"} <= flags
        and torch.backends.mkldnn.is_available()
    )


@dataclass(frozen=True)
class PackedWeight:
    """An [in, out] weight in the ``linear`` kernel's layout: panels of
    PANEL_WIDTH columns, [ceil(out / PANEL_WIDTH), in, PANEL_WIDTH], the last
    one zero-padded. The fused path keeps its weights only in this form."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, w: torch.Tensor) -> PackedWeight:
        k, n = w.shape
        count = -(-n // PANEL_WIDTH)
        padded = w.new_zeros(k, count * PANEL_WIDTH)
        padded[:, :n] = w
        panels = hugepages.empty((count, k, PANEL_WIDTH), w.dtype, w.device)
        panels.copy_(padded.view(k, count, PANEL_WIDTH).transpose(0, 1))
        return cls(panels, n)

    @classmethod
    def pack_gate_up(cls, w: torch.Tensor) -> PackedWeight:
        """The [in, 2 * inter] gate-and-up weight for ``linear_silu_mul``: the
        gate's panels, then the up's, each half padded on its own, so that
        panel t and panel G + t hold the same columns of both; ``out_features``
        is ``inter``, the width of what linear_silu_mul returns."""
        inter = w.shape[1] // 2
        return cls(cls.pack(_pad_halves(w)).panels, inter)

    @staticmethod
    def pad_gate_up_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
        """A [2 * inter] bias laid out as pack_gate_up lays out the columns."""
        return None if bias is None else _pad_halves(bias)


def _pad_halves(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each half of its last dimension zero-padded to whole panels."""
    inter = t.shape[-1] // 2
    width = -(-inter // PANEL_WIDTH) * PANEL_WIDTH
    padded = t.new_zeros(*t.shape[:-1], 2, width)
    padded[..., :inter] = t.unflatten(-1, (2, inter))
    return padded.flatten(-2)


@dataclass(frozen=True)
class Int8Head:
    """An int8 copy of a packed head, for cpu_ops' greedy_head, which reads
    it instead of the float32 panels and recomputes exactly only the columns
    that could hold the argmax. Column j is quantized symmetrically,
    ``w~_j = scale_j * q_j`` with ``|q_j| <= 127``; per column it keeps what
    the screen's bound needs: for a row x and its quantized x~,
    ``|x~ . w~_j - y_j| <= ||x|| * error_j + ||x - x~|| * norm_j`` where y_j
    is the float32 logit the linear kernel gives."""

    q8: torch.Tensor  # int8 [panels, 2 * ceil(K / 8), PANEL_WIDTH, 4]
    colsum: torch.Tensor  # int32 [columns]: sum of each column's q
    columns: torch.Tensor  # float32 [3, columns]: scale, error (||w - w~|| + rounding), ||w~||

    GROUP = 4  # k values a vpmaddubsw or vpdpbusd lane multiplies

    @classmethod
    def of(cls, head: PackedWeight, chunk: int = 256) -> Int8Head | None:
        """None when the weights are not all finite."""
        panels = head.panels
        if not bool(torch.isfinite(panels).all()):
            return None
        count, k, width = panels.shape
        groups = -(-k // (2 * cls.GROUP)) * 2  # the kernel takes two groups at a time
        unit = 2.0**-24  # float32 rounding of each fused multiply-add of y
        gamma = k * unit / (1 - k * unit)
        q8 = torch.zeros(count, groups * cls.GROUP, width, dtype=torch.int8)
        colsum = torch.empty(count, width, dtype=torch.int32)
        columns = torch.empty(3, count, width, dtype=torch.float32)
        for start in range(0, count, chunk):  # float64 copies a chunk at a time
            part = slice(start, start + chunk)
            w = panels[part].double()  # [p, K, 32]
            scale = (w.abs().amax(dim=1) / 127).float()  # what the kernel multiplies by
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(w / scale.double()[:, None, :]).clamp(-127, 127)
            approx = q * scale.double()[:, None, :]  # exact: a float32 times a small integer
            q8[part, :k] = q.to(torch.int8)
            colsum[part] = q.sum(dim=1).to(torch.int32)
            norm = w.square().sum(1).sqrt()
            columns[0, part] = scale
            # Rounded up: float64 arithmetic here, float32 storage.
            error = (w - approx).square().sum(1).sqrt() + gamma * norm
            columns[1, part] = (error * (1 + 1e-6) + 1e-30).float()
            columns[2, part] = (approx.square().sum(1).sqrt() * (1 + 1e-6)).float()
        packed = hugepages.empty((count, groups, width, cls.GROUP), torch.int8, q8.device)
        q8 = packed.copy_(q8.view(count, groups, cls.GROUP, width).transpose(2, 3))
        return cls(q8, colsum.reshape(-1), columns.reshape(3, -1).contiguous())

    def tokens(self, ops: ModuleType, x: torch.Tensor, head: PackedWeight, n: int, limit: int):
        """cpu_ops' greedy_head_i8 over this copy: [M] int64 tokens, -1 unsettled."""
        return ops.greedy_head_i8(x, head.panels, self.q8, self.colsum, self.columns, n, limit)


@dataclass(frozen=True)
class HalfHead:
    """A float16 copy of a packed head and, per column, how far a logit summed
    over it can be from the float32 one: ``|approx - exact| <= ||x||_2 *
    bound``. cpu_ops' greedy_head reads it instead of the float32 panels and
    recomputes exactly only the columns that could hold the argmax."""

    half: torch.Tensor  # float16, the packed panels' shape
    bound: torch.Tensor  # float64 [columns]

    @classmethod
    def of(cls, head: PackedWeight, chunk: int = 256) -> HalfHead | None:
        """None when float16 cannot hold the weights (too large, not finite)."""
        panels = head.panels
        if not bool(torch.isfinite(panels).all()) or float(panels.abs().max()) > 65504.0:
            return None
        half = panels.half()
        k = panels.shape[1]
        unit = 2.0**-24  # float32 rounding of each fused multiply-add
        gamma = k * unit / (1 - k * unit)
        parts = []
        for start in range(0, panels.shape[0], chunk):  # float64 copies a chunk at a time
            w = panels[start : start + chunk].double()
            w_half = half[start : start + chunk].double()
            error = (w - w_half).square().sum(1).sqrt()
            rounding = gamma * (w.square().sum(1).sqrt() + w_half.square().sum(1).sqrt())
            parts.append((error + rounding).reshape(-1))
        # Slack for the float64 arithmetic of the bound and of the screen itself.
        bound = torch.cat(parts) * (1 + 1e-6) + 1e-30
        return cls(half, bound)

    def tokens(self, ops: ModuleType, x: torch.Tensor, head: PackedWeight, n: int, limit: int):
        """cpu_ops' greedy_head_f16 over this copy: [M] int64 tokens, -1 unsettled."""
        return ops.greedy_head_f16(x, head.panels, self.half, self.bound, n, limit)


INT8_MAX_HIDDEN = {31: 512, 127: 2048}
"""The widest head the int8 screen takes, by how finely the kernel quantizes
rows (cpu_ops.INT8_ROW_LEVELS): the rows' share of the bound grows with
sqrt(hidden size) against the spread of the logits. With 6-bit rows (AVX2)
too many columns get through past 512; with 8-bit rows (AVX512-VNNI, AMX)
the screen still settles nearly every row at 2048 (docs/cpu-kernels.md has
the measurements)."""


def screen_for(head: PackedWeight, row_levels: int) -> Int8Head | HalfHead | None:
    """The greedy screen for a packed head, given cpu_ops.INT8_ROW_LEVELS: int8
    up to INT8_MAX_HIDDEN[row_levels] inputs, float16 above; None when neither
    can hold it."""
    if head.panels.shape[1] <= INT8_MAX_HIDDEN[row_levels]:
        return Int8Head.of(head)
    return HalfHead.of(head)
