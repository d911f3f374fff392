// Linear layers computed from GGUF-quantized weights (Q4_1, Q8_0) without a dense copy:
// y[M, N] = x[M, K] @ W^T in fp32. See engine/quant.py for when kvserve uses them.
//
// Decode streams every weight once per step, so its speed is set by weight bytes: Q4_1 is
// 0.625 bytes a weight against fp32's 4. Weights are expanded to fp32 in registers exactly as
// gguf dequantizes them (Q4_1: d * q + m, Q8_0: d * q, d an fp16 scale and q a small integer,
// so d * q is exact in fp32 and the values equal the dense checkpoint's bit for bit), then
// multiplied by the activations in fp32: the result differs from F.linear on the dequantized
// matrix only in summation order.
//
// Packed layout. gguf_pack regroups GGUF's rows of blocks into strips of 8 output columns:
// strip s, block b holds the 8 columns' scales (fp16) and then their codes k-major, so one
// 8-lane vector is "8 columns at one k". The kernel walks a strip once per group of up to 8
// rows: per k it expands one vector and feeds one FMA per row with x[row, k] broadcast; the
// accumulators are the outputs themselves. Same bytes as GGUF, no transposes at run time.
//   Q4_1 strip-block (160 bytes): d[8] fp16, m[8] fp16, then 8 groups of 16 bytes; in group
//        g, byte i holds column i % 8 at k = 4g + i / 8 (low nibble) and k = 4g + 2 + i / 8
//        (high nibble).
//   Q8_0 strip-block (272 bytes): d[8] fp16, then int8 codes, byte 8 k + c = column c at k.
// Columns past N in the last strip are zero.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSERVE_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block (along K), both formats
constexpr int64_t kStrip = 8;   // output columns per strip
constexpr int kMaxRows = 8;     // rows per pass over a strip

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

struct Q4_1 {
  static constexpr int64_t kGgufBytes = 20;   // half d, half m, 16 bytes of nibbles
  static constexpr int64_t kStripBytes = 160;
  // GGUF block: weight j is the low nibble of byte j, weight j + 16 its high nibble.
  static int gguf_code(const uint8_t* blk, int j) { return j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4; }
  static void pack(const uint8_t* const cols[kStrip], uint8_t* dst) {
    std::memset(dst, 0, kStripBytes);
    for (int c = 0; c < kStrip; ++c) {
      if (!cols[c]) continue;
      std::memcpy(dst + 2 * c, cols[c], 2);
      std::memcpy(dst + 16 + 2 * c, cols[c] + 2, 2);
      for (int k = 0; k < kBlock; ++k) {
        const int g = k / 4, r = k % 4, i = (r % 2) * 8 + c;
        dst[32 + 16 * g + i] |= gguf_code(cols[c], k) << (r < 2 ? 0 : 4);
      }
    }
  }
  // w[k][c] = the strip-block's weight at (k, column c), as gguf computes it: d * q + m.
  static void expand(const uint8_t* sb, float w[kBlock][kStrip]) {
    float d[kStrip], m[kStrip];
    for (int c = 0; c < kStrip; ++c) d[c] = half_at(sb + 2 * c), m[c] = half_at(sb + 16 + 2 * c);
    for (int k = 0; k < kBlock; ++k) {
      const uint8_t* q = sb + 32 + 16 * (k / 4) + (k % 2) * 8;
      for (int c = 0; c < kStrip; ++c) w[k][c] = d[c] * static_cast<float>(k % 4 < 2 ? q[c] & 15 : q[c] >> 4) + m[c];
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kGgufBytes = 34;  // half d, 32 int8 codes
  static constexpr int64_t kStripBytes = 272;
  static void pack(const uint8_t* const cols[kStrip], uint8_t* dst) {
    std::memset(dst, 0, kStripBytes);
    for (int c = 0; c < kStrip; ++c) {
      if (!cols[c]) continue;
      std::memcpy(dst + 2 * c, cols[c], 2);
      for (int k = 0; k < kBlock; ++k) dst[16 + 8 * k + c] = cols[c][2 + k];
    }
  }
  static void expand(const uint8_t* sb, float w[kBlock][kStrip]) {
    float d[kStrip];
    for (int c = 0; c < kStrip; ++c) d[c] = half_at(sb + 2 * c);
    for (int k = 0; k < kBlock; ++k)
      for (int c = 0; c < kStrip; ++c) w[k][c] = d[c] * static_cast<float>(static_cast<int8_t>(sb[16 + 8 * k + c]));
  }
};

// Portable path: each strip-block expanded to fp32 on the stack, then plain loops.
template <typename Format>
void linear_strips_portable(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1,
                            float* out, int64_t N) {
  const int64_t strip_bytes = K / kBlock * Format::kStripBytes;
  float wb[kBlock][kStrip];
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    for (int64_t r = 0; r < M; ++r) {
      float acc[kStrip] = {};
      for (int64_t b = 0; b < K / kBlock; ++b) {
        Format::expand(w + s * strip_bytes + b * Format::kStripBytes, wb);
        const float* xb = x + r * K + b * kBlock;
        for (int k = 0; k < kBlock; ++k)
          for (int c = 0; c < kStrip; ++c) acc[c] += xb[k] * wb[k][c];
      }
      std::copy(acc, acc + cols, out + r * N + s * kStrip);
    }
  }
}

#ifdef KVSERVE_X86
// The AVX2 path, compiled for AVX2 + FMA + F16C whatever -march says and taken only when
// the CPU running it has them (see has_avx2), so a generic build is fast on modern x86.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <typename Format>
struct Avx2;

// fn(k, w): w = the strip-block's 8 columns at k, for k = 0 .. 31 in order.
template <>
struct Avx2<Q4_1> {
  template <typename Fn>
  static inline void for_each_k(const uint8_t* sb, Fn&& fn) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));
    const __m128i mask = _mm_set1_epi8(15);
    for (int g = 0; g < 8; ++g) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * g));
      const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      fn(4 * g + 0, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m));
      fn(4 * g + 1, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m));
      fn(4 * g + 2, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m));
      fn(4 * g + 3, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m));
    }
  }
};

template <>
struct Avx2<Q8_0> {
  template <typename Fn>
  static inline void for_each_k(const uint8_t* sb, Fn&& fn) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
    for (int k = 0; k < kBlock; ++k) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 16 + 8 * k));
      fn(k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    }
  }
};

// Rows [0, R) of x against one strip: out[r * ldo + c] for c < cols. With few rows, each
// row keeps A accumulators (k rotates over them) so the FMA chains are independent enough
// to hide their latency.
template <typename Format, int R>
void strip_rows(const float* x, int64_t K, const uint8_t* strip, float* out, int64_t ldo, int64_t cols) {
  constexpr int A = R == 1 ? 4 : R <= 3 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    Avx2<Format>::for_each_k(strip + b * Format::kStripBytes, [&](int k, __m256 w) {
      for (int r = 0; r < R; ++r) acc[r][k % A] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + r * K + k), w, acc[r][k % A]);
    });
  }
  for (int r = 0; r < R; ++r) {
    __m256 s = acc[r][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
    if (cols == kStrip) {
      _mm256_storeu_ps(out + r * ldo, s);
    } else {
      alignas(32) float tmp[kStrip];
      _mm256_store_ps(tmp, s);
      std::copy(tmp, tmp + cols, out + r * ldo);
    }
  }
}

template <typename Format>
void linear_strips_avx2(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1,
                        float* out, int64_t N) {
  const int64_t strip_bytes = K / kBlock * Format::kStripBytes;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* strip = w + s * strip_bytes;
    const int64_t cols = std::min(kStrip, N - s * kStrip);
    for (int64_t r = 0; r < M; r += kMaxRows) {
      const float* xr = x + r * K;
      float* o = out + r * N + s * kStrip;
      switch (std::min<int64_t>(kMaxRows, M - r)) {
        case 8: strip_rows<Format, 8>(xr, K, strip, o, N, cols); break;
        case 7: strip_rows<Format, 7>(xr, K, strip, o, N, cols); break;
        case 6: strip_rows<Format, 6>(xr, K, strip, o, N, cols); break;
        case 5: strip_rows<Format, 5>(xr, K, strip, o, N, cols); break;
        case 4: strip_rows<Format, 4>(xr, K, strip, o, N, cols); break;
        case 3: strip_rows<Format, 3>(xr, K, strip, o, N, cols); break;
        case 2: strip_rows<Format, 2>(xr, K, strip, o, N, cols); break;
        default: strip_rows<Format, 1>(xr, K, strip, o, N, cols); break;
      }
    }
  }
}

#pragma GCC pop_options
#endif

bool has_avx2() {
#ifdef KVSERVE_X86
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && !std::getenv("KVSERVE_PORTABLE_KERNELS");
  return yes;
#else
  return false;
#endif
}

template <typename Format>
void linear_strips(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t s0, int64_t s1, float* out,
                   int64_t N) {
#ifdef KVSERVE_X86
  if (has_avx2()) return linear_strips_avx2<Format>(x, M, K, w, s0, s1, out, N);
#endif
  linear_strips_portable<Format>(x, M, K, w, s0, s1, out, N);
}

template <typename Fn>
auto with_format(int64_t format, Fn&& fn) {
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  return format == 0 ? fn(Q4_1{}) : fn(Q8_0{});
}

int64_t strip_row_bytes(int64_t K, int64_t format) {
  return with_format(format, [&](auto f) { return K / kBlock * decltype(f)::kStripBytes; });
}

void check_packed(const at::Tensor& packed, int64_t N, int64_t K, int64_t format) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed weights must be a contiguous 2-D uint8 tensor from gguf_pack");
  TORCH_CHECK(N >= 1 && K >= kBlock && K % kBlock == 0 && packed.size(0) == (N + kStrip - 1) / kStrip &&
                  packed.size(1) == strip_row_bytes(K, format),
              "packed weights do not hold ", N, " x ", K, " weights of this format");
}

// GGUF rows [N, K / 32 * gguf_block_bytes] uint8 -> packed strips [ceil(N / 8), K / 32 * strip_block_bytes].
at::Tensor gguf_pack(const at::Tensor& gguf, int64_t K, int64_t format) {
  return with_format(format, [&](auto f) {
    using Format = decltype(f);
    TORCH_CHECK(gguf.dim() == 2 && gguf.scalar_type() == at::kByte && gguf.is_contiguous(),
                "GGUF weights must be a contiguous 2-D uint8 tensor");
    TORCH_CHECK(K >= kBlock && K % kBlock == 0 && gguf.size(1) == K / kBlock * Format::kGgufBytes,
                "GGUF rows do not hold K / 32 blocks of this format");
    const int64_t N = gguf.size(0), blocks = K / kBlock, strips = (N + kStrip - 1) / kStrip;
    at::Tensor packed = at::empty({strips, blocks * Format::kStripBytes}, gguf.options());
    const uint8_t* src = gguf.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    for (int64_t s = 0; s < strips; ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* cols[kStrip];
        for (int64_t c = 0; c < kStrip; ++c) {
          const int64_t n = s * kStrip + c;
          cols[c] = n < N ? src + (n * blocks + b) * Format::kGgufBytes : nullptr;
        }
        Format::pack(cols, dst + (s * blocks + b) * Format::kStripBytes);
      }
    return packed;
  });
}

// packed strips -> [N, K] fp32: the values the kernel multiplies by.
at::Tensor gguf_unpack(const at::Tensor& packed, int64_t N, int64_t K, int64_t format) {
  check_packed(packed, N, K, format);
  return with_format(format, [&](auto f) {
    using Format = decltype(f);
    at::Tensor out = at::empty({N, K}, packed.options().dtype(at::kFloat));
    const uint8_t* src = packed.data_ptr<uint8_t>();
    float* o = out.data_ptr<float>();
    const int64_t blocks = K / kBlock;
    float wb[kBlock][kStrip];
    for (int64_t s = 0; s < packed.size(0); ++s)
      for (int64_t b = 0; b < blocks; ++b) {
        Format::expand(src + (s * blocks + b) * Format::kStripBytes, wb);
        for (int64_t c = 0; c < std::min(kStrip, N - s * kStrip); ++c)
          for (int k = 0; k < kBlock; ++k) o[(s * kStrip + c) * K + b * kBlock + k] = wb[k][c];
      }
    return out;
  });
}

// x [M, K] fp32, packed strips of an [N, K] matrix -> [M, N] fp32.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t format) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, N, K, format);
  const auto xc = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_format(format, [&](auto f) {
    using Format = decltype(f);
    at::parallel_for(0, packed.size(0), 1, [&](int64_t s0, int64_t s1) {
      linear_strips<Format>(xp, M, K, wp, s0, s1, op, N);
    });
    return 0;
  });
  return out;
}

// Which gguf_linear path this CPU runs: "avx2" or "portable" (a plain loop, several times
// slower than fp32 MKL; kvserve's auto backend does not pick the block kernel for it).
std::string gguf_kernel_isa() { return has_avx2() ? "avx2" : "portable"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("gguf_kernel_isa() -> str", &gguf_kernel_isa);
  m.def("gguf_pack(Tensor gguf, int in_features, int format) -> Tensor");
  m.def("gguf_unpack(Tensor packed, int out_features, int in_features, int format) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_unpack", &gguf_unpack);
  m.impl("gguf_linear", &gguf_linear);
}
