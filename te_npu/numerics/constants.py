"""Constants of the 8-bit formats, each with where its value comes from.

MXFP8 follows the OCP Microscaling spec v1.0 (E4M3 elements, E8M0 block scale, 32-element
blocks). HiF8 follows Huawei's HiFloat8 (sign | dot prefix | exponent | mantissa); the code
values below were read off the ``en_dtypes.hifloat8`` reference, which the tests sweep.
"""

# ---- E4M3 (float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no Inf ----
E4M3_MAX = 448.0  # largest finite E4M3 value: 1.75 * 2**8 (code 0x7E)
E4M3_EMAX = 8  # exponent of E4M3_MAX: floor(log2(448)); the floor scale is 2**(floor(log2 amax) - 8)
E4M3_MANTISSA_BITS = 3  # explicit mantissa bits of an E4M3 element
E4M3_MIN_NORMAL_EXP = -6  # smallest normal E4M3 exponent (2**-6); below it spacing is 2**-9
E4M3_NAN_CODE = 0x7F  # canonical E4M3 NaN code (0xFF is the negative NaN)

# ---- E8M0 block scale: 8 exponent bits, bias 127, value 2**(code - 127) ----
E8M0_BIAS = 127  # code = e + 127
E8M0_NAN = 0xFF  # the only non-numeric code: a block holding NaN or +-Inf
E8M0_MIN_EXP = -127  # code 0 -> 2**-127 (the scale of an all-zero block)
E8M0_MAX_EXP = 127  # code 254 -> 2**127

MX_BLOCK_SIZE = 32  # elements per MX block (OCP MX v1.0)
# E8M0 scale rules: "ceil" (the default) is the smallest power of two >= amax / 448 -- torch_npu
# scale_alg=1 ("cuBLAS"), Transformer Engine's float_to_e8m0 round-up, torchao RCEIL, the rule of
# arXiv 2506.08027; "floor" is the OCP MX v1.0 rule 2**(floor(log2 amax) - 8), torch_npu
# scale_alg=0, which clips a block's values above 448 (up to 12.5 % of its top binade) to 448.
MX_SCALE_ALGS = ("ceil", "floor")
MX_DEFAULT_SCALE_ALG = "ceil"

# ---- FP32 bit layout, used to read exponents exactly from bits ----
FP32_MANTISSA_BITS = 23  # explicit mantissa bits of float32
FP32_EXP_BIAS = 127  # float32 exponent bias
FP32_EXP_MASK = 0xFF  # float32 exponent field after shifting out the mantissa
FP32_ABS_MASK = 0x7FFFFFFF  # clears the float32 sign bit
FP32_SIGN_BIT = -0x80000000  # 0x80000000 as an int32: the float32 sign bit
FP32_NAN_BITS = 0x7FC00000  # canonical quiet float32 NaN
FP32_INF_BITS = 0x7F800000  # +Inf as float32 bits; anything above is NaN

# ---- HiFloat8 ----
HIF8_MAX = 32768.0  # largest finite HiF8 value: 2**15 (code 0x6E)
HIF8_MAX_EXP = 15  # largest exponent of a normal HiF8 value
HIF8_MIN_NORMAL_EXP = -15  # smallest exponent with a mantissa bit (codes 0x7E/0x7F: 2**-15, 1.5*2**-15)
HIF8_MIN_DENORMAL_EXP = -22  # smallest denormal 2**-22 (code 0x01); denormals 0x01..0x07 = 2**-22..2**-16
HIF8_DENORMAL_OFFSET = 23  # denormal code m (1..7) has value 2**(m - 23)
HIF8_ZERO = 0x00  # the only zero code (-0.0 also encodes to 0x00)
HIF8_NAN = 0x80  # the only NaN code ("negative zero" pattern)
HIF8_POS_INF = 0x6F  # +Inf: the pattern that would be 1.5 * 2**15
HIF8_NEG_INF = 0xEF  # -Inf
HIF8_SIGN = 0x80  # sign bit of a HiF8 code
# Overflow: values >= 1.25 * 2**15 = 40960 round (ties away) past HIF8_MAX to Inf.
HIF8_OVERFLOW_THRESHOLD = 40960.0
# Underflow: values < 2**-23 (half the smallest denormal) round to zero; 2**-23 itself rounds
# away from zero to 2**-22.
HIF8_UNDERFLOW_THRESHOLD = 2.0**-23
# Mantissa bits by |exponent| band: (lowest |E|, highest |E|, mantissa bits, dot prefix code)
# |E| = 0 -> prefix 0001 + 3 mantissa bits; |E| = 1 -> 001 + exp-sign + 3;
# |E| 2..3 -> 01 + exp-sign + 1 exp bit + 3; 4..7 -> 10 + exp-sign + 2 exp bits + 2;
# 8..15 -> 11 + exp-sign + 3 exp bits + 1; denormals (E -22..-16) -> 0000 + 3-bit exponent, 0.
HIF8_BANDS = ((0, 0, 3, 0x08), (1, 1, 3, 0x10), (2, 3, 3, 0x20), (4, 7, 2, 0x40), (8, 15, 1, 0x60))

# Current-scaling targets: scale = amax / format_max so the scaled amax lands on format_max.
HIF8_INPUT_MAX = 15.0  # forward operands (activations, weights) are scaled into +-15 (3-bit mantissa band)
HIF8_GRAD_MAX = 224.0  # gradients are scaled into +-224 (largest value with a 2-bit mantissa)
