// The native kernel's AVX-512 moment codes against its scalar codes over their whole
// range: every float from 2**-20 up and every subnormal, and every 256th normal float
// below 2**-20 (coded 0, by the same arithmetic). tests/optim/test_native_int4.py builds
// it with the kernel's flags and -I to the kernel's folder; exit 0: none differs, 1:
// some do, 2: no AVX-512 codes here.
// - int8: code_signed16 (a root estimate) against code_signed for x = |m| * f up to
//   2**18 (every 4th run of 16 negated too); code_square16 against code_square for u
//   up to 2**18, and for tiny u whose product with f rounds to 0 (code 1);
// - int4: int4_code_signed16 (a root estimate) against int4_signed_code for x up to 64
//   (every 4th run negated too); int4_square_code16 (a magic sum) against
//   int4_square_code for x below 16.5;
// and special values (0, subnormal, infinite, NaN) for each.
#include <cstdio>

#include "step_cpu.cpp"

namespace {

// Compares the low `bits` bits of the 16 lanes of `fast` with scalar(x[i]); returns how
// many differ (printing the first few).
template <class Scalar>
long compare(const char* what, const float* x, __m512i fast, int bits, Scalar scalar) {
  alignas(64) int32_t out[16];
  _mm512_store_si512(out, fast);
  const int32_t mask = (1 << bits) - 1;
  long differ = 0;
  for (int i = 0; i < 16; ++i) {
    const int32_t want = static_cast<int32_t>(scalar(x[i])) & mask;
    if ((out[i] & mask) != want && ++differ <= 5)
      std::printf("%s %a: %d, scalar %d\n", what, x[i], out[i] & mask, want);
  }
  return differ;
}

long checked = 0;

// Every float from 2**-20 to `top` and every subnormal, 16 at a time, over the threads,
// and of the normal floats below 2**-20 (all coded 0, by the same arithmetic) every
// 16th run of 16; with `both`, every 4th run negated too (the sign only changes how
// the code is stored). Returns how many codes differ.
template <class Check>
long every_float(float top, bool both, Check check) {
  const int64_t runs = static_cast<int64_t>(fbits(top)) / 16 + 1;
  const int64_t tiny_lo = fbits(0x1p-126f) / 16, tiny_hi = fbits(0x1p-20f) / 16;
  long differ = 0, count = 0;
#pragma omp parallel for schedule(static) reduction(+ : differ, count)
  for (int64_t r = 0; r < runs; ++r) {
    if (r >= tiny_lo && r < tiny_hi && r % 16 != 0) continue;
    alignas(64) float x[16];
    for (int i = 0; i < 16; ++i) x[i] = bitsf(static_cast<uint32_t>(r * 16 + i));
    differ += check(x);
    count += 16;
    if (!both || r % 4 != 0) continue;
    for (int i = 0; i < 16; ++i) x[i] = -x[i];
    differ += check(x);
    count += 16;
  }
  checked += count;
  return differ;
}

}  // namespace

int main() {
#if !defined(MIXPREC_INT8_AVX512)
  std::printf("no AVX-512 codes on this CPU\n");
  return 2;
#else
  const __m512 one = _mm512_set1_ps(1.0f);
  auto int8_signed = [&](const float* m) {
    return compare("int8 signed", m, code_signed16(_mm512_load_ps(m), one), 8,
                   [](float v) { return code_signed(v, 1.0f); });
  };
  auto int8_square = [&](const float* u, float f) {
    return compare("int8 square", u, code_square16(_mm512_load_ps(u), _mm512_set1_ps(f)), 8,
                   [f](float v) { return code_square(v, f); });
  };
  auto int4_signed = [&](const float* m) {
    return compare("int4 signed", m, int4_code_signed16(_mm512_load_ps(m), one), 4,
                   [](float v) { return int4_signed_code(v, 1.0f); });
  };
  auto int4_square = [&](const float* v) {
    return compare("int4 square", v, int4_square_code16(_mm512_load_ps(v), one, one), 4,
                   [](float x) { return int4_square_code(x, 1.0f, 1.0f); });
  };
  long differ = every_float(0x1p18f, true, int8_signed);
  differ += every_float(0x1p18f, false, [&](const float* u) { return int8_square(u, 1.0f); });
  differ += every_float(0x1p-120f, false, [&](const float* u) { return int8_square(u, 0x1p-30f); });
  differ += every_float(64.0f, true, int4_signed);
  differ += every_float(16.4999981f, false, int4_square);
  alignas(64) float int8_special[16] = {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e-45f,
                                        -1e-45f, 16129.0f, -16129.0f, 65025.0f, 0x1p18f, 0.25f,
                                        2.25f, 42.25f, 1.0f};
  differ += int8_signed(int8_special);
  for (float& x : int8_special) x = std::fabs(x);
  differ += int8_square(int8_special, 1.0f);
  alignas(64) float int4_special[16] = {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e-45f,
                                        -1e-45f, 49.0f, 49.00001f, 0.25f, 2.25f, 42.25f,
                                        -42.25f, 1.0f, -1.0f};
  differ += int4_signed(int4_special);
  for (float& x : int4_special) x = std::fabs(x) > 16.0f && std::isfinite(x) ? 16.0f : std::fabs(x);
  differ += int4_square(int4_special);  // x below 16.5, or infinite (V_MAX * 1)
  checked += 64;
  std::printf("checked %ld, %ld differ\n", checked, differ);
  return differ != 0;
#endif
}
