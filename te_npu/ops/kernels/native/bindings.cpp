// Python bindings of the native CPU kernels (te_npu/numerics/native_cpu.py builds and loads them).
#include <torch/extension.h>

namespace te_npu_native {
void quantize_into(const at::Tensor& x, bool ceil_alg, const at::Tensor& row_data, const at::Tensor& row_scale,
                   const at::Tensor& col_data, const at::Tensor& col_scale);
void hif8_quantize_into(const at::Tensor& x, int64_t groups, double format_max, bool saturate, const at::Tensor& codes,
                        const at::Tensor& amax, const at::Tensor& scale);
void lut_decode_into(const at::Tensor& codes, const at::Tensor& lut, const at::Tensor& scale, int64_t mode,
                     int64_t block, const at::Tensor& row_to_block, const at::Tensor& out);
}  // namespace te_npu_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_into", &te_npu_native::quantize_into,
        "MXFP8 row/column quantization of a 2D CPU tensor into preallocated uint8 outputs");
  m.def("hif8_quantize_into", &te_npu_native::hif8_quantize_into,
        "HiF8 current-scaling quantization (per tensor or per leading group) into preallocated outputs");
  m.def("lut_decode_into", &te_npu_native::lut_decode_into,
        "8-bit codes -> fp32 through a 256-entry table, optionally times per-block fp32 scales");
}
