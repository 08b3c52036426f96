// PTX wrappers for the GEMM kernels' asynchronous machinery: shared-memory
// addresses, mbarriers, the bulk tensor copy engine (TMA) and the warpgroup
// MMA (wgmma) fences, and the GEMMs' tile order.  Written out in PTX because
// NVRTC builds these sources without any toolkit header.  Everything but
// shared_addr, grouped_tile_of and TensorMap needs sm_90a; the kernels that
// use it are compiled for every architecture (the compile check covers them)
// and trap without it.
#pragma once
#include "cf_common.cuh"

// Operand lists of wgmma's float32 accumulators d[i .. i + 7] / d[i .. i + 31]
// (read and written), for the inline PTX of both GEMM families.
#define CF_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CF_D32(i) CF_D8(i), CF_D8(i + 8), CF_D8(i + 16), CF_D8(i + 24)

namespace cf {

// Output tile `tile` of a tiles_m x tiles_n grid of a GEMM's C in grouped
// order: 8 tile-rows at a time, column by column, so that the tiles in flight
// together share their A and B tiles in L2.  (Both GEMM families order their
// tiles so: gemm_tf32.cuh one tile per block, gemm.cuh persistent blocks.)
__device__ __forceinline__ void grouped_tile_of(i64 tile, i64 tiles_m, i64 tiles_n, i64& tm, i64& tn) {
  constexpr i64 kGroup = 8;
  const i64 in_group = kGroup * tiles_n;
  const i64 first_m = (tile / in_group) * kGroup;
  const i64 group_rows = min(tiles_m - first_m, kGroup);
  tm = first_m + (tile % in_group) % group_rows;
  tn = (tile % in_group) / group_rows;
}

// A TMA descriptor (CUDA's CUtensorMap: 128 opaque bytes, 64-byte aligned),
// encoded on the host (cupy_fused.ops.gemm._tensor_map) and passed by value
// as a __grid_constant__ kernel parameter, so that the copy engine reads it
// from the parameter space.
struct __align__(64) TensorMap {
  unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups of this warpgroup's MMAs are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulator
// registers across the asynchronous MMAs' issue and wait.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// mbarriers (one phase per use of a stage).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the mbarriers' initialisation visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and adds `bytes` to the transactions the current phase waits for
// (the TMA copies complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Whether the phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// One box of a 2-D tensor (inner coordinate first) into shared memory at
// `dst`, completing its bytes on the mbarrier `bar`.  Elements outside the
// tensor arrive as zeros, which is what predicates the GEMM's edges.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap& map, int inner, int outer,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}
// `bytes` contiguous bytes of global memory at `src` into shared memory at
// `dst` (both 16-byte aligned, bytes a multiple of 16), completing them on
// the mbarrier `bar`.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// tma_load_2d for a 4-D tensor, at (c0, c1, c2, c3), innermost first.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap& map, int c0, int c1, int c2,
                                            int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// The box of a 2-D tensor at (inner, outer) from shared memory at `src`, as
// one bulk asynchronous group of this thread; elements outside the tensor
// are not written.  kEvictFirst marks the written lines first to leave L2:
// for outputs written once beside operands that other blocks read again
// from L2.
template <bool kEvictFirst = false>
__device__ __forceinline__ void tma_store_2d(const TensorMap& map, unsigned src, int inner, int outer) {
  if constexpr (kEvictFirst) {
    asm volatile(
        "{\n.reg .b64 policy;\ncreatepolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], policy;\n}\n"
        ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(inner), "r"(outer), "r"(src)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(&map)),
                 "r"(inner), "r"(outer), "r"(src)
                 : "memory");
  }
}
// The same for a 3-D tensor, at (c0, c1, c2), innermost first.
template <bool kEvictFirst = false>
__device__ __forceinline__ void tma_store_3d(const TensorMap& map, unsigned src, int c0, int c1, int c2) {
  if constexpr (kEvictFirst) {
    asm volatile(
        "{\n.reg .b64 policy;\ncreatepolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2, %3}], [%4], policy;\n"
        "}\n" ::"l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(src)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(&map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
  }
}
// The same for a 4-D tensor, at (c0, c1, c2, c3), innermost first.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, unsigned src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(&map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
// `bytes` (a multiple of 16) from shared memory at `src` to global memory at
// `dst` (both 16-byte aligned), as part of this thread's bulk asynchronous
// group: the copy engine writes them, not the thread's own stores.  The
// threads' writes of `src` must be made visible to it first
// (fence_proxy_async, then a barrier with the issuing thread).
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk groups are complete (their writes done).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's shared-memory writes before later reads by the copy
// engine or the tensor cores (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Barrier `id` (1..15; 0 is __syncthreads) over `count` threads.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrives on barrier `id` over `count` threads without waiting: this
// thread's earlier memory accesses are performed for the threads that then
// wait on it (bar.sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Four 8 x 8 matrices of 16-bit values, held as mma accumulator fragments
// (lane l: row l / 4, the pair of columns 2 (l % 4), +1, packed in r_j for
// matrix j), stored transposed: row r of matrix j (its column r) goes to the
// 16 bytes at the address lane 8 j + r gives.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2,
                                                  unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// The same, stored as they are: row r of matrix j goes to the address lane
// 8 j + r gives.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// 16 bytes (four words) to shared memory at `addr`, 16-byte aligned; in
// program order with the other volatile shared-memory accesses.
__device__ __forceinline__ void st_shared_v4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// Four 8 x 8 matrices of 16-bit values from shared memory, row r of matrix j
// the 16 bytes at the address lane 8 j + r gives, into r[j] as mma fragments
// (lane l: row l / 4, the pair of columns 2 (l % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void tma_prefetch_descriptor(const TensorMap& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}
#endif

}  // namespace cf
