// Second, deterministic stage of every per-column (per-channel) parameter
// gradient: out[j] = sum over chunks k, in order, of partial[k][j], where j
// runs over slots x columns.  The first stage leaves its partial sums in
// double; summing them in double and rounding once to the parameter dtype
// makes the gradient as accurate as the dtype allows.  Fixed order, no
// atomics: bitwise reproducible.
//
// The first `duplicated` sums are written a second time after the others
// (out[slots_times_columns + j]): a chain whose two parameters get the same
// gradient (problem 94's two biases) then returns two rows, not one row and
// a copy made by another launch.
#include "cf_common.cuh"

namespace cf {

template <typename T>
__global__ void reduce_column_partials(const double* __restrict__ partial, T* __restrict__ out,
                                       i64 chunks, i64 slots_times_columns, i64 duplicated) {
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= slots_times_columns) return;
  // The loads of eight chunks are issued before their adds, which stay in
  // chunk order: one dependent load (from L2) per chunk would set the pace
  // where there are many chunks.
  constexpr int kAhead = 8;
  double acc = 0.0;
  i64 k = 0;
  for (; k + kAhead <= chunks; k += kAhead) {
    double v[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) v[u] = partial[(k + u) * slots_times_columns + j];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) acc += v[u];
  }
  for (; k < chunks; ++k) acc += partial[k * slots_times_columns + j];
  const T sum = from_float<T>(static_cast<float>(acc));
  out[j] = sum;
  if (j < duplicated) out[slots_times_columns + j] = sum;
}

}  // namespace cf
