// HiFloat8 current-scaling quantization of a CPU tensor: amax per tensor (or per leading group),
// scale = amax * (1.0f / format_max) (1.0 if amax is 0 or not finite), codes of x / scale, bit-identical
// to te_npu.numerics.hif8 (the reference and the default; see te_npu/numerics/native_cpu.py).
//
// The encoder is branch-free integer arithmetic on fp32 bits, written so the compiler
// vectorizes it (variable shifts are AVX2 instructions). Never build with -ffast-math.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace te_npu_native {
namespace {

constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kHiF8MaxBits = 0x47000000u;  // fp32 bits of 2**15, the largest finite HiF8
constexpr uint32_t kHiF8Nan = 0x80u;
constexpr uint32_t kHiF8Inf = 0x6Fu;
constexpr int64_t kGrain = 1 << 16;

inline float as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t as_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// Branch-free helpers on 32-bit lanes. Comparisons give 0 / 1 as uint32 arithmetic (a sign
// bit shifted down), not bool: GCC keeps bools in narrow vectors and then spends most of the
// loop packing and unpacking them (or does not vectorize at all). Operands are small (|x| < 2**30).
inline uint32_t lt(int32_t a, int32_t b) { return static_cast<uint32_t>(a - b) >> 31; }  // a < b
inline uint32_t eq(int32_t a, int32_t b) { return 1u - (lt(a, b) | lt(b, a)); }
inline uint32_t pick(uint32_t cond, uint32_t if_true, uint32_t if_false) {  // cond is 0 or 1
  const uint32_t mask = 0u - cond;
  return (if_true & mask) | (if_false & ~mask);
}

// Mantissa bits HiF8 keeps at unbiased exponent e (|e| = abs_e): 3 for |e| <= 3, 2 for 4..7,
// 1 for 8..15, 0 for the denormal powers of two 2**-22 .. 2**-16 (and below).
inline uint32_t mantissa_bits(int32_t e, int32_t abs_e) {
  const uint32_t m = 1u + lt(abs_e, 8) + lt(abs_e, 4);
  return pick(lt(e, -15), 0u, m);
}

// HiF8 code of y (ties away from zero), as hif8.encode:
// 1. round the fp32 magnitude at the width chosen by its exponent (add half a unit, truncate;
//    a carry into the next power of two is exact in every band);
// 2. code = (code of mantissa 0 at the rounded exponent) + the kept mantissa bits.
inline uint8_t encode_hif8(float y, uint32_t saturate) {
  const uint32_t b = as_bits(y);
  const uint32_t raw = b & 0x7FFFFFFFu;
  // raw and the limits are below 2**31: compare them as ints
  const uint32_t is_nan = lt(static_cast<int32_t>(kInfBits), static_cast<int32_t>(raw));
  const uint32_t clip = saturate & lt(static_cast<int32_t>(kHiF8MaxBits), static_cast<int32_t>(raw)) &
                        lt(static_cast<int32_t>(raw), static_cast<int32_t>(kInfBits));
  const uint32_t mag = pick(clip, kHiF8MaxBits, raw);
  const int32_t e = static_cast<int32_t>(mag >> 23) - 127;
  const int32_t abs_e = e < 0 ? -e : e;
  const uint32_t drop = 23u - mantissa_bits(e, abs_e);
  const uint32_t tiny = lt(e, -23), huge = lt(15, e);
  const uint32_t at_m23 = eq(e, -23);  // [2**-23, 2**-22): ties away -> 2**-22
  uint32_t half = pick(at_m23, 1u << 23, 1u << (drop - 1u));
  uint32_t keep = pick(at_m23, ~0x7FFFFFu, ~((1u << drop) - 1u));
  half = pick(tiny | huge, 0u, half);  // below 2**-23: zero; beyond 2**16, Inf, NaN: as is
  keep = pick(tiny, 0u, pick(huge, ~0u, keep));
  const uint32_t rounded = (mag + half) & keep;

  const int32_t e2 = static_cast<int32_t>(rounded >> 23) - 127;
  const int32_t a2 = e2 < 0 ? -e2 : e2;
  const uint32_t m2 = mantissa_bits(e2, a2);
  const uint32_t mant = (rounded >> (23u - m2)) & ((1u << m2) - 1u);
  // bands |e| in [low, ...]: prefix | exp_sign << (3 if |e| == 1 else 4) | (|e| - low) << m
  const uint32_t ge2 = 1u - lt(a2, 2), ge4 = 1u - lt(a2, 4), ge8 = 1u - lt(a2, 8);
  const uint32_t low = pick(ge8, 8u, pick(ge4, 4u, pick(ge2, 2u, 1u)));
  const uint32_t prefix = pick(ge8, 0x60u, pick(ge4, 0x40u, pick(ge2, 0x20u, 0x10u)));
  const uint32_t exp_sign_bit = pick(lt(e2, 0), pick(ge2, 0x10u, 0x08u), 0u);
  uint32_t base = prefix | exp_sign_bit | ((static_cast<uint32_t>(a2) - low) << m2);
  base = pick(eq(e2, 0), 0x08u, base);
  base = pick(lt(e2, -15), static_cast<uint32_t>(e2 + 23), base);  // denormals 0x01..0x07
  uint32_t code = pick(lt(15, e2), kHiF8Inf, base + mant);         // overflow and Inf
  code = pick(eq(static_cast<int32_t>(rounded), 0), 0u, code | ((b >> 24) & 0x80u));  // no -0: 0x80 is NaN
  code = pick(is_nan, kHiF8Nan, code);
  return static_cast<uint8_t>(code);
}

template <class T>
inline float load_value(const T* p, int64_t i);
template <>
inline float load_value<uint16_t>(const uint16_t* p, int64_t i) { return as_float(static_cast<uint32_t>(p[i]) << 16); }
template <>
inline float load_value<float>(const float* p, int64_t i) { return p[i]; }

// Magnitude bits of the largest |x| of n elements: as unsigned integers they order like |x|,
// with Inf above every finite value and NaN above Inf (so a NaN amax comes out NaN).
template <class T>
uint32_t amax_bits(const T* x, int64_t n) {
  return at::parallel_reduce(0, n, kGrain, 0u, [&](int64_t begin, int64_t end, uint32_t acc) {
    const T* p = x;
    for (int64_t i = begin; i < end; ++i) acc = std::max(acc, as_bits(load_value<T>(p, i)) & 0x7FFFFFFFu);
    return acc;
  }, [](uint32_t a, uint32_t b) { return std::max(a, b); });
}

template <class T>
void encode_group(const T* x, int64_t n, float scale, bool saturate, uint8_t* out) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    const T* p = x;
    uint8_t* o = out;
    const float s = scale;
    const uint32_t sat = saturate ? 1u : 0u;
    for (int64_t i = begin; i < end; ++i) o[i] = encode_hif8(load_value<T>(p, i) / s, sat);
  });
}

template <class T>
void quantize_groups(const T* x, int64_t groups, int64_t group_numel, double format_max, bool saturate,
                     float* amax, float* scale, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const T* xg = x + g * group_numel;
    const float a = as_float(amax_bits<T>(xg, group_numel));
    const bool ok = std::isfinite(a) && a > 0.0f;
    amax[g] = a;
    // amax * (1.0f / format_max) in FP32, as Ascend's per-tensor kernels compute it (ops-nn
    // quant/dynamic_quant arch35 dynamic_quant_regbase_full_load_pertensor.h: Muls by
    // float(1.0) / maxValue), not the division amax / format_max (they differ by an ulp).
    const float reciprocal = 1.0f / static_cast<float>(format_max);
    scale[g] = ok ? a * reciprocal : 1.0f;
    encode_group<T>(xg, group_numel, scale[g], saturate, out + g * group_numel);
  }
}

}  // namespace

// x: contiguous bf16/fp32 CPU tensor viewed as [groups, group_numel]; writes codes (uint8, x's
// numel), amax and scale (fp32, [groups]). scale = amax * (1.0f / format_max) in fp32, as hif8.current_scale.
void hif8_quantize_into(const at::Tensor& x, int64_t groups, double format_max, bool saturate, const at::Tensor& codes,
                        const at::Tensor& amax, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "hif8_cpu: needs a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "hif8_cpu: bf16 or fp32 only, got ",
              x.scalar_type());
  TORCH_CHECK(groups >= 1 && x.numel() % groups == 0, "hif8_cpu: ", x.numel(), " elements do not split into ", groups,
              " groups");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == x.numel(),
              "hif8_cpu: codes must be a contiguous uint8 tensor with ", x.numel(), " elements");
  for (const at::Tensor* t : {&amax, &scale}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == groups,
                "hif8_cpu: amax/scale must be contiguous fp32 tensors with ", groups, " elements");
  }
  const int64_t group_numel = x.numel() / groups;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_groups<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), groups, group_numel, format_max, saturate,
                              amax.data_ptr<float>(), scale.data_ptr<float>(), codes.data_ptr<uint8_t>());
  } else {
    quantize_groups<float>(x.data_ptr<float>(), groups, group_numel, format_max, saturate, amax.data_ptr<float>(),
                           scale.data_ptr<float>(), codes.data_ptr<uint8_t>());
  }
}

}  // namespace te_npu_native
