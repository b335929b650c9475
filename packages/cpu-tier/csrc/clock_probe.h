// Core clock estimate and vector-port rate, shared by the bench probes (bench_probes.cpp) and scripts/port_probe.cpp,
// scripts/smt_probe.cpp.
//
// Chains of dependent 64-bit imul (latency 3 cycles on every x86 core we target; a chain of immediate adds is not
// usable: recent Intel cores fold immediate adds at rename). Two chain lengths are timed (n and 2n iterations of 4
// imul) and the clock is taken from the difference, so loop and timer overheads cancel; fastest of 5 per length.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cpu_tier_clock {

inline uint64_t steady_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
}

__attribute__((noinline)) inline uint64_t imul_chain(uint64_t n, uint64_t x) {
    const uint64_t m = 3;
    for (uint64_t i = 0; i < n; ++i) {
#if defined(__x86_64__)
        __asm__ volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0" : "+r"(x) : "r"(m));
#else
        x *= m * m * m * m;
#endif
    }
    return x;
}

// GHz of the calling core (n = 2e6: 24 M cycles per short chain, ~8 ms at 3 GHz); 0 if the timer misbehaved.
inline double core_ghz(uint64_t n = 2000000, uint64_t seed = 7) {
    uint64_t x = seed | 1u;
    uint64_t best1 = ~uint64_t(0), best2 = ~uint64_t(0);
    for (int rep = 0; rep < 5; ++rep) {
        const uint64_t t0 = steady_ns();
        x = imul_chain(n, x);
        const uint64_t t1 = steady_ns();
        x = imul_chain(2 * n, x);
        const uint64_t t2 = steady_ns();
        best1 = std::min(best1, t1 - t0);
        best2 = std::min(best2, t2 - t1);
    }
    static volatile uint64_t sink;
    sink = x;  // keeps the chains live
    (void)sink;
    const int64_t d = int64_t(best2) - int64_t(best1);  // the time of n iterations of 4 imul
    return d > 0 ? double(12 * n) / double(d) : 0.0;
}

// Throughput of the two vector ports the MUL1 kernels keep busy, on the calling core: 12 independent chains of the
// widest integer multiply(-add) the build targets (AVX-512 VNNI: vpdpwssd zmm; AVX2: vpmaddwd ymm; otherwise 64-bit
// imul), in registers (an array of chains lives on the stack: a store and a reload per step), each chain through
// the instruction's fast input (vpdpwssd's accumulator: through a multiplicand it is latency-bound at ~0.8 per
// cycle on Emerald Rapids). A core alone reaches about 2 steps per cycle (512-bit: ports 0 and 5). Chain steps per
// ns over about `sec` seconds. With every core busy at once, a core that shares its ports with another busy one (an
// SMT sibling: another vCPU of this or another guest) runs it at about half its rate alone. (Compiler feature macros, not cpu-tier's ISA defines: scripts/smt_probe.cpp and
// every kernel variant use it; the emulated AVX-512 variant is built for AVX2 and times the AVX2 loop.)
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
using PortVec = __m512i;
#define CT_PR_SET(v) _mm512_set1_epi32(v)
#define CT_PR_OP(a, b) _mm512_dpwssd_epi32(a, b, b)  // the chain runs through the accumulator input
#define CT_PR_KEEP(v) __asm__ volatile("" : "+v"(v))
#elif defined(__AVX2__)
using PortVec = __m256i;
#define CT_PR_SET(v) _mm256_set1_epi32(v)
#define CT_PR_OP(a, b) _mm256_madd_epi16(a, b)  // 5-cycle latency on Intel: 12 chains still saturate two ports
#define CT_PR_KEEP(v) __asm__ volatile("" : "+x"(v))
#else
using PortVec = uint64_t;
#define CT_PR_SET(v) uint64_t(v)
#define CT_PR_OP(a, b) ((a) * (b))
#define CT_PR_KEEP(v) __asm__ volatile("" : "+r"(v))
#endif

// n steps of the 12 chains in a[] (loaded into registers, stored back at the end). Not inlined: no call inside, so
// the chains stay in registers (a caller that times between blocks would make the compiler keep them in memory).
__attribute__((noinline)) inline void port_block(PortVec* a, long n) {
    PortVec a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7], a8 = a[8],
            a9 = a[9], a10 = a[10], a11 = a[11];
    PortVec b = CT_PR_SET(0x00010003);
    CT_PR_KEEP(b);
    for (long i = 0; i < n; ++i) {
        a0 = CT_PR_OP(a0, b); a1 = CT_PR_OP(a1, b); a2 = CT_PR_OP(a2, b); a3 = CT_PR_OP(a3, b);
        a4 = CT_PR_OP(a4, b); a5 = CT_PR_OP(a5, b); a6 = CT_PR_OP(a6, b); a7 = CT_PR_OP(a7, b);
        a8 = CT_PR_OP(a8, b); a9 = CT_PR_OP(a9, b); a10 = CT_PR_OP(a10, b); a11 = CT_PR_OP(a11, b);
        CT_PR_KEEP(a0); CT_PR_KEEP(a1); CT_PR_KEEP(a2); CT_PR_KEEP(a3); CT_PR_KEEP(a4); CT_PR_KEEP(a5);
        CT_PR_KEEP(a6); CT_PR_KEEP(a7); CT_PR_KEEP(a8); CT_PR_KEEP(a9); CT_PR_KEEP(a10); CT_PR_KEEP(a11);
    }
    a[0] = a0; a[1] = a1; a[2] = a2; a[3] = a3; a[4] = a4; a[5] = a5;
    a[6] = a6; a[7] = a7; a[8] = a8; a[9] = a9; a[10] = a10; a[11] = a11;
}

inline double port_rate(double sec) {
    PortVec a[12];
    for (int i = 0; i < 12; ++i) a[i] = CT_PR_SET(i + 1);
    const long block = 4096;
    long n = 0;
    const uint64_t t0 = steady_ns();
    uint64_t t = t0;
    do {
        port_block(a, block);
        n += block;
        t = steady_ns();
    } while (double(t - t0) < sec * 1e9);
    return 12.0 * double(n) / double(t - t0);
}
#undef CT_PR_SET
#undef CT_PR_OP
#undef CT_PR_KEEP

}  // namespace cpu_tier_clock
