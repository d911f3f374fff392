// A prefill chunk's row-wise ops, each one pass over the rows split among the threads, where
// torch's CPU composite takes four to six (F.rms_norm is pow, mean, add, rsqrt and two
// multiplies; the residual add and RoPE each write a temporary). Numerics are the native decode
// layer's (vec_math.h), so a prompt's rows and its decode rows are normed and rotated alike:
//
// - rms_norm(x, w, eps) -> y: F.rms_norm over the last dimension;
// - add_rms_norm_(h, x, w, eps) -> y: h += x in place (the residual stream), then y = rms_norm(h);
// - rope_(qkv, cos, sin, heads): RoPE in place on the first heads * D columns of each row
//   (q and k, adjacent in the fused qkv), cos / sin [rows, D] with sin sign-adjusted
//   (engine/model/rope.py signed_sin).
//
// All take contiguous float32 CPU tensors (a row stride for qkv) and say so otherwise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "vec_math.h"  // rms_norm_row, rope_row

namespace {

constexpr int64_t kGrain = 8;  // rows per task: a few KB each, enough to amortize a task

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(), name,
              " must be a contiguous 2-d float32 CPU tensor");
}

void check_weight(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == K,
              "weight must be a contiguous float32 vector of ", K);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  check_weight(w, K);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kvserve::rms_norm_row(xp + r * K, wp, K, static_cast<float>(eps), yp + r * K);
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(h, "h");
  check_rows(x, "x");
  TORCH_CHECK(h.sizes() == x.sizes(), "h and x must have one shape, got ", h.sizes(), " and ", x.sizes());
  const int64_t M = h.size(0), K = h.size(1);
  check_weight(w, K);
  at::Tensor y = at::empty_like(h);
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, M, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* hr = hp + r * K;
      const float* xr = xp + r * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) hr[k] += xr[k];
      kvserve::rms_norm_row(hr, wp, K, static_cast<float>(eps), yp + r * K);
    }
  });
  return y;
}

void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() && qkv.stride(1) == 1,
              "qkv must be a 2-d float32 CPU tensor with unit column stride");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t M = qkv.size(0), D = cos.size(1), ld = qkv.stride(0);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == M && D % 2 == 0,
              "cos and sin must both be [rows, even head_dim], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(heads >= 0 && heads * D <= qkv.size(1), heads, " heads of ", D, " do not fit ", qkv.size(1), " columns");
  float* v = qkv.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  at::parallel_for(0, M, kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(D);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < heads; ++h) kvserve::rope_row(v + r * ld + h * D, c + r * D, s + r * D, D, tmp.data());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
}
