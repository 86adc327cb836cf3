// Master format `fp32`: its per-element codec in the native CPU kernel, the C++ of
// fp32.py's decode and encode (bitwise the same; tests/optim/test_native.py). A part
// of optim/native/step_cpu.cpp, included inside its namespace after its helpers
// (Args, load_p, fbits, f2bf, ...): not a standalone header.
template <>
struct MasterCodec<M_FP32> {
  template <int PDT>
  static float decode(const Args& a, int64_t i) { return static_cast<const float*>(a.s0)[i]; }
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) {
    static_cast<uint16_t*>(a.param)[i] = f2bf(value);
    static_cast<float*>(a.s0)[i] = value;
  }
};
