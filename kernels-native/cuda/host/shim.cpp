// The ds4 CUDA kernels built for the host under shim.h, with one C entry point per kernel for the Rust tests
// (tests/tests/cuda_host_shim.rs): `shim_<kernel>(grid, block, <kernel arguments>)` runs the launch to completion.

#include "shim.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ds4shim {

thread_local dim3 tl_thread = {0, 0, 0}, tl_block = {0, 0, 0};
dim3 g_block_dim = {1, 1, 1}, g_grid_dim = {1, 1, 1};

namespace {

struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    unsigned n = 0, count = 0;
    uint64_t gen = 0;
    const char* what = "";
    void wait() {
        std::unique_lock<std::mutex> l(m);
        const uint64_t g = gen;
        if (++count == n) {
            count = 0;
            ++gen;
            cv.notify_all();
            return;
        }
        if (!cv.wait_for(l, std::chrono::seconds(20), [&] { return gen != g; })) {
            std::fprintf(stderr, "ds4 host shim: %s barrier timed out: a kernel broke the shim's rules\n", what);
            std::abort();
        }
    }
};

struct Warp {
    Barrier bar;
    uint64_t slots[2][32] = {};
};

struct Launch {
    Barrier block_bar;  // __syncthreads
    Barrier cta_bar;    // between CTAs
    std::vector<std::unique_ptr<Warp>> warps;
};

Launch* g_launch = nullptr;
thread_local unsigned tl_linear = 0;
thread_local unsigned tl_phase = 0;
std::mutex g_launch_mutex;

}  // namespace

void sync_block() { g_launch->block_bar.wait(); }
void sync_warp() { g_launch->warps[tl_linear / 32]->bar.wait(); }
uint64_t* warp_slots() {
    tl_phase ^= 1;
    return g_launch->warps[tl_linear / 32]->slots[tl_phase];
}

void launch(dim3 grid, dim3 block, void (*body)(void*), void* ctx) {
    std::lock_guard<std::mutex> guard(g_launch_mutex);
    const unsigned nt = block.x * block.y * block.z;
    if (nt == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) return;
    Launch l;
    l.block_bar.n = nt;
    l.block_bar.what = "__syncthreads";
    l.cta_bar.n = nt;
    l.cta_bar.what = "end-of-CTA";
    for (unsigned w = 0; w < (nt + 31) / 32; ++w) {
        l.warps.emplace_back(new Warp());
        l.warps.back()->bar.n = (w + 1) * 32 <= nt ? 32 : nt - w * 32;
        l.warps.back()->bar.what = "warp shuffle";
    }
    g_launch = &l;
    g_block_dim = block;
    g_grid_dim = grid;
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (unsigned i = 0; i < nt; ++i) {
        threads.emplace_back([&, i] {
            tl_linear = i;
            tl_phase = 0;
            tl_thread = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        tl_block = {x, y, z};
                        body(ctx);
                        l.cta_bar.wait();
                    }
        });
    }
    for (auto& t : threads) t.join();
    g_launch = nullptr;
}

}  // namespace ds4shim

#include "../common.cuh"
#include "../iq2_grid.cuh"
#include "../blocks.cuh"
#include "../quant.cu"
#include "../matvec.cu"
#include "../moe.cu"
#include "../rowops.cu"

using ds4shim::dim3;

#define DS4_UNPAREN(...) __VA_ARGS__
#define SHIM(name, params, args)                                                                     \
    extern "C" void shim_##name(const dim3* grid, const dim3* block, DS4_UNPAREN params) {         \
        ds4shim::run(*grid, *block, [&] { name args; });                                             \
    }

SHIM(ds4_quantize_q8_0, (const float* x, i8* q, float* d, int nblocks), (x, q, d, nblocks))
SHIM(ds4_quantize_q8_k, (const float* x, i8* q, float* d, i32* bs, int nblocks), (x, q, d, bs, nblocks))

#define SHIM_MATVEC(name)                                                                                      \
    SHIM(name, (const u8* W, const i8* aq, const float* ad, const i32* bs, float* y, int rows, int cols, int ntok), \
         (W, aq, ad, bs, y, rows, cols, ntok))
SHIM_MATVEC(ds4_matvec_q8_0_b1)
SHIM_MATVEC(ds4_matvec_q8_0_b2)
SHIM_MATVEC(ds4_matvec_q8_0_b4)
SHIM_MATVEC(ds4_matvec_q8_0_b8)
SHIM_MATVEC(ds4_matvec_iq2_xxs_b1)
SHIM_MATVEC(ds4_matvec_iq2_xxs_b4)
SHIM_MATVEC(ds4_matvec_q2_k_b1)
SHIM_MATVEC(ds4_matvec_q2_k_b4)
SHIM_MATVEC(ds4_matvec_q4_k_b1)
SHIM_MATVEC(ds4_matvec_q4_k_b4)

SHIM(ds4_matvec_f16_b1, (const u16* W, const float* x, float* y, int rows, int cols, int ntok),
     (W, x, y, rows, cols, ntok))
SHIM(ds4_matvec_f16_b4, (const u16* W, const float* x, float* y, int rows, int cols, int ntok),
     (W, x, y, rows, cols, ntok))

#define SHIM_TERMS(name) \
    SHIM(name, (const u8* w, int nb, const i8* aq, const float* ad, const i32* bs, float* out), (w, nb, aq, ad, bs, out))
SHIM_TERMS(ds4_block_terms_q8_0)
SHIM_TERMS(ds4_block_terms_iq2_xxs)
SHIM_TERMS(ds4_block_terms_q2_k)
SHIM_TERMS(ds4_block_terms_q4_k)

#define SHIM_MOE(sfx)                                                                                              \
    SHIM(ds4_moe_gate_up_##sfx,                                                                                    \
         (const u8* gate, const u8* up, i64 expert_bytes, int n_experts, const i8* aq, const float* ad,            \
          const i32* bs, const i32* ids, const float* rw, float* h, int ffn, int cols, int n_used, float limit),    \
         (gate, up, expert_bytes, n_experts, aq, ad, bs, ids, rw, h, ffn, cols, n_used, limit))                    \
    SHIM(ds4_moe_down_sum_##sfx,                                                                                   \
         (const u8* down, i64 expert_bytes, int n_experts, const i8* hq, const float* hd, const i32* hbs,          \
          const i32* ids, const float* rw, float* out, int d_model, int ffn, int n_used),                          \
         (down, expert_bytes, n_experts, hq, hd, hbs, ids, rw, out, d_model, ffn, n_used))
SHIM_MOE(iq2_xxs)
SHIM_MOE(q2_k)
SHIM_MOE(q4_k)

SHIM(ds4_rms_norm, (const float* x, const float* w, float* y, int width, float eps), (x, w, y, width, eps))
SHIM(ds4_rope,
     (float* x, const float* inv_freq, const i32* pos, int width, int heads, int half, int inverse, int nvec),
     (x, inv_freq, pos, width, heads, half, inverse, nvec))
SHIM(ds4_swiglu, (float* g, const float* u, i64 n, float limit), (g, u, n, limit))
