// AVX-512 (F, BW, VL, DQ, BF16) kernels; only called after a run-time CPU check (see native.cpp).
#if defined(__x86_64__) || defined(__i386__)
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,popcnt,lzcnt")
#define VN_LEVEL 2
#define VN_NS avx512
#include "kernels_body.h"

namespace vptq_native {
const IsaTable* isa_avx512() { return &avx512::kTable; }
}  // namespace vptq_native
#else
#include "common.h"
namespace vptq_native {
const IsaTable* isa_avx512() { return nullptr; }
}  // namespace vptq_native
#endif
