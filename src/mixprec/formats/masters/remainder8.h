// Master format `remainder8`: its per-element codec in the native CPU kernel, the C++ of
// remainder8.py's decode and encode (bitwise the same; tests/optim/test_native.py). A part
// of optim/native/step_cpu.cpp, included inside its namespace after its helpers
// (Args, load_p, fbits, f2bf, ...): not a standalone header.
template <>
struct MasterCodec<M_REM8> {
  template <int PDT>
  static float decode(const Args& a, int64_t i) {
    uint32_t hi = static_cast<uint32_t>(static_cast<const uint16_t*>(a.param)[i]) << 16;
    int32_t rem = static_cast<int32_t>(static_cast<const int8_t*>(a.s0)[i]) * 256;
    return bitsf(hi + static_cast<uint32_t>(rem));
  }
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) {
    uint32_t b = canon(fbits(value));
    uint32_t r = (b + 127u + ((b >> 8) & 1u)) & ~0xFFu;  // nearest even at 15 mantissa bits
    int32_t low = static_cast<int32_t>(((r >> 8) & 0xFFu) ^ 0x80u) - 0x80;
    uint32_t high = r - static_cast<uint32_t>(low * 256);
    static_cast<uint16_t*>(a.param)[i] = static_cast<uint16_t>(high >> 16);
    static_cast<int8_t*>(a.s0)[i] = static_cast<int8_t>(low);
  }
};
