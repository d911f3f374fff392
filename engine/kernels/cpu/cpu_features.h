// Which instructions the kernels may use, at compile time and at run time. Every x86 kernel is
// compiled for its own target (target attributes and pragmas) whatever the build flags, and runs
// only where the CPU answers yes here, so a build for a generic CPU is still fast on a modern one.
// - KVSERVE_X86 (and <immintrin.h>): x86-64 with GCC or clang, so intrinsics and target attributes.
// - cpu_has_avx2, cpu_has_avx512f, detect_vnni: the CPU's answer (cpuid, through the compiler's
//   builtins) and the KVSERVE_* switches that turn a path off.
// - cpu_has_amx: declared here, defined in quant_linear_amx.cpp (the detection also asks Linux for
//   permission to use tile data); cpu_has_amx_bf16, defined in prefill_attention.cpp.
// Included by every source and header that chooses a path or holds x86 code: argmax.cpp,
// decode_layer.cpp, prefill_attention.cpp, prefill_attention_f32.cpp, prefill_linear.cpp,
// quant_linear.cpp, quant_linear_q8.cpp, quant_linear_amx.cpp, amx_tiles.h, block_codes.h,
// paged_attention.h, quant_linear.h and vec_math.h.
#pragma once

#include <cstdlib>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVSERVE_X86 1
#include <immintrin.h>
#endif

namespace kvserve {

// Whether this CPU runs the AVX2 kernels (AVX2, FMA and F16C, and KVSERVE_PORTABLE_KERNELS unset);
// every vectorized path (the block matmuls, attention, arg-max) chooses by it.
inline bool cpu_has_avx2() {
#ifdef KVSERVE_X86
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && !std::getenv("KVSERVE_PORTABLE_KERNELS");
  return yes;
#else
  return false;
#endif
}

// Whether this CPU runs 512-bit vectors (AVX-512F, besides cpu_has_avx2): argmax.cpp's scan.
inline bool cpu_has_avx512f() {
#ifdef KVSERVE_X86
  static const bool yes = kvserve::cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

#ifdef KVSERVE_X86
// Whether this CPU runs the AVX512-VNNI int8 kernels (AVX512 VNNI, VL and BW besides
// cpu_has_avx2, and KVSERVE_NO_VNNI unset). Asked anew on each call: quant_linear_q8.cpp asks
// once, at load, into the constant its kernels test per block (a call there would spill their
// registers).
inline bool detect_vnni() {
  __builtin_cpu_init();  // may run among the library's constructors
  return cpu_has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && !std::getenv("KVSERVE_NO_VNNI");
}
#endif

// Whether this CPU (and OS) runs AMX-INT8 tiles and KVSERVE_NO_AMX is unset (quant_linear_amx.cpp;
// prefill_attention.cpp asks it too, before its own AMX-BF16 test).
bool cpu_has_amx();

// cpu_has_amx and AMX-BF16 and AVX512-BF16 (prefill_attention.cpp, which defines it, and
// prefill_linear.cpp): the bf16 tile kernels' test, asked at first use.
bool cpu_has_amx_bf16();

}  // namespace kvserve
