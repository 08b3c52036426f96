// Second, deterministic stage of every per-column (per-channel) parameter
// gradient: out[j] = sum over chunks k, in order, of partial[k][p][j] for each
// of the `planes` planes (1, or 2 when a first stage left its compensation
// terms beside its sums).  j runs over slots x columns.  Fixed order, no
// atomics: bitwise reproducible.  Compensated float sum, rounded once to the
// parameter dtype.
#include "cf_common.cuh"

namespace cf {

template <typename T>
__global__ void reduce_column_partials(const float* __restrict__ partial, T* __restrict__ out,
                                       i64 chunks, i64 planes, i64 slots_times_columns) {
  const i64 j = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (j >= slots_times_columns) return;
  CompensatedSum acc;
  for (i64 k = 0; k < chunks * planes; ++k) acc.add(partial[k * slots_times_columns + j]);
  out[j] = from_float<T>(acc.value());
}

}  // namespace cf
