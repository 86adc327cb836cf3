// mixprec native CPU optimizer step (every rule of optim/rules.py): one pass over
// memory per step.
//
// Built and loaded by mixprec.optim.native (g++ -O3 -march=native -fopenmp,
// no fast-math, no FMA contraction). Every operation mirrors the eager
// PyTorch formulation in mixprec.optim (rules.py Rule.math and Rule.scalars,
// masters/*, moments/*) so results are bitwise identical to it for finite
// values (tests/optim/test_native*.py check every family; NaN payloads, and
// int8 codes computed from NaN moments, may differ: callers never apply a
// non-finite step). Plain C++ that GCC vectorizes, with intrinsic paths behind
// guards so it builds on any CPU the compiler targets: the streaming store of the
// fp32 master's bf16 parameter (stream_lines: __AVX512F__ / __AVX__ / __SSE2__, else
// memcpy), the Kahan master's loop with fp32 moments (kahan_fp32_avx512: __AVX512F__
// and __AVX512BF16__, else the generic loop), int4's table lookups
// (formats/moments/int4.h: __AVX512F__, else plain loops), and AdamW's loops for the
// remainder8 master over bf16 parameters with int8 or int4 moments
// (MIXPREC_INT8_AVX512: AVX-512 F, BW and VBMI, else the generic loops). AdamW has
// fused loops per master, moment format and dtypes; the other rules share staged
// loops (below: "Every other rule"); int4 moments take two passes over rows (below:
// "int4 moments").
//
// Layout of the pointers (see mixprec/optim/native/binding.py):
//   master state s0, s1: fp32 master | exact: remainder_hi, remainder_lo (int8)
//                        | remainder8: remainder (int8) | kahan: compensation
//   moments mo0..mo5:    dense: one tensor per slot of the rule (Rule.slots: AdamW
//                        exp_avg, exp_avg_sq), fp32 or bf16
//                        | int8: per slot its codes and per-block scale (signed slot:
//                        int8 codes, absmax; square slot: uint8 codes, sqrt(v) max)
//                        | int4: the signed slot's packed codes and absmax, then per
//                        square slot its packed codes, row maxima and column maxima
//                        (mo0..mo7: AMSGrad's 2 + 3 + 3)
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// The formats' codes are their specs' kernel_code (mixprec/formats/masters/*.py,
// moments/*.py): the build (native/build.py format_defines) passes each as
// -DMIXPREC_MASTER_<NAME>=<code> or -DMIXPREC_MOMENTS_<NAME>=<code>.
enum Master {
  M_NONE = MIXPREC_MASTER_NONE, M_FP32 = MIXPREC_MASTER_FP32, M_EXACT = MIXPREC_MASTER_EXACT,
  M_REM8 = MIXPREC_MASTER_REMAINDER8, M_KAHAN = MIXPREC_MASTER_KAHAN,
  M_STOCH = MIXPREC_MASTER_STOCHASTIC
};
enum Moments {
  MO_FP32 = MIXPREC_MOMENTS_FP32, MO_BF16 = MIXPREC_MOMENTS_BF16, MO_INT8 = MIXPREC_MOMENTS_INT8,
  MO_INT4 = MIXPREC_MOMENTS_INT4
};
enum DType { DT_F32 = 0, DT_BF16 = 1 };

constexpr int64_t kChunk = 4096;     // elements per parallel work item (dense moments)
constexpr int64_t kMaxBlock = 4096;  // largest int8 block handled here

inline uint32_t fbits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bitsf(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float bf2f(uint16_t h) { return bitsf(static_cast<uint32_t>(h) << 16); }
// c10::BFloat16 round_to_nearest_even; NaN -> 0x7FC0.
inline uint16_t f2bf(float f) {
  uint32_t u = fbits(f);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}
inline uint32_t canon(uint32_t u) { return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? 0x7FC00000u : u; }
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x21F0AAADu; x ^= x >> 15; x *= 0x735A2D97u; x ^= x >> 15;
  return x;
}

// A master codec over a run of elements (the staged loops): decode into `out`,
// encode from `in`.
struct Args;
struct Int4Aux;
using DecodeFn = void (*)(const Args&, int64_t, int64_t, float*);
using EncodeFn = void (*)(const Args&, int64_t, int64_t, const float*);

// One tensor of a multi-tensor step: its pointers, its per-step scalars and key, and
// (staged loops) its master codec, null for an fp32 parameter without a master; int4
// moments: its matrix view and the new maxima (int4_run).
struct Args {
  void* param; const void* grad;
  void* s0; void* s1;
  void* mo[8];
  float scalars[7];
  int64_t n; int64_t block; uint32_t key; float grad_sign; bool stream;
  int gdt; DecodeFn decode; EncodeFn encode;
  const Int4Aux* int4;
};

template <int PDT> inline float load_p(const void* p, int64_t i) {
  if constexpr (PDT == DT_F32) return static_cast<const float*>(p)[i];
  else return bf2f(static_cast<const uint16_t*>(p)[i]);
}
template <int PDT> inline void store_p(void* p, int64_t i, float v) {
  if constexpr (PDT == DT_F32) static_cast<float*>(p)[i] = v;
  else static_cast<uint16_t*>(p)[i] = f2bf(v);
}

// Each master format's per-element codec lives beside its Python module, in
// formats/masters/<name>.h: a MasterCodec<code> with decode and encode, the C++
// of the module's decode and encode.
template <int MASTER> struct MasterCodec;
#include "../../formats/masters/none.h"
#include "../../formats/masters/fp32.h"
#include "../../formats/masters/exact.h"
#include "../../formats/masters/remainder8.h"
#include "../../formats/masters/kahan.h"
#include "../../formats/masters/stochastic.h"

template <int MASTER, int PDT>
inline float decode_master(const Args& a, int64_t i) {
  return MasterCodec<MASTER>::template decode<PDT>(a, i);
}

template <int MASTER, int PDT>
inline void encode_master(const Args& a, int64_t i, float value) {
  MasterCodec<MASTER>::template encode<PDT>(a, i, value);
}

inline float sqrt_of(float x) { return std::sqrt(x); }
#if defined(__AVX512F__)
inline __m512 sqrt_of(__m512 x) { return _mm512_sqrt_ps(x); }
#endif

// The AdamW arithmetic of functional.adamw_math, in its operation order: on one
// float, or on 16 (__m512, GCC's vector arithmetic: every product and sum rounded
// on its own, as -ffp-contract=off keeps the scalar code).
struct Math {
  float decay, b1c, beta2, b2c, nss, ibc2, eps;
  explicit Math(const float* s)
      : decay(s[0]), b1c(s[1]), beta2(s[2]), b2c(s[3]), nss(s[4]), ibc2(s[5]), eps(s[6]) {}
  // In: p (master), g, m, v. Out: new p, m, v and sqrt(v).
  template <class F>
  inline void apply(F& p, F g, F& m, F& v, F& u) const {
    p = p * decay;
    m = m + b1c * (g - m);
    v = v * beta2 + (b2c * g) * g;
    u = sqrt_of(v);
    F denom = u * ibc2 + eps;
    p = p + (nss * m) / denom;
  }
};

// moments/int8.py U_MAX: the largest sqrt(v) stored, so a decoded v stays finite.
constexpr float kUMax = 9223372036854775808.0f;  // 2**63

// moments/int8.py and int4.py M_MAX: the largest |m| stored, the root of the largest v
// either stores, so that m / sqrt(v) stays at most 1 where v is capped. As torch.clamp:
// NaN stays NaN.
constexpr float kMMax = 9223372036854775808.0f;  // 2**63
inline float clamp_signed(float m) {
  m = kMMax < m ? kMMax : m;
  return m < -kMMax ? -kMMax : m;
}
// clamp_signed over the n new signed moments of one block whose largest |m| has the
// bits `bits` (NaN's are larger still); returns the clamped block's. A moment above
// M_MAX is rare, so the block's maximum is checked rather than each element.
inline uint32_t clamp_signed_block(float* m, int64_t n, uint32_t bits) {
  if (bits <= fbits(kMMax)) return bits;
  bits = 0;
  for (int64_t j = 0; j < n; ++j) {
    m[j] = clamp_signed(m[j]);
    const uint32_t b = fbits(m[j]) & 0x7FFFFFFFu;
    bits = b > bits ? b : bits;
  }
  return bits;
}

// moments/int8.py's codes of one element: signed, round(sqrt(|m| * f)) with m's sign;
// square, round(sqrt(u * f)), and 1 for a positive u whose code would be 0. f is the
// block's factor (code_max**2 / block max).
inline int8_t code_signed(float m, float f) {
  const float q = std::rint(std::sqrt(std::fabs(m) * f));
  return static_cast<int8_t>(static_cast<int32_t>(m < 0.0f ? -q : q));
}
inline uint8_t code_square(float u, float f) {
  float q = std::rint(std::sqrt(u * f));
  q = (q == 0.0f && u > 0.0f) ? 1.0f : q;
  return static_cast<uint8_t>(static_cast<int32_t>(q));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define MIXPREC_INT8_AVX512 1
// bf2f of 16 lanes.
inline __m512 bf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Adding 1.5 * 2**23 to a float in [-2**22, 2**22] rounds it to an integer (nearest
// even, as std::rint) and leaves that integer in the low mantissa bits: the low byte
// of the sum's bits is the int8 code, with no rounding or conversion instruction.
constexpr float kMagic = 12582912.0f;  // 1.5 * 2**23

// std::rint(std::sqrt(x)) with the sign of `sign`, plus kMagic, of 16 lanes: bitwise
// the scalar's for x in [0, 2**18] (the codes' range: x <= 255**2 and a little) and
// for NaN, infinite and zero x. The int8 step takes two square roots an element for
// the codes besides AdamW's own square root and division, and all four share the one
// divider (about 11 cycles per 16-lane vsqrtps here), which with the rest made the
// int8 step about twice torch fused AdamW's time. Here the root comes from vrsqrt14ps
// (relative error < 2**-14) and one Newton step (then < 2**-20: absolute < 2**-11
// below 512), so its rounding to an integer is the exact root's unless it lies within
// 2**-9 of a half integer; those lanes (about 0.4%), and NaN or infinite x, take
// vsqrtps. code_signed16 and code_square16 are checked against code_signed and
// code_square on every float of magnitude up to 2**18 (one in 256 of the normal ones
// below 2**-20, all coded 0; tests/optim/native_codes_check.cpp). The square code
// keeps vsqrtps: with one root on each path the divider and the vector ports are
// about equally busy (both roots estimated was 8% slower).
// The rounding of a root estimate s of x (s carrying `sign`) to an integer, plus
// kMagic: s's own where it lies at least 2**-9 from a half integer, the exact root's
// (vsqrtps) elsewhere; a NaN s (x infinite or NaN) compares false and takes the exact
// root. s - rint(s) is vreduceps (nearest even). Shared by int4_code_signed16.
inline __m512i rint_root16(__m512 s, __m512 x, __m512 sign) {
  const __m512 magic = _mm512_set1_ps(kMagic);
  __m512 t = _mm512_add_ps(s, magic);
  const __m512 off =
      _mm512_abs_ps(_mm512_reduce_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __mmask16 sure = _mm512_cmp_ps_mask(off, _mm512_set1_ps(0.498046875f), _CMP_LE_OQ);
  if (__builtin_expect(sure != 0xFFFF, 0)) {
    const __m512 exact = _mm512_add_ps(_mm512_or_ps(_mm512_sqrt_ps(x), sign), magic);
    t = _mm512_mask_mov_ps(t, static_cast<__mmask16>(~sure), exact);
  }
  return _mm512_castps_si512(t);
}
inline __m512i rint_sqrt16_estimated(__m512 x, __m512 sign) {
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m512 y = _mm512_rsqrt14_ps(x);
  const __m512 s0 = _mm512_mul_ps(x, y);
  const __m512 r = _mm512_fnmadd_ps(s0, _mm512_mul_ps(y, half), half);  // 0.5 - s0 * y / 2
  __m512 s = _mm512_fmadd_ps(s0, r, s0);
  s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ), s);
  return rint_root16(_mm512_or_ps(s, sign), x, sign);
}
// code_signed and code_square of 16 lanes, in the low byte of each 32-bit lane. The
// signed code: its sign is put on the root before the magic sum (1.5 * 2**23 keeps
// the sum of a negative root in [2**23, 2**24), where floats are the integers, and
// sqrt(-0) and negation round the same way), so its low byte is the two's-complement
// code; a negative zero gives code 0 as m < 0 does in code_signed.
inline __m512i code_signed16(__m512 m, __m512 f) {
  const __m512 sign = _mm512_and_ps(m, _mm512_set1_ps(-0.0f));
  return rint_sqrt16_estimated(_mm512_mul_ps(_mm512_abs_ps(m), f), sign);
}
inline __m512i code_square16(__m512 u, __m512 f) {
  // code 1 for a positive u whose root rounds to 0: the sum raised to kMagic + 1 there
  const __m512 t = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(u, f)), _mm512_set1_ps(kMagic));
  const __mmask16 positive = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_GT_OQ);
  return _mm512_castps_si512(_mm512_mask_max_ps(t, positive, t, _mm512_set1_ps(kMagic + 1.0f)));
}
// Byte `k` of each 32-bit lane of a, then of b: 32 bytes in one permute (vpmovdb
// takes two micro-operations for 16).
template <int K>
inline __m256i byte_of_lanes32(__m512i a, __m512i b) {
  alignas(64) static const uint8_t index[64] = {
      K,      K + 4,  K + 8,  K + 12, K + 16, K + 20, K + 24, K + 28, K + 32, K + 36, K + 40,
      K + 44, K + 48, K + 52, K + 56, K + 60, K + 64, K + 68, K + 72, K + 76, K + 80, K + 84,
      K + 88, K + 92, K + 96, K + 100, K + 104, K + 108, K + 112, K + 116, K + 120, K + 124};
  return _mm512_castsi512_si256(
      _mm512_permutex2var_epi8(a, _mm512_load_si512(reinterpret_cast<const void*>(index)), b));
}
// The upper 16 bits of each 32-bit lane of a, then of b.
inline __m512i high_halves32(__m512i a, __m512i b) {
  alignas(64) static const uint16_t index[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_permutex2var_epi16(a, _mm512_load_si512(reinterpret_cast<const void*>(index)), b);
}
#endif

// Elements [lo, hi) of one tensor with dense moments. TO_BUF (fp32 master only):
// the bf16 parameter of element i goes to buf[i - lo] instead of the parameter.
template <int MASTER, int PDT, int MO, int GDT, bool TO_BUF>
inline void dense_loop(const Args& a, const Math& k, int64_t lo, int64_t hi, uint16_t* buf) {
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    float p = decode_master<MASTER, PDT>(a, i);
    float g = load_p<GDT>(a.grad, i) * a.grad_sign;
    float m, v, u;
    if constexpr (MO == MO_FP32) {
      m = static_cast<const float*>(a.mo[0])[i];
      v = static_cast<const float*>(a.mo[1])[i];
    } else {
      m = bf2f(static_cast<const uint16_t*>(a.mo[0])[i]);
      v = bf2f(static_cast<const uint16_t*>(a.mo[1])[i]);
    }
    k.apply(p, g, m, v, u);
    if constexpr (TO_BUF) {
      buf[i - lo] = f2bf(p);
      static_cast<float*>(a.s0)[i] = p;
    } else {
      encode_master<MASTER, PDT>(a, i, p);
    }
    if constexpr (MO == MO_FP32) {
      static_cast<float*>(a.mo[0])[i] = m;
      static_cast<float*>(a.mo[1])[i] = v;
    } else {
      static_cast<uint16_t*>(a.mo[0])[i] = f2bf(m);
      static_cast<uint16_t*>(a.mo[1])[i] = f2bf(v);
    }
  }
}

constexpr int64_t kLine = 64;        // bytes per cache line
constexpr int64_t kStreamRun = 1024;  // bf16 elements staged in L1 between streamed writes

// Copies whole 64-byte lines from src to the line-aligned dst with non-temporal stores.
inline void stream_lines(void* dst, const void* src, int64_t lines) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__)
  for (int64_t l = 0; l < lines; ++l)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + l * kLine),
                        _mm512_load_si512(reinterpret_cast<const void*>(s + l * kLine)));
#elif defined(__AVX__)
  for (int64_t l = 0; l < 2 * lines; ++l)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + l * 32),
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(s + l * 32)));
#elif defined(__SSE2__)
  for (int64_t l = 0; l < 4 * lines; ++l)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + l * 16),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(s + l * 16)));
#else
  std::memcpy(d, s, static_cast<size_t>(lines * kLine));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MIXPREC_KAHAN_AVX512 1

// Software prefetch distance of the Kahan loop, in elements (512 bytes ahead on
// the fp32 moments). Measured on a Zen 4 EPYC: without it one thread's step on a
// 31M-element tensor was 10% slower (the divisions and square roots fill the
// reorder window, so fewer of the hardware prefetcher's lines are in flight).
constexpr int64_t kKahanPrefetch = 128;

// The Kahan master with fp32 moments, 16 elements at a time: dense_loop's
// operations in its order, with vcvtneps2bf16 for the two roundings of
// encode_master<M_KAHAN>. GCC vectorizes f2bf as eight integer operations where
// the instruction is one, and this master rounds twice per element: in cache the
// loop takes 0.48 ns an element against the generic loop's 0.57 (one thread).
// Returns where the scalar tail starts.
template <int GDT>
inline int64_t kahan_fp32_avx512(const Args& a, const Math& k, int64_t lo, int64_t hi) {
  uint16_t* const param = static_cast<uint16_t*>(a.param);
  uint16_t* const comp = static_cast<uint16_t*>(a.s0);
  float* const m_ptr = static_cast<float*>(a.mo[0]);
  float* const v_ptr = static_cast<float*>(a.mo[1]);
  const uint16_t* const grad16 = static_cast<const uint16_t*>(a.grad);
  const float* const grad32 = static_cast<const float*>(a.grad);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    if (i + kKahanPrefetch < hi) {
      const int64_t f = i + kKahanPrefetch;
      _mm_prefetch(reinterpret_cast<const char*>(m_ptr + f), _MM_HINT_ET0);
      _mm_prefetch(reinterpret_cast<const char*>(v_ptr + f), _MM_HINT_ET0);
      if (GDT == DT_F32) _mm_prefetch(reinterpret_cast<const char*>(grad32 + f), _MM_HINT_T0);
      if ((i & 16) == 0) {  // 16-bit streams: a line every other iteration
        _mm_prefetch(reinterpret_cast<const char*>(param + f), _MM_HINT_ET0);
        _mm_prefetch(reinterpret_cast<const char*>(comp + f), _MM_HINT_ET0);
        if (GDT == DT_BF16) _mm_prefetch(reinterpret_cast<const char*>(grad16 + f), _MM_HINT_T0);
      }
    }
    // decode_master<M_KAHAN>
    __m512 p = bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(param + i))) +
               bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + i)));
    __m512 g = GDT == DT_F32
                   ? _mm512_loadu_ps(grad32 + i)
                   : bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grad16 + i)));
    g = g * a.grad_sign;
    __m512 m = _mm512_loadu_ps(m_ptr + i);
    __m512 v = _mm512_loadu_ps(v_ptr + i);
    __m512 u;
    k.apply(p, g, m, v, u);
    // encode_master<M_KAHAN>. vcvtneps2bf16 rounds to nearest even as f2bf does,
    // but flushes a denormal input to zero and keeps a NaN's sign and payload. One
    // test of the residual finds every lane where that matters: a denormal p leaves
    // itself as the residual, an infinite or NaN p a NaN residual, and a denormal
    // residual is the third case. Those lanes (rare) are redone by encode_master.
    __m256i new_p = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p));
    const __m512 residual = p - bf16x16(new_p);
    __m256i new_c = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(residual));
    const __mmask16 odd = _mm512_fpclass_ps_mask(residual, 0x20 | 0x01 | 0x80);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(param + i), new_p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(comp + i), new_c);
    if (__builtin_expect(odd != 0, 0)) {
      alignas(64) float value[16];
      _mm512_store_ps(value, p);
      for (int j = 0; j < 16; ++j)
        if (odd & (1u << j)) encode_master<M_KAHAN, DT_BF16>(a, i + j, value[j]);
    }
    _mm512_storeu_ps(m_ptr + i, m);
    _mm512_storeu_ps(v_ptr + i, v);
  }
  return i;
}
#endif

template <int MASTER, int PDT, int MO, int GDT>
void dense_range(const Args& args, int64_t lo, int64_t hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Math k(a.scalars);
#if defined(MIXPREC_KAHAN_AVX512)
  if constexpr (MASTER == M_KAHAN && PDT == DT_BF16 && MO == MO_FP32) {
    lo = kahan_fp32_avx512<GDT>(a, k, lo, hi);
  }
#endif
  if constexpr (MASTER == M_FP32) {
    if (a.stream) {
      // The bf16 parameter is written, never read: a plain store first reads each
      // line (read for ownership), 2 bytes per element that nothing uses. Whole lines
      // are computed into an L1 buffer and streamed out; the unaligned head and the
      // partial tail line take plain stores.
      uint16_t* const param = static_cast<uint16_t*>(a.param);
      const uintptr_t addr = reinterpret_cast<uintptr_t>(param + lo);
      const int64_t per_line = kLine / 2;
      int64_t head = static_cast<int64_t>(((kLine - addr % kLine) % kLine) / 2);
      if (addr % 2 != 0 || head > hi - lo) head = hi - lo;
      const int64_t body_end = lo + head + (hi - lo - head) / per_line * per_line;
      dense_loop<MASTER, PDT, MO, GDT, false>(a, k, lo, lo + head, nullptr);
      alignas(64) uint16_t buf[kStreamRun];
      for (int64_t s = lo + head; s < body_end; s += kStreamRun) {
        const int64_t e = body_end - s < kStreamRun ? body_end : s + kStreamRun;
        dense_loop<MASTER, PDT, MO, GDT, true>(a, k, s, e, buf);
        stream_lines(param + s, buf, (e - s) / per_line);
      }
      dense_loop<MASTER, PDT, MO, GDT, false>(a, k, body_end, hi, nullptr);
#if defined(__SSE2__)
      _mm_sfence();  // streamed stores are weakly ordered: drain them before returning
#endif
      return;
    }
  }
  dense_loop<MASTER, PDT, MO, GDT, false>(a, k, lo, hi, nullptr);
}

#if defined(MIXPREC_INT8_AVX512)
// The AdamW update of 16 elements from i on with the remainder8 master over bf16
// parameters, from their decoded moments m and v (updated in place; u: the new
// sqrt(v)): MasterCodec<M_REM8>'s decode, Math::apply, and the rounded bits r of its
// encode (without its mask), which rem8_store32 splits and stores.
template <int GDT>
inline __m512i rem8_adamw16(const Args& a, const Math& k, int64_t i, __m512& m, __m512& v,
                            __m512& u) {
  const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(
                                               static_cast<const uint16_t*>(a.param) + i))),
                                       16);
  const __m512i lo = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                           reinterpret_cast<const __m128i*>(
                                               static_cast<const int8_t*>(a.s0) + i))),
                                       8);
  __m512 p = _mm512_castsi512_ps(_mm512_add_epi32(hi, lo));
  __m512 g = GDT == DT_F32 ? _mm512_loadu_ps(static_cast<const float*>(a.grad) + i)
                           : bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                 static_cast<const uint16_t*>(a.grad) + i)));
  g = g * a.grad_sign;
  k.apply(p, g, m, v, u);
  // canon: a NaN (fpclass quiet or signalling) -> 0x7FC00000.
  const __m512i b = _mm512_mask_mov_epi32(_mm512_castps_si512(p), _mm512_fpclass_ps_mask(p, 0x81),
                                          _mm512_set1_epi32(0x7FC00000));
  return _mm512_add_epi32(b, _mm512_and_si512(_mm512_srli_epi32(b, 8), _mm512_set1_epi32(1)));
}

// MasterCodec<M_REM8>::encode's split of 32 elements from i on (r0: the first 16):
// the parameter (r + 0x807F) >> 16, the remainder byte 1 of r + 127.
inline void rem8_store32(const Args& a, int64_t i, __m512i r0, __m512i r1) {
  const __m512i c0 = _mm512_set1_epi32(0x807F), c1 = _mm512_set1_epi32(127);
  _mm512_storeu_si512(static_cast<uint16_t*>(a.param) + i,
                      high_halves32(_mm512_add_epi32(r0, c0), _mm512_add_epi32(r1, c0)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<int8_t*>(a.s0) + i),
                      byte_of_lanes32<1>(_mm512_add_epi32(r0, c1), _mm512_add_epi32(r1, c1)));
}

// One element per lane of int8_rem8_avx512: decodes its codes, updates it
// (rem8_adamw16), stores its new m and clamped u into the block's buffers and takes
// them into the block maxima; returns rem8_adamw16's bits.
template <int GDT>
inline __m512i int8_rem8_lanes(const Args& a, const Math& k, int64_t i, float ms, float us,
                               float* mloc, float* uloc, __m512& mmax, __m512& umax) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(a.mo[0]) + i))));
  __m512 m = (q * _mm512_abs_ps(q)) * ms;
  const __m512 qv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(a.mo[2]) + i))));
  const __m512 ub = (qv * qv) * us;
  __m512 v = ub * ub;
  __m512 u;
  const __m512i r = rem8_adamw16<GDT>(a, k, i, m, v, u);
  u = _mm512_min_ps(_mm512_set1_ps(kUMax), u);  // kUMax < u ? kUMax : u (NaN stays NaN)
  _mm512_storeu_ps(mloc, m);
  _mm512_storeu_ps(uloc, u);
  // The block maxima of |m| and u: vrangeps 0x0B, the larger magnitude with its sign
  // cleared (for numbers, the larger of the bits without the sign, as int8_range).
  mmax = _mm512_range_ps(mmax, m, 0x0B);
  umax = _mm512_range_ps(umax, u, 0x0B);
  return r;
}

// int8_range's decode and update loops in one, 32 elements at a time, for the
// remainder8 master over bf16 parameters: the codes are decoded where they are read,
// and MasterCodec<M_REM8>'s decode and encode, the update, the U_MAX clamp and the
// block maxima are int8_range's operations in its order. (GCC vectorizes the generic
// loops 64 elements at a time, for the int8 stores, and spills registers.) Returns how
// many elements of the block it did: the rest take the generic loops.
template <int GDT>
inline int64_t int8_rem8_avx512(const Args& a, const Math& k, int64_t base, int64_t bs,
                                float ms, float us, float* mloc, float* uloc, uint32_t& mbits,
                                uint32_t& ubits) {
  __m512 mmax = _mm512_setzero_ps(), umax = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= bs; j += 32) {
    const __m512i r0 = int8_rem8_lanes<GDT>(a, k, base + j, ms, us, mloc + j, uloc + j, mmax, umax);
    const __m512i r1 =
        int8_rem8_lanes<GDT>(a, k, base + j + 16, ms, us, mloc + j + 16, uloc + j + 16, mmax, umax);
    rem8_store32(a, base + j, r0, r1);
  }
  mbits = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_castps_si512(mmax)));
  ubits = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_castps_si512(umax)));
  return j;
}
#endif

// moments/int8.py: m as 127*sqrt(|m|/absmax) with sign, v through u = sqrt(v)
// as 255*sqrt(u/umax); decode, update and re-encode one block at a time.
template <int MASTER, int PDT, int GDT>
void int8_range(const Args& args, int64_t block_lo, int64_t block_hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Math k(a.scalars);
  const int64_t bs = a.block;
  int8_t* const mq = static_cast<int8_t*>(a.mo[0]);
  float* const mmax = static_cast<float*>(a.mo[1]);
  uint8_t* const vq = static_cast<uint8_t*>(a.mo[2]);
  float* const umax = static_cast<float*>(a.mo[3]);
  const float inv127sq = static_cast<float>(1.0 / (127.0 * 127.0));
  const float inv255sq = static_cast<float>(1.0 / (255.0 * 255.0));
  float mloc[kMaxBlock];
  float uloc[kMaxBlock];
  for (int64_t b = block_lo; b < block_hi; ++b) {
    const int64_t base = b * bs;
    const float ms = mmax[b] * inv127sq;
    const float us = umax[b] * inv255sq;
    // Decode, update and encode are three loops over the block; the block's fp32
    // moments stay in L1 between them, so memory is read and written once.
    int64_t j0 = 0;
    uint32_t mbits = 0, ubits = 0;
#if defined(MIXPREC_INT8_AVX512)
    if constexpr (MASTER == M_REM8 && PDT == DT_BF16)
      j0 = int8_rem8_avx512<GDT>(a, k, base, bs, ms, us, mloc, uloc, mbits, ubits);
#endif
#pragma GCC ivdep
    for (int64_t j = j0; j < bs; ++j) {
      const float q = static_cast<float>(mq[base + j]);
      mloc[j] = (q * std::fabs(q)) * ms;
      const float qv = static_cast<float>(vq[base + j]);
      const float ub = (qv * qv) * us;
      uloc[j] = ub * ub;
    }
#pragma GCC ivdep
    for (int64_t j = j0; j < bs; ++j) {
      const int64_t i = base + j;
      float p = decode_master<MASTER, PDT>(a, i);
      float g = load_p<GDT>(a.grad, i) * a.grad_sign;
      float m = mloc[j];
      float v = uloc[j];
      float u;
      k.apply(p, g, m, v, u);
      encode_master<MASTER, PDT>(a, i, p);
      u = kUMax < u ? kUMax : u;  // moments/int8.py U_MAX (NaN stays NaN): vminps
      mloc[j] = m;
      uloc[j] = u;
      uint32_t mb = fbits(m) & 0x7FFFFFFFu;
      uint32_t vb = fbits(u) & 0x7FFFFFFFu;
      mbits = mb > mbits ? mb : mbits;
      ubits = vb > ubits ? vb : ubits;
    }
    mbits = clamp_signed_block(mloc, bs, mbits);
    const float am = bitsf(mbits);
    const float au = bitsf(ubits);
    const float mf = (1.0f / (am > 0.0f ? am : 1.0f)) * (127.0f * 127.0f);
    const float uf = (1.0f / (au > 0.0f ? au : 1.0f)) * (255.0f * 255.0f);
    int64_t j = 0;
#if defined(MIXPREC_INT8_AVX512)
    for (; j + 32 <= bs; j += 32) {
      const __m512 f = _mm512_set1_ps(mf), fu = _mm512_set1_ps(uf);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mq + base + j),
                          byte_of_lanes32<0>(code_signed16(_mm512_loadu_ps(mloc + j), f),
                                             code_signed16(_mm512_loadu_ps(mloc + j + 16), f)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vq + base + j),
                          byte_of_lanes32<0>(code_square16(_mm512_loadu_ps(uloc + j), fu),
                                             code_square16(_mm512_loadu_ps(uloc + j + 16), fu)));
    }
#endif
    for (; j < bs; ++j) {
      mq[base + j] = code_signed(mloc[j], mf);
      vq[base + j] = code_square(uloc[j], uf);
    }
    mmax[b] = am;
    umax[b] = au;
  }
}

// -- Every other rule (rules.py): staged loops -------------------------------------
//
// AdamW keeps the fused loops above (one per master, moment format and gradient
// dtype). The other rules share one loop per rule and moment layout: each run of
// elements is decoded into fp32 arrays in L1 (the master through its codec, a bf16
// gradient, bf16 or int8 moments), the rule's math runs over the arrays, and they
// are encoded back. fp32 values that need no decoding (an fp32 parameter without a
// master, an fp32 gradient, fp32 moments) are not copied: the math reads and writes
// them where they are, so that case is one fused pass too. The master codecs are
// reached through function pointers chosen once per tensor, which keeps the build
// to one instantiation per rule and layout instead of one per rule and format.
enum Rule {
  R_ADAMW = MIXPREC_RULE_ADAMW, R_ADAMW_AMSGRAD = MIXPREC_RULE_ADAMW_AMSGRAD,
  R_ADAM = MIXPREC_RULE_ADAM, R_ADAM_AMSGRAD = MIXPREC_RULE_ADAM_AMSGRAD,
  R_SGD = MIXPREC_RULE_SGD, R_SGD_MOMENTUM = MIXPREC_RULE_SGD_MOMENTUM,
  R_SGD_NESTEROV = MIXPREC_RULE_SGD_NESTEROV, R_LION = MIXPREC_RULE_LION
};

constexpr bool is_adam(int r) {
  return r == R_ADAMW || r == R_ADAMW_AMSGRAD || r == R_ADAM || r == R_ADAM_AMSGRAD;
}
constexpr bool is_sgd(int r) { return r == R_SGD || r == R_SGD_MOMENTUM || r == R_SGD_NESTEROV; }

// Rule.slots: how many moments a rule keeps; slot 0 is signed, the others square.
constexpr int rule_slots(int r) {
  return (r == R_ADAMW_AMSGRAD || r == R_ADAM_AMSGRAD) ? 3
         : (r == R_ADAMW || r == R_ADAM)                ? 2
         : r == R_SGD                                    ? 0
                                                         : 1;
}

// Elements per staged run (dense moments). Short runs keep every stream of the step
// in flight together: with the exact master out of cache (16M elements, one thread)
// runs of 64 or 128 elements ran as fast as AdamW's fused loop, 256 took 15% longer
// and 512 30% longer.
constexpr int64_t kStage = 128;

// Rule.math of `RULE` over n elements, in its operation order (every product and
// sum rounded on its own: -ffp-contract=off). p and the moments are updated in place;
// g is the gradient before `sign` (maximize) is applied.
template <int RULE>
void rule_math(const float* sc, float sign, float* __restrict p, const float* __restrict g_in,
               float* __restrict m0, float* __restrict m1, float* __restrict m2, int64_t n) {
  const float s0 = sc[0], s1 = sc[1], s2 = sc[2], s3 = sc[3], s4 = sc[4], s5 = sc[5],
              s6 = sc[6];
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float g = g_in[i] * sign;
    float x = p[i];
    if constexpr (is_adam(RULE)) {
      constexpr bool decoupled = RULE == R_ADAMW || RULE == R_ADAMW_AMSGRAD;
      if constexpr (decoupled) x = x * s0;
      else g = g + s0 * x;
      const float m = m0[i] + s1 * (g - m0[i]);
      const float v = m1[i] * s2 + (s3 * g) * g;
      float denom;
      if constexpr (rule_slots(RULE) == 3) {
        const float old = m2[i];
        const float vmax = (old != old || old > v) ? old : v;  // torch.maximum(old, v)
        denom = std::sqrt(vmax) * s5 + s6;
        m2[i] = vmax;
      } else {
        denom = std::sqrt(v) * s5 + s6;
      }
      m0[i] = m;
      m1[i] = v;
      x = x + (s4 * m) / denom;
    } else if constexpr (is_sgd(RULE)) {
      g = g + s0 * x;
      if constexpr (RULE != R_SGD) {
        const float buf = m0[i] * s1 + s2 * g;
        m0[i] = buf;
        g = RULE == R_SGD_NESTEROV ? g + s3 * buf : buf;
      }
      x = x + s4 * g;
    } else {  // R_LION
      const float m = m0[i];
      const float c = m * s1 + s2 * g;
      const float update = static_cast<float>((c > 0.0f) - (c < 0.0f));  // torch.sign
      x = x * s0 + s5 * update;
      m0[i] = m * s3 + s4 * g;
    }
    p[i] = x;
  }
}

// (A private copy of the Args: the codecs' int8 stores may alias anything else, so
// through the caller's reference every iteration would reload its pointers.)
template <int MASTER, int PDT>
void decode_run(const Args& args, int64_t lo, int64_t n, float* out) {
  const Args a = args;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) out[j] = decode_master<MASTER, PDT>(a, lo + j);
}
template <int MASTER, int PDT>
void encode_run(const Args& args, int64_t lo, int64_t n, const float* in) {
  const Args a = args;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) encode_master<MASTER, PDT>(a, lo + j, in[j]);
}

inline void bf16_run(const void* src, int64_t lo, int64_t n, float* out) {
  const uint16_t* s = static_cast<const uint16_t*>(src) + lo;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) out[j] = bf2f(s[j]);
}
inline void bf16_store_run(void* dst, int64_t lo, int64_t n, const float* in) {
  uint16_t* d = static_cast<uint16_t*>(dst) + lo;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) d[j] = f2bf(in[j]);
}

// The value array of run [lo, lo + n): the parameter itself (fp32, no master) or
// its decoding into buf.
inline float* stage_value(const Args& a, int64_t lo, int64_t n, float* buf) {
  if (a.decode == nullptr) return static_cast<float*>(a.param) + lo;
  a.decode(a, lo, n, buf);
  return buf;
}
inline const float* stage_grad(const Args& a, int64_t lo, int64_t n, float* buf) {
  if (a.gdt == DT_F32) return static_cast<const float*>(a.grad) + lo;
  bf16_run(a.grad, lo, n, buf);
  return buf;
}

// Dense moments (fp32 in place, or bf16 staged), elements [lo, hi).
template <int RULE, int MO>
void staged_dense_range(const Args& args, int64_t lo, int64_t hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  constexpr int slots = rule_slots(RULE);
  alignas(64) float pbuf[kStage], gbuf[kStage], mbuf[slots > 0 ? slots : 1][kStage];
  for (int64_t s = lo; s < hi; s += kStage) {
    const int64_t n = hi - s < kStage ? hi - s : kStage;
    float* const p = stage_value(a, s, n, pbuf);
    const float* const g = stage_grad(a, s, n, gbuf);
    float* m[3] = {nullptr, nullptr, nullptr};
    for (int k = 0; k < slots; ++k) {
      if constexpr (MO == MO_FP32) {
        m[k] = static_cast<float*>(a.mo[k]) + s;
      } else {
        bf16_run(a.mo[k], s, n, mbuf[k]);
        m[k] = mbuf[k];
      }
    }
    rule_math<RULE>(a.scalars, a.grad_sign, p, g, m[0], m[1], m[2], n);
    if (a.encode != nullptr) a.encode(a, s, n, p);
    if constexpr (MO == MO_BF16)
      for (int k = 0; k < slots; ++k) bf16_store_run(a.mo[k], s, n, mbuf[k]);
  }
}

// moments/int8.py dequantize_signed / dequantize_sqrt of one block.
inline void int8_decode_signed(const int8_t* q8, float absmax, int64_t n, float* out) {
  const float ms = absmax * static_cast<float>(1.0 / (127.0 * 127.0));
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const float q = static_cast<float>(q8[j]);
    out[j] = (q * std::fabs(q)) * ms;
  }
}
inline void int8_decode_square(const uint8_t* q8, float umax, int64_t n, float* out) {
  const float us = umax * static_cast<float>(1.0 / (255.0 * 255.0));
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const float q = static_cast<float>(q8[j]);
    const float ub = (q * q) * us;
    out[j] = ub * ub;
  }
}

// moments/int8.py quantize_signed / quantize_sqrt of one block (int8_range's encoding;
// the block maximum is taken on the bits, as there). x is overwritten (quantize_signed:
// clamped to M_MAX; quantize_sqrt: with sqrt(v)).
inline void int8_encode_signed(float* x, int64_t n, int8_t* q8, float* absmax) {
  uint32_t bits = 0;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = fbits(x[j]) & 0x7FFFFFFFu;
    bits = b > bits ? b : bits;
  }
  const float am = bitsf(clamp_signed_block(x, n, bits));
  const float f = (1.0f / (am > 0.0f ? am : 1.0f)) * (127.0f * 127.0f);
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const float m = x[j];
    const float q = std::rint(std::sqrt(std::fabs(m) * f));
    q8[j] = static_cast<int8_t>(static_cast<int32_t>(m < 0.0f ? -q : q));
  }
  *absmax = am;
}
inline void int8_encode_square(float* x, int64_t n, uint8_t* q8, float* umax) {
  uint32_t bits = 0;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    float u = std::sqrt(x[j]);
    u = u > kUMax ? kUMax : u;  // moments/int8.py U_MAX (NaN stays NaN)
    x[j] = u;
    const uint32_t b = fbits(u) & 0x7FFFFFFFu;
    bits = b > bits ? b : bits;
  }
  const float au = bitsf(bits);
  const float f = (1.0f / (au > 0.0f ? au : 1.0f)) * (255.0f * 255.0f);
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) {
    const float u = x[j];
    float q = std::rint(std::sqrt(u * f));
    q = (q == 0.0f && u > 0.0f) ? 1.0f : q;
    q8[j] = static_cast<uint8_t>(static_cast<int32_t>(q));
  }
  *umax = au;
}

// int8 moments: codes mo[2k], per-block scales mo[2k + 1] of slot k; blocks
// [block_lo, block_hi).
template <int RULE>
void staged_int8_range(const Args& args, int64_t block_lo, int64_t block_hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  constexpr int slots = rule_slots(RULE);
  const int64_t bs = a.block;
  alignas(64) float pbuf[kMaxBlock], gbuf[kMaxBlock], mbuf[slots > 0 ? slots : 1][kMaxBlock];
  for (int64_t b = block_lo; b < block_hi; ++b) {
    const int64_t base = b * bs;
    float* const p = stage_value(a, base, bs, pbuf);
    const float* const g = stage_grad(a, base, bs, gbuf);
    float* m[3] = {nullptr, nullptr, nullptr};
    for (int k = 0; k < slots; ++k) {
      const float scale = static_cast<const float*>(a.mo[2 * k + 1])[b];
      if (k == 0) int8_decode_signed(static_cast<const int8_t*>(a.mo[0]) + base, scale, bs, mbuf[0]);
      else int8_decode_square(static_cast<const uint8_t*>(a.mo[2 * k]) + base, scale, bs, mbuf[k]);
      m[k] = mbuf[k];
    }
    rule_math<RULE>(a.scalars, a.grad_sign, p, g, m[0], m[1], m[2], bs);
    if (a.encode != nullptr) a.encode(a, base, bs, p);
    for (int k = 0; k < slots; ++k) {
      float* const scale = static_cast<float*>(a.mo[2 * k + 1]) + b;
      if (k == 0) int8_encode_signed(mbuf[0], bs, static_cast<int8_t*>(a.mo[0]) + base, scale);
      else int8_encode_square(mbuf[k], bs, static_cast<uint8_t*>(a.mo[2 * k]) + base, scale);
    }
  }
}

// Runs items [lo, hi) of one tensor: chunks of kChunk elements (dense moments) or
// runs of int8 blocks.
using RangeFn = void (*)(const Args&, int64_t, int64_t);

// -- int4 moments (moments/int4.py): two passes ------------------------------------
//
// A parameter is the matrix (rows, cols), cols a multiple of 128. The signed slot's
// blocks (128 elements of one row) are local, but a square slot's code needs the new
// maxima of the element's row and column, so the column maxima need every row's new
// v before any code is written. Pass 1 (int4_maxima) reads the gradient and the old
// square codes (and, for Adam's L2 term, the master), recomputes each new v as
// rule_math does and reduces the row and column maxima into small buffers (Int4Aux);
// it writes no state. Pass 2 (int4_apply) is the staged step: it decodes the
// still-unchanged old state, runs rule_math and encodes with the new maxima. So no
// fp32 buffer of the parameter's size is made, and the passes are separable: the
// column maxima are complete between them (int4_run), where a sharded parameter's
// would be reduced across ranks. Rules with only a signed slot (SGD with momentum,
// Lion) take pass 2 alone, over the parameter as blocks of 128.
#include "../../formats/moments/int4.h"

constexpr int64_t kInt4Block = 128;  // int4.py BLOCK_SIZE (== kStage)
constexpr int64_t kInt4Window = int64_t{1} << 19;  // elements a thread (int4_run)
// Software prefetch distance of the int4 passes, in elements. The passes spend their
// time in arithmetic, which fills the reorder window, so fewer of the hardware
// prefetcher's lines are in flight (as in the Kahan loop).
constexpr int64_t kInt4Prefetch = 1024;

// Prefetches the `bytes` bytes at p (for writing: `write`), one line at a time.
inline void prefetch_run(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (write) __builtin_prefetch(c + o, 1, 3);
    else __builtin_prefetch(c + o, 0, 3);
  }
}

// One tensor's matrix view and its square slots' new maxima (slot k + 1 at [k]).
struct Int4Aux {
  int64_t rows, cols;
  float* rowmax[2];       // new row maxima (pass 1)
  uint32_t* colbits[2];   // bits of the new column maxima (pass 1: max over rows)
  float* col_f[2];        // int4_square_factor of each new column maximum (between)
};

// Pass 1's arithmetic over one block: rule_math's new v (and AMSGrad's max) from the
// decoded old ones in vbuf (overwritten), the gradient (dtype GDT) and, for Adam's L2
// term, the master p; their stored values' bits reduced into rowbits and part.
template <int RULE, int GDT>
inline void int4_new_squares(const Args& a, int64_t s, const float* p, float (*vbuf)[kInt4Block],
                             uint32_t* rowbits, uint32_t* const* part) {
  constexpr int squares = rule_slots(RULE) - 1;
  constexpr bool l2 = RULE == R_ADAM || RULE == R_ADAM_AMSGRAD;  // g + wd * p
  const float s0 = a.scalars[0], s2 = a.scalars[2], s3 = a.scalars[3], sign = a.grad_sign;
  uint32_t bits0 = rowbits[0], bits1 = rowbits[1];
  uint32_t* const part0 = part[0];
  uint32_t* const part1 = part[1];
#pragma GCC ivdep
  for (int64_t j = 0; j < kInt4Block; ++j) {
    float gj = load_p<GDT>(a.grad, s + j) * sign;
    if constexpr (l2) gj = gj + s0 * p[j];
    const float v = vbuf[0][j] * s2 + (s3 * gj) * gj;
    const uint32_t b0 = fbits(int4_square_stored(v)) & 0x7FFFFFFFu;
    bits0 = b0 > bits0 ? b0 : bits0;
    part0[j] = b0 > part0[j] ? b0 : part0[j];
    if constexpr (squares == 2) {
      const float old = vbuf[1][j];
      const float vmax = (old != old || old > v) ? old : v;
      const uint32_t b1 = fbits(int4_square_stored(vmax)) & 0x7FFFFFFFu;
      bits1 = b1 > bits1 ? b1 : bits1;
      part1[j] = b1 > part1[j] ? b1 : part1[j];
    }
  }
  rowbits[0] = bits0;
  rowbits[1] = bits1;
}

// Pass 1 over rows [row_lo, row_hi): the new row maxima into a.int4->rowmax, the
// column maxima's bits of these rows into colpart (cols per square slot).
template <int RULE>
void int4_maxima(const Args& args, int64_t row_lo, int64_t row_hi, uint32_t* colpart) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Int4Aux& x = *a.int4;
  constexpr int squares = rule_slots(RULE) - 1;
  constexpr bool l2 = RULE == R_ADAM || RULE == R_ADAM_AMSGRAD;  // g + wd * p
  const int64_t cols = x.cols;
  alignas(64) float pbuf[kInt4Block], vbuf[2][kInt4Block];
  for (int64_t r = row_lo; r < row_hi; ++r) {
    uint32_t rowbits[2] = {0u, 0u};
    for (int64_t c = 0; c < cols; c += kInt4Block) {
      const int64_t s = r * cols + c;
      if (s + kInt4Prefetch < a.n) {
        const int64_t f = s + kInt4Prefetch;
        prefetch_run(static_cast<const char*>(a.grad) + f * (a.gdt == DT_F32 ? 4 : 2),
                     kInt4Block * (a.gdt == DT_F32 ? 4 : 2), false);
        for (int k = 0; k < squares; ++k)
          prefetch_run(static_cast<const uint8_t*>(a.mo[3 * k + 2]) + f / 2, kInt4Block / 2, false);
      }
      const float* const p = l2 ? stage_value(a, s, kInt4Block, pbuf) : nullptr;
      for (int k = 0; k < squares; ++k)
        int4_decode_square(static_cast<const uint8_t*>(a.mo[3 * k + 2]) + s / 2,
                           static_cast<const float*>(a.mo[3 * k + 3])[r],
                           static_cast<const float*>(a.mo[3 * k + 4]) + c, kInt4Block, vbuf[k]);
      uint32_t* const part[2] = {colpart + c, colpart + (squares - 1) * cols + c};
      if (a.gdt == DT_F32) int4_new_squares<RULE, DT_F32>(a, s, p, vbuf, rowbits, part);
      else int4_new_squares<RULE, DT_BF16>(a, s, p, vbuf, rowbits, part);
    }
    for (int k = 0; k < squares; ++k) x.rowmax[k][r] = bitsf(rowbits[k]);
  }
}

// Pass 2 over rows [row_lo, row_hi): the staged step, decoding the old codes and
// maxima, encoding with the new ones (a square slot's row maximum is written once its
// row is done: no other row reads it; the column maxima after the pass, int4_run).
template <int RULE>
void int4_apply(const Args& args, int64_t row_lo, int64_t row_hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Int4Aux& x = *a.int4;
  constexpr int slots = rule_slots(RULE);
  const int64_t cols = x.cols;
  uint8_t* const mq = static_cast<uint8_t*>(a.mo[0]);
  float* const mabs = static_cast<float*>(a.mo[1]);
  alignas(64) float pbuf[kInt4Block], gbuf[kInt4Block], mbuf[3][kInt4Block];
  for (int64_t r = row_lo; r < row_hi; ++r) {
    float row_f[2] = {0.0f, 0.0f};
    for (int k = 0; k + 1 < slots; ++k) row_f[k] = int4_square_factor(x.rowmax[k][r]);
    for (int64_t c = 0; c < cols; c += kInt4Block) {
      const int64_t s = r * cols + c;
      float* const p = stage_value(a, s, kInt4Block, pbuf);
      const float* const g = stage_grad(a, s, kInt4Block, gbuf);
      int4_decode_signed(mq + s / 2, mabs[s / kInt4Block], kInt4Block, mbuf[0]);
      for (int k = 0; k + 1 < slots; ++k)
        int4_decode_square(static_cast<const uint8_t*>(a.mo[3 * k + 2]) + s / 2,
                           static_cast<const float*>(a.mo[3 * k + 3])[r],
                           static_cast<const float*>(a.mo[3 * k + 4]) + c, kInt4Block,
                           mbuf[k + 1]);
      rule_math<RULE>(a.scalars, a.grad_sign, p, g, mbuf[0], mbuf[1], mbuf[2], kInt4Block);
      if (a.encode != nullptr) a.encode(a, s, kInt4Block, p);
      int4_encode_signed(mbuf[0], kInt4Block, mq + s / 2, mabs + s / kInt4Block);
      for (int k = 0; k + 1 < slots; ++k)
        int4_encode_square(mbuf[k + 1], row_f[k], x.col_f[k] + c, kInt4Block,
                           static_cast<uint8_t*>(a.mo[3 * k + 2]) + s / 2);
    }
    for (int k = 0; k + 1 < slots; ++k) static_cast<float*>(a.mo[3 * k + 3])[r] = x.rowmax[k][r];
  }
}

#if defined(MIXPREC_INT8_AVX512)
// int4_adamw_apply's block of 128 elements from s on for the remainder8 master over bf16
// parameters, 32 elements at a time: the old codes decoded where they are read (the
// lookups of int4_decode_signed and int4_decode_square, whose row maximum `row_max` is
// not NaN), the update of rem8_adamw16, and each new v coded at once with the new
// maxima (int4_encode_square's codes: `col_f` and `colmax` point at the block's first
// column). The new m go to mloc: their signed codes need the block's absmax, whose
// bits are returned.
template <int GDT>
inline uint32_t int4_rem8_block(const Args& a, const Math& k, int64_t s, float absmax,
                                float row_max, const float* colmax, float row_f,
                                const float* col_f, float* mloc) {
  const uint8_t* const mq = static_cast<const uint8_t*>(a.mo[0]) + s / 2;
  uint8_t* const vq = static_cast<uint8_t*>(a.mo[2]) + s / 2;
  const __m512 mtable = int4_signed_table(absmax), levels = int4_square_levels();
  const __m512 rv = _mm512_set1_ps(row_max), rf = _mm512_set1_ps(row_f);
  __m512 mmax = _mm512_setzero_ps();
  for (int64_t j = 0; j < kInt4Block; j += 32) {
    __m512i bits[2], codes[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t t = j + 16 * h;
      __m512 m = int4_lookup16(mq + t / 2, mtable);
      __m512 v = _mm512_mul_ps(int4_lookup16(vq + t / 2, levels),
                               _mm512_min_ps(rv, _mm512_loadu_ps(colmax + t)));  // r < c ? r : c
      __m512 u;
      bits[h] = rem8_adamw16<GDT>(a, k, s + t, m, v, u);
      _mm512_store_ps(mloc + t, m);
      mmax = _mm512_range_ps(mmax, m, 0x0B);  // as int8_rem8_lanes
      codes[h] = int4_square_code16(v, rf, _mm512_loadu_ps(col_f + t));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vq + j / 2), int4_pack32(codes[0], codes[1]));
    rem8_store32(a, s + j, bits[0], bits[1]);
  }
  return static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_castps_si512(mmax)));
}
#endif

// int4_apply for AdamW with the master and dtypes inlined, int8_range's structure: the
// block's moments decoded into L1, one loop of Math::apply (rule_math's AdamW, in its
// order), then encoded.
template <int MASTER, int PDT, int GDT>
void int4_adamw_apply(const Args& args, int64_t row_lo, int64_t row_hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Int4Aux& x = *a.int4;
  const Math k(a.scalars);
  const int64_t cols = x.cols;
  uint8_t* const mq = static_cast<uint8_t*>(a.mo[0]);
  float* const mabs = static_cast<float*>(a.mo[1]);
  uint8_t* const vq = static_cast<uint8_t*>(a.mo[2]);
  float* const rmax = static_cast<float*>(a.mo[3]);
  const float* const cmax = static_cast<const float*>(a.mo[4]);
  alignas(64) float mloc[kInt4Block], vloc[kInt4Block];
  for (int64_t r = row_lo; r < row_hi; ++r) {
    const float row_f = int4_square_factor(x.rowmax[0][r]);
    const float row_max = rmax[r];  // the old maximum (decoding), replaced after the row
    const bool fast_row = row_max == row_max;  // a NaN one takes int4_decode_square's path
    for (int64_t c = 0; c < cols; c += kInt4Block) {
      const int64_t s = r * cols + c;
      if (s + kInt4Prefetch < a.n) {
        const int64_t f = s + kInt4Prefetch;
        prefetch_run(static_cast<const char*>(a.grad) + f * (GDT == DT_F32 ? 4 : 2),
                     kInt4Block * (GDT == DT_F32 ? 4 : 2), false);
        prefetch_run(static_cast<const char*>(a.param) + f * (PDT == DT_F32 ? 4 : 2),
                     kInt4Block * (PDT == DT_F32 ? 4 : 2), true);
        prefetch_run(mq + f / 2, kInt4Block / 2, true);
        prefetch_run(vq + f / 2, kInt4Block / 2, true);
      }
#if defined(MIXPREC_INT8_AVX512)
      if constexpr (MASTER == M_REM8 && PDT == DT_BF16) {
        if (fast_row) {
          const uint32_t bits = clamp_signed_block(
              mloc, kInt4Block,
              int4_rem8_block<GDT>(a, k, s, mabs[s / kInt4Block], row_max, cmax + c, row_f,
                                   x.col_f[0] + c, mloc));
          int4_encode_signed_codes(mloc, kInt4Block, bitsf(bits), mq + s / 2);
          mabs[s / kInt4Block] = bitsf(bits);
          continue;
        }
      }
#endif
      int4_decode_signed(mq + s / 2, mabs[s / kInt4Block], kInt4Block, mloc);
      int4_decode_square(vq + s / 2, rmax[r], cmax + c, kInt4Block, vloc);
      uint32_t mbits = 0;
#pragma GCC ivdep
      for (int64_t j = 0; j < kInt4Block; ++j) {
        const int64_t i = s + j;
        float p = decode_master<MASTER, PDT>(a, i);
        float g = load_p<GDT>(a.grad, i) * a.grad_sign;
        float m = mloc[j], v = vloc[j], u;
        k.apply(p, g, m, v, u);
        encode_master<MASTER, PDT>(a, i, p);
        mloc[j] = m;
        vloc[j] = v;
        const uint32_t mb = fbits(m) & 0x7FFFFFFFu;
        mbits = mb > mbits ? mb : mbits;
      }
      mbits = clamp_signed_block(mloc, kInt4Block, mbits);
      int4_encode_signed_codes(mloc, kInt4Block, bitsf(mbits), mq + s / 2);
      mabs[s / kInt4Block] = bitsf(mbits);
      int4_encode_square(vloc, row_f, x.col_f[0] + c, kInt4Block, vq + s / 2);
    }
    rmax[r] = x.rowmax[0][r];
  }
}

using Int4MaximaFn = void (*)(const Args&, int64_t, int64_t, uint32_t*);

inline void atomic_max_bits(uint32_t* dst, uint32_t bits) {
  uint32_t cur = __atomic_load_n(dst, __ATOMIC_RELAXED);
  while (bits > cur &&
         !__atomic_compare_exchange_n(dst, &cur, bits, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Both passes over `count` tensors (apply: each one's int4_apply, null where it is
// skipped; maxima: the rule's pass 1, null for a rule without a square slot). Work
// items are runs of whole rows (about kChunk elements); each thread takes one
// contiguous run of items in each pass. Maxima are exact whatever the order, so
// results do not depend on the thread count.
void int4_run(Args* args, const int64_t* rows_of, RangeFn const* apply, Int4MaximaFn maxima,
              int squares, int64_t count, int threads) {
  Int4Aux* aux = new Int4Aux[count];
  int64_t* first = new int64_t[count + 1];
  int64_t* per_item = new int64_t[count];
  int64_t stats = 0, max_cols = 0;
  first[0] = 0;
  for (int64_t t = 0; t < count; ++t) {
    Int4Aux& x = aux[t];
    const int64_t n = apply[t] == nullptr ? 0 : args[t].n;
    x.rows = squares > 0 ? rows_of[t] : n / kInt4Block;
    x.rows = n == 0 ? 0 : x.rows;
    x.cols = x.rows > 0 ? n / x.rows : 0;
    per_item[t] = x.cols > 0 && kChunk / x.cols > 0 ? kChunk / x.cols : 1;
    first[t + 1] = first[t] + (x.rows + per_item[t] - 1) / per_item[t];
    stats += squares * (x.rows + 2 * x.cols);
    max_cols = x.cols > max_cols ? x.cols : max_cols;
    args[t].int4 = &aux[t];
  }
  float* const buf = stats > 0 ? new float[stats] : nullptr;
  uint32_t* const bits = stats > 0 ? new uint32_t[stats]() : nullptr;  // maxima start at 0
  int64_t next = 0;
  for (int64_t t = 0; t < count; ++t) {
    Int4Aux& x = aux[t];
    for (int k = 0; k < squares; ++k) {
      x.rowmax[k] = buf + next;
      x.col_f[k] = buf + next + x.rows;
      x.colbits[k] = bits + next;
      next += x.rows + 2 * x.cols;
    }
  }
  const int64_t total = first[count];
  int nthreads = threads < 1 ? 1 : threads;
  if (total < nthreads) nthreads = total < 1 ? 1 : static_cast<int>(total);
  // The items [lo, hi) of this thread, tensor by tensor: fn(t, row_lo, row_hi) for each
  // run, done(t) after its last run of tensor t.
  auto walk = [&](int64_t lo, int64_t hi, auto&& fn, auto&& done) {
    int64_t t = 0;
    while (t < count && first[t + 1] <= lo) ++t;
    for (int64_t item = lo; item < hi && t < count; ++t) {
      const int64_t end = hi < first[t + 1] ? hi : first[t + 1];
      const int64_t r_lo = (item - first[t]) * per_item[t];
      int64_t r_hi = (end - first[t]) * per_item[t];
      r_hi = r_hi < aux[t].rows ? r_hi : aux[t].rows;
      if (r_lo < r_hi) {
        fn(t, r_lo, r_hi);
        done(t);
      }
      item = end;
    }
  };
  // Windows of consecutive tensors, about kInt4Window elements a thread: both passes run
  // over one window before the next, so the gradients and square codes pass 1 read are
  // still in cache when pass 2 reads them again. Every thread finds the same windows.
  const int64_t window = kInt4Window * nthreads;
#pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t tid = 0, nt = 1;
#endif
    uint32_t* const part =
        maxima != nullptr ? new uint32_t[squares * (max_cols > 0 ? max_cols : 1)] : nullptr;
    for (int64_t w_lo = 0, w_hi = 0; w_lo < count; w_lo = w_hi) {
      int64_t elems = aux[w_lo].rows * aux[w_lo].cols;
      for (w_hi = w_lo + 1; w_hi < count && elems + aux[w_hi].rows * aux[w_hi].cols <= window;
           ++w_hi)
        elems += aux[w_hi].rows * aux[w_hi].cols;
      const int64_t base = first[w_lo], items = first[w_hi] - base;
      const int64_t lo = base + items * tid / nt, hi = base + items * (tid + 1) / nt;
      if (maxima != nullptr) {
        walk(
            lo, hi,
            [&](int64_t t, int64_t r_lo, int64_t r_hi) {
              std::memset(part, 0, sizeof(uint32_t) * squares * aux[t].cols);
              maxima(args[t], r_lo, r_hi, part);
            },
            [&](int64_t t) {
              const Int4Aux& x = aux[t];
              for (int k = 0; k < squares; ++k)
                for (int64_t j = 0; j < x.cols; ++j)
                  atomic_max_bits(x.colbits[k] + j, part[k * x.cols + j]);
            });
#pragma omp barrier
        // The column maxima are complete (a sharded parameter's would be all-reduced here).
#pragma omp for schedule(static)
        for (int64_t t = w_lo; t < w_hi; ++t)
          for (int k = 0; k < squares; ++k)
            for (int64_t j = 0; j < aux[t].cols; ++j)
              aux[t].col_f[k][j] = int4_square_factor(bitsf(aux[t].colbits[k][j]));
      }
      walk(
          lo, hi, [&](int64_t t, int64_t r_lo, int64_t r_hi) { apply[t](args[t], r_lo, r_hi); },
          [](int64_t) {});
    }
    delete[] part;
  }
  for (int64_t t = 0; t < count; ++t)  // the new column maxima, once every row is coded
    for (int k = 0; k < squares; ++k)
      for (int64_t j = 0; j < aux[t].cols; ++j)
        static_cast<float*>(args[t].mo[3 * k + 4])[j] = bitsf(aux[t].colbits[k][j]);
  for (int64_t t = 0; t < count; ++t) args[t].int4 = nullptr;
  delete[] bits;
  delete[] buf;
  delete[] per_item;
  delete[] first;
  delete[] aux;
}


template <int MASTER, int PDT, int MO, int GDT>
constexpr RangeFn pick() {
  if constexpr (MO == MO_INT8) return &int8_range<MASTER, PDT, GDT>;
  else if constexpr (MO == MO_INT4) return &int4_adamw_apply<MASTER, PDT, GDT>;
  else return &dense_range<MASTER, PDT, MO, GDT>;
}

template <int MASTER, int PDT, int MO>
RangeFn lookup_grad(int gdt) {
  return gdt == DT_F32 ? pick<MASTER, PDT, MO, DT_F32>() : pick<MASTER, PDT, MO, DT_BF16>();
}

template <int MASTER, int PDT>
RangeFn lookup_grad(int mo, int gdt) {
  switch (mo) {  // the codes come from the build: a switch, not a table indexed by them
    case MO_FP32: return lookup_grad<MASTER, PDT, MO_FP32>(gdt);
    case MO_BF16: return lookup_grad<MASTER, PDT, MO_BF16>(gdt);
    case MO_INT8: return lookup_grad<MASTER, PDT, MO_INT8>(gdt);
    case MO_INT4: return lookup_grad<MASTER, PDT, MO_INT4>(gdt);
    default: return nullptr;
  }
}

RangeFn adamw_lookup(int master, int pdt, int mo, int gdt) {
  if (gdt != DT_F32 && gdt != DT_BF16) return nullptr;
  if (pdt == DT_F32) return master == M_NONE ? lookup_grad<M_NONE, DT_F32>(mo, gdt) : nullptr;
  if (pdt != DT_BF16) return nullptr;
  switch (master) {
    case M_NONE: return lookup_grad<M_NONE, DT_BF16>(mo, gdt);
    case M_FP32: return lookup_grad<M_FP32, DT_BF16>(mo, gdt);
    case M_EXACT: return lookup_grad<M_EXACT, DT_BF16>(mo, gdt);
    case M_REM8: return lookup_grad<M_REM8, DT_BF16>(mo, gdt);
    case M_KAHAN: return lookup_grad<M_KAHAN, DT_BF16>(mo, gdt);
    case M_STOCH: return lookup_grad<M_STOCH, DT_BF16>(mo, gdt);
    default: return nullptr;
  }
}

template <int RULE>
RangeFn staged_for(int mo) {
  switch (mo) {
    case MO_FP32: return &staged_dense_range<RULE, MO_FP32>;
    case MO_BF16: return &staged_dense_range<RULE, MO_BF16>;
    case MO_INT8: return &staged_int8_range<RULE>;
    default: return nullptr;
  }
}

// int4 moments: each rule's pass 2 (none for plain SGD: it keeps no moments) and pass 1
// (the rules with a square slot).
RangeFn int4_for(int rule) {
  switch (rule) {
    case R_ADAMW_AMSGRAD: return &int4_apply<R_ADAMW_AMSGRAD>;
    case R_ADAM: return &int4_apply<R_ADAM>;
    case R_ADAM_AMSGRAD: return &int4_apply<R_ADAM_AMSGRAD>;
    case R_SGD_MOMENTUM: return &int4_apply<R_SGD_MOMENTUM>;
    case R_SGD_NESTEROV: return &int4_apply<R_SGD_NESTEROV>;
    case R_LION: return &int4_apply<R_LION>;
    default: return nullptr;
  }
}
Int4MaximaFn int4_maxima_for(int rule) {
  switch (rule) {
    case R_ADAMW: return &int4_maxima<R_ADAMW>;
    case R_ADAMW_AMSGRAD: return &int4_maxima<R_ADAMW_AMSGRAD>;
    case R_ADAM: return &int4_maxima<R_ADAM>;
    case R_ADAM_AMSGRAD: return &int4_maxima<R_ADAM_AMSGRAD>;
    default: return nullptr;
  }
}

// The master codec of the staged loops for a parameter dtype; false: none.
template <int PDT>
bool codec_for(int master, DecodeFn& decode, EncodeFn& encode) {
  switch (master) {
#define MIXPREC_CODEC(M) \
  case M: decode = &decode_run<M, PDT>; encode = &encode_run<M, PDT>; return true;
    MIXPREC_CODEC(M_NONE) MIXPREC_CODEC(M_FP32) MIXPREC_CODEC(M_EXACT)
    MIXPREC_CODEC(M_REM8) MIXPREC_CODEC(M_KAHAN) MIXPREC_CODEC(M_STOCH)
#undef MIXPREC_CODEC
    default: return false;
  }
}
bool codec(int master, int pdt, DecodeFn& decode, EncodeFn& encode) {
  decode = nullptr;
  encode = nullptr;
  if (pdt == DT_F32) return master == M_NONE;  // the parameter is the value: no codec
  return pdt == DT_BF16 && codec_for<DT_BF16>(master, decode, encode);
}

// The loop for one tensor of `rule`, or null where this source has none.
RangeFn lookup(int rule, int master, int pdt, int mo, int gdt) {
  if (rule == R_ADAMW) return adamw_lookup(master, pdt, mo, gdt);
  DecodeFn decode;
  EncodeFn encode;
  if ((gdt != DT_F32 && gdt != DT_BF16) || !codec(master, pdt, decode, encode)) return nullptr;
  if (mo == MO_INT4) return int4_for(rule);
  switch (rule) {
    case R_ADAMW_AMSGRAD: return staged_for<R_ADAMW_AMSGRAD>(mo);
    case R_ADAM: return staged_for<R_ADAM>(mo);
    case R_ADAM_AMSGRAD: return staged_for<R_ADAM_AMSGRAD>(mo);
    case R_SGD: return staged_for<R_SGD>(mo);
    case R_SGD_MOMENTUM: return staged_for<R_SGD_MOMENTUM>(mo);
    case R_SGD_NESTEROV: return staged_for<R_SGD_NESTEROV>(mo);
    case R_LION: return staged_for<R_LION>(mo);
    default: return nullptr;
  }
}

inline bool finite(double x) { return std::isfinite(x); }

// Rule.valid: whether hyper is in the range the rule's math is defined for.
bool hyper_valid(int rule, const double* h) {
  const double lr = h[0], wd = h[4];
  if (is_adam(rule)) {  // lr, beta1, beta2, eps, weight_decay
    const double b1 = h[1], b2 = h[2], eps = h[3];
    return finite(lr) && finite(eps) && finite(wd) && lr >= 0.0 && b1 >= 0.0 && b1 < 1.0 &&
           b2 >= 0.0 && b2 < 1.0 && eps > 0.0 && wd >= 0.0;
  }
  if (is_sgd(rule)) {  // lr, momentum, dampening, -, weight_decay
    const double momentum = h[1], dampening = h[2];
    return finite(lr) && finite(momentum) && finite(dampening) && finite(wd) && lr >= 0.0 &&
           momentum >= 0.0 && wd >= 0.0;
  }
  const double b1 = h[1], b2 = h[2];  // R_LION: lr, beta1, beta2, -, weight_decay
  return finite(lr) && finite(wd) && lr >= 0.0 && b1 >= 0.0 && b1 <= 1.0 && b2 >= 0.0 &&
         b2 <= 1.0 && wd >= 0.0;
}

// Rule.scalars: computed in double from hyper and the step (1 for the first update),
// then rounded to float.
void rule_scalars(int rule, const double* h, double step, float* out) {
  double s[7] = {0, 0, 0, 0, 0, 0, 0};
  const double lr = h[0], wd = h[4];
  if (is_adam(rule)) {
    const double beta1 = h[1], beta2 = h[2], eps = h[3];
    s[0] = (rule == R_ADAMW || rule == R_ADAMW_AMSGRAD) ? 1.0 - lr * wd : wd;
    s[1] = 1.0 - beta1;
    s[2] = beta2;
    s[3] = 1.0 - beta2;
    s[4] = -lr / (1.0 - std::pow(beta1, step));
    s[5] = 1.0 / std::sqrt(1.0 - std::pow(beta2, step));
    s[6] = eps;
  } else if (is_sgd(rule)) {  // the first step makes the (zero) buffer the gradient
    const double momentum = h[1], dampening = h[2];
    const bool first = step == 1.0;
    s[0] = wd;
    s[1] = first ? 0.0 : momentum;
    s[2] = first ? 1.0 : 1.0 - dampening;
    s[3] = momentum;
    s[4] = -lr;
  } else {  // R_LION
    const double beta1 = h[1], beta2 = h[2];
    s[0] = 1.0 - lr * wd;
    s[1] = beta1;
    s[2] = 1.0 - beta1;
    s[3] = beta2;
    s[4] = 1.0 - beta2;
    s[5] = -lr;
  }
  for (int k = 0; k < 7; ++k) out[k] = static_cast<float>(s[k]);
}

// rng.step_key: a per-(parameter, step) key from the parameter's seed and step count.
inline uint32_t step_key(int64_t seed, double step) {
  const uint32_t t = static_cast<uint32_t>(static_cast<int64_t>(step));
  return mix32(mix32(t) + static_cast<uint32_t>(seed));
}

// The codec of mixprec_codec for a master and parameter dtype, or false: every master
// with a code over bf16 parameters but `stochastic` (its encode needs a rounding key),
// and `none` over fp32 ones (a copy).
bool plain_codec(int master, int pdt, DecodeFn& decode, EncodeFn& encode) {
  if (master == M_STOCH) return false;
  if (pdt == DT_F32 && master == M_NONE) {
    decode = &decode_run<M_NONE, DT_F32>;
    encode = &encode_run<M_NONE, DT_F32>;
    return true;
  }
  return pdt == DT_BF16 && codec_for<DT_BF16>(master, decode, encode);
}

}  // namespace

// Whether this build has a case for the rule, master and moment codes (the binding
// asks before sending a format: one registered later with a code of its own has none).
extern "C" int mixprec_covers(int rule, int master, int moments) {
  return lookup(rule, master, DT_BF16, moments, DT_BF16) != nullptr;
}

extern "C" {

// Whether mixprec_codec has a case for the master code and parameter dtype.
int mixprec_codec_covers(int master, int pdt) {
  DecodeFn decode;
  EncodeFn encode;
  return plain_codec(master, pdt, decode, encode) ? 1 : 0;
}

// A master's codec over elements [0, n) of one parameter (the formats' decode and
// encode, bitwise): encode == 0 decodes the parameter (dtype pdt) and its master state
// s0, s1 (as in the step's table) into the fp32 `values`; encode != 0 writes `values`
// into the parameter and its master state. Parallel over chunks of kChunk elements,
// each element on its own: results do not depend on `threads`. The caller checks the
// pointers (native/binding.py NativeLibrary.codec). Returns 0: done; 1: no codec for
// this master and dtype (nothing written).
int mixprec_codec(int master, int pdt, int encode, int64_t n, void* param, void* s0, void* s1,
                  float* values, int threads) {
  DecodeFn decode;
  EncodeFn encode_fn;
  if (!plain_codec(master, pdt, decode, encode_fn)) return 1;
  if (n <= 0) return 0;
  Args a{};
  a.param = param;
  a.s0 = s0;
  a.s1 = s1;
  a.n = n;
  const int64_t items = (n + kChunk - 1) / kChunk;
  int nthreads = threads < 1 ? 1 : threads;
  if (items < nthreads) nthreads = static_cast<int>(items);
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t lo = item * kChunk, len = n - lo < kChunk ? n - lo : kChunk;
    if (encode != 0) encode_fn(a, lo, len, values + lo);
    else decode(a, lo, len, values + lo);
  }
  return 0;
}

// ABI version: bump with any change of an exported signature.
int mixprec_abi_version() { return 11; }

// The columns of the table (native/binding.py TABLE_COLUMNS), count entries each.
enum Column {
  C_PDT = 0, C_GDT, C_NUMEL, C_OFFSET, C_PARAM, C_GRAD, C_S0, C_S1,
  C_MO0, C_MO1, C_MO2, C_MO3, C_MO4, C_MO5, C_MO6, C_MO7, C_STEP, C_SEED,
  C_S0_NUMEL, C_S1_NUMEL, C_MO0_NUMEL, C_MO1_NUMEL, C_MO2_NUMEL, C_MO3_NUMEL, C_MO4_NUMEL,
  C_MO5_NUMEL, C_MO6_NUMEL, C_MO7_NUMEL, C_GRAD_NUMEL,
  C_COLUMNS
};

// Whether tensor t's step counter is a count: finite, whole and not negative.
inline bool step_valid(const int64_t* table, int64_t count, int64_t t) {
  const double step = *reinterpret_cast<const double*>(table[C_STEP * count + t]);
  return std::isfinite(step) && step >= 0.0 && step == std::floor(step);
}

// How many of the state columns s0, s1 (master) and mo0..mo5 (moments) a family uses.
inline int master_slots(int master) {
  return master == M_EXACT ? 2 : (master == M_FP32 || master == M_REM8 || master == M_KAHAN) ? 1 : 0;
}
inline int moment_tensors(int rule, int moments) {
  if (moments == MO_INT4) return rule_slots(rule) > 0 ? 3 * rule_slots(rule) - 1 : 0;
  return rule_slots(rule) * (moments == MO_INT8 ? 2 : 1);
}

// Elements of int4 moment tensor k (int4.py's layout) of a parameter of n elements
// viewed as `rows` rows, or -1 where no size fits (rows must divide n into rows of
// whole 128-blocks). k: codes and absmax of the signed slot, then codes, row maxima and
// column maxima of each square slot.
inline int64_t int4_numel(int k, int64_t n, int64_t rows) {
  if (n % kInt4Block != 0) return -1;
  if (k == 0 || (k - 2) % 3 == 0) return n / 2;  // packed codes
  if (k == 1) return n / kInt4Block;               // absmax per block
  if (rows <= 0 || n % rows != 0 || (n / rows) % kInt4Block != 0) return -1;
  return (k - 2) % 3 == 1 ? rows : n / rows;       // row maxima, column maxima
}

// Whether tensor t's gradient and state fit its parameter: each state tensor the formats
// use has its parameter's element count (int8 scales: one value per block) and, when that
// is not 0, memory (a tensor emptied in place by `set_()` has a null pointer and no
// elements). Checked before any write.
inline bool sizes_fit(const int64_t* table, int64_t count, int64_t t, int rule, int master,
                      int moments, int64_t block) {
  auto col = [&](int c) { return table[c * count + t]; };
  const int64_t n = col(C_NUMEL);
  const bool int8 = moments == MO_INT8;
  if (col(C_GRAD_NUMEL) != n) return false;
  if (n > 0 && (col(C_PARAM) == 0 || col(C_GRAD) == 0)) return false;
  for (int k = 0; k < 10; ++k) {
    const bool used = k < 2 ? k < master_slots(master) : k - 2 < moment_tensors(rule, moments);
    if (!used) continue;  // the formats use no such tensor
    const int ptr_col = C_S0 + k;
    const bool per_block = int8 && k >= 2 && (k - 2) % 2 == 1;  // int8 scales
    int64_t expected = per_block ? n / block : n;
    if (moments == MO_INT4 && k >= 2) expected = int4_numel(k - 2, n, col(C_MO3_NUMEL));
    if (expected < 0) return false;
    if (col(C_S0_NUMEL + k) != expected || (expected > 0 && col(ptr_col) == 0)) return false;
  }
  return true;
}

// One step of `rule` (its Rule.code) over `count` tensors of one family (master and
// moment formats).
//
// table[c * count + t] holds column c of tensor t: parameter and gradient dtypes
// (DType), element count, the global offset of its first element (a shard's
// position in the whole parameter), data pointers (0 where the formats use no
// such tensor), its float64 step counter (incremented here) and its int64
// rounding seed (stochastic master only). The per-step scalars are computed
// from the step count exactly as Rule.scalars computes them (float64, then
// rounded to fp32). hyper: the five values of Rule.read, in Rule.hyper_names order.
//
// stream != 0 (AdamW, fp32 master, dense moments; the caller decides from the
// group's size, native/binding.py STREAM_MIN_BYTES): the bf16 parameters are
// written with non-temporal stores, which skip the read for ownership of a plain
// store and leave the lines out of the cache.
//
// A row whose gradient pointer is 0 (a parameter without a gradient this step) is
// skipped: neither it nor its step counter is touched.
//
// Everything is checked before anything is written. Returns 0: done; 1: a
// combination this source does not build; 2: a bad block size; 3: a state
// tensor whose size does not fit its parameter; 4: a step counter that is not a
// count (negative, fractional, NaN or infinite); 5: a hyperparameter out of range
// (Rule.valid: hyper_valid).
int mixprec_step_multi(int rule, int master, int moments, int maximize, int64_t count,
                       const int64_t* table, const double* hyper, int64_t block, int threads,
                       int stream) {
  if (count <= 0) return 0;
  auto col = [&](int c, int64_t t) { return table[c * count + t]; };
  auto ptr = [&](int c, int64_t t) { return reinterpret_cast<void*>(col(c, t)); };
  const bool int8 = moments == MO_INT8;
  if (lookup(rule, master, DT_BF16, moments, DT_BF16) == nullptr) return 1;
  if (int8 && (block < 1 || block > kMaxBlock)) return 2;
  if (!hyper_valid(rule, hyper)) return 5;
  RangeFn* fns = new RangeFn[count];
  for (int64_t t = 0; t < count; ++t) {
    if (col(C_GRAD, t) == 0 && col(C_NUMEL, t) > 0) {  // no gradient this step: skipped
      fns[t] = nullptr;
      continue;
    }
    fns[t] = lookup(rule, master, static_cast<int>(col(C_PDT, t)), moments,
                    static_cast<int>(col(C_GDT, t)));
    const int rc = fns[t] == nullptr                                  ? 1
                   : (int8 && col(C_NUMEL, t) % block != 0)             ? 2
                   : !sizes_fit(table, count, t, rule, master, moments, block) ? 3
                   : !step_valid(table, count, t)                       ? 4
                                                                        : 0;
    if (rc != 0) {
      delete[] fns;
      return rc;
    }
  }
  Args* args = new Args[count];
  int64_t* first = new int64_t[count + 1];  // first work item of each tensor
  // Items: kChunk elements, or as many whole int8 blocks as fit in kChunk.
  const int64_t per_item = int8 ? (kChunk / block > 0 ? kChunk / block : 1) : kChunk;
  first[0] = 0;
  for (int64_t t = 0; t < count; ++t) {
    if (fns[t] == nullptr) {  // skipped row: no work items
      args[t].n = 0;
      args[t].block = 1;
      first[t + 1] = first[t];
      continue;
    }
    double* const step_ptr = static_cast<double*>(ptr(C_STEP, t));
    const double step = *step_ptr + 1.0;
    *step_ptr = step;
    Args& a = args[t];
    a.param = ptr(C_PARAM, t);
    a.grad = ptr(C_GRAD, t);
    a.s0 = ptr(C_S0, t);
    a.s1 = ptr(C_S1, t);
    for (int k = 0; k < 8; ++k) a.mo[k] = ptr(C_MO0 + k, t);
    a.int4 = nullptr;
    rule_scalars(rule, hyper, step, a.scalars);
    a.n = col(C_NUMEL, t);
    a.block = int8 ? block : 1;
    const int64_t* const seed = static_cast<const int64_t*>(ptr(C_SEED, t));
    a.key = seed ? step_key(*seed, step) + static_cast<uint32_t>(col(C_OFFSET, t)) : 0u;
    a.grad_sign = maximize ? -1.0f : 1.0f;
    a.stream = stream != 0 && rule == R_ADAMW && master == M_FP32 && !int8;
    a.gdt = static_cast<int>(col(C_GDT, t));
    codec(master, static_cast<int>(col(C_PDT, t)), a.decode, a.encode);
    const int64_t units = int8 ? a.n / block : a.n;
    first[t + 1] = first[t] + (units + per_item - 1) / per_item;
  }
  if (moments == MO_INT4) {  // two passes over rows (int4_run)
    int64_t* rows = new int64_t[count];
    for (int64_t t = 0; t < count; ++t) rows[t] = col(C_MO3_NUMEL, t);
    const int squares = rule_slots(rule) > 1 ? rule_slots(rule) - 1 : 0;
    int4_run(args, rows, fns, int4_maxima_for(rule), squares, count, threads);
    delete[] rows;
    delete[] first;
    delete[] args;
    delete[] fns;
    return 0;
  }
  const int64_t total = first[count];
  int nthreads = threads < 1 ? 1 : threads;
  if (total < nthreads) nthreads = total < 1 ? 1 : static_cast<int>(total);
  // Each thread takes one contiguous run of items and walks the tensors it covers:
  // results do not depend on the thread count (every item is independent).
#pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t tid = 0, nt = 1;
#endif
    const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
    int64_t t = 0;
    while (t < count && first[t + 1] <= lo) ++t;
    for (int64_t item = lo; item < hi && t < count;) {
      const int64_t end = hi < first[t + 1] ? hi : first[t + 1];
      const Args& a = args[t];
      const int64_t units = int8 ? a.n / a.block : a.n;
      const int64_t u_lo = (item - first[t]) * per_item;
      int64_t u_hi = (end - first[t]) * per_item;
      u_hi = u_hi < units ? u_hi : units;
      if (u_lo < u_hi) fns[t](a, u_lo, u_hi);
      item = end;
      ++t;
    }
  }
  delete[] first;
  delete[] args;
  delete[] fns;
  return 0;
}

}  // extern "C"
