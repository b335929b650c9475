// Host CPU feature probe: CPUID leaves 1 and 7 plus XGETBV, so a feature counts only when the OS
// also saves the register state it needs (AVX: XCR0 bits 1-2; AVX-512: bits 5-7; AMX: bits 17-18, and on Linux
// the process's grant of the tile-data state, which this probe requests: arch_prctl ARCH_REQ_XCOMP_PERM).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <map>
#include <string>

#include "amx.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define CPU_TIER_X86 1
#endif

namespace nb = nanobind;

namespace cpu_tier {

static std::map<std::string, bool> cpu_features() {
    std::map<std::string, bool> f = {
        {"sse42", false}, {"avx", false}, {"avx2", false}, {"fma", false}, {"f16c", false},
        {"bmi2", false}, {"avx512f", false}, {"avx512bw", false}, {"avx512vl", false},
        {"avx512dq", false}, {"avx512vnni", false}, {"avx512vbmi", false}, {"os_avx", false},
        {"os_avx512", false}, {"amx_tile", false}, {"amx_int8", false}, {"os_amx", false},
    };
#ifdef CPU_TIER_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    const unsigned max_leaf = a;
    __get_cpuid(1, &a, &b, &c, &d);
    const bool osxsave = (c >> 27) & 1;
    f["sse42"] = (c >> 20) & 1;
    f["fma"] = (c >> 12) & 1;
    f["f16c"] = (c >> 29) & 1;
    const bool cpu_avx = (c >> 28) & 1;
    uint64_t xcr0 = 0;
    if (osxsave) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = (uint64_t(hi) << 32) | lo;
    }
    const bool os_avx = osxsave && ((xcr0 & 0x6) == 0x6);
    const bool os_avx512 = os_avx && ((xcr0 & 0xE0) == 0xE0);
    f["os_avx"] = os_avx;
    f["os_avx512"] = os_avx512;
    f["avx"] = cpu_avx && os_avx;
    f["fma"] = f["fma"] && os_avx;
    f["f16c"] = f["f16c"] && os_avx;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        f["avx2"] = ((b >> 5) & 1) && os_avx;
        f["bmi2"] = (b >> 8) & 1;
        f["avx512f"] = ((b >> 16) & 1) && os_avx512;
        f["avx512dq"] = ((b >> 17) & 1) && os_avx512;
        f["avx512bw"] = ((b >> 30) & 1) && os_avx512;
        f["avx512vl"] = ((b >> 31) & 1) && os_avx512;
        f["avx512vbmi"] = ((c >> 1) & 1) && os_avx512;
        f["avx512vnni"] = ((c >> 11) & 1) && os_avx512;
        const bool os_amx_state = osxsave && ((xcr0 & 0x60000) == 0x60000);
        f["amx_tile"] = ((d >> 24) & 1) && os_amx_state;
        f["amx_int8"] = ((d >> 25) & 1) && os_amx_state;
        if (f["amx_tile"] && f["amx_int8"]) f["os_amx"] = cpu_tier::amx_request_permission().empty();
    }
#endif
    return f;
}

}  // namespace cpu_tier

NB_MODULE(_cpu_features, m) {
    m.doc() = "CPUID + XGETBV feature probe for cpu_tier's ISA dispatch";
    m.def("cpu_features", &cpu_tier::cpu_features,
          "Features the CPU has AND the OS enables (XCR0), as a dict of name -> bool.");
}
