// Moment format `int4`: its codes in the native CPU kernel, the C++ of int4.py's
// quantize/dequantize functions in their operation order (bitwise the same for finite
// values; tests/optim/test_native_int4.py). A part of optim/native/step_cpu.cpp,
// included inside its namespace after its helpers (fbits, bitsf): not a standalone
// header. Codes are packed two per byte, element 2k in the low nibble; every run
// handled here starts at an even element and has an even length.

// int4.py V_MAX: the largest v stored (2**126).
constexpr float kInt4VMax = 0x1p126f;

// torch.minimum / torch.maximum of two floats (a NaN in either gives a NaN).
inline float nan_min(float a, float b) { return (a != a || a < b) ? a : b; }
inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// dequantize_signed4 of one block of n elements with absmax `absmax`.
inline void int4_decode_signed(const uint8_t* packed, float absmax, int64_t n, float* out) {
  const float ms = absmax * static_cast<float>(1.0 / 49.0);
#pragma GCC ivdep
  for (int64_t j = 0; j < n / 2; ++j) {
    const int lo = packed[j] & 15, hi = packed[j] >> 4;
    const float ql = static_cast<float>(lo >= 8 ? lo - 16 : lo);
    const float qh = static_cast<float>(hi >= 8 ? hi - 16 : hi);
    out[2 * j] = (ql * std::fabs(ql)) * ms;
    out[2 * j + 1] = (qh * std::fabs(qh)) * ms;
  }
}

// The nibble of m in a block whose factor is f = 49 / absmax (two's complement, -8 never).
inline int int4_signed_code(float m, float f) {
  const int q = static_cast<int>(std::rint(std::sqrt(std::fabs(m) * f)));
  return (m < 0.0f ? 16 - q : q) & 15;
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
  const float am = bitsf(bits);
  const float f = (1.0f / (am > 0.0f ? am : 1.0f)) * 49.0f;
#pragma GCC ivdep
  for (int64_t j = 0; j < n / 2; ++j) {
    const int lo = int4_signed_code(m[2 * j], f), hi = int4_signed_code(m[2 * j + 1], f);
    packed[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  *absmax = am;
}

// dequantize_rank1 of n elements of one row (maximum `rowmax`) from column c on
// (`colmax` points at column c's maximum).
inline void int4_decode_square(const uint8_t* packed, float rowmax, const float* colmax,
                               int64_t n, float* out) {
#pragma GCC ivdep
  for (int64_t j = 0; j < n / 2; ++j) {
    const float ql = static_cast<float>(packed[j] & 15), qh = static_cast<float>(packed[j] >> 4);
    out[2 * j] = ((ql + 1.0f) * 0.0625f) * nan_min(rowmax, colmax[2 * j]);
    out[2 * j + 1] = ((qh + 1.0f) * 0.0625f) * nan_min(rowmax, colmax[2 * j + 1]);
  }
}

// v as quantize_rank1 stores it (at most V_MAX; NaN stays NaN): what the maxima are of.
inline float int4_square_stored(float v) { return v > kInt4VMax ? kInt4VMax : v; }

// The code of v given its row's and column's factors 16 / max (zero-free: level q + 1).
inline int int4_square_code(float v, float row_f, float col_f) {
  float q = std::rint(int4_square_stored(v) * nan_max(row_f, col_f)) - 1.0f;
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
#pragma GCC ivdep
  for (int64_t j = 0; j < n / 2; ++j) {
    const int lo = int4_square_code(v[2 * j], row_f, col_f[2 * j]);
    const int hi = int4_square_code(v[2 * j + 1], row_f, col_f[2 * j + 1]);
    packed[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}
