// How many 512-bit VPDPBUSD (int8 dot products, 64 multiply-adds each) one core retires per second
// here, beside 512-bit fp32 FMAs, each over 12 independent accumulators (more than the latency
// times the ports, so the loop is bound by throughput alone). The 16-row decode step's Q4_1 and
// Q8_0 pair kernels (engine/kernels/cpu/quant_linear_q8.cpp) are made of these two instructions,
// so their rate is the compute bound of that step on this CPU (docs/benchmarks.md, the seventh
// session):
//
//   g++ -O2 -march=native scripts/vnni-port-rate.cpp -o /tmp/vnni-port-rate
//   for c in 0 1; do taskset -c $c /tmp/vnni-port-rate; done
//
// Needs AVX512-VNNI (Ice Lake, Sapphire Rapids, Zen 4 or later). Not part of the kernels' build.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 12;
constexpr long kRounds = 20000000;

template <typename F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

__attribute__((noinline)) long long dot_products() {
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi32(0x03030303), b = _mm512_set1_epi32(0x05050505);
  for (long r = 0; r < kRounds; ++r)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  long long sum = 0;
  for (int i = 0; i < kChains; ++i) sum += _mm512_reduce_add_epi32(acc[i]);
  return sum;
}

__attribute__((noinline)) float fmas() {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (long r = 0; r < kRounds; ++r)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  float sum = 0.f;
  for (int i = 0; i < kChains; ++i) sum += _mm512_reduce_add_ps(acc[i]);
  return sum;
}

}  // namespace

int main() {
  volatile float sink = 0.f;  // keeps the loops' results alive
  for (int run = 0; run < 3; ++run) {
    const double t_fma = seconds([&] { sink = sink + fmas(); });
    const double t_dp = seconds([&] { sink = sink + static_cast<float>(dot_products()); });
    const double n = static_cast<double>(kRounds) * kChains;
    std::printf("fp32 FMA zmm %.2f G/s   VPDPBUSD zmm %.2f G/s (%.0f G multiply-adds/s)   VPDPBUSD / FMA %.2f\n",
                n / t_fma / 1e9, n / t_dp / 1e9, 64 * n / t_dp / 1e9, t_fma / t_dp);
  }
  return 0;
}
