// Moment format `int4`: its codes in the native CPU kernel, the C++ of int4.py's
// quantize/dequantize functions in their operation order (bitwise the same for finite
// values; tests/optim/test_native_int4.py). A part of optim/native/step_cpu.cpp,
// included inside its namespace after its helpers (fbits, bitsf): not a standalone
// header. Codes are packed two per byte, element 2k in the low nibble; every run
// handled here starts at an even element and has an even length of at most
// kInt4Run. The nibbles are (un)packed as bytes and the arithmetic runs over the codes
// in element order: interleaving floats costs more shuffles.

constexpr int64_t kInt4Run = 128;

// int4.py V_MAX: the largest v stored (2**126).
constexpr float kInt4VMax = 0x1p126f;

#if defined(__AVX512F__)
// The values of the signed codes of a block whose absmax is `absmax` (as
// int4_decode_signed: (q * |q|) is exact, then times absmax / 49).
inline __m512 int4_signed_table(float absmax) {
  const __m512 qq = _mm512_setr_ps(0, 1, 4, 9, 16, 25, 36, 49, -64, -49, -36, -25, -16, -9, -4, -1);
  return _mm512_mul_ps(qq, _mm512_set1_ps(absmax * static_cast<float>(1.0 / 49.0)));
}

// The 16 levels (q + 1) / 16 of the square codes (exact).
inline __m512 int4_square_levels() {
  return _mm512_setr_ps(0.0625f, 0.125f, 0.1875f, 0.25f, 0.3125f, 0.375f, 0.4375f, 0.5f, 0.5625f,
                        0.625f, 0.6875f, 0.75f, 0.8125f, 0.875f, 0.9375f, 1.0f);
}
#endif

// Helpers of the AVX-512 loops (MIXPREC_INT8_AVX512, as int8's: AVX-512 F, BW and VBMI).
#if defined(MIXPREC_INT8_AVX512)
// 32 codes, the low nibble of each 32-bit lane of c0 then c1, packed into 16 bytes: per
// 64-bit lane, the even element's nibble and the odd one's shifted beside it (bits 0-3
// of c, bits 4-7 of c >> 28), then byte 0 of each 64-bit lane (one vpermt2b).
inline __m128i int4_pack32(__m512i c0, __m512i c1) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i p0 = _mm512_ternarylogic_epi64(low, c0, _mm512_srli_epi64(c0, 28), 0xCA);
  const __m512i p1 = _mm512_ternarylogic_epi64(low, c1, _mm512_srli_epi64(c1, 28), 0xCA);
  const __m512i index = _mm512_setr_epi64(0x3830282018100800, 0x7870686058504840, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si128(_mm512_permutex2var_epi8(p0, index, p1));
}

// The 16 codes of 8 packed bytes, code i in the low nibble of 32-bit lane i (the bits
// above it are the next codes'): the bytes broadcast to every 64-bit lane and lane i's
// first byte taken from bit 4 * i on (one vpmultishiftqb).
inline __m512i int4_codes16(const uint8_t* packed) {
  int64_t bytes;
  std::memcpy(&bytes, packed, 8);
  const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);
  return _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(bytes));
}

// The codes of int4_codes16 looked up in a table of 16 floats (vpermps reads the low
// 4 bits of each index).
inline __m512 int4_lookup16(const uint8_t* packed, __m512 table) {
  return _mm512_permutexvar_ps(int4_codes16(packed), table);
}

// int4_signed_code of 16 lanes (two's complement in the low byte of each 32-bit lane,
// whose low nibble is the code): int8's code_signed16 without its Newton step. Here
// x = |m| * f <= 49 * (1 + 2**-22), so the root estimate x * vrsqrt14ps(x) is within
// 7.0001 * (2**-14 + 2**-24) < 2**-11 of the exact root, and an estimate at least 2**-9
// from a half integer rounds as the exact root and as its float (within 2**-22 of it);
// the other lanes, and NaN or infinite x, take vsqrtps. Checked against
// int4_signed_code on every float x up to 64 (tests/optim/native_codes_check.cpp).
inline __m512i int4_code_signed16(__m512 m, __m512 f) {
  const __m512 sign = _mm512_and_ps(m, _mm512_set1_ps(-0.0f));
  const __m512 x = _mm512_mul_ps(_mm512_abs_ps(m), f);
  // x * rsqrt14(x), 0 for x == 0 (where the estimate is infinite)
  const __m512 s = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                       x, _mm512_rsqrt14_ps(x));
  return rint_root16(_mm512_or_ps(s, sign), x, sign);
}

// int4_square_code of 16 lanes in the low nibble of each 32-bit lane (given
// int4_square_factor of the row, rf, and of each column, cf). x = min(v, V_MAX) *
// max(rf, cf) is at most 16 * (1 + 2**-21) for a v no larger than its row's and
// column's maxima (which are maxima of these stored values), so rint(x) <= 16 and the
// code is max(rint(x), 1) - 1, with rint from the magic sum (kMagic's low bits are 0).
// vmaxps returns its second operand for a NaN x (a v of 0 times the infinite factor of a
// tiny subnormal maximum): code 0, as the scalar's conversion gives; an infinite x, 15.
// Checked against int4_square_code on every float x below 16.5
// (tests/optim/native_codes_check.cpp).
inline __m512i int4_square_code16(__m512 v, __m512 rf, __m512 cf) {
  const __m512 x =
      _mm512_mul_ps(_mm512_min_ps(_mm512_set1_ps(kInt4VMax), v), _mm512_max_ps(rf, cf));
  const __m512 t =
      _mm512_max_ps(_mm512_add_ps(x, _mm512_set1_ps(kMagic)), _mm512_set1_ps(kMagic + 1.0f));
  return _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(1));
}
#endif

// The codes of 2 * bytes elements, one per byte, in element order.
inline void int4_unpack(const uint8_t* packed, int64_t bytes, uint8_t* codes) {
#pragma GCC ivdep
  for (int64_t j = 0; j < bytes; ++j) {
    codes[2 * j] = packed[j] & 15;
    codes[2 * j + 1] = packed[j] >> 4;
  }
}
inline void int4_pack(const uint8_t* codes, int64_t bytes, uint8_t* packed) {
#pragma GCC ivdep
  for (int64_t j = 0; j < bytes; ++j)
    packed[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
}

// dequantize_signed4 of one block of n elements with absmax `absmax`.
inline void int4_decode_signed(const uint8_t* packed, float absmax, int64_t n, float* out) {
  const float ms = absmax * static_cast<float>(1.0 / 49.0);
  alignas(64) uint8_t codes[kInt4Run];
  int4_unpack(packed, n / 2, codes);
#if defined(__AVX512F__)
  // The 16 values a block's codes decode to, each as below ((q * |q|) is exact), looked
  // up with one permute per 16 elements.
  const __m512 table = int4_signed_table(absmax);
  for (int64_t j = 0; j + 16 <= n; j += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + j)));
    _mm512_storeu_ps(out + j, _mm512_permutexvar_ps(idx, table));
  }
  for (int64_t j = n - n % 16; j < n; ++j) {
#else
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
#endif
    const int c = codes[j];
    const float q = static_cast<float>(c >= 8 ? c - 16 : c);
    out[j] = (q * std::fabs(q)) * ms;
  }
}

// The nibble of m in a block whose factor is f = 49 / absmax (two's complement, -8 never).
inline int int4_signed_code(float m, float f) {
  const int q = static_cast<int>(std::rint(std::sqrt(std::fabs(m) * f)));
  return (m < 0.0f ? 16 - q : q) & 15;
}

// The factor 49 / absmax of a block's signed codes (of 1 when absmax is 0).
inline float int4_signed_factor(float am) { return (1.0f / (am > 0.0f ? am : 1.0f)) * 49.0f; }

// quantize_signed4's codes of one block of n elements whose absmax is `am`.
inline void int4_encode_signed_codes(const float* m, int64_t n, float am, uint8_t* packed) {
  const float f = int4_signed_factor(am);
  int64_t j = 0;
#if defined(MIXPREC_INT8_AVX512)
  const __m512 fv = _mm512_set1_ps(f);
  for (; j + 32 <= n; j += 32)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + j / 2),
                     int4_pack32(int4_code_signed16(_mm512_loadu_ps(m + j), fv),
                                 int4_code_signed16(_mm512_loadu_ps(m + j + 16), fv)));
#endif
  alignas(64) uint8_t codes[kInt4Run];
#pragma GCC ivdep
  for (int64_t t = j; t < n; ++t) codes[t - j] = static_cast<uint8_t>(int4_signed_code(m[t], f));
  int4_pack(codes, (n - j) / 2, packed + j / 2);
}

// quantize_signed4 of one block of n elements: m clamped (in place) to M_MAX, its absmax
// (the maximum of |m| taken on the bits, as int8's) and codes.
inline void int4_encode_signed(float* m, int64_t n, uint8_t* packed, float* absmax) {
  uint32_t bits = 0;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = fbits(m[j]) & 0x7FFFFFFFu;
    bits = b > bits ? b : bits;
  }
  bits = clamp_signed_block(m, n, bits);
  int4_encode_signed_codes(m, n, bitsf(bits), packed);
  *absmax = bitsf(bits);
}

// dequantize_rank1 of n elements of one row (maximum `rowmax`) from column c on
// (`colmax` points at column c's maximum).
inline void int4_decode_square(const uint8_t* packed, float rowmax, const float* colmax,
                               int64_t n, float* out) {
  alignas(64) uint8_t codes[kInt4Run];
  int4_unpack(packed, n / 2, codes);
  // torch.minimum(rowmax, colmax[j]): a NaN in either gives a NaN. With rowmax not NaN
  // that is `rowmax < c ? rowmax : c` (one vminps); a NaN rowmax makes the row NaN.
  const float r = rowmax;
  if (r != r) {
    for (int64_t j = 0; j < n; ++j) out[j] = ((static_cast<float>(codes[j]) + 1.0f) * 0.0625f) * r;
    return;
  }
#if defined(__AVX512F__)
  // The 16 levels (q + 1) / 16 (exact), looked up with one permute per 16 elements.
  const __m512 levels = int4_square_levels();
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t j = 0; j + 16 <= n; j += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + j)));
    const __m512 scale = _mm512_min_ps(rv, _mm512_loadu_ps(colmax + j));  // r < c ? r : c
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_permutexvar_ps(idx, levels), scale));
  }
  for (int64_t j = n - n % 16; j < n; ++j) {
#else
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
#endif
    const float c = colmax[j];
    out[j] = ((static_cast<float>(codes[j]) + 1.0f) * 0.0625f) * (r < c ? r : c);
  }
}

// v as quantize_rank1 stores it (at most V_MAX; NaN stays NaN): what the maxima are of.
inline float int4_square_stored(float v) { return v > kInt4VMax ? kInt4VMax : v; }

// The code of v given its row's and column's factors 16 / max (zero-free: level q + 1;
// the factors are never NaN: int4_square_factor).
inline int int4_square_code(float v, float row_f, float col_f) {
  float q = std::rint(int4_square_stored(v) * (row_f > col_f ? row_f : col_f)) - 1.0f;
  q = q < 0.0f ? 0.0f : q;
  q = q > 15.0f ? 15.0f : q;
  return static_cast<int>(q) & 15;
}

// The factor 16 / max of a row or column maximum (reciprocal of max, or of 1 when it is 0).
inline float int4_square_factor(float max) { return (1.0f / (max > 0.0f ? max : 1.0f)) * 16.0f; }

// quantize_rank1's codes of n elements of one row from column c on, given the new
// maxima's factors (`col_f` points at column c's).
inline void int4_encode_square(const float* v, float row_f, const float* col_f, int64_t n,
                               uint8_t* packed) {
  int64_t j = 0;
#if defined(MIXPREC_INT8_AVX512)
  const __m512 rf = _mm512_set1_ps(row_f);
  for (; j + 32 <= n; j += 32)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + j / 2),
                     int4_pack32(int4_square_code16(_mm512_loadu_ps(v + j), rf,
                                                    _mm512_loadu_ps(col_f + j)),
                                 int4_square_code16(_mm512_loadu_ps(v + j + 16), rf,
                                                    _mm512_loadu_ps(col_f + j + 16))));
#endif
  alignas(64) uint8_t codes[kInt4Run];
#pragma GCC ivdep
  for (int64_t t = j; t < n; ++t)
    codes[t - j] = static_cast<uint8_t>(int4_square_code(v[t], row_f, col_f[t]));
  int4_pack(codes, (n - j) / 2, packed + j / 2);
}
