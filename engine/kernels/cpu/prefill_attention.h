// The prefill attention kernels' one contract (prefill_attention.cpp on AMX-BF16 tiles,
// prefill_attention_f32.cpp in AVX2 vectors): q [n, heads, d] (float32, float16 or bfloat16),
// keys / values [prefix + n, kv_heads, d] (any strides but a contiguous last dim) -> fp32
// [n, heads, d]: query i at position prefix + i attends keys 0 .. prefix + i, softmax(scale q k) v,
// grouped query heads. check_prefill_attention_args refuses what breaks it, with the reason.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/Half.h>

#include <cstdint>

namespace kvserve {

// head_multiple: the head sizes the kernel takes (a multiple of it, at most 256).
inline void check_prefill_attention_args(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                         int64_t prefix, int64_t head_multiple) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q [n, heads, d], keys / values [L, kv_heads, d]");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(n > 0 && prefix >= 0 && keys.size(0) >= prefix + n && values.size(0) >= prefix + n,
              "keys and values must hold prefix + n rows");
  TORCH_CHECK(values.size(1) == kv_heads && keys.size(2) == d && values.size(2) == d, "keys and values shape mismatch");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(d % head_multiple == 0 && d <= 256, "head_dim must be a multiple of ", head_multiple, ", at most 256");
  for (const at::Tensor* t : {&q, &keys, &values}) {
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1, "CPU tensors with a contiguous last dim");
    const auto dt = t->scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "float32, float16 or bfloat16 tensors");
  }
}

// One kv head's rows of a paged pool ([blocks, block_size, kv_heads, d], T = float or c10::Half):
// key or value t of a sequence whose block table is `table`.
template <typename T>
struct PagedRows {
  const T *k, *v;
  const int64_t* table;
  int64_t block_size, token_stride, head_offset;  // elements: between tokens, to the kv head
  const T* row(bool values, int64_t t) const {
    return (values ? v : k) + (table[t / block_size] * block_size + t % block_size) * token_stride + head_offset;
  }
};

// Whether attend_rows_on_tiles runs here for head size d (AMX-BF16, as prefill_attention).
bool rows_on_tiles_supported(int64_t d);

// The native decode stack's chunk rows on the AMX tiles (prefill_attention.cpp): n consecutive
// rows of one sequence at positions prefix .. prefix + n - 1, G query heads of one kv head (row i's
// head h at q + i q_ld + h d, fp32), over that kv head's keys and values 0 .. prefix + n - 1 in the
// pool -> out + i out_ld + h d. prefill_attention's numerics (q, k and v rounded to bf16), one
// thread (it configures the tiles and releases them). Needs rows_on_tiles_supported(d).
template <typename T>
void attend_rows_on_tiles(const float* q, int64_t q_ld, int64_t G, int64_t d, const PagedRows<T>& kv_rows,
                          int64_t prefix, int64_t n, float scale, float* out, int64_t out_ld);

}  // namespace kvserve
