// AVX2 + FMA kernels; only called after a run-time CPU check (see native.cpp).
#if defined(__x86_64__) || defined(__i386__)
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt,lzcnt")
#define VN_LEVEL 1
#define VN_NS avx2
#include "kernels_body.h"

namespace vptq_native {
const IsaTable* isa_avx2() { return &avx2::kTable; }
}  // namespace vptq_native
#else
#include "common.h"
namespace vptq_native {
const IsaTable* isa_avx2() { return nullptr; }
}  // namespace vptq_native
#endif
