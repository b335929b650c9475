// The AVX-512 band kernels alone, timed in thread CPU time (other processes' time slices do not count), on one
// gate-sized matrix (k = 5120, n = 2304, K = 3; POOL > 1: that many, streamed from DRAM), as
// scripts/avx2_kernel_time.cpp for AVX2 (the driver: kernel_time_main.h). A diagnostic, not part of the package
// build. VARIANT 0 = the integer path ("fast", band_int16), 2 = the exact float path (band_exact_mul1), 8 = the
// generic band_float loop (the exact kernel before band_exact_mul1; the same values). Variants 5 and 6 (2bef642 to
// 7487e25) were a prototype, the exact values fed by the integer path's 16-bit decode: no faster on Zen 4 or on the
// H200 host's Intel core (results/devbox_zen4_avx512_exact16_proto.txt, results/h200host_run26_kernel512.txt), removed.
//   g++ -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512vbmi \
//       -mprefer-vector-width=512 -Wno-maybe-uninitialized -std=c++17 -DCPU_TIER_NS=avx512 -DCPU_TIER_ISA_AVX512 \
//       -Ipackages/cpu-tier/csrc packages/cpu-tier/scripts/avx512_kernel_time.cpp -o /tmp/kt512 \
//       && /tmp/kt512 M VARIANT SECONDS [POOL]
#include "arch/avx512/kernels.h"
namespace cpu_tier { namespace avx512 {
template <int M>
static void kb_m(const MatRef& A, int band, const Acts& X, float* y) {
    if (X.variant == 2) return band_float<CB_MUL1, M, true, 6, true>(A, band, X, y);
    if (X.variant == 8) return band_float<CB_MUL1, M, true, 6, true, true>(A, band, X, y);
    band_int16<M, 96>(A, band, X, y);
}
static void kb_gemv(const MatRef& A, int band, const Acts& X, float* y) {
    switch (X.m) {
        case 1: return kb_m<1>(A, band, X, y);
        case 2: return kb_m<2>(A, band, X, y);
        case 3: return kb_m<3>(A, band, X, y);
        case 4: return kb_m<4>(A, band, X, y);
        default: return kb_m<8>(A, band, X, y);
    }
}
}}
#include "kernel_time_main.h"
int main(int argc, char** argv) { return kernel_time_main(argc, argv, cpu_tier::avx512::kb_gemv); }
