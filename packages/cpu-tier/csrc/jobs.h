// Jobs run by the pool: one EXL3 linear over m rows (exl3_matmul), and one MoE layer's routed picks.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "kernel.h"
#include "ops.h"
#include "pool.h"

namespace cpu_tier {
namespace CPU_TIER_NS {

// Prepared activations of one linear for up to MAXM tokens, carved out of scratch memory.
struct ActBuf {
    float* xf = nullptr;    // [MAXM][k]  float path
    int16_t* xq = nullptr;  // [MAXM][k]  int path (one token)
    float* xs = nullptr;    // [MAXM][k/128] int path scales
    float* xsb = nullptr;   // [MAXM][k/128] per-block sums of the prepared activations
    float xsum[MAXM] = {};
    int k = 0;
    const Pool* pool = nullptr;  // Acts::amx of acts(m) = pool->amx_for(m)

    static size_t bytes(int k) { return size_t(MAXM) * (size_t(k) * 4 + size_t(k) * 2 + size_t(k / 128) * 8) + 256; }
    void carve(uint8_t*& p, int k_, const Pool& pool_) {
        k = k_;
        pool = &pool_;
        auto take = [&](size_t n) {
            uint8_t* r = p;
            p += (n + 63) & ~size_t(63);
            return r;
        };
        xf = reinterpret_cast<float*>(take(size_t(MAXM) * k * 4));
        xq = reinterpret_cast<int16_t*>(take(size_t(MAXM) * k * 2));
        xs = reinterpret_cast<float*>(take(size_t(MAXM) * (k / 128) * 4));
        xsb = reinterpret_cast<float*>(take(size_t(MAXM) * (k / 128) * 4));
    }
    Acts acts(int m) const {
        Acts a;
        a.m = m;
        a.xf = xf;
        a.xf_stride = size_t(k);
        a.xq = xq;
        a.xq_stride = size_t(k);
        a.xs = xs;
        a.xs_stride = size_t(k / 128);
        a.xsum = xsum;
        a.amx = pool != nullptr && pool->amx_for(m);
        if (pool != nullptr) a.pf_blocks = pool->prefetch_blocks();
        return a;
    }
    // The activations for blocks [blk0, blk1) only, MUL1 integer sums left raw (see Acts).
    Acts acts_range(int m, int blk0, int blk1, bool raw) const {
        Acts a = acts(m);
        a.blk0 = blk0;
        a.blk1 = blk1;
        a.raw = raw;
        return a;
    }
    // Prepare block b (128 inputs) of token slot s from x128 (input space).
    void prep_block(int s, int b, const float* x128, const uint16_t* suh_block, bool int_path) {
        if (int_path)
            xsb[s * (k / 128) + b] =
                prep_block_int(x128, suh_block, xq + size_t(s) * k + 128 * b, xs + size_t(s) * (k / 128) + b);
        else
            xsb[s * (k / 128) + b] = prep_block_float(x128, suh_block, xf + size_t(s) * k + 128 * b);
    }
    void finish_sums(int m) {
        for (int s = 0; s < m; ++s) {
            float t = 0.0f;
            for (int b = 0; b < k / 128; ++b) t += xsb[s * (k / 128) + b];
            xsum[s] = t;
        }
    }
};

inline size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

// Precision "fast": MUL1 runs the integer path (int16 activations); MCG / 3INST skip the fp16 rounding of the
// codebook value. "exact": exact fp16 codebook values, fp32 activations.
inline GemvMode gemv_mode(const MatRef& A, bool fast, int m) {
    (void)m;
    if (!fast) return GemvMode::Exact;
    return A.codebook == CB_MUL1 ? GemvMode::Int : GemvMode::Fast;
}

// ------------------------------------------------------------------------------------------- linear job
struct LinearJob : JobBase {
    MatRef A;
    const float* x = nullptr;  // [m][k]
    float* out = nullptr;      // [m][n]
    int m = 0;
    bool fast = false;
    int variant = 0;  // kernel form (Acts::variant; tests and benchmarks)

    void run(Pool& pool) override {
        const int nchunks = (m + MAXM - 1) / MAXM;
        const int nb = A.n / 128, kb = A.k / 128;
        std::vector<ActBuf> acts(static_cast<size_t>(nchunks));
        uint8_t* p = pool.scratch(size_t(nchunks) * ActBuf::bytes(A.k));
        for (auto& a : acts) a.carve(p, A.k, pool);
        // phase 1: input transform, one unit per (row, block group of 8 blocks)
        const int bgroups = (kb + 7) / 8;
        pool.parallel_for(m * bgroups, [&](int u, int) {
            const int row = u / bgroups, bg = u % bgroups;
            ActBuf& a = acts[size_t(row / MAXM)];
            const int mc = std::min(MAXM, m - (row / MAXM) * MAXM);
            const bool int_path = gemv_mode(A, fast, mc) == GemvMode::Int;
            for (int b = 8 * bg; b < std::min(kb, 8 * bg + 8); ++b)
                a.prep_block(row % MAXM, b, x + size_t(row) * A.k + 128 * b, A.suh + 128 * b, int_path);
        });
        for (int c = 0; c < nchunks; ++c) acts[size_t(c)].finish_sums(std::min(MAXM, m - c * MAXM));
        // phase 2: GEMV bands + output transform
        pool.parallel_for(nchunks * nb, [&](int u, int) {
            const int c = u / nb, band = u % nb;
            const int mc = std::min(MAXM, m - c * MAXM);
            alignas(64) float y[MAXM * 128];
            Acts X = acts[size_t(c)].acts(mc);
            X.variant = variant;
            gemv_band(A, band, X, gemv_mode(A, fast, mc), y);
            for (int s = 0; s < mc; ++s) {
                out_block(y + 128 * s, A.svh + 128 * band, A.bias ? A.bias + 128 * band : nullptr);
                std::memcpy(out + size_t(c * MAXM + s) * A.n + 128 * band, y + 128 * s, 128 * sizeof(float));
            }
        });
    }
};

// ----------------------------------------------------------------------------------------- MoE layer
struct ExpertMats {
    MatRef gate, up, down;
};

struct Layer {
    int H = 0, I = 0;
    float limit = std::numeric_limits<float>::infinity();  // SwiGLU clamp; inf = none
    std::vector<ExpertMats> experts;
};

struct MoeJob : JobBase {
    std::shared_ptr<const Layer> layer;
    const float* x = nullptr;  // [T][H]
    float* out = nullptr;      // [T][H]
    int T = 0;
    const int32_t* tokens = nullptr;
    const int32_t* experts = nullptr;
    const float* weights = nullptr;
    int P = 0;
    bool fast = false;
    int wave_chunks = 64;
    // Work split of the GEMVs: 0 = units of one 128-column band over all rows (k); S > 0 = units of S 128-row
    // blocks over all bands (the unit reads whole contiguous rows of the trellis, so the hardware prefetchers
    // stream it; partial sums per slab are added in the next phase).
    int slab_blocks = 0;
    int cancel_after_chunks = -1;  // test hook: cancel once this many chunks are complete (< 0: never)
    std::atomic<int> chunks_done{0};
    std::vector<uint8_t> computed;  // per pick: 1 when its weighted output is in `out`
    // statistics: wall time per phase (0 zero, 1 input transforms, 2 gate/up, 3 SwiGLU + down input, 4 down,
    // 5 weighted sum), summed over waves
    uint64_t t_start_ns = 0, t_end_ns = 0;
    uint64_t phase_ns[6] = {0, 0, 0, 0, 0, 0};

    struct Chunk {
        int expert = 0, m = 0;
        int pick[MAXM];
    };

    void run(Pool& pool) override {
        t_start_ns = now_ns();
        const Layer& L = *layer;
        const int H = L.H, I = L.I;
        const int nbI = I / 128, nbH = H / 128;
        computed.assign(size_t(P), 0);
        const uint64_t tp0 = now_ns();
        // phase 0: zero the output (also for a cancelled job: rows with no computed pick are zero)
        const int zrows = 8;
        pool.parallel_for((T + zrows - 1) / zrows, [&](int u, int) {
            const int r0 = u * zrows, r1 = std::min(T, r0 + zrows);
            std::memset(out + size_t(r0) * H, 0, size_t(r1 - r0) * H * sizeof(float));
        });
        phase_ns[0] += now_ns() - tp0;
        // Group picks by expert (stable), chunks of <= MAXM picks of one expert.
        std::vector<int> order(static_cast<size_t>(P));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return experts[a] < experts[b]; });
        std::vector<Chunk> chunks;
        for (int i = 0; i < P;) {
            Chunk c;
            c.expert = experts[order[size_t(i)]];
            c.m = 0;
            while (i < P && c.m < MAXM && experts[order[size_t(i)]] == c.expert) c.pick[c.m++] = order[size_t(i++)];
            chunks.push_back(c);
        }
        const int nchunks_total = int(chunks.size());
        // Scratch per chunk of a wave.
        const size_t act_gu = ActBuf::bytes(H), act_d = ActBuf::bytes(I);
        const size_t ybytes = align64(size_t(MAXM) * I * 4);
        const size_t ydbytes = align64(size_t(MAXM) * H * 4);
        const bool split = slab_blocks > 0;
        const int kbH_ = H / 128, kbI_ = I / 128;
        const int SB = std::max(1, slab_blocks);
        const int nsH = split ? (kbH_ + SB - 1) / SB : 0, nsI = split ? (kbI_ + SB - 1) / SB : 0;
        // split: per chunk, partial sums [slab][token slot][n] of gate, up (n = I) and down (n = H)
        auto partbytes = [&](int m) { return split ? align64(size_t(m) * (2 * size_t(nsH) * I + size_t(nsI) * H) * 4) : 0; };
        const int W = std::max(1, wave_chunks);
        const size_t per_chunk = 2 * act_gu + act_d + 2 * ybytes + ydbytes;
        size_t wave_bytes = 0;  // the largest wave's scratch
        for (int w0 = 0; w0 < nchunks_total; w0 += W) {
            size_t b = 0;
            for (int c = w0; c < std::min(nchunks_total, w0 + W); ++c) b += per_chunk + partbytes(chunks[size_t(c)].m);
            wave_bytes = std::max(wave_bytes, b);
        }
        uint8_t* scratch = pool.scratch(std::max(wave_bytes, per_chunk));
        for (int w0 = 0; w0 < nchunks_total; w0 += W) {
            if (cancelled.load(std::memory_order_relaxed)) break;
            const int nch = std::min(W, nchunks_total - w0);
            const Chunk* ch = chunks.data() + w0;
            std::vector<ActBuf> agu(static_cast<size_t>(2 * nch)), ad(static_cast<size_t>(nch));
            std::vector<float*> yg(static_cast<size_t>(nch)), yu(static_cast<size_t>(nch)), yd(static_cast<size_t>(nch));
            std::vector<float*> pg(static_cast<size_t>(nch)), pu(static_cast<size_t>(nch)), pd(static_cast<size_t>(nch));
            uint8_t* p = scratch;
            for (int c = 0; c < nch; ++c) {
                agu[size_t(2 * c)].carve(p, H, pool);
                agu[size_t(2 * c + 1)].carve(p, H, pool);
                ad[size_t(c)].carve(p, I, pool);
                yg[size_t(c)] = reinterpret_cast<float*>(p);
                p += ybytes;
                yu[size_t(c)] = reinterpret_cast<float*>(p);
                p += ybytes;
                yd[size_t(c)] = reinterpret_cast<float*>(p);
                p += ydbytes;
                if (split) {
                    const int m = ch[c].m;
                    pg[size_t(c)] = reinterpret_cast<float*>(p);
                    pu[size_t(c)] = pg[size_t(c)] + size_t(nsH) * m * I;
                    pd[size_t(c)] = pu[size_t(c)] + size_t(nsH) * m * I;
                    p += partbytes(m);
                }
            }
            // split: completed slabs per chunk (gate + up, down) and SwiGLU blocks; a later phase uses a chunk only
            // when everything it depends on is complete (units skipped after a cancel leave it incomplete)
            std::vector<std::atomic<int>> gu_slabs(static_cast<size_t>(nch)), d_slabs(static_cast<size_t>(nch)),
                sw_blocks(static_cast<size_t>(nch));
            for (int c = 0; c < nch; ++c) {
                gu_slabs[size_t(c)].store(0);
                d_slabs[size_t(c)].store(0);
                sw_blocks[size_t(c)].store(0);
            }
            // finish one band of a split GEMV: sum the slabs' partials, MUL1 integer affine map, output transform
            auto finish_band = [&](const MatRef& A, const float* part, int nslab, int m, int s, int n, int band,
                                   bool int_path, float xsum, float* dst) {
                alignas(64) float t[128];
                for (int i = 0; i < 128; ++i) t[i] = 0.0f;
                for (int sl = 0; sl < nslab; ++sl) {
                    const float* src = part + (size_t(sl) * m + s) * n + 128 * band;
                    for (int i = 0; i < 128; ++i) t[i] += src[i];
                }
                if (int_path) {
                    const float aff = MUL1_K_AFF * xsum;
                    for (int i = 0; i < 128; ++i) t[i] = t[i] * MUL1_K_INV + aff;
                }
                out_block(t, A.svh + 128 * band, A.bias ? A.bias + 128 * band : nullptr);
                std::memcpy(dst, t, 128 * sizeof(float));
            };
            std::vector<std::atomic<int>> down_done(static_cast<size_t>(nch));
            for (auto& d : down_done) d.store(0);
            auto mats = [&](int c) -> const ExpertMats& { return L.experts[size_t(ch[c].expert)]; };
            auto is_int = [&](const MatRef& A, int c) { return gemv_mode(A, fast, ch[c].m) == GemvMode::Int; };

            const uint64_t tp1 = now_ns();
            // phase 1: gate/up input transforms; unit = (chunk, token slot in use, proj, group of 8 blocks)
            const int kbH = H / 128, bgH = (kbH + 7) / 8;
            std::vector<int> slots;  // c * MAXM + s for the slots in use
            for (int c = 0; c < nch; ++c)
                for (int s = 0; s < ch[c].m; ++s) slots.push_back(c * MAXM + s);
            pool.parallel_for(int(slots.size()) * 2 * bgH, [&](int u, int) {
                if (cancelled.load(std::memory_order_relaxed)) return;
                const int bg = u % bgH;
                const int proj = (u / bgH) % 2;
                const int cs = slots[size_t(u / bgH / 2)];
                const int c = cs / MAXM, s = cs % MAXM;
                const MatRef& A = proj == 0 ? mats(c).gate : mats(c).up;
                const float* xr = x + size_t(tokens[ch[c].pick[s]]) * H;
                ActBuf& a = agu[size_t(2 * c + proj)];
                for (int b = 8 * bg; b < std::min(kbH, 8 * bg + 8); ++b)
                    a.prep_block(s, b, xr + 128 * b, A.suh + 128 * b, is_int(A, c));
            });
            for (int c = 0; c < nch; ++c) {
                agu[size_t(2 * c)].finish_sums(ch[c].m);
                agu[size_t(2 * c + 1)].finish_sums(ch[c].m);
            }
            phase_ns[1] += now_ns() - tp1;
            const uint64_t tp2 = now_ns();
            // phase 2: gate and up GEMV bands + output transforms
            if (split) {
                pool.parallel_for(nch * 2 * nsH, [&](int u, int) {
                    if (cancelled.load(std::memory_order_relaxed)) return;
                    const int sl = u % nsH, proj = (u / nsH) % 2, c = u / nsH / 2;
                    const MatRef& A = proj == 0 ? mats(c).gate : mats(c).up;
                    const int m = ch[c].m;
                    const bool ip = is_int(A, c);
                    const Acts X = agu[size_t(2 * c + proj)].acts_range(m, sl * SB, std::min(kbH_, (sl + 1) * SB), ip);
                    float* part = (proj == 0 ? pg[size_t(c)] : pu[size_t(c)]) + size_t(sl) * m * I;
                    alignas(64) float y[MAXM * 128];
                    for (int band = 0; band < nbI; ++band) {
                        gemv_band(A, band, X, gemv_mode(A, fast, m), y);
                        for (int s = 0; s < m; ++s) std::memcpy(part + size_t(s) * I + 128 * band, y + 128 * s, 128 * sizeof(float));
                    }
                    gu_slabs[size_t(c)].fetch_add(1, std::memory_order_acq_rel);
                });
            } else {
                pool.parallel_for(nch * 2 * nbI, [&](int u, int) {
                    if (cancelled.load(std::memory_order_relaxed)) return;
                    const int band = u % nbI, proj = (u / nbI) % 2, c = u / nbI / 2;
                    const MatRef& A = proj == 0 ? mats(c).gate : mats(c).up;
                    const int m = ch[c].m;
                    alignas(64) float y[MAXM * 128];
                    gemv_band(A, band, agu[size_t(2 * c + proj)].acts(m), gemv_mode(A, fast, m), y);
                    float* dst = proj == 0 ? yg[size_t(c)] : yu[size_t(c)];
                    for (int s = 0; s < m; ++s) {
                        out_block(y + 128 * s, A.svh + 128 * band, A.bias ? A.bias + 128 * band : nullptr);
                        std::memcpy(dst + size_t(s) * I + 128 * band, y + 128 * s, 128 * sizeof(float));
                    }
                });
            }
            phase_ns[2] += now_ns() - tp2;
            const uint64_t tp3 = now_ns();
            // phase 3: clamped SwiGLU + down input transform, unit = (chunk, block of I)
            pool.parallel_for(nch * nbI, [&](int u, int) {
                if (cancelled.load(std::memory_order_relaxed)) return;
                const int b = u % nbI, c = u / nbI;
                const MatRef& D = mats(c).down;
                alignas(64) float a[128];
                if (split) {
                    if (gu_slabs[size_t(c)].load(std::memory_order_acquire) != 2 * nsH) return;
                    const ExpertMats& E = mats(c);
                    for (int s = 0; s < ch[c].m; ++s) {
                        finish_band(E.gate, pg[size_t(c)], nsH, ch[c].m, s, I, b, is_int(E.gate, c),
                                    agu[size_t(2 * c)].xsum[s], yg[size_t(c)] + size_t(s) * I + 128 * b);
                        finish_band(E.up, pu[size_t(c)], nsH, ch[c].m, s, I, b, is_int(E.up, c),
                                    agu[size_t(2 * c + 1)].xsum[s], yu[size_t(c)] + size_t(s) * I + 128 * b);
                    }
                }
                for (int s = 0; s < ch[c].m; ++s) {
                    swiglu(yg[size_t(c)] + size_t(s) * I + 128 * b, yu[size_t(c)] + size_t(s) * I + 128 * b, a, 128,
                           L.limit);
                    ad[size_t(c)].prep_block(s, b, a, D.suh + 128 * b, is_int(D, c));
                }
                if (split) sw_blocks[size_t(c)].fetch_add(1, std::memory_order_acq_rel);
            });
            for (int c = 0; c < nch; ++c) ad[size_t(c)].finish_sums(ch[c].m);
            phase_ns[3] += now_ns() - tp3;
            const uint64_t tp4 = now_ns();
            // phase 4: down GEMV bands + output transform
            if (split) {
                pool.parallel_for(nch * nsI, [&](int u, int) {
                    if (cancelled.load(std::memory_order_relaxed)) return;
                    const int sl = u % nsI, c = u / nsI;
                    if (sw_blocks[size_t(c)].load(std::memory_order_acquire) != nbI) return;
                    const MatRef& D = mats(c).down;
                    const int m = ch[c].m;
                    const Acts X = ad[size_t(c)].acts_range(m, sl * SB, std::min(kbI_, (sl + 1) * SB), is_int(D, c));
                    float* part = pd[size_t(c)] + size_t(sl) * m * H;
                    alignas(64) float y[MAXM * 128];
                    for (int band = 0; band < nbH; ++band) {
                        gemv_band(D, band, X, gemv_mode(D, fast, m), y);
                        for (int s = 0; s < m; ++s) std::memcpy(part + size_t(s) * H + 128 * band, y + 128 * s, 128 * sizeof(float));
                    }
                    d_slabs[size_t(c)].fetch_add(1, std::memory_order_acq_rel);
                });
                // the down outputs: sum of the slabs, affine map, output transform; unit = (chunk, band)
                pool.parallel_for(nch * nbH, [&](int u, int) {
                    if (cancelled.load(std::memory_order_relaxed)) return;
                    const int band = u % nbH, c = u / nbH;
                    if (d_slabs[size_t(c)].load(std::memory_order_acquire) != nsI) return;
                    const MatRef& D = mats(c).down;
                    for (int s = 0; s < ch[c].m; ++s)
                        finish_band(D, pd[size_t(c)], nsI, ch[c].m, s, H, band, is_int(D, c), ad[size_t(c)].xsum[s],
                                    yd[size_t(c)] + size_t(s) * H + 128 * band);
                    if (down_done[size_t(c)].fetch_add(1, std::memory_order_acq_rel) + 1 == nbH && cancel_after_chunks >= 0 &&
                        chunks_done.fetch_add(1) + 1 >= cancel_after_chunks)
                        cancelled.store(true);
                });
            } else {
                pool.parallel_for(nch * nbH, [&](int u, int) {
                    if (cancelled.load(std::memory_order_relaxed)) return;
                    const int band = u % nbH, c = u / nbH;
                    const MatRef& D = mats(c).down;
                    const int m = ch[c].m;
                    alignas(64) float y[MAXM * 128];
                    gemv_band(D, band, ad[size_t(c)].acts(m), gemv_mode(D, fast, m), y);
                    for (int s = 0; s < m; ++s) {
                        out_block(y + 128 * s, D.svh + 128 * band, D.bias ? D.bias + 128 * band : nullptr);
                        std::memcpy(yd[size_t(c)] + size_t(s) * H + 128 * band, y + 128 * s, 128 * sizeof(float));
                    }
                    if (down_done[size_t(c)].fetch_add(1, std::memory_order_acq_rel) + 1 == nbH && cancel_after_chunks >= 0 &&
                        chunks_done.fetch_add(1) + 1 >= cancel_after_chunks)
                        cancelled.store(true);
                });
            }
            phase_ns[4] += now_ns() - tp4;
            const uint64_t tp5 = now_ns();
            // phase 5: weighted sum into out for the complete chunks; unit = (token, column chunk of 512)
            struct Entry {
                int token, c, s;
                float w;
            };
            std::vector<Entry> ent;
            for (int c = 0; c < nch; ++c) {
                if (down_done[size_t(c)].load() != nbH) continue;
                for (int s = 0; s < ch[c].m; ++s) {
                    const int pk = ch[c].pick[s];
                    ent.push_back({tokens[pk], c, s, weights[pk]});
                    computed[size_t(pk)] = 1;
                }
            }
            std::stable_sort(ent.begin(), ent.end(), [](const Entry& a, const Entry& b) { return a.token < b.token; });
            std::vector<int> starts;
            for (size_t i = 0; i < ent.size(); ++i)
                if (i == 0 || ent[i].token != ent[i - 1].token) starts.push_back(int(i));
            starts.push_back(int(ent.size()));
            const int ntok = int(starts.size()) - 1;
            const int cc = 512, ncc = (H + cc - 1) / cc;
            pool.parallel_for(ntok * ncc, [&](int u, int) {
                const int ti = u / ncc, col0 = (u % ncc) * cc, col1 = std::min(H, col0 + cc);
                float* o = out + size_t(ent[size_t(starts[size_t(ti)])].token) * H;
                for (int e = starts[size_t(ti)]; e < starts[size_t(ti) + 1]; ++e) {
                    const Entry& en = ent[size_t(e)];
                    const float* src = yd[size_t(en.c)] + size_t(en.s) * H;
                    const float w = en.w;
                    for (int i = col0; i < col1; ++i) o[i] += w * src[i];
                }
            });
            phase_ns[5] += now_ns() - tp5;
        }
        t_end_ns = now_ns();
    }
};

}  // namespace CPU_TIER_NS
}  // namespace cpu_tier
