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
  // Rounded to nearest even at 15 mantissa bits, r = (b + 127 + ((b >> 8) & 1)) & ~0xFF,
  // then split as split_float does: the signed low byte low = int8((r >> 8) & 0xFF) and
  // high = r - low * 256, whose top half is ((r + 0x8000) >> 16) (subtracting a negative
  // low carries one into it). The mask is left out: the byte it clears never carries
  // into bit 8, so neither result changes. Five integer operations fewer an element.
  template <int PDT>
  static void encode(const Args& a, int64_t i, float value) {
    const uint32_t b = canon(fbits(value));
    const uint32_t r = b + ((b >> 8) & 1u);
    static_cast<uint16_t*>(a.param)[i] = static_cast<uint16_t>((r + 0x807Fu) >> 16);
    static_cast<int8_t*>(a.s0)[i] = static_cast<int8_t>((r + 127u) >> 8);
  }
};
