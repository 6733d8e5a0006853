// MXFP8 quantization (E4M3 data, E8M0 block scales of 32 elements) of a 2D CPU tensor, both
// orientations in one pass per 32-row tile, bit-identical to te_npu.numerics.mxfp8.quantize
// (which stays the reference and the default; see te_npu/numerics/native_cpu.py).
//
// Plain loops written so the compiler vectorizes them (no intrinsics, no branches in inner
// loops). Never build with -ffast-math: encode_e4m3 relies on IEEE round-to-nearest-even adds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "huge_pages.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>


namespace te_npu_native {
namespace {

constexpr int kBlock = 32;                         // MX block size
constexpr uint32_t kE4M3MaxBits = 0x43E00000u;     // fp32 bits of 448, the largest E4M3 value
constexpr uint32_t kE4M3MinNormal = 0x3C800000u;   // fp32 bits of 2**-6, the smallest normal E4M3
constexpr uint32_t kExpMask = 0x7F800000u;         // fp32 exponent field (also +Inf)
constexpr int16_t kBf16TwoPowM10 = 0x3A80;        // bf16 bits of 2**-10
constexpr int16_t kBf16TwoPowM6 = 0x3C80;         // bf16 bits of 2**-6
constexpr uint8_t kE4M3Nan = 0x7F;
constexpr uint8_t kE8M0Nan = 0xFF;

inline float as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t as_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Input element: raw bits T, magnitude bits Mag (sign cleared; as unsigned integers they order
// like |x|, with Inf above every finite value and NaN above Inf), the value as float.
struct BF16In {
  using T = uint16_t;
  using Mag = uint16_t;
  static constexpr int kFieldShift = 7;  // exponent field of bf16 bits
  static inline Mag mag(T v) { return static_cast<Mag>(v & 0x7FFFu); }
  static inline float value_of_mag(uint32_t mag) { return as_float(mag << 16); }
  static inline float value(T v) { return as_float(static_cast<uint32_t>(v) << 16); }
};
struct F32In {
  using T = uint32_t;
  using Mag = uint32_t;
  static constexpr int kFieldShift = 23;
  static inline Mag mag(T v) { return v & 0x7FFFFFFFu; }
  static inline float value_of_mag(uint32_t mag) { return as_float(mag); }
  static inline float value(T v) { return as_float(v); }
};

// Floor scale (OCP MX): code = exponent field of amax - 8, at least 0; 0xFF for NaN/Inf.
template <class In>
inline uint32_t floor_code(uint32_t amax_mag) {
  const uint32_t field = amax_mag >> In::kFieldShift;
  const uint32_t code = field > 8u ? field - 8u : 0u;
  return field == 0xFFu ? kE8M0Nan : code;
}

// Ceil scale: smallest power of two >= amax / 448 (mxfp8.scale_codes_from_amax, "ceil").
template <class In>
inline uint32_t ceil_code(uint32_t amax_mag) {
  if ((amax_mag >> In::kFieldShift) == 0xFFu) return kE8M0Nan;
  const float q = In::value_of_mag(amax_mag) / 448.0f;
  const uint32_t q_exp = as_bits(q) >> 23;
  const float truncated = q_exp == 0u ? as_float(1u << 22) : as_float(q_exp << 23);
  const uint32_t code = q_exp + (q > truncated ? 1u : 0u);
  return code < 254u ? code : 254u;
}

// 2**-(code - 127) as float (NaN for 0xFF): exact for every reachable code.
inline float inverse_scale(uint32_t code) {
  const uint32_t field = code < 253u ? 254u - code : 1u;
  return code == kE8M0Nan ? as_float(0x7FC00000u) : as_float(field << 23);
}

// Saturating round-to-nearest-even float -> E4M3 code, for finite or infinite y (a NaN gives
// some code; NaN blocks are overwritten with 0x7F afterwards):
//   E    = max(exponent of |y|, -6)   (E4M3 keeps 3 mantissa bits; below 2**-6 the spacing stays
//                                      2**-9: the subnormal range)
//   s    = |y| + 2**(E + 20)          (one fp32 add; the spacing of s is 2**(E - 3), so the FPU
//                                      rounds |y| to E4M3 spacing, ties to even)
//   k    = mantissa field of s        (the rounded significand in units of 2**(E - 3): 8..16 for
//                                      normals, 0..8 below 2**-6)
//   code = 8 * (E + 6) + k            (k = 16 carries into the next exponent by itself)
inline uint8_t encode_e4m3(float y) {
  const uint32_t b = as_bits(y);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t m = mag < kE4M3MaxBits ? mag : kE4M3MaxBits;  // |y| saturated to 448
  const uint32_t e = m & kExpMask;
  const uint32_t exp_bits = e > kE4M3MinNormal ? e : kE4M3MinNormal;  // 2**E as fp32 bits
  const uint32_t k = as_bits(as_float(m) + as_float(exp_bits + (20u << 23))) & 0x7FFFFFu;
  const uint32_t code = (exp_bits >> 20) - (121u << 3) + k;  // 8 * (E + 127 - 121) + k
  return static_cast<uint8_t>(code | ((b >> 24) & 0x80u));
}

// Fast path for bf16 input, on 16-bit lanes (twice as many per vector as encode_e4m3):
// y = x * 2**-e is formed exactly by subtracting e from the bf16 exponent field
// (es = e << 7, two's complement), then the 7-bit mantissa is rounded to 3 bits (ties to even)
// with integer ops. Exact when the block is finite, |x| < 2**(e + 9) (true of every element of a
// block scaled from its amax) and e >= -116 (so a bf16-subnormal x gives |y| < 2**-10, code 0).
// Sets `slow` when |y| lies in (2**-10, 2**-6), the E4M3 subnormals this path does not round:
// the caller then re-encodes that row with encode_e4m3. Checked exhaustively against
// encode_e4m3 by tests/unit/numerics/test_native_cpu.py.
inline uint8_t encode_e4m3_bf16(uint16_t x, uint16_t es, uint16_t& slow) {
  const uint16_t y_bits = static_cast<uint16_t>((x & 0x7FFFu) - es);
  const int16_t y = static_cast<int16_t>(y_bits);  // <= 0 when y underflowed the bf16 exponent
  const uint16_t rounded = static_cast<uint16_t>(y_bits + 7u + ((y_bits >> 4) & 1u));
  uint16_t code = static_cast<uint16_t>((rounded >> 4) - (120u << 3));  // rebias 127 -> 7
  code = code < 126u ? code : 126u;                                        // saturate to 448
  code = y <= kBf16TwoPowM10 ? 0 : code;                                   // |y| <= 2**-10
  slow |= static_cast<uint16_t>((y > kBf16TwoPowM10) & (y < kBf16TwoPowM6));
  return static_cast<uint8_t>(code | ((x >> 8) & 0x80u));
}

constexpr uint32_t kMinFastCode = 11;  // e = code - 127 >= -116: the bf16 fast path is exact

// Block amax (magnitude bits) -> E8M0 codes and inverse scales, n blocks.
template <class In>
void codes_and_inverses(const typename In::Mag* amax, int64_t n, bool ceil_alg, uint8_t* codes, float* inv) {
  if (ceil_alg) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t c = ceil_code<In>(amax[i]);
      codes[i] = static_cast<uint8_t>(c);
      inv[i] = inverse_scale(c);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t c = floor_code<In>(amax[i]);
      codes[i] = static_cast<uint8_t>(c);
      inv[i] = inverse_scale(c);
    }
  }
}

// Encoders of one row of n elements (straight loops, so they vectorize).
template <class In>
void encode_row_blocks(const typename In::T* src, const float* block_inv, uint8_t* dst, int64_t n) {
  for (int64_t kb = 0; kb < n / kBlock; ++kb) {
    const float inv = block_inv[kb];
    for (int j = 0; j < kBlock; ++j) dst[kb * kBlock + j] = encode_e4m3(In::value(src[kb * kBlock + j]) * inv);
  }
}

template <class In>
void encode_row(const typename In::T* src, const float* inv, uint8_t* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = encode_e4m3(In::value(src[k]) * inv[k]);
}

// bf16 fast path over a row; returns false if some element needs encode_e4m3 (see above).
inline bool encode_row_bf16(const uint16_t* src, const uint16_t* es, uint8_t* dst, int64_t n) {
  uint16_t slow = 0;
  for (int64_t k = 0; k < n; ++k) dst[k] = encode_e4m3_bf16(src[k], es[k], slow);
  return slow == 0;
}

// Exponent shift of the bf16 fast path: (code - 127) << 7 as uint16; 0 for NaN blocks.
inline uint16_t exponent_shift(uint8_t code) {
  return code == kE8M0Nan ? 0 : static_cast<uint16_t>((static_cast<int>(code) - 127) * 128);
}

// One 32-row tile per task. Pass 1 reduces the block amax of both orientations; pass 2 encodes
// both while the tile is still in cache (bf16: fast path first, encode_e4m3 for a row it cannot
// do exactly); pass 3 writes the NaN code into blocks scaled 0xFF.
template <class In, bool kRow, bool kCol>
void quantize_tiles(const typename In::T* x, int64_t rows, int64_t cols, bool ceil_alg,
                    uint8_t* row_data, uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale) {
  using T = typename In::T;
  using Mag = typename In::Mag;
  constexpr bool kBf16 = std::is_same<In, BF16In>::value;
  const int64_t tiles = (rows + kBlock - 1) / kBlock;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // Local copies: a store through uint8_t* may alias anything the lambda captured by
    // reference, which would keep the compiler from vectorizing loops bounded by these.
    const int64_t n_rows = rows, n_cols = cols, col_blocks = cols / kBlock;
    const bool ceil = ceil_alg;
    std::vector<Mag> col_amax(kCol ? n_cols : 0), row_amax(kRow ? kBlock * col_blocks : 0);
    std::vector<float> col_inv(kCol ? n_cols : 0), row_inv(kRow ? kBlock * col_blocks : 0);
    std::vector<uint16_t> col_es(kBf16 && kCol ? n_cols : 0), row_es(kBf16 && kRow ? n_cols : 0);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * kBlock;
      const int64_t nr = std::min<int64_t>(kBlock, n_rows - r0);
      // pass 1: block amax, as magnitude bits
      Mag* camax = col_amax.data();
      if (kCol) std::fill(col_amax.begin(), col_amax.end(), Mag(0));
      for (int64_t r = 0; r < nr; ++r) {
        const T* src = x + (r0 + r) * n_cols;
        if (kCol) {
          for (int64_t k = 0; k < n_cols; ++k) camax[k] = std::max(camax[k], In::mag(src[k]));
        }
        if (kRow) {
          for (int64_t kb = 0; kb < col_blocks; ++kb) {
            Mag block_max = 0;
            for (int j = 0; j < kBlock; ++j) block_max = std::max(block_max, In::mag(src[kb * kBlock + j]));
            row_amax[r * col_blocks + kb] = block_max;
          }
        }
      }
      uint8_t* row_codes = kRow ? row_scale + r0 * col_blocks : nullptr;
      uint8_t* col_codes = kCol ? col_scale + tile * n_cols : nullptr;
      if (kRow) codes_and_inverses<In>(row_amax.data(), nr * col_blocks, ceil, row_codes, row_inv.data());
      if (kCol) codes_and_inverses<In>(camax, n_cols, ceil, col_codes, col_inv.data());
      // pass 2: encode
      bool col_fast = kBf16 && kCol;
      if (kBf16 && kCol) {
        for (int64_t k = 0; k < n_cols; ++k) {
          col_es[k] = exponent_shift(col_codes[k]);
          col_fast = col_fast && col_codes[k] >= kMinFastCode;
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        const T* src = x + (r0 + r) * n_cols;
        uint8_t* row_dst = kRow ? row_data + (r0 + r) * n_cols : nullptr;
        uint8_t* col_dst = kCol ? col_data + (r0 + r) * n_cols : nullptr;
        bool row_done = false, col_done = false;
        if constexpr (kBf16) {
          bool row_fast = kRow;
          if (kRow) {
            const uint8_t* codes = row_codes + r * col_blocks;
            for (int64_t kb = 0; kb < col_blocks; ++kb) {
              const uint16_t es = exponent_shift(codes[kb]);
              row_fast = row_fast && codes[kb] >= kMinFastCode;
              for (int j = 0; j < kBlock; ++j) row_es[kb * kBlock + j] = es;
            }
          }
          if (kRow && kCol) {  // one load of x for both orientations
            const uint16_t* res = row_es.data();
            const uint16_t* ces = col_es.data();
            uint16_t row_slow = 0, col_slow = 0;
            for (int64_t k = 0; k < n_cols; ++k) {
              row_dst[k] = encode_e4m3_bf16(src[k], res[k], row_slow);
              col_dst[k] = encode_e4m3_bf16(src[k], ces[k], col_slow);
            }
            row_done = row_fast && row_slow == 0;
            col_done = col_fast && col_slow == 0;
          } else if (kRow) {
            row_done = row_fast && encode_row_bf16(src, row_es.data(), row_dst, n_cols);
          } else {
            col_done = col_fast && encode_row_bf16(src, col_es.data(), col_dst, n_cols);
          }
        }
        if (kRow && !row_done) encode_row_blocks<In>(src, row_inv.data() + r * col_blocks, row_dst, n_cols);
        if (kCol && !col_done) encode_row<In>(src, col_inv.data(), col_dst, n_cols);
      }
      // pass 3: blocks holding NaN/Inf (scale 0xFF) are all NaN codes, as in mxfp8.quantize
      if (kRow) {
        for (int64_t i = 0; i < nr * col_blocks; ++i) {
          if (row_codes[i] == kE8M0Nan) std::fill_n(row_data + r0 * n_cols + i * kBlock, kBlock, kE4M3Nan);
        }
      }
      if (kCol) {
        for (int64_t k = 0; k < n_cols; ++k) {
          if (col_codes[k] != kE8M0Nan) continue;
          for (int64_t r = 0; r < nr; ++r) col_data[(r0 + r) * n_cols + k] = kE4M3Nan;
        }
      }
    }
  });
}

template <class In>
void dispatch(const at::Tensor& x, bool ceil_alg, uint8_t* rd, uint8_t* rs, uint8_t* cd, uint8_t* cs) {
  const auto* src = reinterpret_cast<const typename In::T*>(x.data_ptr());
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rd && cd) quantize_tiles<In, true, true>(src, rows, cols, ceil_alg, rd, rs, cd, cs);
  else if (rd) quantize_tiles<In, true, false>(src, rows, cols, ceil_alg, rd, rs, cd, cs);
  else if (cd) quantize_tiles<In, false, true>(src, rows, cols, ceil_alg, rd, rs, cd, cs);
}

void check_output(const at::Tensor& t, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == cols,
              "mxfp8_cpu: ", name, " must be a contiguous uint8 CPU tensor of shape [", rows, ", ", cols,
              "], got ", t.sizes(), " ", t.scalar_type());
}

}  // namespace

// Writes MXFP8 codes of x: [R, K] (contiguous bf16/fp32, CPU) into preallocated uint8 outputs:
// row_data [R, K] + row_scale [R, K/32] (blocks along K) and/or col_data [R, K] + col_scale
// [R/32, K] (blocks along R). An orientation whose data tensor is empty (numel 0) is skipped.
void quantize_into(const at::Tensor& x, bool ceil_alg, const at::Tensor& row_data, const at::Tensor& row_scale,
                   const at::Tensor& col_data, const at::Tensor& col_scale) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "mxfp8_cpu: needs a contiguous 2D CPU tensor, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "mxfp8_cpu: bf16 or fp32 only, got ",
              x.scalar_type());
  const int64_t rows = x.size(0), cols = x.size(1);
  const bool want_row = row_data.numel() > 0, want_col = col_data.numel() > 0;
  if (want_row) {
    TORCH_CHECK(cols % kBlock == 0, "mxfp8_cpu: ", cols, " columns is not a multiple of 32");
    check_output(row_data, rows, cols, "row_data");
    check_output(row_scale, rows, cols / kBlock, "row_scale");
  }
  if (want_col) {
    TORCH_CHECK(rows % kBlock == 0, "mxfp8_cpu: ", rows, " rows is not a multiple of 32");
    check_output(col_data, rows, cols, "col_data");
    check_output(col_scale, rows / kBlock, cols, "col_scale");
  }
  for (const at::Tensor* t : {&row_data, &col_data}) advise_huge_pages(t->data_ptr(), t->nbytes());
  uint8_t* rd = want_row ? row_data.data_ptr<uint8_t>() : nullptr;
  uint8_t* rs = want_row ? row_scale.data_ptr<uint8_t>() : nullptr;
  uint8_t* cd = want_col ? col_data.data_ptr<uint8_t>() : nullptr;
  uint8_t* cs = want_col ? col_scale.data_ptr<uint8_t>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) dispatch<BF16In>(x, ceil_alg, rd, rs, cd, cs);
  else dispatch<F32In>(x, ceil_alg, rd, rs, cd, cs);
}

}  // namespace te_npu_native
