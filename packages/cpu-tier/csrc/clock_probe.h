// Core clock estimate shared by the bench job (module.cpp) and scripts/port_probe.cpp.
//
// Chains of dependent 64-bit imul (latency 3 cycles on every x86 core we target; a chain of immediate adds is not
// usable: recent Intel cores fold immediate adds at rename). Two chain lengths are timed (n and 2n iterations of 4
// imul) and the clock is taken from the difference, so loop and timer overheads cancel; fastest of 5 per length.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

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
    const int64_t d = int64_t(best2) - int64_t(best1);  // the time of n iterations of 4 imul
    return d > 0 ? double(12 * n) / double(d) : 0.0;
}

}  // namespace cpu_tier_clock
