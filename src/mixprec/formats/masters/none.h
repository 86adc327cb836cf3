// Master format `none`: its per-element codec in the native CPU kernel, the C++ of
// none.py's decode and encode (bitwise the same; tests/optim/test_native.py). A part
// of optim/native/step_cpu.cpp, included inside its namespace after its helpers
// (Args, load_p, fbits, f2bf, ...): not a standalone header.
template <>
struct MasterCodec<M_NONE> {
  template <int PDT>
  static float decode(const Args& a, int64_t i) { return load_p<PDT>(a.param, i); }
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) { store_p<PDT>(a.param, i, value); }
};
