// The block matmul of quant_linear.cpp as a plain function, for other kernels of the library
// (decode_layer.cpp) that split the output features over their own threads.
#pragma once

#include <cstdint>

namespace kvserve {

// Output features [n0, n1) of y[M, N] = x[M, K] @ W^T, W one packed matrix of `format` (the
// codes of engine/quant.py BlockFormat, as gguf_linear takes it): feature n of row r goes to
// out[r * ldo + n - n0], computed on the calling thread. For the strip formats (Q4_1, Q8_0) n0 must be a multiple of 8 and n1
// a multiple of 8 or N.
void gguf_linear_range(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t format,
                       int64_t n0, int64_t n1, float* out, int64_t ldo);

}  // namespace kvserve
