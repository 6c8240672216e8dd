// The ds4 CUDA kernels built for the host under shim.h, with one C entry point per kernel for the Rust tests
// (tests/tests/cuda_host_shim.rs): `shim_<kernel>(grid, block, <kernel arguments>)` runs the launch to completion.

#include "shim.h"

#if defined(__x86_64__) && defined(__linux__)
#define DS4_FIBER_ASM 1
#else
#include <ucontext.h>
#endif

#include <memory>
#include <mutex>
#include <vector>

namespace ds4shim {

thread_local dim3 tl_thread = {0, 0, 0}, tl_block = {0, 0, 0};
dim3 g_block_dim = {1, 1, 1}, g_grid_dim = {1, 1, 1};

namespace {

// The CUDA threads of a launch are fibers on the launching OS thread, run in turn by `launch`: a fiber runs
// until it waits at a barrier or finishes, then the next one runs. A barrier completes when its last participant
// arrives; its waiters then resume on their next turn. On x86-64 Linux a switch saves the callee-saved registers
// and swaps stacks (`ds4_fiber_switch`, no system call); elsewhere it is ucontext's swapcontext.
constexpr size_t kStack = 256 * 1024;

#if DS4_FIBER_ASM
// Saves rbp, rbx, r12-r15 on the current stack, stores the stack pointer at *from, loads `to` and restores the
// same registers from it, then returns into that fiber.
extern "C" void ds4_fiber_switch(void** from, void* to);
asm(R"(
    .text
    .globl ds4_fiber_switch
    .type ds4_fiber_switch, @function
ds4_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ds4_fiber_switch, .-ds4_fiber_switch
)");
struct Context {
    void* sp = nullptr;
};
#else
using Context = ucontext_t;
#endif

struct Fiber {
    Context ctx;
    dim3 thread, block;
    unsigned linear = 0, phase = 0;
    bool done = false;
};

// Fiber stacks, kept from one launch to the next (launches are serialised by g_launch_mutex).
std::vector<std::unique_ptr<char[]>> g_stacks;

struct Launch;
Launch* g_launch = nullptr;
thread_local unsigned tl_linear = 0;
thread_local unsigned tl_phase = 0;
std::mutex g_launch_mutex;

struct Barrier {
    unsigned n = 0, count = 0;
    uint64_t gen = 0;
    const char* what = "";
    void wait();
};

struct Warp {
    Barrier bar;
    uint64_t slots[2][32] = {};
};

struct Launch {
    Barrier block_bar;  // __syncthreads
    Barrier cta_bar;    // between CTAs
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<Fiber> fibers;
    Context sched;
    unsigned cur = 0;
    uint64_t progress = 0;  // arrivals and finished fibers: a round without any is a deadlock
    const char* waiting = "";
    void (*body)(void*) = nullptr;
    void* ctx = nullptr;
};

void switch_to(Context* from, Context* to) {
#if DS4_FIBER_ASM
    ds4_fiber_switch(&from->sp, to->sp);
#else
    swapcontext(from, to);
#endif
}

void yield_to_scheduler() {
    Launch& l = *g_launch;
    switch_to(&l.fibers[l.cur].ctx, &l.sched);
}

void Barrier::wait() {
    Launch& l = *g_launch;
    ++l.progress;
    const uint64_t g = gen;
    if (++count == n) {
        count = 0;
        ++gen;
        return;
    }
    while (gen == g) {
        l.waiting = what;
        yield_to_scheduler();
    }
}

void fiber_main() {
    Launch& l = *g_launch;
    const dim3 grid = g_grid_dim;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                tl_block = {x, y, z};
                l.body(l.ctx);
                l.cta_bar.wait();
            }
    l.fibers[l.cur].done = true;
    ++l.progress;
#if DS4_FIBER_ASM
    // A finished fiber never runs again: switch away for good.
    yield_to_scheduler();
    std::abort();
#endif
    // (ucontext: returning resumes uc_link, the scheduler.)
}

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
    l.body = body;
    l.ctx = ctx;
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
    l.fibers.resize(nt);
    for (unsigned i = 0; i < nt; ++i) {
        Fiber& f = l.fibers[i];
        f.linear = i;
        f.thread = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        if (g_stacks.size() <= i) g_stacks.emplace_back(new char[kStack]);
#if DS4_FIBER_ASM
        // The first switch pops six zero registers and returns into fiber_main with the stack pointer at 8 mod
        // 16, as a call leaves it.
        uintptr_t top = ((uintptr_t)g_stacks[i].get() + kStack) & ~(uintptr_t)15;
        void** sp = (void**)top;
        *--sp = nullptr;  // fiber_main's (never used) return address slot keeps the alignment
        *--sp = (void*)&fiber_main;
        for (int r = 0; r < 6; ++r) *--sp = nullptr;
        f.ctx.sp = sp;
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks[i].get();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = &l.sched;
        makecontext(&f.ctx, fiber_main, 0);
#endif
    }
    const dim3 saved_thread = tl_thread, saved_block = tl_block;
    for (unsigned alive = nt; alive > 0;) {
        const uint64_t before = l.progress;
        alive = 0;
        for (unsigned i = 0; i < nt; ++i) {
            Fiber& f = l.fibers[i];
            if (f.done) continue;
            l.cur = i;
            tl_thread = f.thread;
            tl_block = f.block;
            tl_linear = f.linear;
            tl_phase = f.phase;
            switch_to(&l.sched, &f.ctx);
            f.block = tl_block;
            f.phase = tl_phase;
            alive += f.done ? 0 : 1;
        }
        if (alive > 0 && l.progress == before) {
            std::fprintf(stderr, "ds4 host shim: %s barrier can never complete: a kernel broke the shim's rules\n",
                         l.waiting);
            std::abort();
        }
    }
    tl_thread = saved_thread;
    tl_block = saved_block;
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
#include "../hc.cu"

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
SHIM(ds4_moe_route,
     (const float* logits, const float* bias, const i32* table, const i32* tokens, i32* ids, float* rw, int n, int ne,
      int k, int norm, float scale),
     (logits, bias, table, tokens, ids, rw, n, ne, k, norm, scale))
SHIM(ds4_add, (float* y, const float* x, i64 n), (y, x, n))
SHIM(ds4_gather_rows, (const float* x, const i32* rows, float* y, int width, int n), (x, rows, y, width, n))
SHIM(ds4_embed, (const u8* table, int ty, i64 row_bytes, const i32* tokens, float* streams, int d, int hc, int n),
     (table, ty, row_bytes, tokens, streams, d, hc, n))
SHIM(ds4_hc_weights,
     (const float* mix, int mix_stride, const float* base, const float* scale, int hc, float eps, int iters, float* pre,
      float* postcomb, int n),
     (mix, mix_stride, base, scale, hc, eps, iters, pre, postcomb, n))
SHIM(ds4_hc_head_weights, (const float* mix, const float* base, float scale, int hc, float eps, float* pre, int n),
     (mix, base, scale, hc, eps, pre, n))
SHIM(ds4_hc_collapse, (const float* x, const float* pre, float* u, int hc, int d), (x, pre, u, hc, d))
SHIM(ds4_hc_post, (float* x, const float* f, const float* postcomb, int hc, int d), (x, f, postcomb, hc, d))
SHIM(ds4_top_candidates, (const float* x, int vocab, int k, u32* ids, float* vals), (x, vocab, k, ids, vals))
