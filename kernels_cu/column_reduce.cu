// Second, deterministic stage of every per-column (per-channel) parameter
// gradient: out[s][c] = sum over chunks k, in order, of partial[k][s][c].
// Fixed order, no atomics: bitwise reproducible.  The sum stays in float and
// is rounded once to the parameter dtype.
#include "cf_common.cuh"

namespace cf {

template <typename T>
__global__ void reduce_column_partials(const float* __restrict__ partial, T* __restrict__ out,
                                       i64 chunks, i64 slots_times_columns) {
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= slots_times_columns) return;
  float acc = 0.0f;
  for (i64 k = 0; k < chunks; ++k) acc += partial[k * slots_times_columns + j];
  out[j] = from_float<T>(acc);
}

}  // namespace cf
