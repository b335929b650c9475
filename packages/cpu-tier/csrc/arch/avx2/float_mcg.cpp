// The avx2 variant's float path for the MCG codebook (one translation unit per codebook: built in parallel).
#include "kernels.h"
#include "../x86/float_dispatch.h"

namespace cpu_tier {
namespace CPU_TIER_NS {
CT_DEFINE_GEMV_FLOAT(gemv_float_mcg, CB_MCG)
}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
