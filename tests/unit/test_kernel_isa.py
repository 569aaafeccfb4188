"""The kernels' AVX2 branches, on whatever CPU runs the tests (an AVX-512 or
AMX one included): TANDEM_KERNEL_ISA=avx2 builds them with -march=x86-64-v3,
and the kernel tests run against the PyTorch reference in a subprocess that
uses that build (docs/cpu-kernels.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine.kernels as kernels
from engine.kernels import build

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# A few of each family's tests: rows, matmuls, attention, argmax, screens, quantized.
KERNEL_TESTS = [
    "tests/unit/test_cpu_kernels.py::test_rms_norm_and_fused_residual",
    "tests/unit/test_cpu_kernels.py::test_silu_mul",
    "tests/unit/test_cpu_kernels.py::test_rope_store_kv",
    "tests/unit/test_cpu_kernels.py::test_linear_equals_mm_over_packed_panels",
    "tests/unit/test_cpu_kernels.py::test_linear_rows_do_not_depend_on_the_batch",
    "tests/unit/test_cpu_kernels.py::test_linear_rows_are_the_same_bits_in_a_prefill_sized_batch",
    "tests/unit/test_cpu_kernels.py::test_linear_silu_mul_is_the_same_bits_as_linear_then_silu_mul",
    "tests/unit/test_cpu_kernels.py::test_paged_decode_attention_equals_the_pytorch_path",
    "tests/unit/test_cpu_kernels.py::test_paged_prefill_attention_equals_sdpa",
    "tests/unit/test_cpu_kernels.py::test_argmax_rows",
    "tests/unit/test_greedy_head.py::test_tokens_equal_the_full_logits_argmax",
    "tests/unit/test_greedy_head.py::test_the_int8_bounds_hold",
    "tests/unit/test_greedy_head.py::test_the_float16_bound_holds",
    "tests/unit/test_quant.py::test_quant_linear_equals_the_dequantized_matmul",
    "tests/unit/test_quant.py::test_quant_linear_rows_do_not_depend_on_the_batch",
]
# The 32k-column heads (about a second each) at two batch sizes only.
SELECT = "not 32000 or 16-int8 or 1-float16"


@pytest.mark.skipif(
    os.environ.get("TANDEM_KERNEL_ISA") != "avx2", reason="runs inside the AVX2 test's subprocess"
)
def test_the_kernels_are_the_avx2_build():
    ops = kernels.cpu_ops(required=True)
    assert ops.__name__.startswith("tandem_cpu_ops_avx2_")
    assert ops.ISA == "avx2"
    assert ops.INT8_ROW_LEVELS == 31  # vpmaddubsw's 6-bit rows, not VNNI's 8
    assert not ops.amx_screen()  # the runtime AMX check is compiled out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.skipif(not build.supported("avx2"), reason="this CPU has no AVX2")
def test_the_avx2_branches_equal_the_pytorch_reference():
    ops = kernels.cpu_ops(required=False)
    if ops is not None and ops.ISA == "avx2" and "avx_vnni" not in build.cpu_isa_flags():
        assert ops.INT8_ROW_LEVELS == 31 and not ops.amx_screen()  # no VNNI, no AMX compiled in
        pytest.skip("the native build is the AVX2 one here: the kernel tests ran its branches")
    env = {**os.environ, "TANDEM_KERNEL_ISA": "avx2"}
    own = "tests/unit/test_kernel_isa.py::test_the_kernels_are_the_avx2_build"
    pytest_args = ["-q", "-p", "no:cacheprovider", "-k", SELECT, own, *KERNEL_TESTS]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = run.stdout.strip().splitlines()[-1:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in summary[0] and "skipped" not in summary[0], summary
