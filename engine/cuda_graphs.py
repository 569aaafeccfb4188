"""Decode steps at fixed shapes, replayed as CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch
cost rivals the work at small batches. A CUDA graph records the whole
forward once per shape and replays it with one launch. Shapes must be
static, so a step is padded:

- the batch up to the next size in ``BATCH_SIZES``, with rows that read and
  write only a scratch block the engine sets aside; their outputs are
  dropped;
- the block tables up to a multiple of ``WIDTH_STEP`` blocks (padding
  entries point at block 0 and are masked out);
- on a GPU with Triton, one launch of the paged-attention kernel over
  static tables, lengths and a grid of one query token a row
  (engine/gpu/paged_attention.py); elsewhere one attention group with a
  length mask for every row (``attention.py``'s single-sequence shortcut
  cuts by a Python int, which a graph cannot).

On the host (tests) the same padded forward runs eagerly, so the padding
logic is checked without a GPU. Graphs are captured lazily, once per
(batch size, table width), and kept.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, DecodeGroup
from engine.gpu.paged_attention import PagedBatch
from engine.kv_cache import KVCache

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WIDTH_STEP = 8  # blocks: at most 8 * block_size - 1 padded tokens of KV read per sequence


def _bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= n), None)


class _Shape:
    """Static input buffers of one (batch, width) shape, and its graph."""

    def __init__(
        self, batch: int, width: int, block_size: int, device: torch.device, gpu_kernel: bool
    ) -> None:
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(batch, **long)
        self.positions = torch.zeros(batch, **long)
        self.slots = torch.zeros(batch, **long)
        self.lens = torch.ones(batch, **long)
        self.tables = torch.zeros(batch, width, **long)
        self.mask: torch.Tensor | None = None  # the length mask of the SDPA path
        paged, groups = None, []
        if gpu_kernel:  # the kernel reads tables and lengths in place
            rows = torch.arange(batch, **long)
            paged = PagedBatch(self.tables, rows, torch.ones_like(rows), self.lens, max_q_len=1)
        else:
            keys = width * block_size
            self.mask = torch.zeros(batch, 1, 1, keys, dtype=torch.bool, device=device)
            self.token_positions = torch.arange(keys, device=device)
            groups = [DecodeGroup(0, batch, self.tables, self.mask, 0)]
        self.meta = AttentionMetadata(
            slots=self.slots,
            num_decode=batch,
            decode_groups=groups,
            prefills=[],
            decode_tables=self.tables,  # for a model on the fused CPU kernels
            decode_lens=self.lens,
            paged=paged,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None


class DecodeGraphRunner:
    """Runs decode-only steps of up to ``max_batch`` sequences at fixed shapes."""

    def __init__(
        self,
        model,
        cache: KVCache,
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
        scratch_block: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.max_width = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.batch_sizes = (*(s for s in BATCH_SIZES if s < max_batch), max_batch)
        self.device = cache.layers[0].device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._pool = None  # one memory pool shared by every captured graph

    def supports(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    @property
    def num_graphs(self) -> int:
        return sum(s.graph is not None for s in self._shapes.values())

    def forward(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
    ) -> torch.Tensor:  # [len(input_ids), hidden]
        n = len(input_ids)
        batch = _bucket(n, self.batch_sizes)
        longest = max(len(t) for t in tables)
        width = min(-(-longest // WIDTH_STEP) * WIDTH_STEP, self.max_width)
        if batch is None or width < longest:
            raise ValueError(f"no fixed shape for {n} sequences of up to {longest} blocks")
        shape = self._shapes.get((batch, width))
        if shape is None:
            shape = self._shapes[(batch, width)] = _Shape(
                batch, width, self.block_size, self.device, self.model.gpu_attention
            )
        pad = batch - n
        self._fill(shape, input_ids, positions, slots, tables, lens, pad, width)
        if not self.use_graphs:
            return self._run(shape)[:n]
        if shape.graph is None:
            self._capture(shape)
        shape.graph.replay()
        return shape.output[:n]

    def _fill(self, shape, input_ids, positions, slots, tables, lens, pad, width) -> None:
        # Padding rows: token 0 at position 0 in the scratch block, nothing else.
        scratch = self.scratch_block
        rows = [t + [0] * (width - len(t)) for t in tables]
        rows += [[scratch] + [0] * (width - 1)] * pad
        host = torch.tensor(
            [
                input_ids + [0] * pad,
                positions + [0] * pad,
                slots + [scratch * self.block_size] * pad,
                lens + [1] * pad,
            ],
            dtype=torch.long,
        )
        shape.input_ids.copy_(host[0], non_blocking=True)
        shape.positions.copy_(host[1], non_blocking=True)
        shape.slots.copy_(host[2], non_blocking=True)
        shape.lens.copy_(host[3], non_blocking=True)
        shape.tables.copy_(torch.tensor(rows), non_blocking=True)
        if shape.mask is not None:
            visible = shape.token_positions[None, :] < shape.lens[:, None]
            shape.mask.copy_(visible[:, None, None, :])

    def _run(self, shape: _Shape) -> torch.Tensor:
        return self.model.forward(shape.input_ids, shape.positions, shape.meta, self.cache)

    def _capture(self, shape: _Shape) -> None:
        # Warm up on a side stream (allocator, cuBLAS handles), then record.
        # Both runs see this step's real inputs, so their KV writes are the
        # step's own.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._run(shape)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            shape.output = self._run(shape)
        self._pool = graph.pool()
        shape.graph = graph
