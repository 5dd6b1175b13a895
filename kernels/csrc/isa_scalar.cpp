// Plain C++ kernels (any x86-64 / other CPU): the fallback when neither AVX2 nor AVX-512 is usable.
#include <algorithm>
#include <cstdint>
#include <cstring>
#define VN_LEVEL 0
#define VN_NS scalar
#include "kernels_body.h"

namespace vptq_native {
const IsaTable* isa_scalar() { return &scalar::kTable; }
}  // namespace vptq_native
