// Master format `kahan`: its per-element codec in the native CPU kernel, the C++ of
// kahan.py's decode and encode (bitwise the same; tests/optim/test_native.py). A part
// of optim/native/step_cpu.cpp, included inside its namespace after its helpers
// (Args, load_p, fbits, f2bf, ...): not a standalone header.
// (The kernel also has a 16-lane AVX-512 loop for this master with fp32 moments,
// kahan_fp32_avx512, which falls back to encode below for its rare lanes.)
template <>
struct MasterCodec<M_KAHAN> {
  template <int PDT>
  static float decode(const Args& a, int64_t i) {
    return bf2f(static_cast<const uint16_t*>(a.param)[i]) +
           bf2f(static_cast<const uint16_t*>(a.s0)[i]);
  }
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) {
    uint16_t p = f2bf(value);
    static_cast<uint16_t*>(a.param)[i] = p;
    static_cast<uint16_t*>(a.s0)[i] = f2bf(value - bf2f(p));
  }
};
