// Port-throughput probe for the MUL1 "fast" kernels (a standalone diagnostic, not part of the package build).
//
//   g++ -O2 -march=native -pthread packages/cpu-tier/scripts/port_probe.cpp -o /tmp/port_probe && /tmp/port_probe
//
// For 1 thread and for every online core at once (threads pinned to cores 0..N-1) it prints, per thread:
//  * the core clock from a dependent imul chain (3-cycle latency), timed at two chain lengths (overheads cancel);
//  * the throughput (instructions per cycle at that clock) of each vector instruction of the kernels' inner loops,
//    alone and in pairs (a pair that sums to ~1/cycle shares one port), at 512 and 256 bits;
//  * the kernels' decode+dot sequence per 32 weights from registers (no memory): the compute bound in cycles.
// Twelve independent dependency chains per instruction keep it throughput-bound (12 chains: latency <= 6 at 2 per cycle).
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "../csrc/clock_probe.h"

static uint64_t now_ns() { return cpu_tier_clock::steady_ns(); }

static double clock_ghz() { return cpu_tier_clock::core_ghz(); }

#define KEEP(v) __asm__ volatile("" : "+v"(v))
constexpr long ITERS = 16000000;

// Each test returns instructions executed; run() turns that into instructions per ns.
struct Test {
    const char* name;
    int per_iter;  // instructions (or weights for the "kernel" tests) per loop iteration
    std::function<void(long)> body;
};

#if defined(__AVX512F__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define HAVE512 1
#endif

#ifdef HAVE512
static inline __m512i PERMT2B(__m512i a, __m512i b) { return _mm512_permutex2var_epi8(a, b, b); }
static inline __m512i DPWSSD(__m512i a, __m512i b) { return _mm512_dpwssd_epi32(a, b, b); }
#endif

static std::vector<Test> tests() {
    std::vector<Test> t;
#define T1(NAME, TYPE, SET, OP)                                                                                    \
    t.push_back({NAME, 12, [](long n) {                                                                            \
                     TYPE a0 = SET(1), a1 = SET(2), a2 = SET(3), a3 = SET(4), a4 = SET(5), a5 = SET(6), a6 = SET(7), \
                          a7 = SET(8), a8 = SET(9), a9 = SET(10), a10 = SET(11), a11 = SET(12), b = SET(0x1234);     \
                     for (long i = 0; i < n; ++i) {                                                                \
                         a0 = OP(a0, b); a1 = OP(a1, b); a2 = OP(a2, b); a3 = OP(a3, b);                           \
                         a4 = OP(a4, b); a5 = OP(a5, b); a6 = OP(a6, b); a7 = OP(a7, b);                           \
                         a8 = OP(a8, b); a9 = OP(a9, b); a10 = OP(a10, b); a11 = OP(a11, b);                       \
                         KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);           \
                         KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);                                                 \
                     }                                                                                             \
                 }})
#define T2(NAME, TYPE, SET, OPA, OPB)                                                                              \
    t.push_back({NAME, 12, [](long n) {                                                                            \
                     TYPE a0 = SET(1), a1 = SET(2), a2 = SET(3), a3 = SET(4), a4 = SET(5), a5 = SET(6), a6 = SET(7), \
                          a7 = SET(8), a8 = SET(9), a9 = SET(10), a10 = SET(11), a11 = SET(12), b = SET(0x1234);     \
                     for (long i = 0; i < n; ++i) {                                                                \
                         a0 = OPA(a0, b); a1 = OPB(a1, b); a2 = OPA(a2, b); a3 = OPB(a3, b);                       \
                         a4 = OPA(a4, b); a5 = OPB(a5, b); a6 = OPA(a6, b); a7 = OPB(a7, b);                       \
                         a8 = OPA(a8, b); a9 = OPB(a9, b); a10 = OPA(a10, b); a11 = OPB(a11, b);                   \
                         KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);           \
                         KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11);                                                 \
                     }                                                                                             \
                 }})
    // 256-bit (AVX2)
    T1("ymm vpmullw", __m256i, _mm256_set1_epi16, _mm256_mullo_epi16);
    T1("ymm vpmulld", __m256i, _mm256_set1_epi32, _mm256_mullo_epi32);
    T1("ymm vpmaddubsw", __m256i, _mm256_set1_epi16, _mm256_maddubs_epi16);
    T1("ymm vpmaddwd", __m256i, _mm256_set1_epi16, _mm256_madd_epi16);
    T1("ymm vpshufb", __m256i, _mm256_set1_epi16, _mm256_shuffle_epi8);
    T1("ymm vpsrlvd", __m256i, _mm256_set1_epi32, _mm256_srlv_epi32);
    T2("ymm vpmulld+vpshufb", __m256i, _mm256_set1_epi32, _mm256_mullo_epi32, _mm256_shuffle_epi8);
    T2("ymm vpmaddubsw+vpsrlvd", __m256i, _mm256_set1_epi32, _mm256_maddubs_epi16, _mm256_srlv_epi32);
    // the AVX2 kernel's sequence per 8 weights (shuffle, srlv, and, mulld, maddubs, maddwd, add), 8 streams
    t.push_back({"ymm kernel seq (weights/ns)", 32, [](long n) {
                     const __m256i c = _mm256_set1_epi32(0x03020100), sh = _mm256_set1_epi32(3),
                                   m16 = _mm256_set1_epi32(0xFFFF), M = _mm256_set1_epi32(int(0x83DCD12Du)),
                                   o = _mm256_set1_epi8(1), x = _mm256_set1_epi32(0x00050005);
                     __m256i L0 = _mm256_set1_epi32(1), L1 = _mm256_set1_epi32(2), L2 = _mm256_set1_epi32(3),
                             L3 = _mm256_set1_epi32(4);
                     __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
                     auto step = [&](__m256i L, __m256i acc) {
                         __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(L, c), sh), m16);
                         s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_mullo_epi32(s, M), o), x);
                         return _mm256_add_epi32(acc, s);
                     };
                     for (long i = 0; i < n; ++i) {
                         KEEP(L0); KEEP(L1); KEEP(L2); KEEP(L3);
                         c0 = step(L0, c0); c1 = step(L1, c1); c2 = step(L2, c2); c3 = step(L3, c3);
                     }
                     KEEP(c0); KEEP(c1); KEEP(c2); KEEP(c3);
                 }});
#ifdef HAVE512
    T1("zmm vpmullw", __m512i, _mm512_set1_epi16, _mm512_mullo_epi16);
    T1("zmm vpmulhuw", __m512i, _mm512_set1_epi16, _mm512_mulhi_epu16);
    T1("zmm vpmaddubsw", __m512i, _mm512_set1_epi16, _mm512_maddubs_epi16);
    T1("zmm vpmultishiftqb", __m512i, _mm512_set1_epi16, _mm512_multishift_epi64_epi8);
    T1("zmm vpaddw", __m512i, _mm512_set1_epi16, _mm512_add_epi16);
    T1("zmm vpshufb", __m512i, _mm512_set1_epi16, _mm512_shuffle_epi8);
    T1("zmm vpermt2b", __m512i, _mm512_set1_epi16, PERMT2B);
    T1("zmm vpermb", __m512i, _mm512_set1_epi16, _mm512_permutexvar_epi8);
    T1("zmm vpdpwssd", __m512i, _mm512_set1_epi16, DPWSSD);
    T2("zmm vpmullw+vpmultishiftqb", __m512i, _mm512_set1_epi16, _mm512_mullo_epi16, _mm512_multishift_epi64_epi8);
    T2("zmm vpmullw+vpshufb", __m512i, _mm512_set1_epi16, _mm512_mullo_epi16, _mm512_shuffle_epi8);
    T2("zmm vpmullw+vpaddw", __m512i, _mm512_set1_epi16, _mm512_mullo_epi16, _mm512_add_epi16);
    T1("ymm(evex) vpmultishiftqb", __m256i, _mm256_set1_epi16, _mm256_multishift_epi64_epi8);
    T2("ymm vpmullw+vpmaddubsw", __m256i, _mm256_set1_epi16, _mm256_mullo_epi16, _mm256_maddubs_epi16);
    // the AVX-512 kernel's sequence per 32 weights (band_int16), 4 streams, from registers
    t.push_back({"zmm kernel seq (weights/ns)", 128, [](long n) {
                     const __m512i perm = _mm512_set1_epi8(9), msh = _mm512_set1_epi64(0x3020100), ml = _mm512_set1_epi16(short(0xD12D)),
                                 mh = _mm512_set1_epi16(short(0x83DC)), o = _mm512_set1_epi8(1), x = _mm512_set1_epi16(77),
                                 z1 = _mm512_set1_epi8(11);
                     __m512i z0 = _mm512_set1_epi8(1), z2 = _mm512_set1_epi8(2), z3 = _mm512_set1_epi8(3), z4 = _mm512_set1_epi8(4);
                     __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
                     auto step = [&](__m512i z, __m512i acc) {
                         const __m512i st = _mm512_multishift_epi64_epi8(msh, _mm512_permutex2var_epi8(z, perm, z1));
                         const __m512i plo = _mm512_mullo_epi16(st, ml);
                         const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                         const __m512i bs = _mm512_add_epi16(_mm512_maddubs_epi16(plo, o), _mm512_maddubs_epi16(phi, o));
                         return _mm512_dpwssd_epi32(acc, bs, x);
                     };
                     for (long i = 0; i < n; ++i) {
                         KEEP(z0); KEEP(z2); KEEP(z3); KEEP(z4);
                         c0 = step(z0, c0); c1 = step(z2, c1); c2 = step(z3, c2); c3 = step(z4, c3);
                     }
                     KEEP(c0); KEEP(c1); KEEP(c2); KEEP(c3);
                 }});
    // the same sequence on 256-bit registers (AVX-512VL + VBMI + VNNI): 16 weights per step, ports 0 and 1
    t.push_back({"ymm(evex) kernel seq (weights/ns)", 64, [](long n) {
                     const __m256i perm = _mm256_set1_epi8(9), msh = _mm256_set1_epi64x(0x3020100), ml = _mm256_set1_epi16(short(0xD12D)),
                                 mh = _mm256_set1_epi16(short(0x83DC)), o = _mm256_set1_epi8(1), x = _mm256_set1_epi16(77),
                                 z1 = _mm256_set1_epi8(11);
                     __m256i z0 = _mm256_set1_epi8(1), z2 = _mm256_set1_epi8(2), z3 = _mm256_set1_epi8(3), z4 = _mm256_set1_epi8(4);
                     __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
                     auto step = [&](__m256i z, __m256i acc) {
                         const __m256i st = _mm256_multishift_epi64_epi8(msh, _mm256_permutex2var_epi8(z, perm, z1));
                         const __m256i plo = _mm256_mullo_epi16(st, ml);
                         const __m256i phi = _mm256_add_epi16(_mm256_mulhi_epu16(st, ml), _mm256_mullo_epi16(st, mh));
                         const __m256i bs = _mm256_add_epi16(_mm256_maddubs_epi16(plo, o), _mm256_maddubs_epi16(phi, o));
                         return _mm256_dpwssd_epi32(acc, bs, x);
                     };
                     for (long i = 0; i < n; ++i) {
                         KEEP(z0); KEEP(z2); KEEP(z3); KEEP(z4);
                         c0 = step(z0, c0); c1 = step(z2, c1); c2 = step(z3, c2); c3 = step(z4, c3);
                     }
                     KEEP(c0); KEEP(c1); KEEP(c2); KEEP(c3);
                 }});
#endif
    return t;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Runs f on `threads` pinned threads at once (started together); returns per-thread results.
template <class F>
static std::vector<double> on_threads(int threads, F f) {
    std::vector<double> res(size_t(threads), 0.0);
    std::atomic<int> ready{0};
    std::vector<std::thread> th;
    for (int w = 0; w < threads; ++w)
        th.emplace_back([&, w] {
            pin(w);
            ready.fetch_add(1);
            while (ready.load() < threads) {
            }
            res[size_t(w)] = f();
        });
    for (auto& t : th) t.join();
    return res;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    const int ncpu = int(std::thread::hardware_concurrency());
    const auto ts = tests();
    for (int threads : {1, ncpu}) {
        if (threads == ncpu && ncpu == 1) break;
        const double ghz = median(on_threads(threads, [] { return clock_ghz(); }));
        std::printf("== %d thread(s) busy: imul-chain clock %.3f GHz (median over threads)\n", threads, ghz);
        for (const Test& t : ts) {
            const auto rate = on_threads(threads, [&] {
                t.body(ITERS / 16);  // warm-up (and AVX frequency transition)
                const uint64_t t0 = now_ns();
                t.body(ITERS);
                return double(ITERS) * t.per_iter / double(now_ns() - t0);  // per ns
            });
            const double r = median(rate), lo = *std::min_element(rate.begin(), rate.end());
            const bool kernel = std::string(t.name).find("kernel") != std::string::npos;
            if (kernel)
                std::printf("  %-32s %7.2f weights/ns/thread (min %.2f) = %6.3f cycles/weight = %5.2f cycles per %d weights\n",
                            t.name, r, lo, ghz / r, ghz / r * (t.per_iter / 4), t.per_iter / 4);
            else
                std::printf("  %-32s %7.3f instr/cycle/thread (min %.3f)\n", t.name, r / ghz, lo / ghz);
        }
    }
    return 0;
}
