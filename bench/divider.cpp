// The divider's throughput here: nanoseconds per vsqrtps and vdivps on 512-bit (zmm)
// and 256-bit (ymm) registers, eight independent chains each, so the unit, not the
// latency, is the limit. The AdamW steps need AdamW's square root and division per
// element (torch's fused CPU step runs them on ymm here), and int8 moments one more
// root for the square code: docs/benchmarks.md, "The divider's share".
//
//     g++ -O2 -march=native bench/divider.cpp -o /tmp/divider && /tmp/divider
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

float sink;  // keeps the results live

template <class V, class Start, class Op, class Sum>
double ns_per_op(Start start, Op op, Sum sum) {
  constexpr long kOps = 20000000;
  V a[8];
  for (int k = 0; k < 8; ++k) a[k] = start(k);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kOps / 8; ++i)
    for (int k = 0; k < 8; ++k) {
      a[k] = op(a[k]);
      asm volatile("" : "+v"(a[k]));  // no folding, no hoisting
    }
  const auto t1 = std::chrono::steady_clock::now();
  for (int k = 0; k < 8; ++k) sink += sum(a[k]);
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / kOps;
}

}  // namespace

int main() {
  const auto z = [](int k) { return _mm512_set1_ps(1.5f + k); };
  const auto y = [](int k) { return _mm256_set1_ps(1.5f + k); };
  const auto zsum = [](__m512 v) { return _mm512_reduce_add_ps(v); };
  const auto ysum = [](__m256 v) { return _mm_cvtss_f32(_mm256_castps256_ps128(v)); };
  for (int run = 0; run < 3; ++run) {
    const double zs = ns_per_op<__m512>(z, [](__m512 v) { return _mm512_sqrt_ps(v); }, zsum);
    const double zd = ns_per_op<__m512>(
        z, [](__m512 v) { return _mm512_div_ps(v, _mm512_set1_ps(1.0000001f)); }, zsum);
    const double ys = ns_per_op<__m256>(y, [](__m256 v) { return _mm256_sqrt_ps(v); }, ysum);
    const double yd = ns_per_op<__m256>(
        y, [](__m256 v) { return _mm256_div_ps(v, _mm256_set1_ps(1.0000001f)); }, ysum);
    std::printf(
        "ns per op: vsqrtps zmm %.2f, vdivps zmm %.2f, vsqrtps ymm %.2f, vdivps ymm %.2f; "
        "ns per element: root + division %.3f (zmm), %.3f (ymm); two roots + division "
        "%.3f (zmm)\n",
        zs, zd, ys, yd, (zs + zd) / 16, (ys + yd) / 8, (2 * zs + zd) / 16);
  }
  return sink == 12345.0f;  // never: the sink is read
}
