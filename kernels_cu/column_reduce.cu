// Second, deterministic stage of every per-column (per-channel) parameter
// gradient: out[j] = the sum over chunks k of partial[k][j], where j runs
// over slots x columns.  The first stage leaves its partial sums in double;
// summing them in double and rounding only at the end (to float, and from
// float to a 16-bit parameter dtype) keeps the chunks' own sums from adding
// rounding errors.  Fixed order, no atomics: bitwise reproducible.
//
// A block is blockDim.x / 32 warps in column groups of W = 2^log2_chunk_warps
// warps (a function of the chunk count alone: ops/_common.py,
// reduce_warps); a group takes kColumns consecutive j, a lane each, and its
// warps split the chunks (warp w of the group: chunks w, w + W, ..., in
// order); their sums are added in warp order.  With the chunks spread over
// W warps a thread waits for chunks / W loads, not chunks: a backward with
// few columns and many chunks (a channels-last convolution's: 256 sums of
// 528 chunks) would otherwise run a few blocks whose every thread waits for
// hundreds of loads from L2 in turn.
//
// The first `duplicated` sums are written a second time after the others
// (out[slots_times_columns + j]): a chain whose two parameters get the same
// gradient (problem 94's two biases) then returns two rows, not one row and
// a copy made by another launch.
#include "cf_common.cuh"

namespace cf {

namespace column_reduce {
constexpr int kColumns = 32;
constexpr int kMaxWarps = 32;
}  // namespace column_reduce

// Launch contract (ops/_common.py, _reduce_partials): kColumns and kMaxWarps
// are REDUCE_COLUMNS and REDUCE_MAX_WARPS there; blockDim.x is a multiple of
// 32 W; kSplit is W > 1, the case where the group's warps meet in shared
// memory.  W == 1 (fewer than 32 chunks: 76's, 88's and 94's backwards) is
// an instantiation of its own, without the shared array and its barrier:
// the stage is a few microseconds there, next to a first stage not much
// longer, so every fixed cost shows.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(32 * column_reduce::kMaxWarps)
reduce_column_partials(const double* __restrict__ partial, T* __restrict__ out, i64 chunks,
                       i64 slots_times_columns, i64 duplicated, i64 log2_chunk_warps) {
  using column_reduce::kColumns;
  // (W a power of two: shifts and masks, not divisions, in a kernel of a
  // few microseconds)
  const int shift = static_cast<int>(log2_chunk_warps);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = 1 << shift;
  const int group = warp >> shift, w = warp & (warps - 1);
  const i64 groups = blockDim.x >> (5 + shift);
  const i64 j = (blockIdx.x * groups + group) * kColumns + lane;
  // The loads of eight of the warp's chunks are issued before their adds,
  // which stay in chunk order: one load from L2 per chunk, each waited
  // for, would set the pace where a warp has many chunks.
  constexpr int kAhead = 8;
  double acc = 0.0;
  if (j < slots_times_columns) {
    const double* p = partial + w * slots_times_columns + j;
    const i64 stride = warps * slots_times_columns;
    i64 k = w;
    for (; k + (kAhead - 1) * warps < chunks; k += kAhead * warps, p += kAhead * stride) {
      double v[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) v[u] = p[u * stride];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) acc += v[u];
    }
    for (; k < chunks; k += warps, p += stride) acc += *p;
  }
  // Column j's sum, rounded to float and then to T, and its duplicate.
  const auto write = [&](double total) {
    const T sum = from_float<T>(static_cast<float>(total));
    out[j] = sum;
    if (j < duplicated) out[slots_times_columns + j] = sum;
  };
  if constexpr (!kSplit) {  // W == 1: no other warp's sums to add
    if (j < slots_times_columns) write(acc);
  } else {
    __shared__ double sums[column_reduce::kMaxWarps][kColumns];
    sums[warp][lane] = acc;
    __syncthreads();
    if (w == 0 && j < slots_times_columns) {
      double total = acc;
      for (int u = 1; u < warps; ++u) total += sums[warp + u][lane];
      write(total);
    }
  }
}

}  // namespace cf
