// cupaged_rt.cpp: the CPU backend's runtime. Built once (per shim version and
// compiler) into its own shared library, loaded RTLD_GLOBAL before any kernel
// module, and shared by all of them: one worker pool per process.
//
// Model. Every CUDA thread is a fiber with its own 64 KiB stack (plus a
// PROT_NONE guard region); one OS thread (a worker) runs all fibers of one
// block, so block-scope __shared__ (static thread_local) is shared by the
// block and private to the worker. Blocks are spread over a persistent pool
// of workers through an atomic counter; launches are serialized by a mutex.
//
// Fibers are never pre-empted: a fiber runs until it exits or parks in a
// barrier or warp collective. A parked fiber switches straight to the next
// runnable one; when none is runnable the worker's scheduler context resumes
// and either the block is done or it is deadlocked, which is reported with
// the source lines where the threads wait (std::source_location passed from
// every call site).
#include "cupaged_rt.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__x86_64__) || defined(CUPAGED_FIBER_UCONTEXT)
#define CUPAGED_USE_UCONTEXT 1
#else
#define CUPAGED_USE_UCONTEXT 0
#endif
#include <ucontext.h>  // also for the fault handler's register state

#if defined(__SANITIZE_ADDRESS__)  // CUPAGED_CPU_ASAN=1: tell ASan about every stack switch
#define CUPAGED_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define CUPAGED_ASAN 0
#endif

namespace cupaged {
namespace {

// ---- context switch ---------------------------------------------------------
struct Ctx {
#if CUPAGED_USE_UCONTEXT
    ucontext_t uc;
#else
    void* sp;
#endif
#if CUPAGED_ASAN
    const void* stack_lo = nullptr;
    size_t stack_size = 0;
#endif
};
#if CUPAGED_USE_UCONTEXT
inline void raw_swap(Ctx* from, Ctx* to) { swapcontext(&from->uc, &to->uc); }
#else
extern "C" void cupaged_ctx_switch(void** save_sp, void* new_sp);
// Save the callee-saved registers on the current stack, store the stack
// pointer, load the other one and pop its registers. MXCSR and the x87 control
// word are the same for every fiber, so they are not switched.
asm(R"(
    .text
    .p2align 4
    .globl cupaged_ctx_switch
    .hidden cupaged_ctx_switch
    .type cupaged_ctx_switch,@function
cupaged_ctx_switch:
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
    .size cupaged_ctx_switch,.-cupaged_ctx_switch
)");
inline void raw_swap(Ctx* from, Ctx* to) { cupaged_ctx_switch(&from->sp, to->sp); }
#endif

// Switch stacks; `from_dies` when the current context is never resumed.
inline void swap_ctx(Ctx* from, Ctx* to, bool from_dies = false) {
#if CUPAGED_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(from_dies ? nullptr : &fake, to->stack_lo, to->stack_size);
    raw_swap(from, to);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    (void)from_dies;
    raw_swap(from, to);
#endif
}

// ---- state ------------------------------------------------------------------
enum State : unsigned char { kReady, kRunning, kWaitBarrier, kWaitWarp, kExited };

struct Worker;

struct Fiber {
    FiberPub pub;  // first: what kernels read through cur()
    Worker* w;
    unsigned lane, warp;
    State state;
    int kind;  // barrier or warp kind it waits in
    std::source_location site;
    unsigned mask;  // warp collective mask it waits with
    int b, width, pred;
    unsigned long long val, res;
    void* ptr;  // cupaged_warp_collective lane data
    void* cctx;  // cupaged_warp_collective context
    Ctx ctx;
    alignas(16) unsigned char local[kFiberLocalBytes];  // pub.local
};
static_assert(sizeof(Fiber) + (kColors - 1) * 64 <= kTop, "fiber state must fit the top of its region");

struct Pending {  // one warp collective that some lanes have reached
    unsigned mask, arrived;
    int kind;
    const void* fn;
    std::source_location site;
};

struct WarpRt {
    unsigned exists, exited, npend;
    Pending pend[32];
};

struct Launch {
    const char* kernel;
    unsigned grid[3], block[3], smem, nthreads;
    void (*fn)(void*);
    void* ctx;
    unsigned long long nblocks;
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};
    std::atomic<bool> cancel{false};  // SIGINT: no new block starts, running ones stop at their next collective
    std::mutex err_mu;
    std::string err;
    void fail(std::string msg) {
        std::lock_guard<std::mutex> g(err_mu);
        if (!failed.load()) {
            err = std::move(msg);
            failed.store(true);
        }
    }
};

struct Worker {
    unsigned index = 0;
    std::vector<Fiber*> fibers;  // capacity grows to the largest block seen
    void* smem = nullptr;  // dynamic shared memory, kMaxDynamicShared bytes
    char* altstack = nullptr;
    BlockPub pub{};
    Launch* L = nullptr;
    unsigned tid_dims[3] = {0, 0, 0};  // block shape the fibers' threadIdx were set for
    // block run state
    unsigned n = 0, live = 0;
    std::vector<Fiber*> runq;  // ring, power-of-two capacity
    unsigned qh = 0, qt = 0, qmask = 0;
    std::vector<Fiber*> barw;  // fibers waiting at the block barrier
    unsigned nbar = 0;
    struct Named {  // one named barrier (bar.sync / bar.arrive)
        unsigned count = 0, arrived = 0;  // its thread count (0: idle) and the arrivals since it last completed
        std::source_location site;  // where its first arrival came from
        std::vector<Fiber*> waiters;
    } named[kNamedBarriers];
    std::vector<WarpRt> warps;
    bool failed = false;
    std::string err;
    Ctx sched;
};

thread_local Worker* t_worker = nullptr;
thread_local std::string t_last_error;

inline Fiber* self() { return reinterpret_cast<Fiber*>(const_cast<FiberPub*>(cur())); }

inline void enqueue(Worker* w, Fiber* f) {
    f->state = kReady;
    w->runq[w->qt++ & w->qmask] = f;
}
// At the head of the queue: the next to run (a warp collective's lanes, so that one warp's fibers run
// back to back while their stacks are still in the cache).
inline void enqueue_front(Worker* w, Fiber* f) {
    f->state = kReady;
    w->runq[--w->qh & w->qmask] = f;
}
inline Fiber* dequeue(Worker* w) {
    if (w->qh == w->qt) return nullptr;
    return w->runq[w->qh++ & w->qmask];
}

// Switch from the current fiber to the next runnable one, or to the scheduler.
inline void switch_away(Worker* w, Ctx* save, bool dies = false) {
    Fiber* next = dequeue(w);
    if (next) {
        // The fibers to run after it: the saved stack of the next one (its state was fetched a switch ago)
        // and the state of the one after, while this switch runs.
        const unsigned queued = w->qt - w->qh;
#if !CUPAGED_USE_UCONTEXT
        if (queued > 0) __builtin_prefetch(w->runq[w->qh & w->qmask]->ctx.sp);
#endif
        if (queued > 1) {
            const char* later = reinterpret_cast<const char*>(w->runq[(w->qh + 1) & w->qmask]);
            __builtin_prefetch(later);
            __builtin_prefetch(later + 64);
        }
        next->state = kRunning;
        swap_ctx(save, &next->ctx, dies);
    } else {
        swap_ctx(save, &w->sched, dies);
    }
}

inline void park(Fiber* f) { switch_away(f->w, &f->ctx); }

// ---- messages ---------------------------------------------------------------
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

std::string site_str(const std::source_location& s) { return fmt("%s:%u", s.file_name(), (unsigned)s.line()); }

bool same_site(const std::source_location& a, const std::source_location& b) {
    return a.line() == b.line() && a.column() == b.column() &&
           (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

const char* warp_kind_name(int k) {
    switch (k) {
        case kShflIdx:
            return "__shfl_sync";
        case kShflUp:
            return "__shfl_up_sync";
        case kShflDown:
            return "__shfl_down_sync";
        case kShflXor:
            return "__shfl_xor_sync";
        case kBallot:
            return "__ballot_sync";
        case kAny:
            return "__any_sync";
        case kAll:
            return "__all_sync";
        case kSyncwarp:
            return "__syncwarp";
        case kReduceAddU:
            return "__reduce_add_sync";
        case kReduceMinU:
        case kReduceMinI:
            return "__reduce_min_sync";
        case kReduceMaxU:
        case kReduceMaxI:
            return "__reduce_max_sync";
        case kReduceAnd:
            return "__reduce_and_sync";
        case kReduceOr:
            return "__reduce_or_sync";
        case kReduceXor:
            return "__reduce_xor_sync";
        case kMatchAny:
            return "__match_any_sync";
        case kMatchAll:
            return "__match_all_sync";
        case kGeneric:
            return "cupaged_warp_collective";
    }
    return "warp collective";
}

const char* barrier_name(int k) {
    switch (k) {
        case kBarCount:
            return "__syncthreads_count";
        case kBarAnd:
            return "__syncthreads_and";
        case kBarOr:
            return "__syncthreads_or";
        case kBarNamed:
            return "bar.sync";
    }
    return "__syncthreads";
}

// "0-31, 40, 64-95" (at most 12 ranges).
std::string id_ranges(const std::vector<unsigned>& ids) {
    std::string out;
    size_t i = 0, nr = 0;
    while (i < ids.size()) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
        if (nr == 12) {
            out += ", ...";
            break;
        }
        if (!out.empty()) out += ", ";
        out += j == i ? fmt("%u", ids[i]) : fmt("%u-%u", ids[i], ids[j]);
        ++nr;
        i = j + 1;
    }
    return out;
}

std::string lanes_str(unsigned mask) {
    std::vector<unsigned> ids;
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1u) ids.push_back(l);
    return fmt("%s %s", ids.size() == 1 ? "lane" : "lanes", id_ranges(ids).c_str());
}

std::string thread_str(const Fiber* f) {
    const dim3& d = f->w->pub.bdim;
    if (d.y == 1 && d.z == 1) return fmt("thread %u", f->pub.tid.x);
    return fmt("thread (%u,%u,%u)", f->pub.tid.x, f->pub.tid.y, f->pub.tid.z);
}

// Record the block's first error and leave the fiber for good: it is never
// resumed, and its stack is reused by the next block.
[[noreturn]] void fail(Worker* w, std::string msg) {
    if (!w->failed) {
        w->failed = true;
        w->err = std::move(msg);
    } else {
        msg.clear();
        msg.shrink_to_fit();
    }
    Ctx dead;
    swap_ctx(&dead, &w->sched, true);
    __builtin_unreachable();
}

// ---- block barrier ----------------------------------------------------------
// Messages are built in functions of their own, so that nothing is left
// undestroyed on a fiber stack that fail() abandons.
std::string barrier_mismatch_report(Worker* w, Fiber* last) {
    std::vector<Fiber*> all(w->barw.begin(), w->barw.begin() + w->nbar);
    if (last) all.push_back(last);
    std::vector<std::pair<Fiber*, std::vector<unsigned>>> groups;  // representative, thread numbers
    for (Fiber* f : all) {
        bool found = false;
        for (auto& g : groups)
            if (g.first->kind == f->kind && same_site(g.first->site, f->site)) {
                g.second.push_back(f->pub.linear);
                found = true;
                break;
            }
        if (!found) groups.push_back({f, {f->pub.linear}});
    }
    std::string msg =
        "threads wait at different block barriers (every live thread of a block must reach the same "
        "__syncthreads; on a GPU this hangs or corrupts shared memory):";
    for (auto& g : groups) {
        std::sort(g.second.begin(), g.second.end());
        msg += fmt("\n  %s %s at %s() %s", g.second.size() == 1 ? "thread" : "threads", id_ranges(g.second).c_str(),
                   barrier_name(g.first->kind), site_str(g.first->site).c_str());
    }
    return msg;
}

// All waiters plus `last` (the arriving thread, or null when the release comes
// from a thread exiting) are released together; they must wait at one site.
int release_barrier(Worker* w, Fiber* last) {
    Fiber* ref = last ? last : w->barw[0];
    bool mismatch = false;
    unsigned count = last ? (last->pred != 0) : 0;
    for (unsigned i = 0; i < w->nbar; ++i) {
        Fiber* f = w->barw[i];
        if (f->kind != ref->kind || !same_site(f->site, ref->site)) mismatch = true;
        count += f->pred != 0;
    }
    if (mismatch) fail(w, barrier_mismatch_report(w, last));
    const unsigned total = w->nbar + (last ? 1u : 0u);
    int result = 0;
    switch (ref->kind) {
        case kBarCount:
            result = (int)count;
            break;
        case kBarAnd:
            result = count == total;
            break;
        case kBarOr:
            result = count != 0;
            break;
    }
    for (unsigned i = 0; i < w->nbar; ++i) {
        w->barw[i]->res = (unsigned long long)(unsigned)result;
        enqueue(w, w->barw[i]);
    }
    w->nbar = 0;
    return result;
}

// ---- warp collectives -------------------------------------------------------
inline bool is_shfl(int k) { return k >= kShflIdx && k <= kShflXor; }

void complete(Worker* w, Fiber* last, WarpRt& W, unsigned pi) {
    Pending p = W.pend[pi];
    W.pend[pi] = W.pend[--W.npend];
    Fiber** lanes = &w->fibers[last->warp * 32];
    const unsigned m = p.mask;
    if (is_shfl(p.kind)) {
        for (unsigned rest = m; rest; rest &= rest - 1) {
            const unsigned l = __builtin_ctz(rest);
            Fiber* f = lanes[l];
            const unsigned seg = 32u - (unsigned)f->width;  // PTX c[12:8]
            const long long minl = l & seg;
            long long j, maxl = minl | (p.kind == kShflUp ? 0 : (31u & ~seg));
            bool ok;
            switch (p.kind) {
                case kShflUp:
                    j = (long long)l - (long long)(unsigned)f->b;
                    ok = j >= maxl;
                    break;
                case kShflDown:
                    j = (long long)l + (long long)(unsigned)f->b;
                    ok = j <= maxl;
                    break;
                case kShflXor:
                    j = (long long)(l ^ (unsigned)f->b);
                    ok = j <= maxl;
                    break;
                default:
                    j = minl | ((unsigned)f->b & ~seg & 31u);
                    ok = true;
                    break;
            }
            // Reading a lane that does not take part is undefined on the GPU; own value here.
            if (!ok || !(m >> j & 1u)) j = l;
            f->res = lanes[j]->val;
        }
    } else if (p.kind == kGeneric) {
        void* data[32] = {};
        for (unsigned rest = m; rest; rest &= rest - 1) data[__builtin_ctz(rest)] = lanes[__builtin_ctz(rest)]->ptr;
        reinterpret_cast<void (*)(void**, unsigned, void*)>(const_cast<void*>(p.fn))(data, m, last->cctx);
    } else if (p.kind != kSyncwarp) {
        unsigned long long r = 0;
        unsigned bits = 0;
        unsigned acc_u = 0, acc_min = ~0u, acc_max = 0, acc_and = ~0u, acc_or = 0, acc_xor = 0;
        int acc_mini = 0x7fffffff, acc_maxi = (int)0x80000000;
        bool all_eq = true;
        const unsigned long long v0 = lanes[__builtin_ctz(m)]->val;
        for (unsigned rest = m; rest; rest &= rest - 1) {
            const unsigned l = __builtin_ctz(rest);
            const unsigned long long v = lanes[l]->val;
            const unsigned u = (unsigned)v;
            if (v) bits |= 1u << l;
            acc_u += u;
            acc_min = u < acc_min ? u : acc_min;
            acc_max = u > acc_max ? u : acc_max;
            acc_mini = (int)u < acc_mini ? (int)u : acc_mini;
            acc_maxi = (int)u > acc_maxi ? (int)u : acc_maxi;
            acc_and &= u;
            acc_or |= u;
            acc_xor ^= u;
            all_eq = all_eq && v == v0;
        }
        switch (p.kind) {
            case kBallot:
                r = bits;
                break;
            case kAny:
                r = bits != 0;
                break;
            case kAll:
                r = bits == m;
                break;
            case kReduceAddU:
                r = acc_u;
                break;
            case kReduceMinU:
                r = acc_min;
                break;
            case kReduceMaxU:
                r = acc_max;
                break;
            case kReduceMinI:
                r = (unsigned)acc_mini;
                break;
            case kReduceMaxI:
                r = (unsigned)acc_maxi;
                break;
            case kReduceAnd:
                r = acc_and;
                break;
            case kReduceOr:
                r = acc_or;
                break;
            case kReduceXor:
                r = acc_xor;
                break;
            case kMatchAll:
                r = all_eq ? (m | (1ull << 32)) : 0;
                break;
        }
        for (unsigned rest = m; rest; rest &= rest - 1) {
            Fiber* f = lanes[__builtin_ctz(rest)];
            if (p.kind == kMatchAny) {
                unsigned eq = 0;
                for (unsigned r2 = m; r2; r2 &= r2 - 1)
                    if (lanes[__builtin_ctz(r2)]->val == f->val) eq |= 1u << __builtin_ctz(r2);
                f->res = eq;
            } else {
                f->res = r;
            }
        }
    }
    for (unsigned rest = m; rest; rest &= ~(1u << (31 - __builtin_clz(rest)))) {  // highest lane first
        Fiber* f = lanes[31 - __builtin_clz(rest)];
        if (f != last) enqueue_front(w, f);
    }
}

std::string pending_str(const Pending& p) {
    return fmt("%s in %s(mask 0x%08x) at %s", lanes_str(p.arrived).c_str(), warp_kind_name(p.kind), p.mask,
               site_str(p.site).c_str());
}

enum Misuse { kNotOwnLane, kBadWidth, kExitedLane };

std::string warp_misuse_report(Fiber* f, int kind, unsigned mask, int width, const std::source_location& loc,
                               Misuse what) {
    const WarpRt& W = f->w->warps[f->warp];
    if (what == kNotOwnLane)
        return fmt("%s (warp %u, lane %u) called %s with mask 0x%08x, which does not include its own lane, at %s",
                   thread_str(f).c_str(), f->warp, f->lane, warp_kind_name(kind), mask, site_str(loc).c_str());
    if (what == kBadWidth)
        return fmt("%s called %s with width %d (must be a power of two from 1 to 32) at %s", thread_str(f).c_str(),
                   warp_kind_name(kind), width, site_str(loc).c_str());
    return fmt("%s (warp %u) called %s(mask 0x%08x) at %s, but %s of the mask already exited", thread_str(f).c_str(),
               f->warp, warp_kind_name(kind), mask, site_str(loc).c_str(), lanes_str(mask & W.exited).c_str());
}

std::string warp_mismatch_report(Fiber* f, const Pending& p, int kind, unsigned mask, const std::source_location& loc) {
    return fmt(
        "lanes of warp %u wait in different warp collectives (lanes named in each other's masks must call the "
        "same collective with the same mask):\n  %s\n  lane %u in %s(mask 0x%08x) at %s",
        f->warp, pending_str(p).c_str(), f->lane, warp_kind_name(kind), mask, site_str(loc).c_str());
}

unsigned long long warp_op(int kind, unsigned mask, unsigned long long val, int b, int width, const void* fn, void* ptr,
                           void* cctx, const std::source_location& loc) {
    Fiber* f = self();
    Worker* w = f->w;
    WarpRt& W = w->warps[f->warp];
    const unsigned bit = 1u << f->lane;
    if (!(mask & bit)) fail(w, warp_misuse_report(f, kind, mask, width, loc, kNotOwnLane));
    if (is_shfl(kind) && (width < 1 || width > 32 || (width & (width - 1))))
        fail(w, warp_misuse_report(f, kind, mask, width, loc, kBadWidth));
    mask &= W.exists;  // lanes past the end of a partial warp never existed
    if (mask & W.exited) fail(w, warp_misuse_report(f, kind, mask, width, loc, kExitedLane));
    f->kind = kind;
    f->site = loc;
    f->mask = mask;
    f->val = val;
    f->b = b;
    f->width = width;
    f->ptr = ptr;
    f->cctx = cctx;
    unsigned pi = W.npend;
    for (unsigned i = 0; i < W.npend; ++i) {
        Pending& p = W.pend[i];
        if (!(p.mask & mask)) continue;
        if (p.mask != mask || p.kind != kind || p.fn != fn) fail(w, warp_mismatch_report(f, p, kind, mask, loc));
        pi = i;
        break;
    }
    if (pi == W.npend) W.pend[W.npend++] = Pending{mask, 0, kind, fn, loc};
    Pending& p = W.pend[pi];
    p.arrived |= bit;
    if (p.arrived == p.mask) {
        complete(w, f, W, pi);
        return f->res;
    }
    f->state = kWaitWarp;
    park(f);
    return f->res;
}

// ---- deadlock report ----------------------------------------------------------
std::string deadlock_report(Worker* w) {
    struct Group {
        Fiber* rep;
        std::vector<unsigned> ids;
    };
    std::vector<Group> groups;
    for (unsigned i = 0; i < w->n; ++i) {
        Fiber* f = w->fibers[i];
        if (f->state != kWaitBarrier && f->state != kWaitWarp) continue;
        bool found = false;
        for (Group& g : groups) {
            Fiber* r = g.rep;
            if (r->state == f->state && r->kind == f->kind && same_site(r->site, f->site) &&
                (f->kind != kBarNamed || r->b == f->b) &&
                (f->state == kWaitBarrier || (r->mask == f->mask && r->warp == f->warp))) {
                g.ids.push_back(i);
                found = true;
                break;
            }
        }
        if (!found) groups.push_back(Group{f, {i}});
    }
    std::string msg = fmt("deadlock: %u of %u threads have not exited and none can proceed:", w->live, w->n);
    for (Group& g : groups) {
        Fiber* r = g.rep;
        const char* who = g.ids.size() == 1 ? "thread" : "threads";
        if (r->state == kWaitBarrier && r->kind == kBarNamed) {
            const Worker::Named& nb = w->named[r->b];
            msg +=
                fmt("\n  %s %s wait%s at bar.sync(%d, %u) %s (%u of %u threads arrived)", who, id_ranges(g.ids).c_str(),
                    g.ids.size() == 1 ? "s" : "", r->b, nb.count, site_str(r->site).c_str(), nb.arrived, nb.count);
        } else if (r->state == kWaitBarrier) {
            msg += fmt("\n  %s %s wait%s at %s() %s", who, id_ranges(g.ids).c_str(), g.ids.size() == 1 ? "s" : "",
                       barrier_name(r->kind), site_str(r->site).c_str());
        } else {
            const WarpRt& W = w->warps[r->warp];
            unsigned missing = 0;
            for (unsigned i = 0; i < W.npend; ++i)
                if (W.pend[i].mask == r->mask) missing = r->mask & ~W.pend[i].arrived;
            msg += fmt("\n  %s %s wait%s in %s(mask 0x%08x) %s (warp %u, waiting for %s)", who,
                       id_ranges(g.ids).c_str(), g.ids.size() == 1 ? "s" : "", warp_kind_name(r->kind), r->mask,
                       site_str(r->site).c_str(), r->warp, lanes_str(missing).c_str());
        }
    }
    return msg;
}

// ---- fibers -----------------------------------------------------------------
std::string exit_report(Fiber* f, const Pending& p) {
    return fmt("%s (warp %u, lane %u) exited while %s wait for it", thread_str(f).c_str(), f->warp, f->lane,
               pending_str(p).c_str());
}

std::string thread_report(Fiber* f, const char* what, const char* file = nullptr, unsigned line = 0,
                          const char* function = nullptr) {
    if (!file) return fmt("%s: %s", thread_str(f).c_str(), what);
    return fmt("%s: %s at %s:%u (in %s)", thread_str(f).c_str(), what, file, line, function ? function : "?");
}

[[noreturn]] void fiber_exit(Fiber* f) {
    Worker* w = f->w;
    f->state = kExited;
    --w->live;
    WarpRt& W = w->warps[f->warp];
    const unsigned bit = 1u << f->lane;
    W.exited |= bit;
    for (unsigned i = 0; i < W.npend; ++i)
        if (W.pend[i].mask & bit) fail(w, exit_report(f, W.pend[i]));
    if (w->nbar && w->nbar == w->live) release_barrier(w, nullptr);
    Ctx dead;
    switch_away(w, &dead, true);
    __builtin_unreachable();
}

[[noreturn]] void fiber_entry() {
#if CUPAGED_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Fiber* f = self();
    Worker* w = f->w;
    bool threw = false;
    try {
        w->L->fn(w->L->ctx);
    } catch (...) {
        threw = true;  // fail() only after the handler has ended
    }
    if (threw) fail(w, thread_report(f, "a C++ exception escaped the kernel"));
    fiber_exit(f);
}

void init_context(Fiber* f) {
#if CUPAGED_ASAN
    // Frames abandoned by the previous block left poisoned redzones behind.
    ASAN_UNPOISON_MEMORY_REGION(reinterpret_cast<char*>(f) - kStack, kStack);
    f->ctx.stack_lo = reinterpret_cast<char*>(f) - kStack;
    f->ctx.stack_size = kStack;
#endif
#if CUPAGED_USE_UCONTEXT
    f->ctx.uc.uc_stack.ss_sp = reinterpret_cast<char*>(f) - kStack;
    f->ctx.uc.uc_stack.ss_size = kStack;
    f->ctx.uc.uc_link = nullptr;
    makecontext(&f->ctx.uc, fiber_entry, 0);
#else
    // The stack top is the header's address (page aligned). The frame below it
    // is what cupaged_ctx_switch pops: six registers, then the return address
    // fiber_entry, entered with rsp = top - 8 like any called function.
    void** sp = reinterpret_cast<void**>(f);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&fiber_entry);
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
    f->ctx.sp = sp;
#endif
}

// ---- fiber stacks, guard regions, fault handler ---------------------------------
struct ChunkRec {
    std::atomic<std::uintptr_t> base{0};
    std::atomic<std::uintptr_t> count{0};
};
constexpr unsigned kMaxChunks = 4096;
ChunkRec g_chunks[kMaxChunks];
std::atomic<unsigned> g_nchunks{0};

// The readable part of the region based at r: the stack and the fiber state
// above it. Below is the guard of this fiber; above, the rest of the region is
// more guard for the stack of the next region's fiber.
constexpr std::uintptr_t stack_floor(std::uintptr_t r) {
    return (header_of_region(r) - kStack) & ~std::uintptr_t(4095);
}
constexpr std::uintptr_t state_ceiling(std::uintptr_t r) {
    return (header_of_region(r) + sizeof(Fiber) + 4095) & ~std::uintptr_t(4095);
}

// The fiber region holding address a, or 0. Async-signal-safe.
std::uintptr_t region_at(std::uintptr_t a) {
    const unsigned n = g_nchunks.load(std::memory_order_acquire);
    for (unsigned i = 0; i < n && i < kMaxChunks; ++i) {
        const std::uintptr_t b = g_chunks[i].base.load(std::memory_order_acquire);
        const std::uintptr_t c = g_chunks[i].count.load(std::memory_order_acquire);
        if (b && a >= b && a < b + c * kRegion) return b + (a - b) / kRegion * kRegion;
    }
    return 0;
}

bool grow_fibers(Worker* w, unsigned n, std::string* err) {
    const unsigned have = (unsigned)w->fibers.size();
    unsigned want = (n + 63u) & ~63u;
    if (want > kMaxThreadsPerBlock) want = kMaxThreadsPerBlock;
    const unsigned count = want - have;
    const size_t bytes = (size_t)count * kRegion;
    void* raw = mmap(nullptr, bytes + kRegion, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        *err = fmt("cannot reserve %zu bytes for %u fiber stacks: %s", bytes, count, strerror(errno));
        return false;
    }
    // Align to kRegion so that a stack pointer finds its fiber by masking.
    const std::uintptr_t r = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t base = (r + kRegion - 1) & ~(kRegion - 1);
    if (base > r) munmap(raw, base - r);
    if (r + kRegion > base) munmap(reinterpret_cast<void*>(base + bytes), r + kRegion - base);
    for (unsigned i = 0; i < count; ++i) {
        const std::uintptr_t region = base + (std::uintptr_t)i * kRegion;
        const std::uintptr_t lo = stack_floor(region);
        if (mprotect(reinterpret_cast<void*>(lo), state_ceiling(region) - lo, PROT_READ | PROT_WRITE) != 0) {
            *err = fmt("cannot map fiber stacks (mprotect: %s; is vm.max_map_count too low?)", strerror(errno));
            munmap(reinterpret_cast<void*>(base), bytes);
            return false;
        }
    }
    const unsigned slot = g_nchunks.load();
    if (slot < kMaxChunks) {  // launches are serialized, so one writer at a time
        g_chunks[slot].base.store(base);
        g_chunks[slot].count.store(count);
        g_nchunks.store(slot + 1, std::memory_order_release);
    }
    for (unsigned i = 0; i < count; ++i) {
        Fiber* f = new (reinterpret_cast<void*>(header_of_region(base + (std::uintptr_t)i * kRegion))) Fiber();
        f->w = w;
        f->pub.local = f->local;
#if CUPAGED_USE_UCONTEXT
        getcontext(&f->ctx.uc);
#endif
        w->fibers.push_back(f);
    }
    w->tid_dims[0] = 0;  // the new fibers have no threadIdx yet
    return true;
}

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_old_action[65];

void put(const char* s) {
    ssize_t r = write(2, s, strlen(s));
    (void)r;
}
void put_u(unsigned long long v, int base = 10) {
    char buf[32];
    int i = 31;
    buf[i] = 0;
    do {
        buf[--i] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v);
    put(buf + i);
}
void put_dim(const uint3& d) {
    put("(");
    put_u(d.x);
    put(",");
    put_u(d.y);
    put(",");
    put_u(d.z);
    put(")");
}

void on_fault(int sig, siginfo_t* si, void* ucv) {
    const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(si->si_addr);
    const bool real_fault = si->si_code > 0;
    std::uintptr_t region = 0;
    bool overflow = false;
    if (real_fault && (sig == SIGSEGV || sig == SIGBUS)) {
        region = region_at(addr);
        // Above a fiber's state is guard for the fiber of the next region up.
        if (region && addr >= state_ceiling(region)) region = region_at(region + kRegion);
        overflow = region && addr < stack_floor(region);
    }
    if (!overflow) {
        std::uintptr_t sp = 0;
#if defined(__x86_64__)
        sp = (std::uintptr_t)static_cast<ucontext_t*>(ucv)->uc_mcontext.gregs[REG_RSP];
#elif defined(__aarch64__)
        sp = (std::uintptr_t)static_cast<ucontext_t*>(ucv)->uc_mcontext.sp;
#else
        (void)ucv;
#endif
        region = real_fault && sp ? region_at(sp) : 0;
    }
    if (region) {
        const FiberPub* f = reinterpret_cast<const FiberPub*>(header_of_region(region));
        const char* kernel = f->block && f->block->kernel ? f->block->kernel : "?";
        if (overflow) {
            put("cupaged CPU backend: fiber stack overflow in kernel ");
            put(kernel);
        } else {
            put("cupaged CPU backend: ");
            put(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : "SIGILL");
            put(" (address 0x");
            put_u(addr, 16);
            put(") in kernel ");
            put(kernel);
        }
        if (f->block) {
            put(", block ");
            put_dim(f->block->bid);
        }
        put(", thread ");
        put_dim(f->tid);
        if (overflow) {
            put(": a CUDA thread has ");
            put_u(kStack / 1024);
            put(" KiB of stack on the CPU backend (deep recursion or large local arrays)\n");
            abort();
        }
        put("\n");
    }
    // Not ours to handle: restore the previous handler and let it see the
    // fault again (a real fault re-executes; a sent signal is raised again).
    sigaction(sig, &g_old_action[sig], nullptr);
    if (!real_fault) raise(sig);
}

// Install (again, if someone replaced it) the fault handler; keep the
// previous one to chain to. Called under the launch mutex.
void install_fault_handler() {
    for (int sig : kSignals) {
        struct sigaction cur;
        if (sigaction(sig, nullptr, &cur) != 0) continue;
        if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_fault) continue;
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        g_old_action[sig] = cur;
        sigaction(sig, &sa, nullptr);
    }
}

// ---- blocks -----------------------------------------------------------------
void run_block(Worker* w, Launch* L, unsigned long long b) {
    const unsigned n = L->nthreads;
    if (w->fibers.size() < n) {
        std::string err;
        if (!grow_fibers(w, n, &err)) {
            L->fail(fmt("kernel '%s': %s", L->kernel, err.c_str()));
            return;
        }
    }
    const unsigned long long gx = L->grid[0], gy = L->grid[1];
    w->pub.bid = uint3{(unsigned)(b % gx), (unsigned)(b / gx % gy), (unsigned)(b / (gx * gy))};
    ++w->pub.serial;
    const unsigned bx = L->block[0], by = L->block[1], bz = L->block[2];
    if (w->tid_dims[0] != bx || w->tid_dims[1] != by || w->tid_dims[2] != bz) {
        for (unsigned i = 0; i < n; ++i) {
            Fiber* f = w->fibers[i];
            f->pub.tid = uint3{i % bx, i / bx % by, i / (bx * by)};
            f->pub.linear = i;
            f->pub.block = &w->pub;
            f->lane = i & 31u;
            f->warp = i >> 5;
        }
        w->tid_dims[0] = bx, w->tid_dims[1] = by, w->tid_dims[2] = bz;
    }
    w->n = w->live = n;
    w->qh = w->qt = 0;
    w->nbar = 0;
    for (Worker::Named& nb : w->named) {
        nb.count = nb.arrived = 0;
        nb.waiters.clear();
    }
    w->failed = false;
    const unsigned nwarps = (n + 31) / 32;
    for (unsigned i = 0; i < nwarps; ++i) {
        WarpRt& W = w->warps[i];
        W.exists = (i + 1 == nwarps && (n & 31u)) ? (1u << (n & 31u)) - 1u : ~0u;
        W.exited = 0;
        W.npend = 0;
    }
    for (unsigned i = 0; i < n; ++i) {
        Fiber* f = w->fibers[i];
        init_context(f);
        enqueue(w, f);
    }
    Fiber* first = dequeue(w);
    first->state = kRunning;
    swap_ctx(&w->sched, &first->ctx);
    if (!w->failed && w->live) {
        w->failed = true;
        w->err = deadlock_report(w);
    }
    if (w->failed) {
        std::string where = fmt("kernel '%s' block (%u,%u,%u)", L->kernel, w->pub.bid.x, w->pub.bid.y, w->pub.bid.z);
        if (by != 1 || bz != 1)
            where +=
                fmt(" (blockDim (%u,%u,%u); thread numbers are x + blockDim.x * (y + blockDim.y * z))", bx, by, bz);
        L->fail(where + ": " + w->err);
        w->err.clear();
    }
}

// ---- worker pool ----------------------------------------------------------------
// workers[0] runs blocks on the thread that launches (cupaged_rt_launch, under
// g_launch_mu: one launch at a time, so one such Worker serves every calling
// thread); workers[1 ..] are threads of their own. A launch of one block
// wakes no thread, a launch of n blocks the first min(n, workers) - 1: no
// thread idles waiting for the others. The same threads run host work split
// in parts (cupaged_rt_parallel: the engine's few-row products).
//
// Waiting: a thread that finished its share waits for the next job (or the
// caller for the others' shares) by polling first, for g_spin_us (set from
// CUPAGED_CPU_SPIN_US: cupaged_rt_set_spin), yielding the core every few
// polls, then on the condition variable. A decode step is a chain of small
// launches and products a few microseconds to a few hundred apart: a futex
// wake costs 10 - 60 us on a shared VM, a poll none; after g_spin_us of
// nothing the threads sleep and cost nothing. 0: no polling (cores other
// processes keep busy, as in the test suite).
std::atomic<unsigned> g_spin_us{1000};

struct Pool {
    std::vector<Worker*> workers;
    std::mutex mu;
    std::condition_variable cv_work, cv_done;
    std::atomic<unsigned long long> gen{0};  // bumped (under mu) for each job
    std::atomic<unsigned> finished{0};  // threads done with this job
    unsigned active = 0;  // workers in this job (the caller's included)
    Launch* L = nullptr;  // the job: a launch's blocks, or
    void (*task)(void*, unsigned, unsigned) = nullptr;  // host work: task(ctx, part, parts)
    void* task_ctx = nullptr;
};

// Polls pred for up to g_spin_us microseconds; false if it never held.
template <class Pred>
bool spin_until(Pred pred) {
    const unsigned us = g_spin_us.load(std::memory_order_relaxed);
    if (pred()) return true;
    if (us == 0) return false;
    const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
    for (unsigned i = 1;; ++i) {
        if (pred()) return true;
        if (i % 64 == 0) {
            if (std::chrono::steady_clock::now() > end) return false;
            sched_yield();
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
}

Pool* g_pool = nullptr;
std::mutex g_launch_mu;
std::atomic<unsigned long long> g_thread_wakes{0};  // jobs that woke worker threads

// The launch's blocks, taken one by one from its counter until none is left
// (or it failed, or was cancelled), on worker w of the calling thread.
void run_blocks(Worker* w, Launch* L) {
    w->L = L;
    w->pub.bdim = dim3(L->block[0], L->block[1], L->block[2]);
    w->pub.gdim = dim3(L->grid[0], L->grid[1], L->grid[2]);
    w->pub.kernel = L->kernel;
    if (w->runq.size() < L->nthreads) {
        unsigned cap = 32;
        while (cap < L->nthreads) cap <<= 1;
        w->runq.assign(cap, nullptr);
        w->qmask = cap - 1;
        w->barw.assign(cap, nullptr);
        w->warps.resize(cap / 32);
    }
    while (!L->failed.load(std::memory_order_relaxed) && !L->cancel.load(std::memory_order_relaxed)) {
        const unsigned long long b = L->next.fetch_add(1, std::memory_order_relaxed);
        if (b >= L->nblocks) break;
        run_block(w, L, b);
    }
}

// The scheduler stack's bounds for ASan's fiber switches: this thread's stack.
void set_sched_stack(Worker* w) {
#if CUPAGED_ASAN
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        void* lo = nullptr;
        size_t size = 0;
        pthread_attr_getstack(&attr, &lo, &size);
        w->sched.stack_lo = lo;
        w->sched.stack_size = size;
        pthread_attr_destroy(&attr);
    }
#else
    (void)w;
#endif
}

void worker_main(Pool* P, Worker* w) {
    t_worker = w;
    sigset_t block_int;  // SIGINT goes to the thread that launched (see cupaged_rt_launch)
    sigemptyset(&block_int);
    sigaddset(&block_int, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block_int, nullptr);
    stack_t ss;
    ss.ss_sp = w->altstack;
    ss.ss_size = 64 * 1024;
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    set_sched_stack(w);
    char name[16];
    snprintf(name, sizeof name, "cupaged-cpu-%u", w->index);
    pthread_setname_np(pthread_self(), name);
    unsigned long long seen = 0;
    for (;;) {
        if (!spin_until([&] { return P->gen.load(std::memory_order_acquire) != seen; })) {
            std::unique_lock<std::mutex> lk(P->mu);
            P->cv_work.wait(lk, [&] { return P->gen.load(std::memory_order_relaxed) != seen; });
        }
        Launch* L;
        void (*task)(void*, unsigned, unsigned);
        void* task_ctx;
        unsigned active;
        {
            std::lock_guard<std::mutex> lk(P->mu);
            seen = P->gen.load(std::memory_order_relaxed);
            active = P->active;
            L = P->L, task = P->task, task_ctx = P->task_ctx;
        }
        if (w->index >= active) continue;
        if (task)
            task(task_ctx, w->index, active);
        else
            run_blocks(w, L);
        if (P->finished.fetch_add(1, std::memory_order_acq_rel) + 2 == active) {
            std::lock_guard<std::mutex> lk(P->mu);  // the caller may be asleep on cv_done
            P->cv_done.notify_all();
        }
    }
}

// Starts a job on workers 1 .. active - 1 (under g_launch_mu; active > 1).
void start_job(Pool* P, unsigned active, Launch* L, void (*task)(void*, unsigned, unsigned), void* ctx) {
    {
        std::lock_guard<std::mutex> lk(P->mu);
        P->L = L, P->task = task, P->task_ctx = ctx;
        P->active = active;
        P->finished.store(0, std::memory_order_relaxed);
        P->gen.fetch_add(1, std::memory_order_release);
    }
    g_thread_wakes.fetch_add(1, std::memory_order_relaxed);
    P->cv_work.notify_all();
}

// Waits for workers 1 .. active - 1 to finish the job; cancel (if given) is set
// when a SIGINT arrives meanwhile.
void finish_job(Pool* P, unsigned active, std::atomic<bool>* cancel);

// Blocks on the calling thread (workers[0]): t_worker names it while they
// run; the thread gets an alternate signal stack of the worker's (for the
// fault handler's report of a fiber stack overflow) unless it has one.
void run_blocks_here(Worker* w, Launch* L) {
    static thread_local bool altstack_checked = false;
    if (!altstack_checked) {
        stack_t cur;
        if (sigaltstack(nullptr, &cur) == 0 && (cur.ss_flags & SS_DISABLE)) {
            char* mine = static_cast<char*>(std::malloc(64 * 1024));  // this thread's, kept for its life
            if (mine) {
                stack_t ss;
                ss.ss_sp = mine;
                ss.ss_size = 64 * 1024;
                ss.ss_flags = 0;
                sigaltstack(&ss, nullptr);
            }
        }
        altstack_checked = true;
    }
    set_sched_stack(w);
    Worker* const prev = t_worker;
    t_worker = w;
    run_blocks(w, L);
    t_worker = prev;
}

unsigned g_configured_workers = 0;  // set by the Python side (the one parser of CUPAGED_CPU_WORKERS)

unsigned worker_count() {
    if (g_configured_workers) return g_configured_workers;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return (unsigned)CPU_COUNT(&set);
    const unsigned hc = std::thread::hardware_concurrency();
    return hc ? hc : 1;
}

void atfork_prepare() { g_launch_mu.lock(); }
void atfork_parent() { g_launch_mu.unlock(); }
void atfork_child() {
    // The child has none of the workers: start a fresh pool on its first launch.
    g_launch_mu.unlock();
    g_pool = nullptr;
}

// ---- SIGINT during a launch ------------------------------------------------------
// While the process's main thread runs (its share of the blocks) or waits for
// a launch, a SIGINT handler of ours (chained to the one it replaces,
// Python's) sets g_sigint and cancels that launch; it then stops starting
// blocks, the running blocks stop at their next barrier or warp collective,
// and cupaged_rt_launch returns 2, so Ctrl-C ends a long CPU launch within a
// fraction of a second and the pool stays usable.
volatile sig_atomic_t g_sigint = 0;
std::atomic<bool>* volatile g_sigint_cancel = nullptr;  // the main thread's launch, while it runs
struct sigaction g_prev_sigint;
static_assert(std::atomic<bool>::is_always_lock_free, "a lock-free store in a signal handler");

void on_sigint(int sig, siginfo_t* info, void* uctx) {
    g_sigint = 1;
    if (std::atomic<bool>* c = g_sigint_cancel) c->store(true, std::memory_order_relaxed);
    const struct sigaction& p = g_prev_sigint;
    if (p.sa_flags & SA_SIGINFO) {
        if (p.sa_sigaction) p.sa_sigaction(sig, info, uctx);
    } else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN && p.sa_handler) {
        p.sa_handler(sig);
    }
}

bool on_main_thread() { return (pid_t)syscall(SYS_gettid) == getpid(); }

Pool* get_pool(std::string* err) {
    if (g_pool) return g_pool;
    static bool atfork_done = false;
    if (!atfork_done) {
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
        atfork_done = true;
    }
    Pool* P = new Pool();  // never freed: workers live as long as the process
    const unsigned nw = worker_count();
    for (unsigned i = 0; i < nw; ++i) {  // workers[0]: the launching thread's (no thread of its own)
        Worker* w = new Worker();
        w->index = i;
        w->smem = std::aligned_alloc(4096, (kMaxDynamicShared + 4095) & ~4095u);
        w->altstack = static_cast<char*>(std::malloc(64 * 1024));
        if (!w->smem || !w->altstack) {
            *err = "out of memory starting the CPU worker pool";
            return nullptr;
        }
        P->workers.push_back(w);
    }
    try {
        for (size_t i = 1; i < P->workers.size(); ++i) std::thread(worker_main, P, P->workers[i]).detach();
    } catch (const std::exception& e) {
        *err = fmt("cannot start CPU worker threads: %s", e.what());
        return nullptr;
    }
    g_pool = P;
    return P;
}

void finish_job(Pool* P, unsigned active, std::atomic<bool>* cancel) {
    const auto done = [&] { return P->finished.load(std::memory_order_acquire) + 1 == active; };
    if (!spin_until(done)) {
        std::unique_lock<std::mutex> lk(P->mu);
        while (!done()) {
            P->cv_done.wait_for(lk, std::chrono::milliseconds(20));
            if (g_sigint && cancel && !cancel->load()) cancel->store(true);
        }
    }
    std::lock_guard<std::mutex> lk(P->mu);
    P->L = nullptr, P->task = nullptr, P->task_ctx = nullptr;
}

}  // namespace
}  // namespace cupaged

using namespace cupaged;

// ---- entry points ---------------------------------------------------------------
// A collective of a launch being cancelled (SIGINT) leaves the block here.
inline void stop_if_cancelled(Worker* w) {
    if (w->L->cancel.load(std::memory_order_relaxed)) fail(w, "interrupted (SIGINT)");
}

CUPAGED_RT_API int cupaged_rt_barrier(int kind, int pred, std::source_location loc) {
    Fiber* f = self();
    Worker* w = f->w;
    stop_if_cancelled(w);
    f->kind = kind;
    f->site = loc;
    f->pred = pred;
    if (w->nbar + 1 == w->live) return release_barrier(w, f);
    w->barw[w->nbar++] = f;
    f->state = kWaitBarrier;
    park(f);
    return (int)f->res;
}

// Messages are built in functions of their own (nothing left undestroyed on the stack fail() abandons).
static std::string named_barrier_error(Fiber* f, unsigned id, unsigned count, const char* what,
                                       const Worker::Named* busy = nullptr) {
    std::string msg = fmt("%s: bar.%s(%u, %u) at %s: %s", thread_str(f).c_str(),
                          f->kind == kBarNamed ? "sync" : "arrive", id, count, site_str(f->site).c_str(), what);
    if (busy)
        msg += fmt(" (barrier %u is in use with %u threads since %s)", id, busy->count, site_str(busy->site).c_str());
    return msg;
}

CUPAGED_RT_API void cupaged_rt_named_barrier(unsigned id, unsigned count, int wait, std::source_location loc) {
    Fiber* f = self();
    Worker* w = f->w;
    stop_if_cancelled(w);
    f->kind = wait ? kBarNamed : kBarSync;  // for the messages only, until it parks
    f->site = loc;
    const unsigned n = count ? count : w->n;
    if (id == 0 || id >= kNamedBarriers)
        fail(w, named_barrier_error(f, id, count, "barrier ids 1 .. 15 (0 is __syncthreads' barrier)"));
    if (n % 32u || n > w->n)
        fail(w, named_barrier_error(f, id, count, "the thread count must be a multiple of 32, at most the block's"));
    Worker::Named& nb = w->named[id];
    if (nb.arrived == 0) {
        nb.count = n;
        nb.site = loc;
    } else if (nb.count != n) {
        fail(w, named_barrier_error(f, id, count, "every arrival between two completions names one count", &nb));
    }
    if (++nb.arrived == n) {  // complete: the waiters go on, the barrier starts over
        for (Fiber* x : nb.waiters) enqueue(w, x);
        nb.waiters.clear();
        nb.arrived = 0;
        return;
    }
    if (!wait) return;
    nb.waiters.push_back(f);
    f->b = (int)id;
    f->state = kWaitBarrier;
    park(f);
}

CUPAGED_RT_API unsigned long long cupaged_rt_warp_op(int kind, unsigned mask, unsigned long long value, int b,
                                                     int width, std::source_location loc) {
    stop_if_cancelled(self()->w);
    return warp_op(kind, mask, value, b, width, nullptr, nullptr, nullptr, loc);
}

CUPAGED_RT_API void cupaged_rt_warp_collective(unsigned mask, void* lane_data, void (*fn)(void**, unsigned, void*),
                                               void* ctx, std::source_location loc) {
    stop_if_cancelled(self()->w);
    warp_op(kGeneric, mask, 0, 0, 32, reinterpret_cast<const void*>(fn), lane_data, ctx, loc);
}

CUPAGED_RT_API void cupaged_rt_set_workers(unsigned n) {
    std::lock_guard<std::mutex> g(g_launch_mu);
    g_configured_workers = n;  // read when the pool starts (first launch, or after a fork)
}

CUPAGED_RT_API void cupaged_rt_set_spin(unsigned us) { g_spin_us.store(us, std::memory_order_relaxed); }

CUPAGED_RT_API unsigned cupaged_rt_activemask() {
    Fiber* f = self();
    const WarpRt& W = f->w->warps[f->warp];
    return W.exists & ~W.exited;
}

CUPAGED_RT_API void cupaged_rt_trap(const char* what, const char* file, unsigned line, const char* function) {
    Fiber* f = self();
    fail(f->w, thread_report(f, what, file, line, function));
}

CUPAGED_RT_API void* cupaged_rt_dynamic_shared() { return t_worker ? t_worker->smem : nullptr; }

CUPAGED_RT_API const char* cupaged_rt_last_error() { return t_last_error.c_str(); }

// Launches so far that woke worker threads (a launch of one block, or with one
// worker configured, runs on the launching thread alone).
CUPAGED_RT_API unsigned long long cupaged_rt_thread_wakes() { return g_thread_wakes.load(); }

CUPAGED_RT_API int cupaged_rt_num_workers() {
    std::lock_guard<std::mutex> g(g_launch_mu);
    std::string err;
    Pool* P = get_pool(&err);
    return P ? (int)P->workers.size() : 0;
}

CUPAGED_RT_API int cupaged_rt_parallel(void (*task)(void*, unsigned, unsigned), void* ctx, unsigned parts) {
    std::lock_guard<std::mutex> guard(g_launch_mu);
    std::string err;
    Pool* P = get_pool(&err);
    if (!P) {
        t_last_error = err;
        return 1;
    }
    const unsigned active = std::max(1u, std::min<unsigned>(parts, (unsigned)P->workers.size()));
    if (active > 1) start_job(P, active, nullptr, task, ctx);
    task(ctx, 0, active);
    if (active > 1) finish_job(P, active, nullptr);
    return 0;
}

CUPAGED_RT_API int cupaged_rt_launch(const char* kernel, const unsigned* grid3, const unsigned* block3,
                                     unsigned shared_mem, void (*thread_fn)(void*), void* ctx) {
    const unsigned long long nthreads = (unsigned long long)block3[0] * block3[1] * block3[2];
    if (nthreads == 0 || nthreads > kMaxThreadsPerBlock) {
        t_last_error = fmt("kernel '%s': block (%u,%u,%u) has %llu threads; expected 1 to %u", kernel, block3[0],
                           block3[1], block3[2], nthreads, kMaxThreadsPerBlock);
        return 1;
    }
    if (shared_mem > kMaxDynamicShared) {
        t_last_error =
            fmt("kernel '%s': %u bytes of dynamic shared memory; at most %u", kernel, shared_mem, kMaxDynamicShared);
        return 1;
    }
    const unsigned long long nblocks = (unsigned long long)grid3[0] * grid3[1] * grid3[2];
    if (nblocks == 0) return 0;
    std::lock_guard<std::mutex> guard(g_launch_mu);
    std::string err;
    Pool* P = get_pool(&err);
    if (!P) {
        t_last_error = fmt("kernel '%s': %s", kernel, err.c_str());
        return 1;
    }
    install_fault_handler();
    Launch L;
    L.kernel = kernel;
    for (int i = 0; i < 3; ++i) L.grid[i] = grid3[i], L.block[i] = block3[i];
    L.smem = shared_mem;
    L.nthreads = (unsigned)nthreads;
    L.fn = thread_fn;
    L.ctx = ctx;
    L.nblocks = nblocks;
    const unsigned active = (unsigned)std::min<unsigned long long>(P->workers.size(), nblocks);
    const bool watch = on_main_thread();
    if (watch) {
        g_sigint = 0;
        g_sigint_cancel = &L.cancel;
        struct sigaction sa{};
        sa.sa_sigaction = on_sigint;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, &g_prev_sigint);
    }
    if (active > 1) start_job(P, active, &L, nullptr, nullptr);
    run_blocks_here(P->workers[0], &L);
    if (active > 1) finish_job(P, active, &L.cancel);
    if (watch) {
        sigaction(SIGINT, &g_prev_sigint, nullptr);
        g_sigint_cancel = nullptr;
    }
    std::fflush(stdout);
    if (L.cancel.load()) {
        t_last_error = fmt("kernel '%s': interrupted (SIGINT)", kernel);
        return 2;
    }
    if (L.failed.load()) {
        t_last_error = L.err;
        return 1;
    }
    return 0;
}
