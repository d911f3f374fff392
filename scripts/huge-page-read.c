// One core's read bandwidth over 96 MB on 4 KiB pages against 2 MiB transparent huge pages: the
// decode step streams its weights (and KV blocks) this way, and in a VM a TLB miss is a two-level
// page walk (engine/platform/huge_pages.py; docs/benchmarks.md, "a twenty-third session"). The
// loop reads 256 bytes at a time with the kernels' 8 KB-ahead L2 prefetch; best of 15 passes.
//
//   gcc -O2 -march=native scripts/huge-page-read.c -o /tmp/huge-page-read
//   /tmp/huge-page-read 0; /tmp/huge-page-read 1                  # one core, 4 KiB then huge pages
//   /tmp/huge-page-read 1 & /tmp/huge-page-read 1; wait           # two cores at once
//
// Needs AVX-512F and Linux (madvise MADV_HUGEPAGE; transparent huge pages "always" or "madvise").
// Not part of the kernels' build.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int huge = argc > 1 ? atoi(argv[1]) : 1;
  const size_t n = (size_t)96 << 20, align = (size_t)2 << 20;
  char* raw = mmap(0, n + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return 1;
  char* p = (char*)(((size_t)raw + align - 1) & ~(align - 1));
  madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, n);
  double best = 1e9;
  __m512 a = _mm512_setzero_ps();
  for (int r = 0; r < 15; ++r) {
    const double t = now();
    for (size_t o = 0; o < n; o += 256) {
      for (int i = 0; i < 4; ++i) _mm_prefetch(p + o + 8192 + 64 * i, _MM_HINT_T1);
      for (int i = 0; i < 4; ++i) a = _mm512_add_ps(a, _mm512_load_ps((const float*)(p + o + 64 * i)));
    }
    const double e = now() - t;
    if (e < best) best = e;
  }
  float f[16];
  _mm512_storeu_ps(f, a);
  long huge_kb = 0;
  FILE* s = fopen("/proc/self/smaps_rollup", "r");
  char line[256];
  while (s && fgets(line, sizeof line, s))
    if (!strncmp(line, "AnonHugePages:", 14)) huge_kb = atol(line + 14);
  if (s) fclose(s);
  printf("%s pages (AnonHugePages %ld kB): %.2f GB/s one core (%g)\n", huge ? "huge" : "4 KiB", huge_kb, n / best / 1e9,
         f[0]);
  return 0;
}
