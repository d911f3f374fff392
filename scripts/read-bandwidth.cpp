// How fast this machine's cores read a buffer the size of a decode step's K/V (147 MB: 16 rows of
// 400 tokens of SmolLM2's fp16 K and V over 30 layers) from memory, in pieces of a given size
// visited in order or shuffled: a 6,144-byte piece is one layer's K block of 16 tokens, as the
// paged pool scatters them. Each piece is widened from fp16 and summed, as the attention's loads
// are; a 256 MB buffer is read between rounds so the next round starts from memory. Prints the
// best of 7 rounds in GB/s (docs/benchmarks.md, "decode attention's memory bound").
//
//   g++ -O3 -march=native -fopenmp scripts/read-bandwidth.cpp -o /tmp/read-bandwidth
//   OMP_NUM_THREADS=2 /tmp/read-bandwidth 6144 1   # piece bytes, shuffled (0 or 1)
//
// Needs AVX-512F (the loads are 512-bit). Not part of the kernels' build.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const size_t total = 147u << 20;
  const size_t piece = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 6144;
  const bool shuffled = argc > 2 && std::atoi(argv[2]) != 0;
  if (piece < 64 || piece % 64 != 0) {
    std::fprintf(stderr, "the piece size must be a multiple of 64 bytes\n");
    return 2;
  }
  const size_t n = total / piece;
  char* buf = static_cast<char*>(std::aligned_alloc(4096, n * piece));
  for (size_t i = 0; i < n * piece; ++i) buf[i] = (i % 2) ? 0x3c : 0;  // fp16 1.0 everywhere: a finite sum
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(1));
  std::vector<char> flush(256u << 20, 1);
  double best = 1e9;
  float keep = 0;
  for (int round = 0; round < 7; ++round) {
    long f = 0;
    for (size_t i = 0; i < flush.size(); i += 64) f += flush[i];
    keep += static_cast<float>(f & 1);
    const auto t0 = std::chrono::steady_clock::now();
    float total_sum = 0;
#pragma omp parallel for reduction(+ : total_sum) schedule(static)
    for (size_t j = 0; j < n; ++j) {
      const char* p = buf + order[j] * piece;
      __m512 a = _mm512_setzero_ps();
      for (size_t o = 0; o < piece; o += 32)
        a = _mm512_add_ps(a, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o))));
      total_sum += _mm512_reduce_add_ps(a);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    keep += total_sum;
  }
  std::printf("%zu-byte pieces, %s, %d threads: %.1f GB/s (checksum %g)\n", piece, shuffled ? "shuffled" : "in order",
              omp_get_max_threads(), n * piece / best / 1e9, keep);
  std::free(buf);
  return 0;
}
