// Decode of 8-bit codes (E4M3 or HiF8) to fp32 through a 256-entry table, optionally times a
// per-block fp32 scale (MXFP8's 2**(code - 127), already raised as the caller wants). Bit-identical
// to te_npu.numerics.{mxfp8.dequantize, hif8.decode}: the table holds every code's exact value
// and E4M3 value x power of two is exact in fp32 (smallest product 2**-9 * 2**-127 = 2**-136 is a
// normal-range multiple of fp32's 2**-149 quantum). Never build with -ffast-math.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "huge_pages.h"

#include <algorithm>
#include <cstdint>

namespace te_npu_native {
namespace {

constexpr int64_t kGrainElements = 1 << 16;

enum Mode : int64_t { kNoScale = 0, kRowBlocks = 1, kColBlocks = 2 };

}  // namespace

// codes: uint8 [R, K]; lut: fp32 [256]; out: fp32 [R, K]; all contiguous.
// kRowBlocks: scale fp32 [R, K / block]; kColBlocks: scale fp32 [B, K], row r reads scale row
// row_to_block[r] (int64 [R]) or, when row_to_block is empty, r / block.
void lut_decode_into(const at::Tensor& codes, const at::Tensor& lut, const at::Tensor& scale, int64_t mode,
                     int64_t block, const at::Tensor& row_to_block, const at::Tensor& out) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "lut_decode_into: codes must be a contiguous uint8 [R, K] tensor");
  TORCH_CHECK(lut.numel() == 256 && lut.scalar_type() == at::kFloat && lut.is_contiguous(),
              "lut_decode_into: lut must be a contiguous fp32 [256] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == codes.numel(),
              "lut_decode_into: out must be a contiguous fp32 tensor with as many elements as codes");
  TORCH_CHECK(mode == kNoScale || mode == kRowBlocks || mode == kColBlocks, "lut_decode_into: bad mode");
  const int64_t rows = codes.size(0), cols = codes.size(1);
  const bool mapped = mode == kColBlocks && row_to_block.numel() > 0;
  if (mode != kNoScale) {
    TORCH_CHECK(block > 0 && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2,
                "lut_decode_into: scale must be a contiguous fp32 2D tensor");
  }
  if (mode == kRowBlocks) {
    TORCH_CHECK(cols % block == 0 && scale.size(0) == rows && scale.size(1) == cols / block,
                "lut_decode_into: row scale shape does not match codes");
  }
  if (mode == kColBlocks) {
    TORCH_CHECK(scale.size(1) == cols, "lut_decode_into: col scale shape does not match codes");
    if (mapped) {
      TORCH_CHECK(row_to_block.scalar_type() == at::kLong && row_to_block.is_contiguous() &&
                      row_to_block.numel() == rows,
                  "lut_decode_into: row_to_block must be a contiguous int64 [R] tensor");
    } else {
      TORCH_CHECK(rows % block == 0 && scale.size(0) == rows / block,
                  "lut_decode_into: col scale shape does not match codes");
    }
  }
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* table = lut.data_ptr<float>();
  const float* s = mode == kNoScale ? nullptr : scale.data_ptr<float>();
  const int64_t* r2b = mapped ? row_to_block.data_ptr<int64_t>() : nullptr;
  const int64_t num_scale_rows = mode == kColBlocks ? scale.size(0) : 0;
  float* o = out.data_ptr<float>();
  advise_huge_pages(o, static_cast<size_t>(out.nbytes()));
  const int64_t grain_rows = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain_rows, [&](int64_t begin, int64_t end) {
    float lut_local[256];
    std::copy(table, table + 256, lut_local);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* cr = c + r * cols;
      float* orow = o + r * cols;
      if (mode == kNoScale) {
        for (int64_t k = 0; k < cols; ++k) orow[k] = lut_local[cr[k]];
      } else if (mode == kRowBlocks) {
        const float* sr = s + r * (cols / block);
        for (int64_t b = 0; b < cols / block; ++b) {
          const float f = sr[b];
          for (int64_t j = b * block; j < (b + 1) * block; ++j) orow[j] = lut_local[cr[j]] * f;
        }
      } else {
        const int64_t blk = mapped ? r2b[r] : r / block;
        TORCH_CHECK(blk >= 0 && blk < num_scale_rows, "lut_decode_into: row ", r, " maps to scale row ", blk,
                    " outside [0, ", num_scale_rows, ")");
        const float* sr = s + blk * cols;
        for (int64_t k = 0; k < cols; ++k) orow[k] = lut_local[cr[k]] * sr[k];
      }
    }
  });
}

}  // namespace te_npu_native
