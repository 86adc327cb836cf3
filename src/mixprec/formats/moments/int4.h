// Moment format `int4`: its codes in the native CPU kernel, the C++ of int4.py's
// quantize/dequantize functions in their operation order (bitwise the same for finite
// values; tests/optim/test_native_int4.py). A part of optim/native/step_cpu.cpp,
// included inside its namespace after its helpers (fbits, bitsf): not a standalone
// header. Codes are packed two per byte, element 2k in the low nibble; every run
// handled here starts at an even element and has an even length of at most
// kInt4Run. The nibbles are (un)packed in one loop over bytes and the arithmetic runs
// over the codes in element order: interleaving floats costs more shuffles.

constexpr int64_t kInt4Run = 128;

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

// int4.py V_MAX: the largest v stored (2**126).
constexpr float kInt4VMax = 0x1p126f;


// dequantize_signed4 of one block of n elements with absmax `absmax`.
inline void int4_decode_signed(const uint8_t* packed, float absmax, int64_t n, float* out) {
  const float ms = absmax * static_cast<float>(1.0 / 49.0);
  alignas(64) uint8_t codes[kInt4Run];
  int4_unpack(packed, n / 2, codes);
#if defined(__AVX512F__)
  // The 16 values a block's codes decode to, each as below ((q * |q|) is exact), looked
  // up with one permute per 16 elements.
  const __m512 qq = _mm512_setr_ps(0, 1, 4, 9, 16, 25, 36, 49, -64, -49, -36, -25, -16, -9, -4, -1);
  const __m512 table = _mm512_mul_ps(qq, _mm512_set1_ps(ms));
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

// quantize_signed4's codes of one block of n elements whose absmax is `am`.
inline void int4_encode_signed_codes(const float* m, int64_t n, float am, uint8_t* packed) {
  const float f = (1.0f / (am > 0.0f ? am : 1.0f)) * 49.0f;
  alignas(64) uint8_t codes[kInt4Run];
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) codes[j] = static_cast<uint8_t>(int4_signed_code(m[j], f));
  int4_pack(codes, n / 2, packed);
}

// quantize_signed4 of one block of n elements: its absmax (the maximum of |m| taken on
// the bits, as int8's) and codes.
inline void int4_encode_signed(const float* m, int64_t n, uint8_t* packed, float* absmax) {
  uint32_t bits = 0;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = fbits(m[j]) & 0x7FFFFFFFu;
    bits = b > bits ? b : bits;
  }
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
  const __m512 levels = _mm512_setr_ps(0.0625f, 0.125f, 0.1875f, 0.25f, 0.3125f, 0.375f, 0.4375f,
                                       0.5f, 0.5625f, 0.625f, 0.6875f, 0.75f, 0.8125f, 0.875f,
                                       0.9375f, 1.0f);
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
  alignas(64) uint8_t codes[kInt4Run];
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j)
    codes[j] = static_cast<uint8_t>(int4_square_code(v[j], row_f, col_f[j]));
  int4_pack(codes, n / 2, packed);
}
