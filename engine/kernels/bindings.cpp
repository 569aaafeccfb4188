// The Python module: every kernel, and what the build chose (ISA, the
// greedy head's constants). The kernels release the GIL, as ATen ops do: a
// worker's KV-receive and output threads keep running while a step's
// attention is computed.

#include <torch/python.h>

#include "head.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm, "RMSNorm over rows", release());
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; RMSNorm(residual)", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("linear_silu_mul", &linear_silu_mul, "silu(x @ W_gate + b) * (x @ W_up + b), packed",
        py::arg("x"), py::arg("panels"), py::arg("inter"), py::arg("bias") = py::none(), release());
  m.def("rope_store_kv", &rope_store_kv, "rotary embedding in place; store K and V", release());
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV",
        release());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention over paged KV", release());
  m.def("argmax_rows", &argmax_rows, "argmax of each row", release());
  m.def("linear", &linear, "x @ W (+ bias), W packed in panels", py::arg("x"), py::arg("panels"),
        py::arg("n"), py::arg("bias") = py::none(), release());
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias), W quantized in blocks of 32 inputs",
        py::arg("x"), py::arg("weight"), py::arg("scales"), py::arg("format"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("row_invariant") = false, release());
  m.def("quant_dense_bf16", &quant_dense_bf16,
        "the bfloat16 [N, K] weights of a quantized matrix (many rows on the matrix units)",
        py::arg("weight"), py::arg("scales"), py::arg("format"), py::arg("k"),
        py::arg("out") = py::none(), release());
#ifdef TANDEM_GREEDY_HEAD
  m.def("greedy_head_f16", &greedy_head_f16, "greedy tokens from a float16 screen of the head",
        release());
  m.def("greedy_head_i8", &greedy_head_i8, "greedy tokens from an int8 screen of the head",
        py::arg("x"), py::arg("panels"), py::arg("q8"), py::arg("colsum"), py::arg("columns"),
        py::arg("n"), py::arg("max_candidates"), py::arg("amx") = true, release());
#endif
#ifdef TANDEM_AMX_SCREEN
  m.def("amx_screen", &amx_usable, "whether greedy_head_i8's screen runs on AMX tiles");
#else
  m.def("amx_screen", [] { return false; }, "whether greedy_head_i8's screen runs on AMX tiles");
#endif
  m.attr("PANEL_WIDTH") = kPanel;
  m.attr("QUANT_PANEL_ROWS") = kQuantPanelRows;
  // The formats quant_linear runs on the integer GEMM from QUANT_PANEL_ROWS
  // rows on (x quantized by rows); the others dequantize float32 panels.
  py::list gemm_formats;
  for (int64_t f = 0; f < 4; ++f)
    if (int8_gemm_supports(f)) gemm_formats.append(f);
  m.attr("INT8_GEMM_FORMATS") = py::tuple(gemm_formats);
#ifdef TANDEM_GREEDY_HEAD
  m.attr("INT8_ROW_LEVELS") = kQuantMax;  // |q_x| of greedy_head_i8's quantized rows
  m.attr("HALF_SCREEN_MAX_ROWS") = kHalfScreenMaxRows;  // greedy_head_f16 pays off up to
#endif
  // The vector branch the preprocessor took (the linear kernel's tiles, the
  // screens): "avx512", "avx2" (with F16C and FMA) or "generic".
#if defined(__AVX512F__)
  m.attr("ISA") = "avx512";
#elif defined(TANDEM_GREEDY_HEAD)
  m.attr("ISA") = "avx2";
#else
  m.attr("ISA") = "generic";
#endif
}
