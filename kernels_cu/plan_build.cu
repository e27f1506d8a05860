// plan_build.cu: a step's plan metadata words built on the device from an
// engine's device metadata (vLLM's query_start_loc, seq_lens, block table),
// so a CUDA step needs no device-to-host copy and a CUDA graph can replay it.
//
// The words are exactly those HostPlan.build(...).upload writes for the same
// step padded to the plan's fixed capacity (docs/layout.md, "Plans built on
// the device"): `queries` packed queries and `sequences` rows, of which the
// first num_seqs are the step's, the rows after them padding (kv_len 0, no
// query, no page) and the last row the padding sequence that holds the
// queries past the step's (kv_len 0: they read nothing, their output is 0).
//
// Inputs (int32): query_start_loc [num_seqs + 1], seq_lens [num_seqs],
// block_table [num_seqs, bt_cols] with row stride bt_stride (elements).
// Checks on the device (every input value is read, none trusted):
//  * query_start_loc decreasing, or its span qsl[n] - qsl[0] > queries: the
//    whole step is written as padding (every query in the padding row);
//    status bit 1;
//  * seq_lens[s] < 0 or > min(table_width * page_size, CP_MAX_VISIBLE_LEN):
//    kv_len[s] = 0 (reads nothing); status bit 2;
//  * a block id inside a sequence's length outside 0 .. num_pages - 1, or a
//    column inside it past the block table's bt_cols: that entry is
//    CP_NO_PAGE (as every invalid entry: the kernels skip it); status bit 4;
//  * q_len > kv_len (the first queries at negative positions, what HostPlan
//    calls non-causal only): written as HostPlan.build writes it; status bit 8.
// status[0] |= bits (sticky: the host reads and clears it; no launch does).
// Nothing is read or written outside the arrays for any input values: the
// sizes are kernel arguments checked on the host.
//
// grid (blocks), block 256: every block first validates query_start_loc
// (num_seqs + 1 reads, __syncthreads_or), then the threads of the grid
// stride over the words, region by region. A query finds its sequence by a
// binary search over query_start_loc (log2(num_seqs) L2-resident reads).
// Memory traffic: one read of each input value (the block table row prefix
// of bt_cols entries per sequence), one 4-byte write per word, a
// log2(num_seqs) search per query; the host sizes the grid to the words.
#include "common.cuh"
#include "plan_words.cuh"

// Status bits: defined once in cupaged/ops/plan_build.py (DEFINES), passed as
// CP_BUILD_BAD_QUERY_START, CP_BUILD_BAD_SEQ_LEN, CP_BUILD_BAD_PAGE, CP_BUILD_NEGATIVE_POSITION.
#if !defined(CP_BUILD_BAD_QUERY_START) || !defined(CP_BUILD_BAD_SEQ_LEN) || !defined(CP_BUILD_BAD_PAGE) || \
    !defined(CP_BUILD_NEGATIVE_POSITION)
#error "plan_build.cu: the CP_BUILD_* status bits come from cupaged/ops/plan_build.py (DEFINES)"
#endif

namespace {
// The step's view of query_start_loc: q_start of row s in 0 .. sequences.
struct Starts {
    const int* qsl;
    u32 num_seqs, sequences, queries;
    long long base, total;  // qsl[0]; queries of the step (0 when query_start_loc is invalid)
    __device__ __forceinline__ u32 at(u32 s) const {
        if (s >= sequences) return queries;
        if (s <= num_seqs && total > 0) return (u32)((long long)qsl[s] - base);
        return (u32)total;
    }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    plan_build(u32* words, u32 queries, u32 sequences, u32 table_width, u32 page_size, u32 num_pages,
               const int* __restrict__ qsl, const int* __restrict__ seq_lens, const int* __restrict__ block_table,
               u32 num_seqs, u32 bt_cols, u64 bt_stride, u32* status) {
    // Host guarantees: 1 <= sequences, num_seqs < sequences, bt_cols <= table_width.
    const long long base = qsl[0];
    int bad = 0;
    for (u32 s = threadIdx.x; s < num_seqs; s += blockDim.x) bad |= qsl[s + 1] < qsl[s];
    bad = __syncthreads_or(bad);
    long long total = (long long)qsl[num_seqs] - base;
    if (bad || total > (long long)queries) total = 0;
    const Starts st{qsl, num_seqs, sequences, queries, base, total};
    const u64 cap = (u64)table_width * page_size;
    const u64 max_len = cap < CP_MAX_VISIBLE_LEN ? cap : CP_MAX_VISIBLE_LEN;
    u32 flags = (bad || (long long)qsl[num_seqs] - base > (long long)queries) ? CP_BUILD_BAD_QUERY_START : 0u;

    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
    const u64 o_q_pos = pw::q_pos(queries), o_kv = pw::kv_len(queries);
    const u64 o_start = pw::q_start(queries, sequences), o_table = pw::page_table(queries, sequences);
    if (tid < CP_HEADER_WORDS) {  // magic, sizes, the arrays' offsets, reserved 0 (no local array: no stack)
        u64 v = 0;
        switch ((u32)tid) {
            case 0:
                v = CP_PLAN_MAGIC;
                break;
            case 1:
                v = queries;
                break;
            case 2:
                v = sequences;
                break;
            case 3:
                v = table_width;
                break;
            case 4:
                v = page_size;
                break;
            case 5:
                v = num_pages;
                break;
            case 6:
                v = pw::q_seq(queries);
                break;
            case 7:
                v = o_q_pos;
                break;
            case 8:
                v = o_kv;
                break;
            case 9:
                v = o_start;
                break;
            case 10:
                v = o_table;
                break;
            default:
                break;
        }
        words[tid] = (u32)v;
    }
    // kv_len of row s (0 past the step's rows and for a length out of range).
    auto kv_of = [&](u32 s, bool flag) -> u32 {
        if (s >= num_seqs) return 0u;
        const int v = seq_lens[s];
        if (v < 0 || (u64)v > max_len) {
            if (flag) flags |= CP_BUILD_BAD_SEQ_LEN;
            return 0u;
        }
        return (u32)v;
    };
    for (u64 s = tid; s < sequences; s += step) words[o_kv + s] = kv_of((u32)s, true);
    for (u64 s = tid; s <= sequences; s += step) words[o_start + s] = st.at((u32)s);
    for (u64 i = tid; i < queries; i += step) {
        // The last row s with q_start[s] <= i (row 0 starts at 0).
        u32 lo = 0, hi = sequences - 1;
        while (lo < hi) {
            const u32 mid = lo + (hi - lo + 1) / 2;
            if (st.at(mid) <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        const u32 q0 = st.at(lo), q1 = st.at(lo + 1);
        const long long kv = kv_of(lo, false), ql = (long long)q1 - q0;
        if (ql > kv && lo < num_seqs) flags |= CP_BUILD_NEGATIVE_POSITION;
        words[CP_HEADER_WORDS + i] = lo;
        words[o_q_pos + i] = (u32)(kv - ql + (long long)(i - q0));
    }
    const u64 cells = (u64)sequences * table_width;
    for (u64 c = tid; c < cells; c += step) {
        const u32 s = (u32)(c / table_width), j = (u32)(c % table_width);
        u32 w = CP_NO_PAGE;
        if (s < num_seqs) {
            const int id = j < bt_cols ? block_table[(u64)s * bt_stride + j] : -1;
            if (id >= 0 && (u32)id < num_pages)
                w = (u32)id;
            else if ((u64)j * page_size < kv_of(s, false))
                flags |= CP_BUILD_BAD_PAGE;  // inside the length
        }
        words[o_table + c] = w;
    }
    if (flags) atomicOr(status, flags);
}
