"""Measure the engine alone (in process, no Ray) and fit cost models.

prefill_s(lengths) = a + b * sum(L) + c * sum(L^2)   (one batch of prompts)
decode_step_s(batch, ctx) = d + e * batch + f * batch * ctx   (ctx: mean context)

A prompt chunk of n tokens after ctx tokens already in the cache (chunked
prefill, a prefix hit) counts n * (n + 2 * ctx) in the quadratic term: the
attention of its queries over the cached keys. ``step_s`` is one engine step
of both kinds (engine/simulated.py waits that long).

Format versions: 1 (what ``tandem plan --profile-out`` wrote first); 2 adds
the descriptive fields ``name``, ``source`` (where each figure comes from),
``hardware``, ``max_model_len`` and ``notes``. Version-1 files load as they are.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILE_VERSION = 2
MIN_STEP_S = 1e-6

DEFAULT_PREFILL_LENS = (32, 128, 256, 512, 1024)
DEFAULT_PREFILL_BATCHES = (1, 2, 4)
DEFAULT_DECODE_BATCHES = (1, 8, 32, 64)
DEFAULT_DECODE_CTX = (64, 256, 512, 1024)
QUICK_PREFILL_LENS = (32, 256, 1024)
QUICK_PREFILL_BATCHES = (1, 4)
QUICK_DECODE_BATCHES = (1, 16, 64)
QUICK_DECODE_CTX = (64, 1024)


@dataclass
class Profile:
    prefill: dict[str, float]  # a, b, c
    decode: dict[str, float]  # d, e, f
    kv_bytes_per_token: int = 0
    vocab_size: int = 1000
    model: str | None = None
    num_threads: int = 1
    prefill_samples: list[dict] = field(default_factory=list)
    decode_samples: list[dict] = field(default_factory=list)
    fit_quality: dict[str, float] = field(default_factory=dict)
    version: int = PROFILE_VERSION
    name: str | None = None  # a shipped profile's name (planner/profiles/NAME.json)
    source: str = "measured"  # where the figures come from (measured: this machine)
    hardware: str | None = None  # what the figures are of, e.g. "1x H100 SXM 80GB"
    max_model_len: int | None = None  # the real model's context limit
    notes: list[str] = field(default_factory=list)  # how the figures were derived

    def prefill_s(self, lengths: Sequence[int], contexts: Sequence[int] | None = None) -> float:
        """One step prefilling chunks of ``lengths`` tokens, each after
        ``contexts[i]`` tokens already cached (default none)."""
        p = self.prefill
        ctx = contexts if contexts is not None else [0] * len(lengths)
        tokens = sum(lengths)
        squares = sum(n * (n + 2 * c) for n, c in zip(lengths, ctx, strict=True))
        return max(MIN_STEP_S, p["a"] + p["b"] * tokens + p.get("c", 0.0) * squares)

    def decode_step_s(self, batch: int, ctx: float) -> float:
        d = self.decode
        return max(MIN_STEP_S, d["d"] + d["e"] * batch + d["f"] * batch * ctx)

    def step_s(
        self,
        lengths: Sequence[int],
        contexts: Sequence[int],
        decode_batch: int,
        decode_ctx: float,
    ) -> float:
        """One engine step: prompt chunks (``lengths`` after ``contexts``) and
        ``decode_batch`` one-token rows of mean context ``decode_ctx``. A mixed
        step costs both parts with the step's fixed cost (the decode model's
        intercept) counted once."""
        if not lengths:
            return self.decode_step_s(decode_batch, decode_ctx) if decode_batch else 0.0
        prefill = self.prefill_s(lengths, contexts)
        if not decode_batch:
            return prefill
        decode = self.decode_step_s(decode_batch, decode_ctx) - self.decode["d"]
        return prefill + max(0.0, decode)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        for key, names in (("prefill", ("a", "b")), ("decode", ("d", "e", "f"))):
            missing = [n for n in names if n not in data.get(key, {})]
            if missing:
                raise ValueError(f"profile: {key} lacks {', '.join(missing)}")
        version = data.get("version", 1)
        if not isinstance(version, int) or version > PROFILE_VERSION:
            raise ValueError(
                f"profile: format version {version!r} is newer than this tandem reads "
                f"({PROFILE_VERSION})"
            )
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in data.items() if k in known}
        return cls(**{**fields, "version": version})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        lines = [
            f"prefill_s(L) = {p['a'] * 1e3:.3f} ms + {p['b'] * 1e6:.3f} us*sum(L)"
            f" + {p.get('c', 0.0) * 1e9:.4f} ns*sum(L^2)",
            f"decode_step_s(B, ctx) = {d['d'] * 1e3:.3f} ms + {d['e'] * 1e6:.3f} us*B"
            f" + {d['f'] * 1e9:.4f} ns*B*ctx",
        ]
        if self.fit_quality:
            q = ", ".join(f"{k}={v:.3f}" for k, v in sorted(self.fit_quality.items()))
            lines.append(f"fit: {q}")
        return "\n".join(lines)


def _lstsq(columns: list[np.ndarray], y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares of the relative error (rows weighted by 1/y), so that the
    small batches count as much as the large ones; R^2 is the plain one."""
    x = np.stack(columns, axis=1)
    w = 1.0 / np.maximum(np.abs(y), MIN_STEP_S)
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    pred = x @ coef
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return coef, r2


def fit_prefill(samples: Sequence[tuple[Sequence[int], float]]) -> tuple[dict[str, float], float]:
    """(prompt lengths of one batch, seconds) -> ({a, b, c}, R^2). A negative
    quadratic term is dropped (refit linear)."""
    y = np.array([s for _, s in samples], dtype=float)
    ones = np.ones(len(samples))
    tokens = np.array([sum(ls) for ls, _ in samples], dtype=float)
    squares = np.array([sum(n * n for n in ls) for ls, _ in samples], dtype=float)
    coef, r2 = _lstsq([ones, tokens, squares], y)
    if coef[2] < 0:
        lin, r2 = _lstsq([ones, tokens], y)
        coef = np.array([lin[0], lin[1], 0.0])
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2])}, r2


def fit_decode(samples: Sequence[tuple[int, float, float]]) -> tuple[dict[str, float], float]:
    """(batch, mean context, seconds per step) -> ({d, e, f}, R^2). A negative
    context term is dropped (refit without it)."""
    y = np.array([s for *_, s in samples], dtype=float)
    ones = np.ones(len(samples))
    batch = np.array([b for b, _, _ in samples], dtype=float)
    bctx = np.array([b * c for b, c, _ in samples], dtype=float)
    coef, r2 = _lstsq([ones, batch, bctx], y)
    if coef[2] < 0:
        lin, r2 = _lstsq([ones, batch], y)
        coef = np.array([lin[0], lin[1], 0.0])
    return {"d": float(coef[0]), "e": float(coef[1]), "f": float(coef[2])}, r2


# ---- measuring ----------------------------------------------------------------


def _kv_bytes_per_token(engine) -> int:
    spec = engine.spec
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[engine.config.dtype]
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * size


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _measure_prefill(engine, lengths: Sequence[int], rng: random.Random, tag: str) -> float:
    """Seconds of the steps until every prompt of the batch has its first token."""
    from protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = engine.spec.vocab_size
    pending = set()
    for i, n in enumerate(lengths):
        rid = f"{tag}-{i}"
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(n)], params)
        pending.add(rid)
    start = time.perf_counter()
    while pending:
        for out in engine.step():
            if out.num_output_tokens >= 1:
                pending.discard(out.request_id)
    elapsed = time.perf_counter() - start
    _drain(engine)
    return elapsed


def _measure_decode(
    engine, batch: int, ctx: int, steps: int, rng: random.Random, tag: str
) -> float:
    """Least seconds of one decode step with `batch` sequences at context ~ctx.
    The prompts share a cached prefix so that setting up costs one prefill."""
    from protocol.sampling import SamplingParams

    vocab = engine.spec.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(ctx - 1)]
    engine.add_request(
        f"{tag}-warm", [*prefix, 0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    )
    _drain(engine)  # its full blocks stay in the prefix cache
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [*prefix, 1 + i % (vocab - 1)], params)
    times: list[float] = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        # Count only pure decode steps: every sequence got one token, none new.
        if len(outs) == batch and all(o.num_output_tokens >= 2 for o in outs):
            times.append(dt)
    if not times:
        raise RuntimeError(f"no pure decode step measured (batch {batch}, ctx {ctx})")
    return min(times)  # the least disturbed step: the cores may be shared


def run_profile(
    model: str | None = None,
    *,
    quick: bool = False,
    num_threads: int = 1,
    decode_steps: int = 4,
    repeats: int = 2,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    engine=None,
) -> Profile:
    """Profile the engine (built here unless given) over a grid; a few tens of
    seconds on the default model, a few seconds with quick=True."""
    if engine is None:
        from engine import EngineConfig, LLMEngine

        engine = LLMEngine(
            EngineConfig(
                model=model,
                num_threads=num_threads,
                kv_cache_memory_bytes=256 * 1024 * 1024,
                max_num_seqs=256,
            )
        )
    rng = random.Random(seed)
    lens = QUICK_PREFILL_LENS if quick else DEFAULT_PREFILL_LENS
    pbatches = QUICK_PREFILL_BATCHES if quick else DEFAULT_PREFILL_BATCHES
    dbatches = QUICK_DECODE_BATCHES if quick else DEFAULT_DECODE_BATCHES
    dctx = QUICK_DECODE_CTX if quick else DEFAULT_DECODE_CTX
    max_len = engine.max_model_len - decode_steps - 4

    _measure_prefill(engine, [16], rng, "warmup")  # first-call overheads
    prefill_samples: list[tuple[list[int], float]] = []
    for n in lens:
        if n > max_len:
            continue
        for b in pbatches:
            seconds = min(
                _measure_prefill(engine, [n] * b, rng, f"p{n}x{b}-{i}") for i in range(repeats)
            )
            prefill_samples.append(([n] * b, seconds))
            if log:
                log(f"prefill {b} x {n} tokens: {seconds * 1e3:.1f} ms")
    decode_samples: list[tuple[int, float, float]] = []
    for ctx in dctx:
        if ctx > max_len:
            continue
        for b in dbatches:
            seconds = _measure_decode(engine, b, ctx, decode_steps, rng, f"d{ctx}x{b}")
            mean_ctx = ctx + 1 + decode_steps / 2
            decode_samples.append((b, mean_ctx, seconds))
            if log:
                log(f"decode step batch {b} ctx {ctx}: {seconds * 1e3:.2f} ms")
    if len(prefill_samples) < 3 or len(decode_samples) < 3:
        raise RuntimeError("too few profile points (model too short for the grid?)")
    prefill, r2p = fit_prefill(prefill_samples)
    decode, r2d = fit_decode(decode_samples)
    return Profile(
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=_kv_bytes_per_token(engine),
        vocab_size=engine.spec.vocab_size,
        model=model,
        num_threads=num_threads,
        prefill_samples=[{"lengths": ls, "seconds": s} for ls, s in prefill_samples],
        decode_samples=[{"batch": b, "ctx": c, "seconds": s} for b, c, s in decode_samples],
        fit_quality={"prefill_r2": r2p, "decode_r2": r2d},
    )
