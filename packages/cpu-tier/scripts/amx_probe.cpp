// AMX micro-probe (a standalone diagnostic, not part of the package build): what the tile unit costs on this host.
//
//   g++ -O2 -march=native -pthread packages/cpu-tier/scripts/amx_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
//
// Cycles (at the clock measured by clock_probe.h) per operation, one thread:
//  * TDPBSUD throughput (4 independent accumulators) and latency (one accumulator), A tiles of 2 and 16 rows;
//  * TILELOADD of a 1 KiB tile from L1, alone; after 16 zmm stores to the same buffer (store -> tile load); after
//    16 zmm stores to another buffer (does a tile load wait for unrelated stores?);
//  * LDTILECFG + TILERELEASE;
//  * the AMX kernel's step from registers: 16 zmm stores + TILELOADD B + TDPBSUD, with the staging in rotation;
//  * the kernel's whole tile step (decode of 256 weights from registers: 4 vpermt2b, 8 vpmultishiftqb, 24
//    multiplies, 8 adds, 16 stores), alone and with the tile loads and TDPBSUD added one by one.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "../csrc/clock_probe.h"

struct alignas(64) Cfg {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

static void config(int arows) {
    Cfg c;
    for (int t = 0; t < 6; ++t) {
        c.rows[t] = uint8_t(arows);
        c.colsb[t] = 64;
    }
    for (int t = 6; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

alignas(64) static uint8_t bufA[16][64], bufB[8][16][64], other[8][16][64];
alignas(64) static int32_t cout[16][16];

static double ghz;
template <class F>
static double cycles_per(const char* name, long n, int per_iter, F f) {
    f(n / 10);
    double ns = 1e300;  // best of 5: this VM's per-core speed varies
    for (int rep = 0; rep < 5; ++rep) {
        const uint64_t t0 = cpu_tier_clock::steady_ns();
        f(n / 5);
        ns = std::min(ns, 5.0 * double(cpu_tier_clock::steady_ns() - t0));
    }
    const double c = ns * ghz / double(n) / per_iter;
    std::printf("%-58s %8.2f cycles\n", name, c);
    return c;
}

#define BAR() __asm__ volatile("" ::: "memory")

// 16 zmm stores (one staged B tile), a new value for the next call, and a compiler barrier.
static inline void stores16(uint8_t* p, __m512i& v) {
    for (int r = 0; r < 16; ++r) _mm512_store_si512(p + 64 * r, v);
    v = _mm512_add_epi32(v, v);
    BAR();
}

int main() {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
        std::printf("AMX permission refused\n");
        return 1;
    }
    ghz = cpu_tier_clock::core_ghz();
    std::printf("clock %.2f GHz\n", ghz);
    std::memset(bufA, 1, sizeof(bufA));
    std::memset(bufB, 2, sizeof(bufB));
    for (int arows : {2, 16}) {
        config(arows);
        _tile_loadd(4, bufA, 64);
        _tile_loadd(6, bufB[0], 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        char name[96];
        std::snprintf(name, sizeof name, "tdpbsud throughput, A %d rows (4 accumulators)", arows);
        cycles_per(name, 2000000, 4, [](long n) {
            for (long i = 0; i < n; ++i) {
                _tile_dpbsud(0, 4, 6);
                _tile_dpbsud(1, 4, 6);
                _tile_dpbsud(2, 4, 6);
                _tile_dpbsud(3, 4, 6);
            }
        });
        std::snprintf(name, sizeof name, "tdpbsud latency, A %d rows (1 accumulator)", arows);
        cycles_per(name, 2000000, 4, [](long n) {
            for (long i = 0; i < n; ++i) {
                _tile_dpbsud(0, 4, 6);
                _tile_dpbsud(0, 4, 6);
                _tile_dpbsud(0, 4, 6);
                _tile_dpbsud(0, 4, 6);
            }
        });
        std::snprintf(name, sizeof name, "tileloadd 16x64 from L1 (2 regs)");
        cycles_per(name, 2000000, 2, [](long n) {
            for (long i = 0; i < n; ++i) {
                BAR();
                _tile_loadd(6, bufB[i & 7], 64);
                _tile_loadd(7, bufB[(i + 1) & 7], 64);
            }
        });
        cycles_per("16 zmm stores alone", 2000000, 1, [](long n) {
            __m512i v = _mm512_set1_epi32(3);
            for (long i = 0; i < n; ++i) {
                uint8_t* p = bufB[i & 7][0];
                stores16(p, v);
            }
        });
        cycles_per("16 zmm stores + tileloadd same buffer", 2000000, 1, [](long n) {
            __m512i v = _mm512_set1_epi32(3);
            for (long i = 0; i < n; ++i) {
                uint8_t* p = bufB[i & 7][0];
                stores16(p, v);
                _tile_loadd(6, p, 64);
            }
        });
        cycles_per("16 zmm stores + tileloadd of a buffer stored 4 steps ago", 2000000, 1, [](long n) {
            __m512i v = _mm512_set1_epi32(3);
            for (long i = 0; i < n; ++i) {
                uint8_t* p = bufB[i & 7][0];
                stores16(p, v);
                _tile_loadd(6, bufB[(i + 4) & 7], 64);
            }
        });
        cycles_per("16 zmm stores (other) + tileloadd untouched buffer", 2000000, 1, [](long n) {
            __m512i v = _mm512_set1_epi32(3);
            for (long i = 0; i < n; ++i) {
                uint8_t* p = other[i & 7][0];
                stores16(p, v);
                _tile_loadd(6, bufB[i & 7], 64);
            }
        });
        cycles_per("step: 16 stores + tileloadd B (4 ago) + tdpbsud", 2000000, 1, [](long n) {
            __m512i v = _mm512_set1_epi32(3);
            for (long i = 0; i < n; i += 2) {
                uint8_t* p = bufB[i & 7][0];
                stores16(p, v);
                _tile_loadd(6, bufB[(i + 4) & 7], 64);
                _tile_dpbsud(0, 4, 6);
                p = bufB[(i + 1) & 7][0];
                stores16(p, v);
                _tile_loadd(7, bufB[(i + 5) & 7], 64);
                _tile_dpbsud(1, 4, 7);
            }
        });
        cycles_per("tilestored C + 2 loads of it", 2000000, 1, [](long n) {
            for (long i = 0; i < n; ++i) {
                _tile_stored(0, cout, 64);
                __m512i a = _mm512_load_si512(cout[0]);
                __asm__ volatile("" : "+v"(a));
            }
        });
        _tile_release();
    }
    config(2);
    _tile_loadd(4, bufA, 64);
    _tile_zero(0);
    _tile_zero(1);
    for (int mode = -1; mode < 4; ++mode) {
        static const char* names[5] = {"tile step: decode 256 w, no stores", "tile step: decode 256 w + 16 stores",
                                       "tile step: + tileloadd B",
                                       "tile step: + tileloadd B + tdpbsud", "tile step: + tileloadd A, B + tdpbsud"};
        cycles_per(names[mode + 1], 1000000, 1, [mode](long n) {
            __m512i z0 = _mm512_set1_epi64(0x0123456789abcdefLL), z1 = _mm512_set1_epi64(0x1122334455667788LL);
            __m512i perm[4], msh[8];
            for (int i = 0; i < 4; ++i) perm[i] = _mm512_set1_epi8(char(17 * i + 3));
            for (int i = 0; i < 8; ++i) msh[i] = _mm512_set1_epi8(char(5 * i + 1));
            const __m512i ml = _mm512_set1_epi16(short(0xD12D)), mh = _mm512_set1_epi16(short(0x83DC));
            for (long i = 0; i < n; ++i) {
                uint8_t* bt = bufB[i & 7][0];
                for (int qp = 0; qp < 4; ++qp) {
                    const __m512i s2 = _mm512_permutex2var_epi8(z0, perm[qp], z1);
                    for (int h = 0; h < 2; ++h) {
                        const __m512i st = _mm512_multishift_epi64_epi8(msh[2 * qp + h], s2);
                        const __m512i plo = _mm512_mullo_epi16(st, ml);
                        const __m512i phi = _mm512_add_epi16(_mm512_mulhi_epu16(st, ml), _mm512_mullo_epi16(st, mh));
                        if (mode >= 0) {
                            _mm512_store_si512(bt + 64 * (2 * qp + h), plo);
                            _mm512_store_si512(bt + 64 * (8 + 2 * qp + h), phi);
                        } else {
                            __asm__ volatile("" ::"v"(plo), "v"(phi));  // computed, not stored
                        }
                    }
                }
                z0 = _mm512_add_epi64(z0, z1);
                BAR();
                if (mode >= 1) {
                    if (i & 1) _tile_loadd(6, bufB[(i + 4) & 7], 64);
                    else _tile_loadd(7, bufB[(i + 4) & 7], 64);
                }
                if (mode == 3) _tile_loadd(4, bufA, 64);
                if (mode >= 2) {
                    if (i & 1) _tile_dpbsud(0, 4, 6);
                    else _tile_dpbsud(1, 4, 7);
                }
            }
        });
    }
    _tile_release();
    cycles_per("ldtilecfg + tilerelease", 200000, 1, [](long n) {
        for (long i = 0; i < n; ++i) {
            config(2);
            _tile_release();
        }
    });
    return 0;
}
