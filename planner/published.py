"""The shipped GPU profiles (planner/profiles/*.json), derived from published
figures: ``python -m planner.published`` writes them again.

Every figure comes with its source. They are estimates: a published benchmark
measures whole requests through a server (TTFT, inter-token latency), not
engine steps, and where a term is not published it is derived from the
hardware's datasheet with a stated efficiency. Replace them with profiles
measured on the GPU (``tandem plan --profile-out``) when one is available.

Cost terms (planner/profile.py): a compute-bound token costs 2 * params FLOPs
at an achieved share of the dense peak (b, and the per-sequence decode term e:
a decode row is a token of the same matmuls); a decode step's fixed cost d is
the published step time less those terms; the context term f is the KV bytes a
step reads per sequence token at an achieved share of the memory bandwidth;
the quadratic prefill term c is attention's 2 * layers * hidden FLOPs per
(query, key) pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.profile import Profile, fit_decode

FOLDER = Path(__file__).resolve().parent / "profiles"

VLLM_PERF_BUILD = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
NIM_PERF = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"
H200_DATASHEET = "https://www.nvidia.com/en-us/data-center/h200/"
MFU = 0.5  # achieved share of the dense BF16 peak in prefill (assumed)
MBU = 0.7  # achieved share of the HBM bandwidth reading the KV cache (assumed)


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_model_len: int

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


LLAMA_8B = Model("meta-llama/Llama-3.1-8B-Instruct", 8.03e9, 32, 4096, 8, 128, 128256, 131072)
LLAMA3_70B = Model("meta-llama/Meta-Llama-3-70B-Instruct", 70.6e9, 80, 8192, 8, 128, 128256, 8192)
LLAMA_70B = Model("meta-llama/Llama-3.3-70B-Instruct", 70.6e9, 80, 8192, 8, 128, 128256, 131072)


@dataclass(frozen=True)
class Gpus:
    label: str
    count: int
    flops: float  # dense peak of one GPU, FLOP/s (the cache's dtype)
    bandwidth: float  # HBM bytes/s of one GPU


H200_BF16 = 989e12
H200_BW = 4.8e12


def _from_latency_test(
    name: str, model: Model, gpus: Gpus, step_s: float, batch: int, ctx: float, source: str
) -> Profile:
    """A profile whose decode step at (batch, ctx) takes ``step_s`` (published)."""
    per_token = 2 * model.params / (gpus.count * gpus.flops * MFU)
    per_ctx = model.kv_bytes_per_token() / (gpus.count * gpus.bandwidth * MBU)
    pair = 2 * model.layers * model.hidden / (gpus.count * gpus.flops * MFU)
    d = step_s - batch * per_token - batch * ctx * per_ctx
    return Profile(
        prefill={"a": d, "b": per_token, "c": pair},
        decode={"d": d, "e": per_token, "f": per_ctx},
        kv_bytes_per_token=model.kv_bytes_per_token(),
        vocab_size=model.vocab,
        model=model.name,
        num_threads=1,
        decode_samples=[{"batch": batch, "ctx": ctx, "seconds": step_s}],
        name=name,
        source=source,
        hardware=gpus.label,
        max_model_len=model.max_model_len,
    )


def llama_8b_h200() -> Profile:
    """vLLM's CI latency test: Llama-3.1-8B, TP1, H200, batch 8, 32 prompt
    tokens, 128 output tokens: 833.4 ms end to end (mean)."""
    gpus = Gpus("1x H200 141GB (bf16, TP=1)", 1, H200_BF16, H200_BW)
    prefill_s = 8 * 32 * 2 * LLAMA_8B.params / (H200_BF16 * MFU)
    step = (0.8334 - prefill_s) / 128
    profile = _from_latency_test(
        "llama-3.1-8b-h200",
        LLAMA_8B,
        gpus,
        step,
        8,
        32 + 64,
        f"{VLLM_PERF_BUILD} (latency_llama8B_tp1, H200: 833.4 ms mean for batch 8, "
        f"32 in / 128 out); {H200_DATASHEET} (989 TFLOPS dense BF16, 4.8 TB/s)",
    )
    profile.notes = _notes("833.4 ms / 128 steps")
    return profile


def llama_70b_tp4_h200() -> Profile:
    """vLLM's CI latency test: Llama-3-70B, TP4, H200, batch 8, 32 prompt
    tokens, 128 output tokens: 2077.5 ms end to end (mean)."""
    gpus = Gpus("4x H200 141GB (bf16, TP=4)", 4, H200_BF16, H200_BW)
    prefill_s = 8 * 32 * 2 * LLAMA3_70B.params / (4 * H200_BF16 * MFU)
    step = (2.0775 - prefill_s) / 128
    profile = _from_latency_test(
        "llama-3-70b-tp4-h200",
        LLAMA3_70B,
        gpus,
        step,
        8,
        32 + 64,
        f"{VLLM_PERF_BUILD} (latency_llama70B_tp4, H200: 2077.5 ms mean for batch 8, "
        f"32 in / 128 out); {H200_DATASHEET} (989 TFLOPS dense BF16, 4.8 TB/s per GPU)",
    )
    profile.notes = _notes("2077.5 ms / 128 steps")
    return profile


# NIM 1.8.0, Llama-3.3-70B-Instruct, 2x H100 80G, fp8, TP2: (concurrency, TTFT ms, ITL ms).
NIM_70B_5000_500 = [(1, 406.77, 18.58), (5, 546.7, 21.83), (25, 688.69, 38.75), (50, 834.51, 59.73)]
NIM_70B_500_2000_C1 = (1, 47.77, 18.91)


def llama_70b_fp8_tp2_h100() -> Profile:
    """NVIDIA's NIM benchmark tables: decode fitted to the inter-token latency
    at concurrency 1-50 (5000 in / 500 out) and 1 (500 in / 2000 out);
    prefill to the TTFT at concurrency 1 of both (linear: two points)."""
    samples = [(c, 5000 + 250, itl / 1e3) for c, _, itl in NIM_70B_5000_500]
    samples.append((1, 500 + 1000, NIM_70B_500_2000_C1[2] / 1e3))
    decode, r2 = fit_decode(samples)
    long_ttft, short_ttft = NIM_70B_5000_500[0][1] / 1e3, NIM_70B_500_2000_C1[1] / 1e3
    b = (long_ttft - short_ttft) / 4500
    model = LLAMA_70B
    return Profile(
        prefill={"a": short_ttft - 500 * b, "b": b, "c": 0.0},
        decode=decode,
        kv_bytes_per_token=model.kv_bytes_per_token(1),  # fp8 KV cache
        vocab_size=model.vocab,
        model=f"{model.name} (fp8)",
        decode_samples=[{"batch": b_, "ctx": c, "seconds": s} for b_, c, s in samples],
        prefill_samples=[
            {"lengths": [5000], "seconds": long_ttft},
            {"lengths": [500], "seconds": short_ttft},
        ],
        fit_quality={"decode_r2": r2},
        name="llama-3.3-70b-fp8-tp2-h100",
        source=f"{NIM_PERF} (Llama-3.3-70b-instruct, NIM 1.8.0, 2 x H100 80G, fp8 TP2: "
        "TTFT and ITL by concurrency, 5000 in / 500 out and 500 in / 2000 out)",
        hardware="2x H100 80GB (fp8, TP=2)",
        max_model_len=model.max_model_len,
        notes=[
            "Estimate from a served benchmark, not engine steps: the ITL at a "
            "concurrency stands for a decode step of that batch (prefills of "
            "other requests share those steps), the TTFT at concurrency 1 for a "
            "lone prefill (it includes the server's overhead and one decode step).",
            "The KV cache is taken as fp8 (1 byte a value).",
            "Replace with a profile measured on the GPU (tandem plan --profile-out).",
        ],
    )


def _notes(step: str) -> list[str]:
    return [
        f"d: the decode step of the published latency test ({step}, less the "
        f"batch's prefill at the b below) less the e and f terms at batch 8.",
        f"b and e: 2 x params FLOPs a token at {MFU:.0%} of the dense BF16 peak (assumed).",
        f"f: the KV bytes a token of context adds to a step, read at {MBU:.0%} of the "
        "HBM bandwidth (assumed); c: attention's 2 x layers x hidden FLOPs a "
        "(query, key) pair at the same share of the peak.",
        "a: the decode step's fixed cost (a short prefill step reads the weights once too).",
        "An estimate, not a measurement: replace with a profile measured on the "
        "GPU (tandem plan --profile-out) when one is available.",
    ]


PUBLISHED = (llama_8b_h200, llama_70b_tp4_h200, llama_70b_fp8_tp2_h100)


def write_all(folder: Path = FOLDER) -> list[Path]:
    paths = []
    for make in PUBLISHED:
        profile = make()
        path = folder / f"{profile.name}.json"
        profile.save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for path in write_all():
        print(path)
