// mixprec native CPU AdamW step: one pass over memory per step.
//
// Built and loaded by mixprec.optim.native (g++ -O3 -march=native -fopenmp,
// no fast-math, no FMA contraction). Every operation mirrors the eager
// PyTorch formulation in mixprec.optim (functional.adamw_math, bits,
// masters/*, moments/*) so results are bitwise identical to it for finite
// values (tests/optim/test_native.py checks every family; NaN payloads, and
// int8 codes computed from NaN moments, may differ: callers never apply a
// non-finite step). Plain C++ that GCC vectorizes, with two intrinsic paths
// behind guards so it builds on any CPU the compiler targets: the streaming
// store of the fp32 master's bf16 parameter (stream_lines: __AVX512F__ /
// __AVX__ / __SSE2__, else memcpy) and the Kahan master's loop with fp32
// moments (kahan_fp32_avx512: __AVX512F__ and __AVX512BF16__, else the generic
// loop).
//
// Layout of the pointers (see mixprec/optim/native/binding.py):
//   master state s0, s1: fp32 master | exact: remainder_hi, remainder_lo (int8)
//                        | remainder8: remainder (int8) | kahan: compensation
//   moments mo0..mo3:    dense: exp_avg, exp_avg_sq (fp32 or bf16)
//                        | int8: m codes (int8), m absmax (f32), v codes (uint8), sqrt(v) max (f32)
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
  MO_FP32 = MIXPREC_MOMENTS_FP32, MO_BF16 = MIXPREC_MOMENTS_BF16, MO_INT8 = MIXPREC_MOMENTS_INT8
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

// One tensor of a multi-tensor step: its pointers, its per-step scalars and key.
struct Args {
  void* param; const void* grad;
  void* s0; void* s1;
  void* mo0; void* mo1; void* mo2; void* mo3;
  float scalars[7];
  int64_t n; int64_t block; uint32_t key; float grad_sign; bool stream;
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
      m = static_cast<const float*>(a.mo0)[i];
      v = static_cast<const float*>(a.mo1)[i];
    } else {
      m = bf2f(static_cast<const uint16_t*>(a.mo0)[i]);
      v = bf2f(static_cast<const uint16_t*>(a.mo1)[i]);
    }
    k.apply(p, g, m, v, u);
    if constexpr (TO_BUF) {
      buf[i - lo] = f2bf(p);
      static_cast<float*>(a.s0)[i] = p;
    } else {
      encode_master<MASTER, PDT>(a, i, p);
    }
    if constexpr (MO == MO_FP32) {
      static_cast<float*>(a.mo0)[i] = m;
      static_cast<float*>(a.mo1)[i] = v;
    } else {
      static_cast<uint16_t*>(a.mo0)[i] = f2bf(m);
      static_cast<uint16_t*>(a.mo1)[i] = f2bf(v);
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
// bf2f of 16 lanes.
inline __m512 bf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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
  float* const m_ptr = static_cast<float*>(a.mo0);
  float* const v_ptr = static_cast<float*>(a.mo1);
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

// moments/int8.py: m as 127*sqrt(|m|/absmax) with sign, v through u = sqrt(v)
// as 255*sqrt(u/umax); decode, update and re-encode one block at a time.
template <int MASTER, int PDT, int GDT>
void int8_range(const Args& args, int64_t block_lo, int64_t block_hi) {
  const Args a = args;  // a private copy: stores through the data pointers cannot alias it
  const Math k(a.scalars);
  const int64_t bs = a.block;
  int8_t* const mq = static_cast<int8_t*>(a.mo0);
  float* const mmax = static_cast<float*>(a.mo1);
  uint8_t* const vq = static_cast<uint8_t*>(a.mo2);
  float* const umax = static_cast<float*>(a.mo3);
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
#pragma GCC ivdep
    for (int64_t j = 0; j < bs; ++j) {
      const float q = static_cast<float>(mq[base + j]);
      mloc[j] = (q * std::fabs(q)) * ms;
      const float qv = static_cast<float>(vq[base + j]);
      const float ub = (qv * qv) * us;
      uloc[j] = ub * ub;
    }
    uint32_t mbits = 0, ubits = 0;
#pragma GCC ivdep
    for (int64_t j = 0; j < bs; ++j) {
      const int64_t i = base + j;
      float p = decode_master<MASTER, PDT>(a, i);
      float g = load_p<GDT>(a.grad, i) * a.grad_sign;
      float m = mloc[j];
      float v = uloc[j];
      float u;
      k.apply(p, g, m, v, u);
      encode_master<MASTER, PDT>(a, i, p);
      u = u > kUMax ? kUMax : u;  // moments/int8.py U_MAX (NaN stays NaN)
      mloc[j] = m;
      uloc[j] = u;
      uint32_t mb = fbits(m) & 0x7FFFFFFFu;
      uint32_t vb = fbits(u) & 0x7FFFFFFFu;
      mbits = mb > mbits ? mb : mbits;
      ubits = vb > ubits ? vb : ubits;
    }
    const float am = bitsf(mbits);
    const float au = bitsf(ubits);
    const float mf = (1.0f / (am > 0.0f ? am : 1.0f)) * (127.0f * 127.0f);
    const float uf = (1.0f / (au > 0.0f ? au : 1.0f)) * (255.0f * 255.0f);
#pragma GCC ivdep
    for (int64_t j = 0; j < bs; ++j) {
      const float m = mloc[j];
      const float u = uloc[j];
      float q = std::rint(std::sqrt(std::fabs(m) * mf));
      mq[base + j] = static_cast<int8_t>(static_cast<int32_t>(m < 0.0f ? -q : q));
      float qv = std::rint(std::sqrt(u * uf));
      qv = (qv == 0.0f && u > 0.0f) ? 1.0f : qv;
      vq[base + j] = static_cast<uint8_t>(static_cast<int32_t>(qv));
    }
    mmax[b] = am;
    umax[b] = au;
  }
}

// Runs items [lo, hi) of one tensor: chunks of kChunk elements (dense moments) or
// runs of int8 blocks.
using RangeFn = void (*)(const Args&, int64_t, int64_t);

template <int MASTER, int PDT, int MO, int GDT>
constexpr RangeFn pick() {
  if constexpr (MO == MO_INT8) return &int8_range<MASTER, PDT, GDT>;
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
    default: return nullptr;
  }
}

RangeFn lookup(int master, int pdt, int mo, int gdt) {
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

// rng.step_key: a per-(parameter, step) key from the parameter's seed and step count.
inline uint32_t step_key(int64_t seed, double step) {
  const uint32_t t = static_cast<uint32_t>(static_cast<int64_t>(step));
  return mix32(mix32(t) + static_cast<uint32_t>(seed));
}

}  // namespace

// Whether this build has a case for the master and moment codes (the binding asks
// before sending a format: one registered later with a code of its own has none).
extern "C" int mixprec_covers(int master, int moments) {
  return lookup(master, DT_BF16, moments, DT_BF16) != nullptr;
}

extern "C" {

// ABI version: bump with any change of the signature below.
int mixprec_abi_version() { return 8; }

// The columns of the table (native/binding.py TABLE_COLUMNS), count entries each.
enum Column {
  C_PDT = 0, C_GDT, C_NUMEL, C_OFFSET, C_PARAM, C_GRAD, C_S0, C_S1,
  C_MO0, C_MO1, C_MO2, C_MO3, C_STEP, C_SEED,
  C_S0_NUMEL, C_S1_NUMEL, C_MO0_NUMEL, C_MO1_NUMEL, C_MO2_NUMEL, C_MO3_NUMEL, C_GRAD_NUMEL,
  C_COLUMNS
};

// Whether tensor t's step counter is a count: finite, whole and not negative.
inline bool step_valid(const int64_t* table, int64_t count, int64_t t) {
  const double step = *reinterpret_cast<const double*>(table[C_STEP * count + t]);
  return std::isfinite(step) && step >= 0.0 && step == std::floor(step);
}

// How many of the state columns s0, s1 (master) and mo0..mo3 (moments) a format uses.
inline int master_slots(int master) {
  return master == M_EXACT ? 2 : (master == M_FP32 || master == M_REM8 || master == M_KAHAN) ? 1 : 0;
}
inline int moment_slots(int moments) { return moments == MO_INT8 ? 4 : 2; }

// Whether tensor t's gradient and state fit its parameter: each state tensor the formats
// use has its parameter's element count (int8 scales: one value per block) and, when that
// is not 0, memory (a tensor emptied in place by `set_()` has a null pointer and no
// elements). Checked before any write.
inline bool sizes_fit(const int64_t* table, int64_t count, int64_t t, int master, int moments,
                      int64_t block) {
  auto col = [&](int c) { return table[c * count + t]; };
  const int64_t n = col(C_NUMEL);
  const bool int8 = moments == MO_INT8;
  if (col(C_GRAD_NUMEL) != n) return false;
  if (n > 0 && (col(C_PARAM) == 0 || col(C_GRAD) == 0)) return false;
  for (int k = 0; k < 6; ++k) {
    const bool used = k < 2 ? k < master_slots(master) : k - 2 < moment_slots(moments);
    if (!used) continue;  // the formats use no such tensor
    const int ptr_col = C_S0 + k;
    const bool per_block = int8 && (ptr_col == C_MO1 || ptr_col == C_MO3);  // int8 scales
    const int64_t expected = per_block ? n / block : n;
    if (col(C_S0_NUMEL + k) != expected || (expected > 0 && col(ptr_col) == 0)) return false;
  }
  return true;
}

// One AdamW step over `count` tensors of one family (master and moment formats).
//
// table[c * count + t] holds column c of tensor t: parameter and gradient dtypes
// (DType), element count, the global offset of its first element (a shard's
// position in the whole parameter), data pointers (0 where the formats use no
// such tensor), its float64 step counter (incremented here) and its int64
// rounding seed (stochastic master only). The per-step scalars are computed
// from the step count exactly as functional.adamw_scalars computes them
// (float64, then rounded to fp32). hyper: lr, beta1, beta2, eps, weight_decay.
//
// stream != 0 (fp32 master, dense moments; the caller decides from the group's
// size, native/binding.py STREAM_MIN_BYTES): the bf16 parameters are written
// with non-temporal stores, which skip the read for ownership of a plain store
// and leave the lines out of the cache.
//
// A row whose gradient pointer is 0 (a parameter without a gradient this step) is
// skipped: neither it nor its step counter is touched.
//
// Everything is checked before anything is written. Returns 0: done; 1: a
// combination this source does not build; 2: a bad block size; 3: a state
// tensor whose size does not fit its parameter; 4: a step counter that is not a
// count (negative, fractional, NaN or infinite); 5: a hyperparameter out of range
// (lr, weight_decay finite >= 0; betas in [0, 1); eps finite > 0).
int mixprec_adamw_multi(int master, int moments, int maximize, int64_t count,
                        const int64_t* table, const double* hyper, int64_t block, int threads,
                        int stream) {
  if (count <= 0) return 0;
  auto col = [&](int c, int64_t t) { return table[c * count + t]; };
  auto ptr = [&](int c, int64_t t) { return reinterpret_cast<void*>(col(c, t)); };
  const bool int8 = moments == MO_INT8;
  if (int8 && (block < 1 || block > kMaxBlock)) return 2;
  {
    const double lr = hyper[0], b1 = hyper[1], b2 = hyper[2], eps = hyper[3], wd = hyper[4];
    if (!(lr >= 0.0 && std::isfinite(lr) && b1 >= 0.0 && b1 < 1.0 && b2 >= 0.0 && b2 < 1.0 &&
          eps > 0.0 && std::isfinite(eps) && wd >= 0.0 && std::isfinite(wd)))
      return 5;
  }
  RangeFn* fns = new RangeFn[count];
  for (int64_t t = 0; t < count; ++t) {
    if (col(C_GRAD, t) == 0 && col(C_NUMEL, t) > 0) {  // no gradient this step: skipped
      fns[t] = nullptr;
      continue;
    }
    fns[t] = lookup(master, static_cast<int>(col(C_PDT, t)), moments,
                    static_cast<int>(col(C_GDT, t)));
    const int rc = fns[t] == nullptr                            ? 1
                   : (int8 && col(C_NUMEL, t) % block != 0)       ? 2
                   : !sizes_fit(table, count, t, master, moments, block) ? 3
                   : !step_valid(table, count, t)                 ? 4
                                                                  : 0;
    if (rc != 0) {
      delete[] fns;
      return rc;
    }
  }
  const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], wd = hyper[4];
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
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double bc2 = 1.0 - std::pow(beta2, step);
    Args& a = args[t];
    a.param = ptr(C_PARAM, t);
    a.grad = ptr(C_GRAD, t);
    a.s0 = ptr(C_S0, t);
    a.s1 = ptr(C_S1, t);
    a.mo0 = ptr(C_MO0, t);
    a.mo1 = ptr(C_MO1, t);
    a.mo2 = ptr(C_MO2, t);
    a.mo3 = ptr(C_MO3, t);
    a.scalars[0] = static_cast<float>(1.0 - lr * wd);
    a.scalars[1] = static_cast<float>(1.0 - beta1);
    a.scalars[2] = static_cast<float>(beta2);
    a.scalars[3] = static_cast<float>(1.0 - beta2);
    a.scalars[4] = static_cast<float>(-lr / bc1);
    a.scalars[5] = static_cast<float>(1.0 / std::sqrt(bc2));
    a.scalars[6] = static_cast<float>(eps);
    a.n = col(C_NUMEL, t);
    a.block = int8 ? block : 1;
    const int64_t* const seed = static_cast<const int64_t*>(ptr(C_SEED, t));
    a.key = seed ? step_key(*seed, step) + static_cast<uint32_t>(col(C_OFFSET, t)) : 0u;
    a.grad_sign = maximize ? -1.0f : 1.0f;
    a.stream = stream != 0 && master == M_FP32 && !int8;
    const int64_t units = int8 ? a.n / block : a.n;
    first[t + 1] = first[t] + (units + per_item - 1) / per_item;
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
