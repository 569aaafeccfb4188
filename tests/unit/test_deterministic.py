"""Deterministic mode (docs/deterministic.md): one prompt's tokens and logprobs,
greedy and seeded, are bit-identical alone and inside batches of 1 to 64 with
different neighbours, at every chunked-prefill size, after a prefix hit and
when prefilled again with part of its output (a failover's resume), on the
fused CPU path (float32, int8, q4 weights), the PyTorch path on CPU, and on
CUDA where a GPU is present (skipped otherwise)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import FUSED_PREFILL_MAX_KEYS
from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from router.config import ServeConfig
from tandem_cli.main import build_parser
from tandem_cli.serve import config_from_args

pytestmark = pytest.mark.unit

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True
)
# (cpu_kernels, quantization): the fused float32, int8 and q4 paths, and PyTorch's
# with float32 and int8 weights; ("cuda", ...): PyTorch's on a GPU
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PATHS = [
    ("auto", "none"),
    ("auto", "int8"),
    ("auto", "q4"),
    ("off", "none"),
    ("off", "int8"),
    pytest.param(("cuda", "none"), marks=NO_CUDA),
]

RNG = random.Random(5)
TARGET = [RNG.randrange(5, 500) for _ in range(37)]


def _engine(path: tuple[str, str], **options) -> LLMEngine:
    kernels, quantization = path
    device = "cuda" if kernels == "cuda" else "cpu"
    kernels = "off" if device == "cuda" else kernels
    options = {"num_kv_blocks": 2048, "num_threads": 2, "device": device, **options}
    return LLMEngine(
        EngineConfig(cpu_kernels=kernels, quantization=quantization, deterministic=True, **options)
    )


def _run(engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Each request's (token, logprob, top logprobs) per output token, and cached tokens."""
    out: dict[str, list] = {rid: [] for rid, _, _ in batch}
    cached = {}
    for rid, prompt, params in batch:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [(x.token_id, x.logprob, tuple(x.top)) for x in o.logprobs or []]
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    for rid, _, params in batch:
        assert params.logprobs is None or len(out[rid]) == params.max_tokens, rid
    return {"outputs": out, "cached": cached}


def _neighbours(n: int, rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    """``n`` other requests: prompts of 1 to 90 tokens, greedy, seeded or unseeded."""
    kinds = [GREEDY, SEEDED, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)]
    return [
        (f"n{i}", [rng.randrange(5, 500) for _ in range(rng.randrange(1, 90))], kinds[i % 3])
        for i in range(n)
    ]


@pytest.fixture(scope="module", params=PATHS, ids=lambda p: f"{p[0]}-{p[1]}")
def path(request):
    return request.param


@pytest.fixture(scope="module")
def alone(path) -> dict:
    """The target prompt alone, greedy and seeded, each on a fresh engine."""
    return {
        kind: _run(_engine(path), [("target", TARGET, params)])["outputs"]["target"]
        for kind, params in (("greedy", GREEDY), ("seeded", SEEDED))
    }


@pytest.mark.parametrize("size", [2, 8, 64])
def test_alone_equals_inside_a_batch(path, alone, size):
    """The greedy and the seeded request each at a random place among neighbours."""
    rng = random.Random(size)
    batch = _neighbours(size - 2, rng)
    batch.insert(rng.randrange(size - 1), ("greedy", TARGET, GREEDY))
    batch.insert(rng.randrange(size), ("seeded", TARGET, SEEDED))
    got = _run(_engine(path), batch)["outputs"]
    assert got["greedy"] == alone["greedy"]
    assert got["seeded"] == alone["seeded"]


def _both(neighbours: int, seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """The greedy and the seeded target among ``neighbours`` other requests."""
    return [("greedy", TARGET, GREEDY), ("seeded", TARGET, SEEDED),
            *_neighbours(neighbours, random.Random(seed))]  # fmt: skip


@pytest.mark.parametrize("budget", [5, 16, 33])
def test_chunked_prefill_sizes_change_nothing(path, alone, budget):
    got = _run(_engine(path, max_num_batched_tokens=budget), _both(3, budget))["outputs"]
    assert (got["greedy"], got["seeded"]) == (alone["greedy"], alone["seeded"])


def test_a_prefix_hit_changes_nothing(path, alone):
    engine = _engine(path, block_size=8)
    _run(engine, [("first", [*TARGET[:30], 7, 8, 9], GREEDY)])  # caches 3 blocks of TARGET
    result = _run(engine, _both(4, 1))
    assert result["cached"]["greedy"] == result["cached"]["seeded"] == 24
    got = result["outputs"]
    assert (got["greedy"], got["seeded"]) == (alone["greedy"], alone["seeded"])


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_prefilled_again_with_part_of_its_output(path, alone, kind):
    """A failover's resume: the prompt and the tokens streamed so far are
    prefilled on another worker (in a batch), which goes on from there."""
    ref, params = alone[kind], GREEDY if kind == "greedy" else SEEDED
    engine = _engine(path)
    for rid, prompt, p in _neighbours(6, random.Random(2)):
        engine.add_request(rid, prompt, p)
    streamed = [token for token, _, _ in ref[:5]]
    engine.add_request("target", TARGET, params, output_token_ids=streamed)
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "target":
                got += [(x.token_id, x.logprob, tuple(x.top)) for x in o.logprobs or []]
    assert got == ref[5:]


def test_past_the_fused_prefill_key_limit():
    """The fused kernel keeps every row past FUSED_PREFILL_MAX_KEYS (where SDPA
    takes over outside the mode): a 2,100-token prompt alone, and in chunks of
    700 beside neighbours."""
    long = [RNG.randrange(5, 500) for _ in range(FUSED_PREFILL_MAX_KEYS + 52)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    ref = _run(_engine(PATHS[0]), [("long", long, params)])["outputs"]["long"]
    engine = _engine(PATHS[0], max_num_batched_tokens=700)
    got = _run(engine, [("long", long, params), *_neighbours(5, random.Random(9))])
    assert got["outputs"]["long"] == ref


@pytest.mark.parametrize("path", [PATHS[0], PATHS[3]], ids=["fused", "pytorch"])
def test_without_the_mode_outputs_do_change(path):
    """What the mode is for (so the tests above can fail): outside it a resumed
    stream's logprobs differ on the fused float32 path (decode and prefill
    attention sum otherwise), and a batch changes the PyTorch path's."""
    kernels, quantization = path
    config = {"cpu_kernels": kernels, "quantization": quantization, "num_kv_blocks": 2048}
    config["device"] = "cpu"

    def fresh() -> LLMEngine:
        return LLMEngine(EngineConfig(num_threads=2, **config))

    ref = _run(fresh(), [("greedy", TARGET, GREEDY)])["outputs"]["greedy"]
    engine = fresh()
    if kernels == "auto":
        streamed = [token for token, _, _ in ref[:5]]
        engine.add_request("greedy", TARGET, GREEDY, output_token_ids=streamed)
        got = []
        while engine.has_unfinished():
            got += [(x.token_id, x.logprob, tuple(x.top)) for o in engine.step()
                    for x in o.logprobs or []]  # fmt: skip
        assert got != ref[5:]
    else:
        batch = [("greedy", TARGET, GREEDY), *_neighbours(7, random.Random(3))]
        assert _run(engine, batch)["outputs"]["greedy"] != ref


def test_lossy_transfer_speculation_and_graphs_are_refused():
    with pytest.raises(ValueError, match="KV transfer int8 is lossy"):
        EngineConfig(deterministic=True, kv_transfer_dtype="int8")
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(deterministic=True, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="CUDA graphs"):
        EngineConfig(deterministic=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="same kind of device"):
        ServeConfig.load(
            None, {"engine.deterministic": True, "pools.prefill_resources.num_gpus": 1}
        )
    with pytest.raises(ValueError, match="speculative decoding"):
        ServeConfig.load(None, {"engine.deterministic": True, "speculative.method": "ngram"})
    with pytest.raises(ValueError, match="fp8 is lossy"):
        ServeConfig.load(None, {"engine.deterministic": True, "transfer.dtype": "fp8"})
    with pytest.raises(ValueError, match="CUDA graphs"):
        ServeConfig.load(None, {"engine.deterministic": True, "engine.cuda_graphs": True})
    args = build_parser().parse_args(["serve", "--deterministic"])
    assert config_from_args(args).engine_config("decode", 0).deterministic


def test_its_kv_is_never_shared_with_other_workers():
    """Its blocks are summed otherwise: another fingerprint, so neither a prefix
    index nor a KV transfer mixes them with a default worker's."""
    plain = LLMEngine(EngineConfig(num_kv_blocks=64))
    det = LLMEngine(EngineConfig(num_kv_blocks=64, deterministic=True))
    assert plain.kv_layout.model_fingerprint != det.kv_layout.model_fingerprint
    assert plain.root_hash != det.root_hash
