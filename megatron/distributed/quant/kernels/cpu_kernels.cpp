// Fused CPU kernels for the group-wise symmetric quantizer (SDP4Bit collectives).
//
// Numerics are those of reference.py (see its module docstring); this file reproduces its fp32
// operation sequence so that round-to-nearest results are bit-identical:
//   amax = max|x| per group (NaN treated as +inf, which gives the same NaN scale as torch's
//   NaN-propagating amax), inv = qmax / amax (one IEEE division), ok = 0 < inv < inf,
//   scale = ok ? 1 / inv : (amax < inf ? 0 : NaN), v = x * inv, q = floor(v) + (frac >= 0.5)
//   [stochastic: + (u < frac)], clamp to [-qmax-1, qmax], pack MSB-first.
// Sums over sources are fp32, in source order 0..S-1, starting from +0 (like the reference's
// ``acc = zeros; acc = acc + d[s]``). The Hadamard transform is the same butterfly (strides
// 1, 2, 4, ...; (a, b) -> (a + b, a - b)). Build with -ffp-contract=off: an FMA would change
// ``acc + code * scale``.
//
// Stochastic rounding: u = (hash(seed, element index) >> 8) * 2^-24, a counter-based hash of the
// *input* element index (quantize / quantize_partitions / quantize_difference) or of the output
// element index (dequantize_sum_requantize), so the result does not depend on the output layout
// or on how the work is split. The 64-bit seed is drawn by the Python wrapper from the caller's
// torch.Generator once per call.
//
// Plain C ABI (called through ctypes with raw pointers): no torch headers, so the one-time build
// takes a few seconds. Loops are written so that GCC vectorizes them (-O3).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------------------------------------
// dtypes (0 = float32, 1 = bfloat16, 2 = float16)
// ------------------------------------------------------------------------------------------------

inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_f32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// round-to-nearest-even, NaN -> 0x7FC0 (what c10::BFloat16(float) does)
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (f != f) ? static_cast<uint16_t>(0x7FC0) : r;
}

// IEEE half <-> float (exact; round-to-nearest-even on the way down). Scalar bit manipulation.
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
    return (sign ? -f : f);
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = bits_from_f32(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                               // subnormal half or 0
    // value * 2^24 rounded to nearest even integer = half mantissa
    float v = f32_from_bits(a) * 16777216.0f;                          // exact (power of two)
    float r = std::nearbyint(v);                                       // default mode: RNE
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  uint32_t m = a + 0xC8000FFFu + ((a >> 13) & 1u);                     // rebias exp (-112<<23), RNE
  return static_cast<uint16_t>(sign | (m >> 13));
}

template <int DT> struct Dt;
template <> struct Dt<0> {
  using T = float;
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline float round(float x) { return x; }
  static inline void store(float* p, int64_t i, float x) { p[i] = x; }
};
template <> struct Dt<1> {
  using T = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
  static inline float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
  static inline void store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
};
template <> struct Dt<2> {
  using T = uint16_t;
  static inline float load(const uint16_t* p, int64_t i) { return f16_to_f32(p[i]); }
  static inline float round(float x) { return f16_to_f32(f32_to_f16(x)); }
  static inline void store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_f16(x); }
};

inline bool nonfinite(float x) { return (bits_from_f32(x) & 0x7F800000u) == 0x7F800000u; }

// ------------------------------------------------------------------------------------------------
// counter-based RNG
// ------------------------------------------------------------------------------------------------

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t mix32(uint32_t h) {  // a bijective 32-bit finaliser (two multiply rounds)
  h ^= h >> 16; h *= 0x7FEB352Du;
  h ^= h >> 15; h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

// uniform in [0, 1) on a 2^-24 grid, from (key, 64-bit element index)
inline float uniform(uint32_t k0, uint32_t k1, uint64_t idx) {
  uint32_t h = mix32(static_cast<uint32_t>(idx) ^ k0);
  h = mix32(h ^ static_cast<uint32_t>(idx >> 32) ^ k1);
  return static_cast<float>(h >> 8) * 5.9604644775390625e-8f;
}

struct Rng { uint32_t k0, k1; };
inline Rng make_rng(uint64_t seed) {
  uint64_t s = splitmix64(seed);
  return Rng{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)};
}

// ------------------------------------------------------------------------------------------------
// Hadamard (in place on a buffer of whole blocks)
// ------------------------------------------------------------------------------------------------

#if defined(__GNUC__) && !defined(__clang__)
#define SDP4BIT_VEC8 1
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

// Stages h = 1, 2, 4 of every aligned 8-element chunk, in registers. Each stage computes exactly
// a + b and a - b (as a + (-b), which IEEE defines to be the same operation).
inline void fwht8_chunks(float* __restrict x, int64_t len) {
  const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1};
  const v8f s2 = {1, 1, -1, -1, 1, 1, -1, -1};
  const v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
  const v8i a1 = {0, 0, 2, 2, 4, 4, 6, 6}, b1 = {1, 1, 3, 3, 5, 5, 7, 7};
  const v8i a2 = {0, 1, 0, 1, 4, 5, 4, 5}, b2 = {2, 3, 2, 3, 6, 7, 6, 7};
  const v8i a4 = {0, 1, 2, 3, 0, 1, 2, 3}, b4 = {4, 5, 6, 7, 4, 5, 6, 7};
  for (int64_t b = 0; b < len; b += 8) {
    v8f v;
    std::memcpy(&v, x + b, 32);
    v = __builtin_shuffle(v, a1) + __builtin_shuffle(v, b1) * s1;
    v = __builtin_shuffle(v, a2) + __builtin_shuffle(v, b2) * s2;
    v = __builtin_shuffle(v, a4) + __builtin_shuffle(v, b4) * s4;
    std::memcpy(x + b, &v, 32);
  }
}
#endif

void fwht_blocks(float* __restrict x, int64_t len, int64_t hb) {
  int64_t h0 = 1;
#ifdef SDP4BIT_VEC8
  if (hb >= 8) {
    fwht8_chunks(x, len);
    h0 = 8;
  }
#endif
  if (h0 == 1) {
    if (hb >= 2) {
      for (int64_t b = 0; b < len; b += 2) {
        float a = x[b], c = x[b + 1];
        x[b] = a + c; x[b + 1] = a - c;
      }
    }
    if (hb >= 4) {
      for (int64_t b = 0; b < len; b += 4) {
        float a0 = x[b], a1 = x[b + 1], c0 = x[b + 2], c1 = x[b + 3];
        x[b] = a0 + c0; x[b + 1] = a1 + c1; x[b + 2] = a0 - c0; x[b + 3] = a1 - c1;
      }
    }
    if (hb >= 8) {
      for (int64_t b = 0; b < len; b += 8) {
        for (int k = 0; k < 4; ++k) {
          float a = x[b + k], c = x[b + 4 + k];
          x[b + k] = a + c; x[b + 4 + k] = a - c;
        }
      }
    }
  }
#ifdef SDP4BIT_VEC8
  if (hb >= 16) {  // stages h >= 8: whole 8-float vectors, a block pair at a time
    for (int64_t h = 8; h < hb; h <<= 1) {
      for (int64_t b = 0; b < len; b += 2 * h) {
        for (int64_t k = 0; k < h; k += 8) {
          v8f a, c;
          std::memcpy(&a, x + b + k, 32);
          std::memcpy(&c, x + b + h + k, 32);
          v8f s = a + c, d = a - c;
          std::memcpy(x + b + k, &s, 32);
          std::memcpy(x + b + h + k, &d, 32);
        }
      }
    }
    return;
  }
#endif
  for (int64_t h = 8; h < hb; h <<= 1) {
    for (int64_t b = 0; b < len; b += 2 * h) {
      float* __restrict lo = x + b;
      float* __restrict hi = x + b + h;
      for (int64_t k = 0; k < h; ++k) {
        float a = lo[k], c = hi[k];
        lo[k] = a + c; hi[k] = a - c;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// quantize one group held in fp32 in buf[0..gs) -> packed codes + scale
// ------------------------------------------------------------------------------------------------

template <int BITS>
inline void pack_codes(const int8_t* __restrict c, int64_t gs, uint8_t* __restrict out) {
  if (BITS == 8) {
    std::memcpy(out, c, static_cast<size_t>(gs));
  } else if (BITS == 4) {
    for (int64_t i = 0; i < gs / 2; ++i)
      out[i] = static_cast<uint8_t>((static_cast<uint8_t>(c[2 * i]) << 4) |
                                    (static_cast<uint8_t>(c[2 * i + 1]) & 0xFu));
  } else {
    for (int64_t i = 0; i < gs / 4; ++i)
      out[i] = static_cast<uint8_t>(((static_cast<uint8_t>(c[4 * i]) & 3u) << 6) |
                                    ((static_cast<uint8_t>(c[4 * i + 1]) & 3u) << 4) |
                                    ((static_cast<uint8_t>(c[4 * i + 2]) & 3u) << 2) |
                                    (static_cast<uint8_t>(c[4 * i + 3]) & 3u));
  }
}

template <int BITS, bool STOCH>
void quant_group(const float* __restrict buf, int64_t gs, uint64_t elem0, Rng rng,
                 int8_t* __restrict cbuf, uint8_t* __restrict codes_out, float* scale_out) {
  constexpr float QMAX = static_cast<float>((1 << (BITS - 1)) - 1);
  // max |x| on the bit patterns: for sign-cleared floats the uint32 order is the float order,
  // with Inf (0x7F800000) above every finite value and NaN above Inf; NaN then counts as Inf.
  uint32_t mb = 0;
  for (int64_t i = 0; i < gs; ++i) {
    uint32_t a = bits_from_f32(buf[i]) & 0x7FFFFFFFu;
    mb = a > mb ? a : mb;
  }
  const float amax = mb >= 0x7F800000u ? kInf : f32_from_bits(mb);

  const float inv = QMAX / amax;
  const bool ok = (inv < kInf) && (inv > 0.0f);
  if (!ok) {
    *scale_out = (amax < kInf) ? 0.0f : kNaN;
    std::memset(codes_out, 0, static_cast<size_t>(gs * BITS / 8));
    return;
  }
  *scale_out = 1.0f / inv;
  const uint32_t lo32 = static_cast<uint32_t>(elem0);
  const bool straddle = STOCH && (static_cast<uint64_t>(lo32) + static_cast<uint64_t>(gs) > (1ull << 32));
  const uint32_t hik = static_cast<uint32_t>(elem0 >> 32) ^ rng.k1;
  for (int64_t e = 0; e < gs; ++e) {
    float v = buf[e] * inv;
    float t = static_cast<float>(static_cast<int32_t>(v));  // trunc; |v| <= ~qmax here
    float lo = t > v ? t - 1.0f : t;                          // floor
    float frac = v - lo;
    float q;
    if (STOCH) {
      uint32_t h = mix32((lo32 + static_cast<uint32_t>(e)) ^ rng.k0);
      h = mix32(h ^ hik);
      float u = static_cast<float>(h >> 8) * 5.9604644775390625e-8f;
      q = lo + (u < frac ? 1.0f : 0.0f);
    } else {
      q = lo + (frac >= 0.5f ? 1.0f : 0.0f);
    }
    q = q < -QMAX - 1.0f ? -QMAX - 1.0f : q;
    q = q > QMAX ? QMAX : q;
    cbuf[e] = static_cast<int8_t>(static_cast<int32_t>(q));
  }
  if (straddle) {  // rare: the group crosses a 2^32 element boundary, redo it with 64-bit indices
    for (int64_t e = 0; e < gs; ++e) {
      float v = buf[e] * inv;
      float t = static_cast<float>(static_cast<int32_t>(v));
      float lo = t > v ? t - 1.0f : t;
      float frac = v - lo;
      float u = uniform(rng.k0, rng.k1, elem0 + static_cast<uint64_t>(e));
      float q = lo + (u < frac ? 1.0f : 0.0f);
      q = q < -QMAX - 1.0f ? -QMAX - 1.0f : q;
      q = q > QMAX ? QMAX : q;
      cbuf[e] = static_cast<int8_t>(static_cast<int32_t>(q));
    }
  }
  pack_codes<BITS>(cbuf, gs, codes_out);
}

using QuantFn = void (*)(const float*, int64_t, uint64_t, Rng, int8_t*, uint8_t*, float*);

QuantFn pick_quant(int bits, bool stoch) {
  if (bits == 8) return stoch ? quant_group<8, true> : quant_group<8, false>;
  if (bits == 4) return stoch ? quant_group<4, true> : quant_group<4, false>;
  return stoch ? quant_group<2, true> : quant_group<2, false>;
}

// ------------------------------------------------------------------------------------------------
// loaders: group of the input -> fp32 buffer, counting non-finite values
// ------------------------------------------------------------------------------------------------

template <int DX>
inline int64_t load_plain(const void* x, int64_t off, int64_t len, float* __restrict buf) {
  const auto* p = static_cast<const typename Dt<DX>::T*>(x) + off;
  int64_t bad = 0;
  for (int64_t i = 0; i < len; ++i) {
    float v = Dt<DX>::load(p, i);
    buf[i] = v;
    bad += nonfinite(v) ? 1 : 0;
  }
  return bad;
}

// reference.dtype(new) - reference, rounded to the reference dtype
template <int DN, int DR>
inline int64_t load_diff(const void* x, const void* r, int64_t off, int64_t len,
                         float* __restrict buf) {
  const auto* pn = static_cast<const typename Dt<DN>::T*>(x) + off;
  const auto* pr = static_cast<const typename Dt<DR>::T*>(r) + off;
  int64_t bad = 0;
  for (int64_t i = 0; i < len; ++i) {
    float nv = Dt<DR>::round(Dt<DN>::load(pn, i));
    float v = Dt<DR>::round(nv - Dt<DR>::load(pr, i));
    buf[i] = v;
    bad += nonfinite(v) ? 1 : 0;
  }
  return bad;
}

template <int DX>
int64_t count_nonfinite_t(const void* x, int64_t n) {
  const auto* p = static_cast<const typename Dt<DX>::T*>(x);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += nonfinite(Dt<DX>::load(p, i)) ? 1 : 0;
  return bad;
}

// ------------------------------------------------------------------------------------------------
// dequantization helpers
// ------------------------------------------------------------------------------------------------

// acc[j] (=|+=) code(start + j) * scale, for j in [0, len); start and len are multiples of the
// codes per byte (groups occupy whole bytes, tiles are multiples of 8 elements).
template <int BITS, bool ADD>
inline void decode_seg(const uint8_t* __restrict codes, float s, int64_t start, int64_t len,
                       float* __restrict acc) {
  if (BITS == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes) + start;
    for (int64_t j = 0; j < len; ++j) {
      float d = static_cast<float>(c[j]) * s;
      acc[j] = ADD ? acc[j] + d : d;
    }
  } else if (BITS == 4) {
    const uint8_t* c = codes + start / 2;
    for (int64_t k = 0; k < len / 2; ++k) {
      const uint8_t u = c[k];
      float d0 = static_cast<float>(static_cast<int8_t>(u) >> 4) * s;
      float d1 = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(u << 4)) >> 4) * s;
      acc[2 * k] = ADD ? acc[2 * k] + d0 : d0;
      acc[2 * k + 1] = ADD ? acc[2 * k + 1] + d1 : d1;
    }
  } else {
    const uint8_t* c = codes + start / 4;
    for (int64_t k = 0; k < len / 4; ++k) {
      const uint8_t u = c[k];
      float d0 = static_cast<float>(static_cast<int8_t>(u) >> 6) * s;
      float d1 = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(u << 2)) >> 6) * s;
      float d2 = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(u << 4)) >> 6) * s;
      float d3 = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(u << 6)) >> 6) * s;
      acc[4 * k] = ADD ? acc[4 * k] + d0 : d0;
      acc[4 * k + 1] = ADD ? acc[4 * k + 1] + d1 : d1;
      acc[4 * k + 2] = ADD ? acc[4 * k + 2] + d2 : d2;
      acc[4 * k + 3] = ADD ? acc[4 * k + 3] + d3 : d3;
    }
  }
}

// element range [start, start+len) of a packed tensor, walking its groups
template <int BITS, bool ADD>
inline void decode_range(const uint8_t* codes, const float* scales, int64_t gs, int64_t start,
                         int64_t len, float* acc) {
  int64_t p = start, end = start + len;
  while (p < end) {
    int64_t g = p / gs;
    int64_t e = (g + 1) * gs;
    if (e > end) e = end;
    decode_seg<BITS, ADD>(codes, scales[g], p, e - p, acc + (p - start));
    p = e;
  }
}

template <bool ADD>
inline void decode_any(int bits, const uint8_t* codes, const float* scales, int64_t gs,
                       int64_t start, int64_t len, float* acc) {
  if (bits == 8) decode_range<8, ADD>(codes, scales, gs, start, len, acc);
  else if (bits == 4) decode_range<4, ADD>(codes, scales, gs, start, len, acc);
  else decode_range<2, ADD>(codes, scales, gs, start, len, acc);
}

// 0 + d0 + d1 + ... in fp32, source order (the reference's accumulation)
inline void sum_sources(int bits, const uint8_t* codes, const float* scales, int64_t gs, int64_t n,
                        int64_t num_sources, int64_t start, int64_t len, float* acc) {
  for (int64_t j = 0; j < len; ++j) acc[j] = 0.0f;
  for (int64_t s = 0; s < num_sources; ++s)
    decode_any<true>(bits, codes, scales, gs, s * n + start, len, acc);
}

inline int64_t tile_len(int64_t hb) {
  int64_t t = 4096;
  return hb > t ? hb : t;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// C ABI
// ------------------------------------------------------------------------------------------------

extern "C" {

int sdp4bit_cpu_abi_version() { return 3; }

// Quantize numel elements of x (dtype dx; with r != nullptr: reference.dtype(x) - r, r of dtype
// dr) in groups of gs. hb > 1: Hadamard on aligned blocks of hb first. slot_of != nullptr:
// partition p (groups_per_part groups each) is written to output slot slot_of[p].
// Returns the number of non-finite values in the (difference) input if check != 0, else 0.
int64_t sdp4bit_quantize(const void* x, int dx, const void* r, int dr, int64_t numel, int bits,
                         int64_t gs, int stochastic, uint64_t seed, int64_t hb,
                         const int64_t* slot_of, int64_t groups_per_part, int check,
                         uint8_t* codes, float* scales) {
  if (numel <= 0) return 0;
  const int64_t ng = numel / gs;
  const int64_t bpg = gs * bits / 8;
  const Rng rng = make_rng(seed);
  const QuantFn qf = pick_quant(bits, stochastic != 0);
  std::vector<float> buf(static_cast<size_t>(gs));
  std::vector<int8_t> cbuf(static_cast<size_t>(gs));
  int64_t bad = 0;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t off = g * gs;
    int64_t b;
    if (r == nullptr) {
      if (dx == 0) b = load_plain<0>(x, off, gs, buf.data());
      else if (dx == 1) b = load_plain<1>(x, off, gs, buf.data());
      else b = load_plain<2>(x, off, gs, buf.data());
    } else {
      const int k = dx * 3 + dr;
      switch (k) {
        case 0: b = load_diff<0, 0>(x, r, off, gs, buf.data()); break;
        case 1: b = load_diff<0, 1>(x, r, off, gs, buf.data()); break;
        case 2: b = load_diff<0, 2>(x, r, off, gs, buf.data()); break;
        case 3: b = load_diff<1, 0>(x, r, off, gs, buf.data()); break;
        case 4: b = load_diff<1, 1>(x, r, off, gs, buf.data()); break;
        case 5: b = load_diff<1, 2>(x, r, off, gs, buf.data()); break;
        case 6: b = load_diff<2, 0>(x, r, off, gs, buf.data()); break;
        case 7: b = load_diff<2, 1>(x, r, off, gs, buf.data()); break;
        default: b = load_diff<2, 2>(x, r, off, gs, buf.data()); break;
      }
    }
    bad += b;
    if (hb > 1) fwht_blocks(buf.data(), gs, hb);
    int64_t og = g;
    if (slot_of != nullptr) og = slot_of[g / groups_per_part] * groups_per_part + g % groups_per_part;
    qf(buf.data(), gs, static_cast<uint64_t>(off), rng, cbuf.data(), codes + og * bpg, scales + og);
  }
  return check ? bad : 0;
}

// Middle hop: sum the num_sources chunks of n elements (codes_in/scales_in, bits_in, gs_in) in fp32
// and requantize to bits_out with gs_out (random stream indexed by the output element index).
// Noise index map (a pipeline chunk of a larger call): output element i draws the noise of element
// (i / part_len) * part_stride + base + i % part_len of the whole call; part_len = n, base = 0 is
// the identity. part_len is a multiple of gs_out, so a group never straddles two parts.
void sdp4bit_dsum_requant(const uint8_t* codes_in, const float* scales_in, int bits_in,
                          int64_t gs_in, int64_t n, int64_t num_sources, int bits_out,
                          int64_t gs_out, int stochastic, uint64_t seed, int64_t part_len,
                          int64_t part_stride, int64_t base, uint8_t* codes, float* scales) {
  if (n <= 0) return;
  const int64_t ng = n / gs_out;
  const int64_t bpg = gs_out * bits_out / 8;
  const Rng rng = make_rng(seed);
  const QuantFn qf = pick_quant(bits_out, stochastic != 0);
  std::vector<float> buf(static_cast<size_t>(gs_out));
  std::vector<int8_t> cbuf(static_cast<size_t>(gs_out));
  for (int64_t g = 0; g < ng; ++g) {
    sum_sources(bits_in, codes_in, scales_in, gs_in, n, num_sources, g * gs_out, gs_out, buf.data());
    const int64_t off = g * gs_out;
    const int64_t noise_off = (off / part_len) * part_stride + base + off % part_len;
    qf(buf.data(), gs_out, static_cast<uint64_t>(noise_off), rng, cbuf.data(), codes + g * bpg,
       scales + g);
  }
}

// Final hop / dequantize: out = [inverse Hadamard](sum of num_sources chunks) [* scale], written
// as fp32 (dout 0) or bf16 (dout 1) to a contiguous buffer. assign_first != 0 (dequantize with
// one source): out = code * scale without the 0 + (identical except for -0).
void sdp4bit_dsum(const uint8_t* codes, const float* scales, int bits, int64_t gs, int64_t n,
                  int64_t num_sources, int64_t hb, int has_scale, float scale, int assign_first,
                  void* out, int dout) {
  if (n <= 0) return;
  const int64_t tl = tile_len(hb);
  std::vector<float> buf(static_cast<size_t>(tl));
  const float inv_hb = hb > 1 ? 1.0f / static_cast<float>(hb) : 1.0f;
  for (int64_t t0 = 0; t0 < n; t0 += tl) {
    const int64_t len = (n - t0) < tl ? (n - t0) : tl;
    float* a = buf.data();
    if (assign_first && num_sources == 1) decode_any<false>(bits, codes, scales, gs, t0, len, a);
    else sum_sources(bits, codes, scales, gs, n, num_sources, t0, len, a);
    if (hb > 1) {
      fwht_blocks(a, len, hb);
      for (int64_t j = 0; j < len; ++j) a[j] = a[j] * inv_hb;
    }
    if (has_scale)
      for (int64_t j = 0; j < len; ++j) a[j] = a[j] * scale;
    if (dout == 0) {
      std::memcpy(static_cast<float*>(out) + t0, a, static_cast<size_t>(len) * 4);
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + t0;
      for (int64_t j = 0; j < len; ++j) o[j] = f32_to_bf16(a[j]);
    }
  }
}

// LoCo's first-hop residual in one call: out (fp32, the input layout of n elements in partitions
// of part_len) = [sub -] [inverse Hadamard](code * scale) of the slot that holds each partition
// (partition p is slot slot_of[p], as sdp4bit_quantize wrote it). Per element what sdp4bit_dsum
// with one source and assign_first computes for that slot, then one fp32 subtraction: bit-identical
// to dequantizing slot by slot and subtracting. part_len is a multiple of gs and hb, so tiles taken
// inside a partition hold whole Hadamard blocks. out may be sub itself (read before written).
void sdp4bit_dequant_parts(const uint8_t* codes, const float* scales, int bits, int64_t gs,
                           int64_t n, const int64_t* slot_of, int64_t part_len, int64_t hb,
                           const float* sub, float* out) {
  if (n <= 0 || part_len <= 0) return;
  const int64_t tl = tile_len(hb);
  std::vector<float> buf(static_cast<size_t>(tl));
  const float inv_hb = hb > 1 ? 1.0f / static_cast<float>(hb) : 1.0f;
  const int64_t parts = n / part_len;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t src0 = slot_of[p] * part_len, dst0 = p * part_len;
    for (int64_t t0 = 0; t0 < part_len; t0 += tl) {
      const int64_t len = (part_len - t0) < tl ? (part_len - t0) : tl;
      float* a = buf.data();
      decode_any<false>(bits, codes, scales, gs, src0 + t0, len, a);
      if (hb > 1) {
        fwht_blocks(a, len, hb);
        for (int64_t j = 0; j < len; ++j) a[j] = a[j] * inv_hb;
      }
      float* o = out + dst0 + t0;
      if (sub != nullptr) {
        const float* h = sub + dst0 + t0;
        for (int64_t j = 0; j < len; ++j) o[j] = h[j] - a[j];
      } else {
        std::memcpy(o, a, static_cast<size_t>(len) * 4);
      }
    }
  }
}

// qWD receive side: out = dt(dt(code * scale) + ref), dt = the reference dtype dr (out may alias ref)
void sdp4bit_dequant_add(const uint8_t* codes, const float* scales, int bits, int64_t gs,
                         int64_t n, const void* ref, int dr, void* out) {
  if (n <= 0) return;
  const int64_t tl = 4096;
  std::vector<float> buf(static_cast<size_t>(tl));
  for (int64_t t0 = 0; t0 < n; t0 += tl) {
    const int64_t len = (n - t0) < tl ? (n - t0) : tl;
    float* a = buf.data();
    decode_any<false>(bits, codes, scales, gs, t0, len, a);
    if (dr == 0) {
      const float* pr = static_cast<const float*>(ref) + t0;
      float* po = static_cast<float*>(out) + t0;
      for (int64_t j = 0; j < len; ++j) po[j] = a[j] + pr[j];
    } else if (dr == 1) {
      const uint16_t* pr = static_cast<const uint16_t*>(ref) + t0;
      uint16_t* po = static_cast<uint16_t*>(out) + t0;
      for (int64_t j = 0; j < len; ++j)
        po[j] = f32_to_bf16(Dt<1>::round(a[j]) + bf16_to_f32(pr[j]));
    } else {
      const uint16_t* pr = static_cast<const uint16_t*>(ref) + t0;
      uint16_t* po = static_cast<uint16_t*>(out) + t0;
      for (int64_t j = 0; j < len; ++j)
        po[j] = f32_to_f16(Dt<2>::round(a[j]) + f16_to_f32(pr[j]));
    }
  }
}

int64_t sdp4bit_count_nonfinite(const void* x, int dx, int64_t n) {
  if (n <= 0) return 0;
  if (dx == 0) return count_nonfinite_t<0>(x, n);
  if (dx == 1) return count_nonfinite_t<1>(x, n);
  return count_nonfinite_t<2>(x, n);
}

}  // extern "C"
