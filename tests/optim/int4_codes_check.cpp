// The AVX-512 int4 codes of the native kernel against its scalar codes, on every float
// of their range: int4_code_signed16 (a root estimate) against int4_signed_code for
// every x = |m| * f in [0, 64], both signs, and int4_square_code16 (a magic-sum rounding)
// against int4_square_code for every x in [0, 16.5), plus special values. Built with the
// kernel's flags by tests/optim/test_native_int4.py, with -I to the kernel's folder;
// exits 1 if any code differs.
#include <cstdio>

#include "step_cpu.cpp"

int main() {
#if !defined(MIXPREC_INT8_AVX512)
  std::printf("no AVX-512 int4 codes on this CPU\n");
  return 2;
#else
  long bad = 0, n = 0;
  alignas(64) float xs[16];
  const __m512 one = _mm512_set1_ps(1.0f);
  auto check_signed = [&](const float* m) {
    alignas(64) int32_t out[16];
    _mm512_store_si512(out, int4_code_signed16(_mm512_load_ps(m), one));
    for (int i = 0; i < 16; ++i) {
      ++n;
      if ((out[i] & 15) != int4_signed_code(m[i], 1.0f)) { if (++bad < 5) std::printf("signed %a: %d vs %d\n", m[i], out[i] & 15, int4_signed_code(m[i], 1.0f)); }
    }
  };
  auto check_square = [&](const float* v) {
    alignas(64) int32_t out[16];
    _mm512_store_si512(out, int4_square_code16(_mm512_load_ps(v), one, one));
    for (int i = 0; i < 16; ++i) {
      ++n;
      if ((out[i] & 15) != int4_square_code(v[i], 1.0f, 1.0f)) { if (++bad < 5) std::printf("square %a: %d vs %d\n", v[i], out[i] & 15, int4_square_code(v[i], 1.0f, 1.0f)); }
    }
  };
  const uint32_t top = fbits(64.0f);
  for (uint32_t b = 0; b <= top; b += 16) {
    for (int i = 0; i < 16; ++i) xs[i] = bitsf(b + i);
    check_signed(xs);
    for (int i = 0; i < 16; ++i) xs[i] = -xs[i];
    check_signed(xs);
  }
  const uint32_t top_sq = fbits(16.5f);
  for (uint32_t b = 0; b < top_sq; b += 16) {
    for (int i = 0; i < 16; ++i) xs[i] = bitsf(b + i);
    check_square(xs);
  }
  const float special[16] = {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e-45f, 49.0f, 49.00001f, 0.25f, 2.25f, 6.25f, 12.25f, 20.25f, 30.25f, 42.25f};
  std::memcpy(xs, special, sizeof xs); check_signed(xs);
  const float special_sq[16] = {INFINITY, NAN, 0.0f, 0.5f, 1.5f, 15.5f, 16.0f, 16.4f, 1e-45f, 0.49999997f, 2.5f, 3.5f, 14.5f, 0x1p126f, 0x1p127f, 1.0f};
  std::memcpy(xs, special_sq, sizeof xs);
  // x = v * 1: the two infinite/huge v are clamped to V_MAX (x = 2**126 > 16.5: outside the
  // range the fast code promises) -- check only the others
  xs[13] = xs[14] = 1.0f;
  check_square(xs);
  std::printf("checked %ld, %ld differ\n", n, bad);
  return bad != 0;
#endif
}
