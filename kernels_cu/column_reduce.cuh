// The second, deterministic stage of every per-column (per-channel)
// parameter gradient: out[j] = the sum over chunks k of partial[k][j], where
// j runs over slots x columns.  The first stage (a backward kernel) leaves
// its partial sums in double; summing them in double and rounding only at
// the end (to float, and from float to a 16-bit parameter dtype) keeps the
// chunks' own sums from adding rounding errors.  Fixed order, no atomics on
// floats: bitwise reproducible.
//
// Two forms, the same sums in the same order where both apply:
//  * reduce_column_partials (column_reduce.cu), a launch of its own after
//    the first stage;
//  * reduce_columns_in_last_block, the tail of a first stage whose blocks
//    of one column range are its chunks: the range's last block to finish
//    sums the range, with no second launch (for fewer than 32 chunks:
//    ops/_common.py, _column_counters).
#pragma once
#include "cf_common.cuh"

namespace cf {

namespace column_reduce {
constexpr int kColumns = 32;
constexpr int kMaxWarps = 32;
// Loads issued before their adds, which stay in chunk order: one load from
// L2 per chunk, each waited for, would set the pace where a thread has many
// chunks.
constexpr int kAhead = 8;
}  // namespace column_reduce

// acc plus a column's partial sums of chunks k, k + step, ... < chunks, in
// that order; p: the column's sum in chunk k, stride: the distance between
// two summed chunks.  kL2: loads from L2 (ld.global.cg), for partial sums
// that other blocks of the same launch wrote.
template <bool kL2>
__device__ __forceinline__ double add_chunks(double acc, const double* p, i64 k, i64 chunks,
                                             i64 step, i64 stride) {
  using column_reduce::kAhead;
  const auto load = [](const double* q) { return kL2 ? __ldcg(q) : *q; };
  for (; k + (kAhead - 1) * step < chunks; k += kAhead * step, p += kAhead * stride) {
    double v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) v[u] = load(p + u * stride);
#pragma unroll
    for (int u = 0; u < kAhead; ++u) acc += v[u];
  }
  for (; k < chunks; k += step, p += stride) acc += load(p);
  return acc;
}

// Column j's sum, rounded to float and then to T, at out[j], and at
// out[slots_times_columns + j] where j < duplicated: a chain whose two
// parameters get the same gradient (problem 94's two biases) then returns
// two rows, not one row and a copy made by another launch.
template <typename T>
__device__ __forceinline__ void write_column_sum(T* out, i64 j, double total,
                                                 i64 slots_times_columns, i64 duplicated) {
  const T sum = from_float<T>(static_cast<float>(total));
  out[j] = sum;
  if (j < duplicated) out[slots_times_columns + j] = sum;
}

// The second stage as the tail of a first stage whose grid is (column
// ranges, chunks): each block calls it, every thread, after writing its
// partial[blockIdx.y][slot][c] for the columns c of [col0, col1).  The last
// block of the range to arrive (a count in counters[blockIdx.x]) sums the
// range's columns over the chunks in chunk order, as reduce_column_partials
// does with one warp per column (the same bits), writes out[slot][c], and
// puts the count back to zero.  `counters`: zero before the launch, one per
// column range (ops/_common.py, _column_counters); null: the launch leaves
// the second stage to reduce_column_partials, and this returns at once.
template <typename T>
__device__ void reduce_columns_in_last_block(const double* partial, T* out, unsigned* counters,
                                             i64 slots, i64 columns, i64 col0, i64 col1) {
  if (counters == nullptr) return;
  __shared__ bool last;
  // The block's partial sums, visible before the count: the barrier orders
  // every thread's writes before thread 0's fence, whose release covers
  // them (cumulativity), so the other threads need not wait for their own
  // stores (their dz among them) to drain.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1;
    __threadfence();  // the other blocks' sums, seen after the count
  }
  __syncthreads();
  if (!last) return;
  const i64 width = col1 - col0, stride = slots * columns;
  for (i64 i = threadIdx.x; i < slots * width; i += blockDim.x) {
    const i64 j = (i / width) * columns + col0 + i % width;
    write_column_sum(out, j, add_chunks<true>(0.0, partial + j, 0, gridDim.y, 1, stride), stride,
                     i64(0));
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

}  // namespace cf
