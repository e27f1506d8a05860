// advance.cu: moving a plan's lengths and positions forward on the device,
// inside a captured decode graph.
#include "common.cuh"
#include "plan_words.cuh"

// Advance a plan by one step on the device: every sequence whose length is
// not 0 (0 marks a padded batch entry) and that has room in its page-table
// row moves forward by its q_len tokens: kv_len += q_len, and each of its
// queries' positions += q_len. A sequence without room stays where it is (the
// host loop stops before that). Captured at the end of a decode graph so the
// next replay attends over, rotates by and appends at the next position with
// no host data. Word layout: docs/layout.md, plan_words.cuh.
// grid (ceil(S / 128)), block 128.
extern "C" __global__ void __launch_bounds__(128)
    advance_plan(u32* words, u32 queries, u32 sequences, u32 table_width, u32 page_size) {
    const u32 s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= sequences) return;
    u32* q_pos = words + pw::q_pos(queries);
    u32* kv_len = words + pw::kv_len(queries);
    const u32* q_start = words + pw::q_start(queries, sequences);
    const u32 q0 = q_start[s], q1 = q_start[s + 1];
    if (q0 > q1 || q1 > queries) return;
    const u32 step = q1 - q0, len = kv_len[s];
    const u64 capacity = (u64)table_width * page_size;
    if (len == 0 || step == 0 || (u64)len + step > capacity) return;
    kv_len[s] = len + step;
    for (u32 q = q0; q < q1; ++q) q_pos[q] += step;
}

// The end of a captured decode step over slots (PagedDecodeLoop, DecodeBatch):
// for every active slot s < sequences whose kv_len is not 0, with t =
// tokens[s] the token this step generated (slot state: u32 [CP_SLOT_FIELDS,
// stride], field f of slot s at state[f * stride + s]; plan_words.cuh):
//  * ring (ring_rows > 0): ring[(clock % ring_rows) * stride + s] = t;
//  * it finishes when t is one of stop[0 .. num_stop), when the generated
//    token's position kv_len reaches max_len - 1, or (full_finishes) when its
//    pages hold no room for the next step: active = 0, done_at = clock,
//    reason set, and kv_len = 0 so that later replays read and write nothing
//    for it (a padded entry);
//  * otherwise, with room (kv_len + q_len <= cap and the table's capacity),
//    kv_len += q_len and each of its queries' q_pos += q_len; without room it
//    stays where it is (the host never launches past a slot's pages).
// Then clock += 1. Word layout: docs/layout.md, plan_words.cuh.
// Launch: grid 1, block up to 256 threads (threads stride over the slots).
extern "C" __global__ void __launch_bounds__(256)
    advance_slots(u32* words, u32 queries, u32 sequences, u32 table_width, u32 page_size, u32* state, u32 stride,
                  u32* clock, const long long* __restrict__ tokens, const long long* __restrict__ stop, u32 num_stop,
                  long long* ring, u32 ring_rows, u32 full_finishes) {
    const u32 launch = clock[0];
    u32* q_pos = words + pw::q_pos(queries);
    u32* kv_len = words + pw::kv_len(queries);
    const u32* q_start = words + pw::q_start(queries, sequences);
    const u64 capacity = (u64)table_width * page_size;
    for (u32 s = threadIdx.x; s < sequences && s < stride; s += blockDim.x) {
        if (state[CP_SLOT_ACTIVE * stride + s] == 0u) continue;
        const u32 q0 = q_start[s], q1 = q_start[s + 1];
        if (q0 > q1 || q1 > queries) continue;
        const u32 step = q1 - q0, len = kv_len[s];
        if (len == 0u || step == 0u) continue;
        const long long t = tokens[s];
        if (ring_rows) ring[(u64)(launch % ring_rows) * stride + s] = t;
        u32 reason = 0u;
        for (u32 i = 0; i < num_stop; ++i)
            if (t == stop[i]) reason = CP_FINISH_STOP;
        if (reason == 0u && (u64)len + 1u >= state[CP_SLOT_MAX_LEN * stride + s]) reason = CP_FINISH_MAX_LEN;
        const u64 next = (u64)len + step;
        const bool room = next <= state[CP_SLOT_CAP * stride + s] && next <= capacity;
        if (reason == 0u && !room && full_finishes) reason = CP_FINISH_NO_ROOM;
        if (reason) {
            state[CP_SLOT_ACTIVE * stride + s] = 0u;
            state[CP_SLOT_DONE_AT * stride + s] = launch;
            state[CP_SLOT_REASON * stride + s] = reason;
            kv_len[s] = 0u;
            continue;
        }
        if (!room) continue;
        kv_len[s] = (u32)next;
        for (u32 q = q0; q < q1; ++q) q_pos[q] += step;
    }
    __syncthreads();
    if (threadIdx.x == 0) clock[0] = launch + 1u;
}
