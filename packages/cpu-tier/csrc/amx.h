// AMX (Advanced Matrix Extensions) for the avx512 variant: tile configuration, the OS permission request, and
// the tile instructions the kernels use, behind CT_TILE_* macros so the test-only emulated module (CT_EMU512)
// runs the same kernel code on a scalar model of the tile registers.
//
// Tiles are rows x colsb bytes (<= 16 x 64), configured per thread by LDTILECFG. TDPBSUD dst, a, b:
//   dst.row[m].dword[n] += sum_{k < a.colsb/4} sum_{i < 4} int8(a.row[m].byte[4k+i]) * uint8(b.row[k].byte[4n+i])
// Linux grants a process the 8 KiB tile-data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it the
// first tile instruction faults (SIGILL).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(CPU_TIER_ISA_AVX512) && !defined(CT_EMU512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>
#define CT_HAVE_AMX 1  // real tile instructions
#elif defined(CPU_TIER_ISA_AVX512) && defined(CT_EMU512)
#define CT_HAVE_AMX 1  // emulated
#endif

namespace cpu_tier {

// The 64-byte LDTILECFG operand (palette 1).
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG operand is 64 bytes");

// Ask Linux for the AMX tile-data state for this process (idempotent). Returns "" when granted, else the reason.
inline std::string amx_request_permission() {
#if defined(__linux__) && defined(__x86_64__)
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        return "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) was refused (kernel without AMX support, or AMX disabled)";
    return "";
#else
    return "AMX needs Linux on x86-64";
#endif
}

#if defined(CT_EMU512)
namespace emu {

// Test hook: while set, the emulated TDPBSUD drops its last K group (a mutation the tests must detect).
inline std::atomic<bool>& tile_fault_injection() {
    static std::atomic<bool> on{false};
    return on;
}

struct TileState {
    TileConfig cfg;
    bool configured = false;
    alignas(64) uint8_t t[8][16][64];
};
inline TileState& tile_state() {
    static thread_local TileState s;
    return s;
}
[[noreturn]] inline void tile_fault(const char* what) { throw std::logic_error(std::string("emulated AMX: ") + what); }
inline void tile_check(int t) {
    TileState& s = tile_state();
    if (!s.configured) tile_fault("tile instruction before LDTILECFG");
    if (t < 0 || t > 7) tile_fault("tile register out of range");
    if (s.cfg.rows[t] == 0 || s.cfg.rows[t] > 16 || s.cfg.colsb[t] == 0 || s.cfg.colsb[t] > 64)
        tile_fault("tile register not configured");
}
inline void tile_loadconfig(const TileConfig* c) {
    TileState& s = tile_state();
    if (c->palette != 1) tile_fault("palette must be 1");
    s.cfg = *c;
    s.configured = true;
    std::memset(s.t, 0, sizeof(s.t));
}
inline void tile_release() {
    tile_state().configured = false;
}
inline void tile_zero(int t) {
    tile_check(t);
    std::memset(tile_state().t[t], 0, sizeof(tile_state().t[t]));
}
inline void tile_loadd(int t, const void* p, long stride) {
    tile_check(t);
    TileState& s = tile_state();
    std::memset(s.t[t], 0, sizeof(s.t[t]));
    for (int r = 0; r < s.cfg.rows[t]; ++r)
        std::memcpy(s.t[t][r], static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[t]);
}
inline void tile_stored(int t, void* p, long stride) {
    tile_check(t);
    TileState& s = tile_state();
    for (int r = 0; r < s.cfg.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[t][r], s.cfg.colsb[t]);
}
inline void tile_dpbsud(int c, int a, int b) {
    tile_check(c);
    tile_check(a);
    tile_check(b);
    TileState& s = tile_state();
    const TileConfig& g = s.cfg;
    if (g.rows[a] != g.rows[c] || g.colsb[b] != g.colsb[c] || g.colsb[a] != 4 * g.rows[b] || g.colsb[c] % 4)
        tile_fault("TDPBSUD shapes do not match");
    for (int m = 0; m < g.rows[c]; ++m)
        for (int n = 0; n < g.colsb[c] / 4; ++n) {
            int32_t acc;
            std::memcpy(&acc, s.t[c][m] + 4 * n, 4);
            const int kn = g.colsb[a] / 4 - (tile_fault_injection().load() ? 1 : 0);
            for (int k = 0; k < kn; ++k)
                for (int i = 0; i < 4; ++i)
                    acc += int32_t(int8_t(s.t[a][m][4 * k + i])) * int32_t(s.t[b][k][4 * n + i]);
            std::memcpy(s.t[c][m] + 4 * n, &acc, 4);
        }
}

}  // namespace emu
#define CT_TILE_LOADCONFIG(cfg) ::cpu_tier::emu::tile_loadconfig(cfg)
#define CT_TILE_RELEASE() ::cpu_tier::emu::tile_release()
#define CT_TILE_ZERO(t) ::cpu_tier::emu::tile_zero(t)
#define CT_TILE_LOADD(t, p, stride) ::cpu_tier::emu::tile_loadd(t, p, stride)
#define CT_TILE_STORED(t, p, stride) ::cpu_tier::emu::tile_stored(t, p, stride)
#define CT_TILE_DPBSUD(c, a, b) ::cpu_tier::emu::tile_dpbsud(c, a, b)
#elif defined(CT_HAVE_AMX)
// GCC's tile intrinsics stringize the tile number (pass literals) and tell the compiler nothing of the memory that
// ldtilecfg / tileloadd read (8 bytes / none): a compiler barrier first makes the stores before them happen.
#define CT_TILE_LOADCONFIG(cfg)              \
    do {                                     \
        __asm__ volatile("" ::: "memory");   \
        _tile_loadconfig(cfg);               \
    } while (0)
#define CT_TILE_RELEASE() _tile_release()
#define CT_TILE_ZERO(t) _tile_zero(t)
#define CT_TILE_LOADD(t, p, stride)          \
    do {                                     \
        __asm__ volatile("" ::: "memory");   \
        _tile_loadd(t, p, stride);           \
    } while (0)
#define CT_TILE_STORED(t, p, stride) _tile_stored(t, p, stride)
#define CT_TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#endif

}  // namespace cpu_tier
