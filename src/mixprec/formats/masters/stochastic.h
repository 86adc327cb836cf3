// Master format `stochastic`: its per-element codec in the native CPU kernel, the C++ of
// stochastic.py's decode and encode (bitwise the same; tests/optim/test_native.py). A part
// of optim/native/step_cpu.cpp, included inside its namespace after its helpers
// (Args, load_p, fbits, f2bf, ...): not a standalone header.
template <>
struct MasterCodec<M_STOCH> {
  template <int PDT>
  static float decode(const Args& a, int64_t i) { return load_p<PDT>(a.param, i); }
  // stochastic_round with the noise of optim/rng.py uniform16 at i + key.
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) {
    uint32_t noise = mix32(static_cast<uint32_t>(i) + a.key) >> 16;
    uint32_t r = (canon(fbits(value)) + noise) & 0xFFFF0000u;
    static_cast<uint16_t*>(a.param)[i] = static_cast<uint16_t>(r >> 16);
  }
};
