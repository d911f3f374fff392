// The block matmul of quant_linear.cpp as a plain function, for other kernels of the library
// (decode_layer.cpp) that split the output features over their own threads; and the int8
// activation matmul of quant_linear_q8.cpp (ModelConfig.activation_quant "int8").
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve {

// Output features [n0, n1) of y[M, N] = x[M, K] @ W^T, W one packed matrix of `format` (the
// codes of engine/quant.py BlockFormat, as gguf_linear takes it): feature n of row r goes to
// out[r * ldo + n - n0], computed on the calling thread. For the strip formats (Q4_1, Q8_0) n0 must be a multiple of 8 and n1
// a multiple of 8 or N.
void gguf_linear_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t format,
                       int64_t n0, int64_t n1, float* out, int64_t ldo);

// Rows of activations quantized to int8 in blocks of 32 along K, as llama.cpp's Q8_0/Q8_1 do:
// block b of row r has the fp32 scale d = max|x| / 127, codes q = round-half-even(x * (1 / d))
// in [-127, 127] (all 0 when the block is 0), and s = d * sum(q) (the block sum the offset
// formats need). The value the kernels multiply by is d * q. The codes are held in the two
// layouts the kernels read (see quant_linear_q8.cpp): int8 `q8` (Q4_1, the K-quants), int16 `q16`
// (Q8_0 on AVX2) and offset `u8` (Q8_0 on AVX512-VNNI).
struct Q8Act {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q8;    // [M, K] the codes
  std::vector<uint8_t> u8;   // [M, K] the codes + 128 (AVX512-VNNI CPUs only: the unsigned operand of vpdpbusd for Q8_0; kOffset)
  std::vector<int8_t> kq;    // [M, K] the codes per 256 in transpose_k's order (K % 256 == 0, AVX2 only; kTransposed)
  std::vector<int16_t> q16;  // [M, K] the codes as int16 (kWide)
  std::vector<int16_t> sum16; // [M, K / 16] sum of the codes of each 16 (Q6_K's offset of 32; kSums16), |.| <= 2032
  std::vector<float> d, s;   // [M, K / 32]
  // The layouts beyond q8, d and s (which are always made), as a bit set: each kernel reads
  // some of them (q8_layouts), so a call makes only those (the others are left empty).
  enum Layout : unsigned { kTransposed = 1, kWide = 2, kOffset = 4, kSums16 = 8, kAll = 15 };
  // Quantize x [M, K] (row stride K, K a multiple of 32) into this buffer, reusing its memory.
  void quantize(const float* x, int64_t M, int64_t K, unsigned layouts = kAll);
};

// The Q8Act layouts the int8 kernel of `format` reads on this CPU (0 where it has none).
unsigned q8_layouts(int64_t format);

// Whether this CPU runs the AVX2 kernels (AVX2, FMA and F16C, and KVSERVE_PORTABLE_KERNELS unset);
// both block-matmul sources choose their path by it.
bool cpu_has_avx2();

// Whether gguf_linear_q8_range runs `format` on this CPU (AVX2 and a format it has a kernel
// for); where not, callers multiply the fp32 activations (gguf_linear_range).
bool q8_supported(int64_t format);

// As gguf_linear_range, with the activations quantized (Q8Act) and integer dot products per
// block; requires q8_supported(format).
void gguf_linear_q8_range(const Q8Act& x, const uint8_t* w, int64_t N, int64_t format, int64_t n0, int64_t n1,
                          float* out, int64_t ldo);

}  // namespace kvserve
