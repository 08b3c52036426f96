// Kernel family "column_reduce": the second stage of the per-column
// parameter gradients as a launch of its own (column_reduce.cuh).
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
#include <column_reduce.cuh>  // (<>: the include path alone, not the working folder)

namespace cf {

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
  double acc = 0.0;
  if (j < slots_times_columns)
    acc = add_chunks<false>(0.0, partial + w * slots_times_columns + j, w, chunks, warps,
                            warps * slots_times_columns);
  const auto write = [&](double total) {
    write_column_sum(out, j, total, slots_times_columns, duplicated);
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
