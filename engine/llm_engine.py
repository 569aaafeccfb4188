"""The step-level engine that both pools drive.

add_request -> step() ... -> outputs; abort at any time. A prefill-only
request stops after its first token and keeps its blocks until
``export_kv`` / ``release``; ``add_prefilled_request`` takes over blocks
that arrived from another engine (their holder's references become the
request's) and continues decoding there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import PrefillSlice, build_metadata, slice_table
from engine.block_pool import BlockPool, Held, Holder
from engine.config import EngineConfig, ModelSpec
from engine.cuda_graphs import BATCH_SIZES, DecodeGraphRunner
from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.device import resolve_device
from engine.gpu.paged_attention import use_kernel as use_gpu_kernel
from engine.hashing import BlockHash, root_hash
from engine.kernels import select as select_kernels
from engine.kv_cache import KVCache, KVLayout
from engine.kv_tier import KVTier
from engine.layer_reports import layer_reports
from engine.loader import (
    load_hf_config,
    load_weights,
    model_fingerprint,
    resolve_model_dir,
)
from engine.models.llama import LlamaModel
from engine.packaged_model import resolve_quantization
from engine.parallel import setup as tensor_parallel
from engine.parallel.group import GroupBroken
from engine.parallel.sharding import check_splittable
from engine.request_faults import RequestFaults
from engine.sampling import (
    NONFINITE_LOGITS,
    SampledToken,
    Sampler,
    SampleRequest,
    nonfinite_rows,
    seed_for_token,
)
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import KVWatcher, SeqStatus, Sequence
from engine.simulated import SimulatedModel
from engine.spec import SpecDecoder
from protocol.outputs import RequestOutput, TokenLogprobs
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

# Holds the block decode graphs point their padding rows at, for the engine's lifetime.
SCRATCH = Holder("scratch", "decode-graphs")


@dataclass
class KVExport:
    """A prefilled sequence's KV blocks, ready to move to another engine."""

    request_id: str
    layout: KVLayout
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]  # in the exporting engine's pool
    block_hashes: list[BlockHash]  # of the full blocks, in order
    data: torch.Tensor | None  # [layers, 2, blocks, block_size, kv_heads, head_dim]


@contextlib.contextmanager
def _released(lock: threading.RLock | None) -> Iterator[None]:
    """Let go of ``lock`` (held once by this thread) for the duration."""
    if lock is None:
        yield
        return
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine(RequestFaults):
    def __init__(
        self,
        config: EngineConfig | None = None,
        launcher: tensor_parallel.RankLauncher | None = None,
    ) -> None:
        """``launcher``: starts the other ranks when tensor_parallel_size > 1
        (engine/parallel/); None: as local processes."""
        config = config or EngineConfig()
        quantization = resolve_quantization(config.quantization, config.model)
        self.config = config = dataclasses.replace(config, quantization=quantization)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        device = torch.device("cpu") if config.simulate else resolve_device(config.device)
        self.simulated: SimulatedModel | None = None  # the model, when it is simulated
        self.tp: tensor_parallel.TensorParallel | None = None  # tensor_parallel_size > 1
        if config.simulate is not None:
            num_blocks, kernels = self._build_simulated(config), None
        else:
            num_blocks, kernels = self._build_model(config, device, launcher)
        spec, fingerprint = self.spec, self.kv_layout.model_fingerprint
        self.block_pool = BlockPool(num_blocks, config.block_size)
        self.kv_cache = KVCache(self.kv_layout, num_blocks, device)  # rank 0's kv heads
        if self.tp is not None:
            self.tp.attach(self.kv_cache)
        self.kv_tier = self._make_tier(config)
        self.root_hash = root_hash(fingerprint, config.block_size)
        self.scheduler = Scheduler(
            self.block_pool,
            self.root_hash,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_prefix_caching,
        )
        eos = set(spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.sampler = Sampler(spec.vocab_size, self.eos_token_ids, kernels)
        self._seqs: dict[str, Sequence] = {}
        self.failed_steps = 0  # engine/request_faults.py: the worker's health
        self.last_failed_step_at: float | None = None
        self.clock = time.monotonic
        self._arrival = itertools.count()
        self.device = device
        self.speculator: SpecDecoder | None = None
        if config.speculative is not None:
            self.speculator = SpecDecoder(self, config.speculative)
        self.decode_graphs: DecodeGraphRunner | None = None
        if config.cuda_graphs and device.type == "cuda":
            self.enable_decode_graphs(use_graphs=True)

    def _build_model(
        self,
        config: EngineConfig,
        device: torch.device,
        launcher: tensor_parallel.RankLauncher | None,
    ) -> tuple[int, Any]:
        """Load the checkpoint's model (rank 0's share, the other ranks started,
        when tensor-parallel); the pool's block count and the kernels."""
        model_dir = resolve_model_dir(config.model)
        hf_config = load_hf_config(model_dir)
        self.spec = spec = ModelSpec.from_hf_config(hf_config)
        self.model_dir = model_dir
        self.tokenizer = self._load_tokenizer(config, model_dir)
        dtype = getattr(torch, config.dtype)
        fingerprint = model_fingerprint(model_dir, hf_config, config.load_format, config.seed)
        if config.quantization != "none":  # other weights, other KV: no sharing with floats
            tagged = f"{fingerprint}:{config.quantization}".encode()
            fingerprint = hashlib.sha256(tagged).hexdigest()[:32]
        gpu_attention = use_gpu_kernel(config.attention, device, config.deterministic)
        kernels = None if gpu_attention else select_kernels(config.cpu_kernels, device, dtype)
        if config.deterministic:  # KV summed otherwise, bits of this path: shared with its like
            path = f"{device.type}:{'fused' if kernels is not None else 'torch'}"
            tagged = f"{fingerprint}:deterministic:{path}".encode()
            fingerprint = hashlib.sha256(tagged).hexdigest()[:32]
        self.kv_layout = KVLayout(
            model_fingerprint=fingerprint,
            dtype=config.dtype,
            num_layers=spec.num_layers,
            block_size=config.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            tp_size=config.tensor_parallel_size,
        )
        num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
            self.kv_layout, config.kv_cache_memory_bytes
        )
        self.max_model_len = self._model_len(config, spec, num_blocks)
        if config.tensor_parallel_size > 1:
            self._start_ranks(config, device, kernels, num_blocks, launcher)
            return num_blocks, kernels
        state = load_weights(config, model_dir, spec, hf_config)
        self.model = LlamaModel(
            spec, state, hf_config, self.max_model_len, dtype, device, kernels,
            greedy_screen=config.greedy_screen, quantization=config.quantization,
            deterministic=config.deterministic, gpu_attention=gpu_attention,
            matrix_units=config.matrix_units,
        )  # fmt: skip
        del state
        return num_blocks, kernels

    def _start_ranks(
        self,
        config: EngineConfig,
        device: torch.device,
        kernels: Any,
        num_blocks: int,
        launcher: tensor_parallel.RankLauncher | None,
    ) -> None:
        """The model split over tensor_parallel_size ranks; this is rank 0."""
        check_splittable(self.spec, config.tensor_parallel_size)
        plan = tensor_parallel.ShardPlan(
            dataclasses.replace(config, cpu_kernels="on" if kernels is not None else "off"),
            str(self.model_dir),
            self.kv_layout,
            num_blocks,
            self.max_model_len,
            self.spec.vocab_size,
        )
        self.tp = tensor_parallel.start(plan, device, launcher)
        weakref.finalize(self, self.tp.close)  # the ranks end with the engine
        self.model = self.tp.model

    def _build_simulated(self, config: EngineConfig) -> int:
        """The simulated model of ``config.simulate``'s profile (engine/simulated.py);
        the pool's block count (its KV memory at the profiled model's bytes a token)."""
        from engine.simulated_setup import simulated_setup

        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        vocab, eos = None, set()
        if self.tokenizer is not None:
            vocab, eos = len(self.tokenizer), {self.tokenizer.eos_token_id} - {None}
        setup = simulated_setup(config, vocab, eos)
        self.model_dir, self.spec, self.kv_layout = setup.profile_path, setup.spec, setup.kv_layout
        self.max_model_len = self._model_len(config, setup.spec, setup.num_blocks)
        self.model = self.simulated = setup.model
        self._work_left = False  # unfinished requests when the last step ended
        return setup.num_blocks

    @staticmethod
    def _model_len(config: EngineConfig, spec: ModelSpec, num_blocks: int) -> int:
        limits = [spec.max_position_embeddings, num_blocks * config.block_size]
        limits += [x for x in (config.max_model_len, spec.sliding_window) if x]
        return min(limits)

    def _make_tier(self, config: EngineConfig) -> KVTier | None:
        """The second KV tier the config asks for (none without prefix caching)."""
        blocks = config.kv_tier_num_blocks
        if blocks is None and config.kv_tier_memory_bytes:
            blocks = KVCache.blocks_for_budget(self.kv_layout, config.kv_tier_memory_bytes)
        if not blocks or not config.enable_prefix_caching:
            return None
        tier = KVTier(self.kv_cache, blocks, config.kv_tier_dir)
        self.block_pool.attach_tier(tier)
        return tier

    def close(self, stepping: bool = False) -> None:
        """Let go of the second tier's storage and stop the other tensor-parallel
        ranks (a worker that stops). ``stepping``: another thread may still be
        in a step (its loop did not end): the ranks are ended, not told to stop
        over the group that step uses."""
        if self.tp is not None:
            self.tp.close(stepping)
        if self.kv_tier is not None:
            self.block_pool.tier = None
            self.kv_tier.close()
            self.kv_tier = None

    def enable_decode_graphs(self, use_graphs: bool = True) -> None:
        """Run decode-only steps at fixed shapes (see cuda_graphs.py), as CUDA
        graphs when ``use_graphs`` and the device is a GPU, else eagerly. Sets
        one block aside for the padding rows; call before adding requests."""
        scratch = self.block_pool.allocate(SCRATCH, 1)
        if scratch is None:
            raise RuntimeError("no free block to set aside for decode graphs")
        bs = self.config.block_size
        self.decode_graphs = DecodeGraphRunner(
            self.model,
            self.kv_cache,
            bs,
            max_blocks_per_seq=-(-self.max_model_len // bs),
            max_batch=min(self.config.max_num_seqs, BATCH_SIZES[-1]),
            scratch_block=scratch[0],
            use_graphs=use_graphs,
        )

    @staticmethod
    def _load_tokenizer(config: EngineConfig, model_dir):
        if config.tokenizer is not None:
            return load_tokenizer(config.tokenizer)
        if any(model_dir.glob("tokenizer*")):
            return load_tokenizer(str(model_dir))
        return None

    # ---- requests -------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids has {bad}, outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the limit is "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len})"
            )
        params.validate_for_vocab(vocab, self.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")

    def _new_seq(
        self,
        request_id: str,
        prompt: Seq[int],
        params: SamplingParams,
        prefill_only: bool,
        output_token_ids: Seq[int] = (),
        stop_matcher: StopMatcher | None = None,
        cache_salt: bytes = b"",
    ) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate(prompt, params)
        self._validate_outputs(prompt, output_token_ids, params)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=params,
            arrival=next(self._arrival),
            prefill_only=prefill_only,
            cache_salt=bytes(cache_salt),
            output_token_ids=list(output_token_ids),
        )
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                params.stop,
                params.skip_special_tokens,
                stop_matcher,
            )
            for token in seq.output_token_ids:  # their text was emitted already
                seq.detokenizer.add(token)
        self._seqs[request_id] = seq
        return seq

    def _validate_outputs(
        self, prompt: Seq[int], outputs: Seq[int], params: SamplingParams
    ) -> None:
        """Tokens already generated (a request continued elsewhere) must leave
        room for one more."""
        if not outputs:
            return
        vocab = self.spec.vocab_size
        bad = next((t for t in outputs if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"output_token_ids has {bad}, outside the vocabulary [0, {vocab})")
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"{len(outputs)} output tokens already reach max_tokens")
        if len(prompt) + len(outputs) >= self.max_model_len:
            raise ValueError(
                f"{len(prompt) + len(outputs)} tokens already reach max_model_len "
                f"{self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        prefill_only: bool = False,
        output_token_ids: Seq[int] = (),
        stop_matcher: StopMatcher | None = None,
        cache_salt: bytes = b"",
        kv_watcher: KVWatcher | None = None,
    ) -> None:
        """Queue a request. ``output_token_ids``: tokens it generated already
        (elsewhere, before a failover); they are computed with the prompt and
        the request goes on as if it had produced them here: same max_tokens
        count, stop strings, penalties and detokenizer state. ``stop_matcher``:
        ``stop_matcher(params.stop)`` built by the caller off the engine thread
        (None: built here). ``cache_salt``: its prefix-cache domain (every block
        hash of it uses it); only requests of the same salt share cached blocks.
        ``kv_watcher``: told after each layer of each step where its KV stands
        (engine/sequence.py), for a prefill that sends its KV as it goes."""
        seq = self._new_seq(
            request_id,
            prompt_token_ids,
            params,
            prefill_only,
            output_token_ids,
            stop_matcher,
            cache_salt,
        )
        seq.kv_watcher = kv_watcher
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        if self.speculator is not None:
            self.speculator.release(request_id)
        return True

    def request_ids(self) -> list[str]:
        """Every request this engine holds: waiting, running or prefilled."""
        return list(self._seqs)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------

    def step(self, pool_lock: threading.RLock | None = None) -> list[RequestOutput]:
        """One pass over the scheduled batch. ``pool_lock``, held by the caller
        around the step, is released while the model computes: the step then
        touches no pool state, and other threads (KV transfers) may use the pool.

        A fault tied to one sequence (non-finite logits, an error in its stop,
        detokenize or verify step) fails that request alone (finish_reason
        "error"), frees its blocks, and the rest of the batch goes on. A pass
        of one sequence that raises fails that one. A pass of several that
        raises is run again one sequence at a time: the sequences that raise
        alone fail, the others go on; if none runs even alone, they are all
        aborted and the step counts in ``failed_steps`` (the fault is then not
        known to be one request's; engine/request_faults.py, docs/failures.md)."""
        if self.simulated is not None:
            self.simulated.begin_step(self._work_left)
            try:
                return self._step_batch(pool_lock)
            finally:
                self._work_left = self.has_unfinished()
        return self._step_batch(pool_lock)

    def _step_batch(self, pool_lock: threading.RLock | None) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.speculator is not None:
            self.speculator.fit(batch)
        try:
            outputs = self._run(batch, pool_lock)
        except GroupBroken:  # the engine's, not a request's: no pass can run now
            raise
        except Exception as exc:
            return self._step_raised(batch, pool_lock, exc)
        self.failed_steps = 0
        return outputs

    def _run(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None
    ) -> list[RequestOutput]:
        """Forward, sample, then each sequence's bookkeeping. Raises only
        before any state changed (in the pass or the batched sampling)."""
        # One-token sequences first, shortest context first (see attention.py).
        batch.sort(key=lambda s: (s.num_tokens != 1, s.seq.num_computed))
        # Sequences whose last known token is computed this step (the rows of
        # sample_rows, in batch order) get their next token.
        to_sample = [
            item.seq
            for item in batch
            if not item.seq.spec_token_ids
            and item.seq.num_computed + item.num_tokens == item.seq.num_tokens
        ]
        with _released(pool_lock):
            sample_rows, spec_rows, hidden = self._forward(batch)
            sampled = self._sample(to_sample, hidden[sample_rows]) if to_sample else []
            spec_logits = self.model.logits(hidden[spec_rows]) if spec_rows else None
            if self.simulated is not None:
                self.simulated.pace()  # asleep, to the profile's step time
        failed = {s.request_id for s, t in zip(to_sample, sampled, strict=True) if t.error}
        speculated = []
        outputs: list[RequestOutput] = []
        for item in batch:
            seq = item.seq
            if seq.request_id in failed:  # its KV of this step is suspect: none is cached
                continue
            if seq.spec_token_ids:  # only accepted tokens count as computed (engine/spec/)
                speculated.append(seq)
                continue
            seq.num_computed += item.num_tokens
            if seq.kv_watcher is not None:  # before a finish can free its blocks
                done, layers = seq.num_computed, self.kv_layout.num_layers
                seq.kv_watcher(seq.block_table, done - item.num_tokens, done, layers)
            outputs += self._guarded(seq, lambda seq=seq: self._cache_full_blocks(seq) or [])
        for seq, token in zip(to_sample, sampled, strict=True):
            if token.error is not None:
                outputs.append(self._fail(seq, token.error, suspect_kv=True))
            elif seq.request_id in self._seqs:
                outputs += self._guarded(seq, lambda s=seq, t=token: [self._append_token(s, t)])
        if speculated:
            assert spec_logits is not None
            outputs += self._accept(speculated, spec_logits)
        return outputs

    def _sample(self, seqs: list[Sequence], hidden: torch.Tensor) -> list[SampledToken]:
        """One token per row of ``hidden``; a row with a non-finite hidden state
        or logits gets an error instead (its request fails alone)."""
        for s in seqs:
            seed_for_token(s.generator, s.params.seed, len(s.output_token_ids))
        requests = [
            SampleRequest(s.params, s.prompt_token_ids, s.output_token_ids, s.generator)
            for s in seqs
        ]
        if self.simulated is not None:
            return self.simulated.sample(hidden, requests)
        broken = nonfinite_rows(hidden)
        if broken:  # the head and the sampler see zeros there, so no kernel meets a NaN
            hidden = hidden.clone()
            hidden[broken] = 0.0
        if self.model.screen_head is not None and all(map(Sampler.plain_greedy, requests)):
            tokens = self.model.greedy_tokens(hidden, self.sampler.vocab_size)
            out = [SampledToken(t, None, None) for t in tokens]
        elif self.config.deterministic:  # the sampler's batched ops, a row at a time
            logits = self.model.logits(hidden)
            out = [self.sampler(logits[i : i + 1], [r])[0] for i, r in enumerate(requests)]
        else:
            out = self.sampler(self.model.logits(hidden), requests)
        for i in broken:
            out[i] = SampledToken(out[i].token_id, None, None, NONFINITE_LOGITS)
        return out

    def _forward(self, batch: list[ScheduledSeq]) -> tuple[list[int], list[int], torch.Tensor]:
        """The step's pass: rows to sample (one per sequence that reaches its last
        token), rows to verify (every position of a speculating sequence), hidden."""
        bs = self.config.block_size
        # (a simulated model's tokens are a function of the context already)
        deterministic = self.config.deterministic and self.simulated is None
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        sample_rows: list[int] = []
        spec_rows: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            table = seq.block_table
            spec = seq.spec_token_ids
            input_ids += seq.token_ids(start, start + n - len(spec)) + spec
            if n == 1 and not deterministic:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                gpu = self.model.gpu_attention
                prefills.append(
                    PrefillSlice(len(slots), n, start, slice_table(table, self.device, gpu))
                )
                span = range(start, start + n)
                positions += span
                slots += [table[p // bs] * bs + p % bs for p in span]
            if spec:
                spec_rows += range(len(slots) - n, len(slots))
            elif start + n == seq.num_tokens:
                sample_rows.append(len(slots) - 1)
        graphs = self.decode_graphs
        # A step with a streamed prefill's chunk goes through _layer_reports: its
        # reports then come only once the KV is in device memory.
        streaming = any(item.seq.kv_watcher is not None for item in batch)
        if (
            graphs is not None
            and not prefills
            and not streaming
            and graphs.supports(len(decode_tables))
        ):
            hidden = graphs.forward(input_ids, positions, slots, decode_tables, decode_lens)
            return sample_rows, spec_rows, hidden
        meta = build_metadata(
            bs, decode_tables, decode_lens, prefills, slots, self.device, self.model.fused,
            row_invariant=deterministic, gpu_kernel=self.model.gpu_attention,
        )  # fmt: skip
        with self._layer_reports(batch):
            hidden = self.model.forward(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                meta,
                self.kv_cache,
            )
        return sample_rows, spec_rows, hidden

    @contextlib.contextmanager
    def _layer_reports(self, batch: list[ScheduledSeq]) -> Iterator[None]:
        """While the model computes: after each layer (once it is done on the
        device: engine/layer_reports.py), tell the watched sequences of
        ``batch`` that this layer holds their new tokens' KV."""
        watched = [item for item in batch if item.seq.kv_watcher is not None]
        if not watched or isinstance(self.model, SimulatedModel):
            yield
            return

        def report(layer: int) -> None:
            for item in watched:
                seq, start = item.seq, item.seq.num_computed
                seq.kv_watcher(seq.block_table, start, start + item.num_tokens, layer + 1)

        with layer_reports(self.model, report, self.device):
            yield

    def _cache_full_blocks(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed // bs
        if full <= len(seq.block_hashes):
            return
        hashes = seq.full_block_hashes(full, bs, self.root_hash)
        for j in range(len(seq.block_hashes), full):
            seq.block_hashes.append(hashes[j])
            self.block_pool.cache(
                seq.block_table[j], hashes[j], seq.token_ids(j * bs, (j + 1) * bs)
            )

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> RequestOutput:
        token = sampled.token_id
        seq.output_token_ids.append(token)
        params = seq.params
        delta = ""
        reason = None
        stopped_by_string = False
        if seq.detokenizer is not None:
            update = seq.detokenizer.add(token)
            delta = update.text_delta
            stopped_by_string = update.stopped
        n_out = len(seq.output_token_ids)
        if stopped_by_string or (
            n_out >= params.min_tokens
            and (
                token in params.stop_token_ids
                or (token in self.eos_token_ids and not params.ignore_eos)
            )
        ):
            reason = "stop"
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None and not stopped_by_string and seq.detokenizer is not None:
            delta += seq.detokenizer.finish()
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprobs(token, sampled.logprob, sampled.top_logprobs or [])]
        finished = reason is not None
        if finished:
            self._finish(seq, reason)
        elif seq.prefill_only:
            self.scheduler.running.remove(seq)
            seq.status = SeqStatus.PREFILLED
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            text_delta=delta,
            finished=finished,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=n_out,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.running.remove(seq)
        self.scheduler.free_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]
        if self.speculator is not None:
            self.speculator.release(seq.request_id)

    # ---- moving KV between engines ---------------------------------------

    def export_kv(self, request_id: str, with_data: bool = True) -> KVExport:
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} is not a prefilled request of this engine")
        data = self._read_kv(seq.block_table) if with_data else None
        return KVExport(
            request_id=request_id,
            layout=self.kv_layout,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            block_ids=list(seq.block_table),
            block_hashes=list(seq.block_hashes),
            data=data,
        )

    def _read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks with every kv head (every rank's, when tensor-parallel)."""
        if self.tp is not None and self.tp.kv is not None:
            return self.tp.kv.read(block_ids, 0, self.kv_layout.num_layers)
        return self.kv_cache.read_blocks(block_ids)

    def _write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        if self.tp is not None and self.tp.kv is not None:
            self.tp.kv.write(block_ids, 0, data)
        else:
            self.kv_cache.write_blocks(block_ids, data)

    def release(self, request_id: str) -> None:
        """Free a prefilled request's blocks (after its export, or to give up)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} is not a prefilled request of this engine")
        self.scheduler.free_blocks(seq)
        seq.status = SeqStatus.FINISHED
        del self._seqs[request_id]

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        output_token_ids: Seq[int],
        params: SamplingParams,
        blocks: Seq[Held],
        stop_matcher: StopMatcher | None = None,
        cache_salt: bytes = b"",
    ) -> None:
        """Continue a request whose KV for all but the last token is already in
        this pool: its block table is the blocks of ``blocks`` in order, and
        their holders' references become the request's (when this call fails,
        they are released). ``cache_salt`` as for ``add_request``."""
        try:
            seq = self._new_seq(
                request_id,
                prompt_token_ids,
                params,
                False,
                output_token_ids[:-1],
                stop_matcher,
                cache_salt,
            )
        except Exception:
            self.block_pool.release_held(blocks)
            raise
        for part in blocks:
            self.block_pool.transfer(part.holder, seq.holder, part.block_ids)
            seq.block_table += part.block_ids
        seq.output_token_ids = list(output_token_ids)
        seq.num_computed = seq.num_tokens - 1
        if seq.detokenizer is not None and output_token_ids:
            seq.detokenizer.add(output_token_ids[-1])  # the sender already emitted its text
        expected = -(-seq.num_computed // self.config.block_size)
        if len(seq.block_table) != expected or not output_token_ids:
            del self._seqs[request_id]  # never queued: not the scheduler's to remove
            self.scheduler.free_blocks(seq)
            raise ValueError(
                f"{len(seq.block_table)} blocks for {seq.num_computed} computed tokens; "
                f"expected {expected} and at least one output token"
            )
        self._cache_full_blocks(seq)
        self.scheduler.add_running(seq)

    def import_kv(self, export: KVExport, params: SamplingParams) -> None:
        """Copy an export into this pool and continue decoding it here."""
        field = self.kv_layout.mismatch(export.layout)
        if field is not None:
            raise ValueError(f"KV layout differs in {field}")
        if export.data is None:
            raise ValueError("export has no data")
        holder = Holder("lease", f"import:{export.request_id}")
        blocks = self.block_pool.allocate(holder, len(export.block_ids))
        if blocks is None:
            raise RuntimeError(f"no room for {len(export.block_ids)} blocks")
        self._write_kv(blocks, export.data)
        self.add_prefilled_request(
            export.request_id,
            export.prompt_token_ids,
            export.output_token_ids,
            params,
            [Held(holder, blocks)],
        )
