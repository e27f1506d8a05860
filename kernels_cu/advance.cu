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
