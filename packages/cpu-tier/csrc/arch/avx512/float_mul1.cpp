// The avx512 variant's float path for the MUL1 codebook (one translation unit per codebook: built in parallel).
#include "kernels.h"
#include "../x86/float_dispatch.h"

namespace cpu_tier {
namespace CPU_TIER_NS {
CT_DEFINE_GEMV_FLOAT(gemv_float_mul1, CB_MUL1)
}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
