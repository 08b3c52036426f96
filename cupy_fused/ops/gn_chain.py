"""GroupNorm epilogues: the whole elementwise chain of problems 37, 88 and 94
around a GroupNorm, forward and backward, one kernel family
(``kernels_cu/gn_chain.cuh``) templated on dtype and op chain (the chains
themselves are in ``kernels_cu/gn_chains.cuh``).

Forward saves z (the GEMM output, with or without the linear bias) and the
per (row, group) mean and 1/std in float32 (one tensor, ``stats`` [2, M,
groups]); the backward recomputes every other intermediate from them in
registers.

Under ``torch.autocast`` the GroupNorm runs in float32, as autocast runs
``group_norm``: a float16 / bfloat16 z meets float32 vectors and the result
is float32 (the "amp" family of instantiations); z's gradient keeps z's dtype.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch

from .. import _bridge, _runtime
from .._amp import HALF_DTYPES, autocast_enabled, cast
from .._autograd import FusedOp, needs_grad, refuse_jit
from .._validation import FLOAT_DTYPES, check_eps, check_groups, check_tensor, check_vector, cxx_type
from ..settings import check_flag
from ._common import (BLOCK, _broadcast_or_dense, call_with_cupy_arrays, cdiv, elementwise_grid,
                      mixed_arguments_error, _one_value_rows, _ptr_or_null, _reduce_partials, _spread,
                      _vector_grads, _whole_sums, row_chunks)


@dataclass(frozen=True)
class Chain:
    """One op chain of the family: its C++ class template and where each
    parameter gradient lands among the backward's per-column sums (slot
    indices, matching the ``kSlot*`` constants of the C++ struct)."""

    cxx: str
    slots: int
    lin_bias: int
    extra_bias: Optional[int]
    gn_weight: int
    gn_bias: int
    mul_weight: Optional[int]

    def type(self, eager_rounding: bool = False) -> str:
        """The C++ type, rounding intermediates as eager PyTorch does or not
        (``kEagerRounding`` in gn_chains.cuh)."""
        return f"{self.cxx}<{'true' if eager_rounding else 'false'}>"

    @property
    def shares_bias_slot(self) -> bool:
        """Whether the two biases get one sum (94: both are added to z)."""
        return self.extra_bias is not None and self.extra_bias == self.lin_bias

    @property
    def grad_rows(self) -> int:
        """Rows of the backward's reduced sums: the slots, plus a copy of the
        shared bias slot (see :func:`._reduce_partials`)."""
        return self.slots + int(self.shares_bias_slot)

    @property
    def grad_row_of(self) -> Tuple[Optional[int], ...]:
        """Row of the reduced sums holding the gradient of (lin_bias,
        extra_bias, gn_weight, gn_bias, mul_weight); None: not in the chain."""
        extra = self.slots if self.shares_bias_slot else self.extra_bias
        return (self.lin_bias, extra, self.gn_weight, self.gn_bias, self.mul_weight)


CHAINS: Dict[str, Chain] = {
    # 37: GroupNorm(swish(z + b_lin) + bias)
    "swish_bias_gn": Chain("cf::ChainSwishBiasGN", 4, 0, 1, 2, 3, None),
    # 88: swish(swish(GroupNorm(z + b_lin)) * multiply_weight)
    "gn_swish_mul_swish": Chain("cf::ChainGNSwishMulSwish", 4, 0, None, 1, 2, 3),
    # 94: GroupNorm(mish(hardtanh(z + b_lin + bias))); both biases get sum dz
    "bias_hardtanh_mish_gn": Chain("cf::ChainBiasHardtanhMishGN", 3, 0, 0, 1, 2, None),
}

# Chain -> Chain.grad_row_of, read by every backward.
_GRAD_ROW_OF = {name: chain.grad_row_of for name, chain in CHAINS.items()}

# Values of a group each lane holds in registers (template parameter
# kMaxVals).  A team of up to 32 lanes (the backward's: up to BLOCK) shares
# one (row, group); each lane holds at least 4 values (a team spanning
# warps: 2 to 4) so that several loads per thread are in flight (the
# kernels are bound by memory latency otherwise).  Groups wider than team *
# kMaxVals channels are processed in slices.
VALS_PER_LANE = (4, 8)


@dataclass(frozen=True)
class LaunchShapes:
    """Launch shapes of the gn_chain kernels: data, chosen with
    ``scripts/tune_gn.py`` (docs/performance.md); :func:`launch_shapes`
    swaps them for a block.

    The ``*_min_blocks`` are each kernel's template parameter ``kMinBlocks``:
    the minimum resident 256-thread blocks per SM the compiler must allow,
    which caps its registers per thread.

    Attributes:
        forward_min_blocks: the scalar forward.
        backward_min_blocks: the scalar backward, but the float32 one with 8
            values per lane (``backward_min_blocks_float_wide``).
        forward_vec_min_blocks_half: the vectorised forward on a float16 /
            bfloat16 z, which holds two rows of loads and its columns'
            vectors per lane.
        forward_vec_min_blocks_float: the same on a float32 z.
        backward_vec_min_blocks_half: the vectorised backward on a float16 /
            bfloat16 z (two rows of loads and a vector's column sums per
            lane, its columns' vectors in shared memory: nothing spills at
            2 blocks per SM).
        backward_vec_min_blocks_float: the same on a float32 z.
        backward_vec_bytes: the vectorised backward's accesses of z, 8 or
            16 bytes (its values per lane, and so its registers).
        team: a fixed (team lanes, values per lane) for the scalar kernels
            instead of :func:`team_shape` / :func:`forward_team_shape` /
            :func:`backward_team_shape`'s rules (tuning only), or None.
            Teams of more than 32 lanes (up to BLOCK) run the backward
            only: the forward's teams are within a warp.
        backward_min_blocks_float_wide: the scalar backward on a float32 z
            with 8 values per lane (groups of 129 to 256 channels; wider
            ones, and teams spanning warps, take the kernel with 4:
            :func:`backward_team_shape`), which spills most at 4
            (docs/performance.md, "The scalar GroupNorm kernels' launch
            bounds").
    """
    forward_min_blocks: int = 8
    backward_min_blocks: int = 4
    forward_vec_min_blocks_half: int = 3
    forward_vec_min_blocks_float: int = 4
    backward_vec_min_blocks_half: int = 2
    backward_vec_min_blocks_float: int = 2
    backward_vec_bytes: int = 16
    team: Optional[Tuple[int, int]] = None
    backward_min_blocks_float_wide: int = 3

    def __post_init__(self):
        if self.team is not None:
            lanes, vals = self.team
            if not (isinstance(lanes, int) and 1 <= lanes <= BLOCK and lanes & (lanes - 1) == 0
                    and vals in (VALS_PER_LANE if lanes <= 32 else VALS_PER_LANE[:1])):
                raise ValueError(f"team must be (lanes: a power of two <= {BLOCK}, values per "
                                 f"lane: one of {VALS_PER_LANE}, {VALS_PER_LANE[0]} for more "
                                 f"than 32 lanes), got {self.team!r}")

    def min_blocks(self, kernel: str, dtype: torch.dtype, vals: int = 0) -> int:
        """kMinBlocks of ``kernel`` ("forward", "backward", "backward_wide",
        "forward_vec" or "backward_vec") on a z of ``dtype``, ``vals``
        values per lane (the scalar kernels')."""
        if kernel == "backward_wide":  # (the same registers per lane)
            kernel = "backward"
        if kernel == "backward" and dtype == torch.float32 and vals > VALS_PER_LANE[0]:
            return self.backward_min_blocks_float_wide
        if kernel.endswith("_vec"):
            return getattr(self, f"{kernel}_min_blocks_"
                           f"{'half' if dtype in HALF_DTYPES else 'float'}")
        return getattr(self, f"{kernel}_min_blocks")


SHIPPED_SHAPES = LaunchShapes()


def _expr(kernel: str, dtype: torch.dtype, chain: str, vals: int, eager_rounding: bool,
          out_dtype: Optional[torch.dtype], shapes: LaunchShapes) -> str:
    out = cxx_type(out_dtype or dtype)
    # "backward_wide": gn_chain_backward with teams spanning warps (kWide)
    name, wide = ("backward", ", true") if kernel == "backward_wide" else (kernel, "")
    return (f"cf::gn_chain_{name}<{cxx_type(dtype)}, {CHAINS[chain].type(eager_rounding)}, "
            f"{vals}, {out}, {shapes.min_blocks(kernel, dtype, vals)}{wide}>")


# The vectorised kernels (``gn_chain_forward_vec`` / ``gn_chain_backward_vec``
# in gn_chain.cuh): lanes own a vector of channels (16 bytes of z; the
# backward's LaunchShapes.backward_vec_bytes), warps walk rows; where the
# shape and alignment allow (:func:`vector_shape`).  The scalar kernels take
# the rest.  Keyed by (kernel, dtype, chain, values per vector).


def _vec_values(dtype: torch.dtype, backward: bool, shapes: LaunchShapes) -> int:
    """Values per vector of the vectorised kernels on a z of ``dtype``."""
    size = shapes.backward_vec_bytes if backward else 16
    return size // dtype.itemsize


def _vec_exprs(dtypes, out_dtype: Optional[torch.dtype], shapes: LaunchShapes) -> Dict[tuple, str]:
    exprs = {}
    for d in dtypes:
        out = cxx_type(out_dtype or d)
        for c in CHAINS:
            for kernel in ("forward_vec", "backward_vec"):
                e = _vec_values(d, kernel == "backward_vec", shapes)
                exprs[(kernel, d, c, e)] = (
                    f"cf::gn_chain_{kernel}<{cxx_type(d)}, {CHAINS[c].type(False)}, {e}, {out}, "
                    f"{shapes.min_blocks(kernel, d)}>")
    return exprs


@functools.lru_cache(maxsize=None)
def _families(shapes: LaunchShapes) -> Dict[str, _runtime.KernelFamily]:
    """The kernel families of ``shapes``, compiled from the one unit
    gn_chain.cu, an instantiation at a time on its first use.  Scalar
    kernels keyed by (kernel, dtype, chain, values per lane); "eager": the
    eager-rounding variants (float16 / bfloat16 only: rounding to float32
    is the identity); "amp": z in float16 / bfloat16, the output, its
    gradient and the vectors in float32 (autocast), scalar and vectorised."""
    scalar = [(k, d, c, v) for k in ("forward", "backward", "backward_wide") for d in FLOAT_DTYPES
              for c in CHAINS for v in VALS_PER_LANE
              if k != "backward_wide" or v == VALS_PER_LANE[0]]  # (backward_team_shape)
    return {
        "plain": _runtime.KernelFamily("gn_chain.cu", {
            key: _expr(*key, False, None, shapes) for key in scalar}),
        "eager": _runtime.KernelFamily("gn_chain.cu", {
            key: _expr(*key, True, None, shapes) for key in scalar if key[1] != torch.float32}),
        "vec": _runtime.KernelFamily("gn_chain.cu", _vec_exprs(FLOAT_DTYPES, None, shapes)),
        "amp": _runtime.KernelFamily("gn_chain.cu", {
            **{key: _expr(*key, False, torch.float32, shapes) for key in scalar
               if key[1] in HALF_DTYPES},
            **_vec_exprs(HALF_DTYPES, torch.float32, shapes)}),
    }


_families(SHIPPED_SHAPES)  # declared at import: the compile check covers them
_shapes = [SHIPPED_SHAPES]  # the shapes in use (launch_shapes swaps them)


def _family(dtype: torch.dtype, eager_rounding: bool, float_out: bool,
            vec: bool = False) -> _runtime.KernelFamily:
    families = _families(_shapes[0])
    if float_out and dtype != torch.float32:
        return families["amp"]
    if vec:
        return families["vec"]
    if dtype == torch.float32:
        return families["plain"]
    return families["eager" if eager_rounding else "plain"]


@contextlib.contextmanager
def launch_shapes(shapes: LaunchShapes) -> Iterator[LaunchShapes]:
    """Runs the block's gn_chain launches with ``shapes`` (for tuning:
    ``scripts/tune_gn.py``), then the shipped ones again, also when the
    block raises.  Process-wide, like the launch plans it clears.

    Args:
        shapes: a :class:`LaunchShapes`.

    Returns:
        A context manager yielding ``shapes``.
    """
    if not isinstance(shapes, LaunchShapes):
        raise TypeError(f"shapes must be a LaunchShapes, got {type(shapes).__name__}")
    previous = _shapes[0]
    _shapes[0] = shapes
    clear_launch_plans()
    try:
        yield shapes
    finally:
        _shapes[0] = previous
        clear_launch_plans()


# Warps of a block of the vectorised kernels (kWarps in gn_chain.cuh, which
# strides the rows by it: their launches' BLOCK threads must be exactly these
# warps; a CPU test ties the three together).  They walk the rows of the
# block's chunk.
ROW_WARPS = 8

# A gradient broadcast from one value reaches the backward kernels as this
# many copies of it: the vectorised backward reads a whole vector of dy (at
# most 16 bytes of a 16-bit z's values) where a dense dy would have its row.
BROADCAST_DY_VALUES = 8

# The vectorised backward sums each column in float over a warp's rows: at
# most this many, so that the sum stays well inside float's accuracy (the
# warps, then the chunks, are summed in double).
VEC_MAX_ROWS_PER_WARP = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def vector_shape(dtype: torch.dtype, channels_per_group: int,
                 backward: bool) -> Optional[Tuple[int, int]]:
    """(team lanes, values per vector) of the vectorised kernels for this
    group width, or None where they do not apply: the width not a multiple
    of the vector, or wider than a warp holds (a lane owns one vector)."""
    values = _vec_values(dtype, backward, _shapes[0])
    if channels_per_group % values or channels_per_group // values > 32:
        return None
    return _next_pow2(channels_per_group // values), values


def vector_grid(rows: int, num_groups: int, team: int, min_blocks: int, device_index: int,
                max_rows: Optional[int] = None) -> Tuple[int, int, int]:
    """Grid of a vectorised kernel: (slices: blockIdx.x over groups, 32 /
    team per block; chunks: blockIdx.y over rows; rows per chunk), for
    ``rows`` > 0.  The chunks make one wave of ``min_blocks`` blocks per SM
    (the kernel's kMinBlocks), and no more chunks than there are rows per
    block's warps (``row_chunks``; ``max_rows``: as there)."""
    slices = cdiv(num_groups, 32 // team)
    return (slices, *row_chunks(rows, slices, device_index, min_blocks, ROW_WARPS, max_rows))


def _aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether every tensor given starts on 16 bytes (the vector kernels'
    wide accesses)."""
    for t in tensors:
        if t is not None and t.data_ptr() % 16:
            return False
    return True


# Whether eager PyTorch's CUDA GroupNorm, on float16 / bfloat16 input,
# normalises with its mean and rstd rounded to the input's dtype: it stores
# them in tensors of that dtype and, before torch 2.13, reads them back from
# there (from 2.13 on it keeps float32 copies for the normalisation).  The
# eager-rounding kernels follow the installed torch; a GPU test checks this
# rule against torch's own group_norm.
EAGER_GN_ROUNDS_STATISTICS = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


@functools.lru_cache(maxsize=None)
def _rounded_eps(eps: float, dtype: torch.dtype) -> float:
    """eps as eager's GroupNorm kernels use it: a value of the input's dtype."""
    return float(torch.tensor(eps, dtype=torch.float32).to(dtype).item())


def team_shape(channels_per_group: int) -> Tuple[int, int]:
    """(lanes per (row, group) pair: a power of two <= 32, values per lane)
    of the scalar backward (and, via :func:`forward_team_shape`, forward),
    unless the launch shapes in use fix one (:class:`LaunchShapes`)."""
    if _shapes[0].team is not None:
        return _shapes[0].team
    small = VALS_PER_LANE[0]
    team = 1
    while team < 32 and team * small < channels_per_group:
        team *= 2
    vals = small if channels_per_group <= team * small else VALS_PER_LANE[1]
    return team, vals


def backward_team_shape(channels_per_group: int, dtype: torch.dtype,
                        num_groups: int) -> Tuple[int, int]:
    """The scalar backward's (team, values per lane) on a z of ``dtype``
    with ``num_groups`` groups: :func:`team_shape`'s, but for two cases.

    * One to four groups of more than 32 x 4 channels (at most half
      a block's warps: BLOCK threads): a team of 64 to BLOCK lanes,
      adjacent warps that share each row's group (gn_chain.cuh,
      ``wide_team_sums``), as many as the groups leave idle, but no more
      lanes than the group's channels / 4 rounded up to a power of two
      (2 to 4 values a lane).  With 32-lane teams, the warps of a block
      that had no group of their own idled.  Such teams take the kernel
      with 4 values per lane, swept where the group is wider: with 8 held
      in registers, whose column sums spill, they were slower
      (docs/performance.md, "Fewer groups than a block has warps").
    * A float32 group wider than the team's registers hold (more than team
      x 8 channels) runs in two sweeps per row whatever the values per lane:
      on the kernel with 4, whose launch bound suits the sweeps (the same
      bits; LaunchShapes' ``backward_min_blocks_float_wide`` is for 8
      values held in registers).
    """
    team, vals = team_shape(channels_per_group)
    if _shapes[0].team is not None:
        return team, vals
    if team == 32:
        team = max(32, min(BLOCK // _next_pow2(num_groups),
                           _next_pow2(cdiv(channels_per_group, VALS_PER_LANE[0]))))
        if team > 32:
            return team, VALS_PER_LANE[0]
    if dtype == torch.float32 and channels_per_group > team * vals:
        return team, VALS_PER_LANE[0]
    return team, vals


def forward_team_shape(channels_per_group: int) -> Tuple[int, int]:
    """The forward's (team, values per lane): as :func:`team_shape`, but
    where that gives teams of 16 or 32 lanes with 4 values each, half the
    lanes with 8 values: twice the loads in flight per thread, which the
    forward, bound by memory latency, needs (``scripts/tune_gn.py`` times
    the shapes).  The backward keeps :func:`team_shape`: with 8 values its
    per-column sums spill out of registers."""
    team, vals = team_shape(channels_per_group)
    if _shapes[0].team is not None:
        if team > 32:
            raise ValueError(f"the scalar forward takes teams of at most 32 lanes, but the launch "
                             f"shapes in use fix {team}")
        return team, vals
    if vals == VALS_PER_LANE[0] and team >= 16:
        return team // 2, VALS_PER_LANE[1]
    return team, vals


# Launch plans per (rows, channels, num_groups, dtype, chain, eager_rounding,
# float output, operands aligned, device index): what a launch derives from
# the shapes alone (kernel, grid, team), worked out on a shape's first call
# instead of on every call (the half-precision training steps are as long as
# their host work).
_PLANS_KEPT = 512
_forward_plans: Dict[tuple, tuple] = {}
_backward_plans: Dict[tuple, tuple] = {}


def clear_launch_plans() -> None:
    """Forgets every launch plan (:func:`launch_shapes` does, on entry and
    exit)."""
    _forward_plans.clear()
    _backward_plans.clear()


def _keep(plans: Dict[tuple, tuple], key: tuple, plan: tuple) -> tuple:
    if len(plans) >= _PLANS_KEPT:  # many shapes (e.g. varying batch sizes): start over
        plans.clear()
    plans[key] = plan
    return plan


def _rounds(dtype: torch.dtype, eager_rounding: bool, float_out: bool) -> bool:
    """Whether a launch takes the eager-rounding kernels (scalar only)."""
    return eager_rounding and dtype != torch.float32 and not float_out


def _plan_vector_shape(key: tuple, backward: bool) -> Optional[Tuple[int, int]]:
    """:func:`vector_shape` for a plan's key, None where the vectorised
    kernels do not apply (operands off the 16-byte grid, eager rounding)."""
    rows, channels, num_groups, dtype, chain, eager_rounding, float_out, is_aligned, dev = key
    if not is_aligned or _rounds(dtype, eager_rounding, float_out):
        return None
    return vector_shape(dtype, channels // num_groups, backward)


def _forward_plan(key: tuple) -> tuple:
    """(kernel, grid, team, eager-rounding family, trailing arguments) of a
    forward launch."""
    rows, channels, num_groups, dtype, chain, eager_rounding, float_out, _, dev = key
    shape = _plan_vector_shape(key, False)
    if shape is not None:
        team, values = shape
        fn = _family(dtype, False, float_out, True).get(("forward_vec", dtype, chain, values),
                                                        dev)
        slices, chunks, per = vector_grid(rows, num_groups, team,
                                          _shapes[0].min_blocks("forward_vec", dtype), dev)
        return _keep(_forward_plans, key, (fn, (slices, chunks, 1), team, False, (per,)))
    team, vals = forward_team_shape(channels // num_groups)
    fn = _family(dtype, eager_rounding, float_out).get(("forward", dtype, chain, vals), dev)
    return _keep(_forward_plans, key, (fn, (elementwise_grid(rows * num_groups * team, dev), 1, 1),
                                       team, _rounds(dtype, eager_rounding, float_out), ()))


def _backward_plan(key: tuple) -> tuple:
    """(kernel, grid x, row chunks, rows per chunk, team) of a backward launch."""
    rows, channels, num_groups, dtype, chain, eager_rounding, float_out, _, dev = key
    shape = _plan_vector_shape(key, True)
    if shape is not None:
        team, values = shape
        grid_x, chunks, per = vector_grid(rows, num_groups, team,
                                          _shapes[0].min_blocks("backward_vec", dtype), dev,
                                          max_rows=ROW_WARPS * VEC_MAX_ROWS_PER_WARP)
        if chunks <= 65535:
            fn = _family(dtype, False, float_out, True).get(
                ("backward_vec", dtype, chain, values), dev)
            return _keep(_backward_plans, key, (fn, grid_x, chunks, per, team))
    team, vals = backward_team_shape(channels // num_groups, dtype, num_groups)
    grid_x = cdiv(num_groups, BLOCK // team)
    chunks, rows_per_chunk = row_chunks(rows, grid_x, dev)
    kernel = "backward_wide" if team > 32 else "backward"  # (teams spanning warps)
    return _keep(_backward_plans, key, (
        _family(dtype, eager_rounding, float_out).get((kernel, dtype, chain, vals), dev), grid_x,
        chunks, rows_per_chunk, team))


def _stats_pointers(stats: torch.Tensor) -> Tuple[int, int]:
    """Device pointers of the mean and 1/std planes of ``stats`` [2, M,
    groups] (one allocation, one saved tensor, where two would cost a
    second allocation on every forward)."""
    mean = stats.data_ptr()
    return mean, mean + 4 * stats.shape[1] * stats.shape[2]


def _launch_forward(z: torch.Tensor, lin_bias: Optional[torch.Tensor],
                    extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                    gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                    num_groups: int, eps: float, save_stats: bool, bias_in_z: bool,
                    eager_rounding: bool = False,
                    float_out: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, stats): ``stats`` float32 [2, M, num_groups], the mean
    and 1/std of every (row, group), when ``save_stats``, else empty.
    ``float_out``: out and the vectors are float32 whatever z's dtype
    (autocast)."""
    rows, channels = z.shape
    out = torch.empty_like(z, dtype=torch.float32) if float_out else torch.empty_like(z)
    stats = torch.empty((2, rows, num_groups) if save_stats else (0,), dtype=torch.float32,
                        device=z.device)
    if rows and channels:
        lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = (
            _spread(v, channels) for v in (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight))
        dev = z.device.index
        key = (rows, channels, num_groups, z.dtype, chain, eager_rounding, float_out,
               _aligned(z, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight), dev)
        fn, grid, team, rounds, tail = _forward_plans.get(key) or _forward_plan(key)
        round_statistics = 0
        if rounds:
            eps = _rounded_eps(eps, z.dtype)
            round_statistics = int(EAGER_GN_ROUNDS_STATISTICS)
        mean, rstd = _stats_pointers(stats) if save_stats else (0, 0)
        _bridge.launch(fn, grid, BLOCK, (
            z.data_ptr(), out.data_ptr(), mean, rstd, 0 if bias_in_z else _ptr_or_null(lin_bias),
            _ptr_or_null(extra_bias), _ptr_or_null(gn_weight), _ptr_or_null(gn_bias),
            _ptr_or_null(mul_weight), rows, channels, num_groups, team, eps, round_statistics,
            *tail), dev)
    return out, stats


def _forward_fake(z: torch.Tensor, lin_bias: Optional[torch.Tensor],
                  extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                  gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                  num_groups: int, eps: float, save_stats: bool, bias_in_z: bool,
                  eager_rounding: bool = False,
                  float_out: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(z, dtype=torch.float32) if float_out else torch.empty_like(z),
            z.new_empty((2, z.shape[0], num_groups) if save_stats else (0,), dtype=torch.float32))


def _launch_backward(dout: torch.Tensor, z: torch.Tensor, stats: torch.Tensor,
                     lin_bias: Optional[torch.Tensor], extra_bias: Optional[torch.Tensor],
                     gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                     mul_weight: Optional[torch.Tensor], chain: str, num_groups: int,
                     bias_in_z: bool,
                     eager_rounding: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (dz in z's dtype, per-column sums [Chain.grad_rows, C] in
    dout's dtype: the parameter gradients, :func:`_parameter_grads`).
    ``stats``: the forward's.  ``eager_rounding`` must be the forward's: the
    backward recomputes its normalised values.  dout float32 with a half z:
    the autocast kernels (see :func:`_launch_forward`)."""
    rows, channels = z.shape
    spec = CHAINS[chain]
    dz = torch.empty_like(z)
    if rows == 0 or channels == 0:
        return dz, torch.zeros((spec.grad_rows, channels), dtype=dout.dtype, device=z.device)
    vectors = (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    whole = _one_value_rows(vectors, _GRAD_ROW_OF[chain], channels)
    lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = (_spread(v, channels) for v in vectors)
    dev = z.device.index
    float_out = dout.dtype != z.dtype
    dy, dense = _broadcast_or_dense(dout)
    if not dense:
        # The value as a row of BROADCAST_DY_VALUES copies, which the
        # vectorised kernels read for every row (the scalar ones read dy[0]).
        dy = dy.as_strided((BROADCAST_DY_VALUES,), (0,)).contiguous()
    key = (rows, channels, num_groups, z.dtype, chain, eager_rounding, float_out,
           _aligned(z, dy, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight), dev)
    fn, grid_x, chunks, rows_per_chunk, team = _backward_plans.get(key) or _backward_plan(key)
    partial = torch.empty((chunks, spec.slots, channels), dtype=torch.float64, device=z.device)
    mean, rstd = _stats_pointers(stats)
    _bridge.launch(fn, (grid_x, chunks, 1), BLOCK, (
        z.data_ptr(), dy.data_ptr(), dense, mean, rstd,
        0 if bias_in_z else _ptr_or_null(lin_bias),
        _ptr_or_null(extra_bias), _ptr_or_null(gn_weight), _ptr_or_null(gn_bias),
        _ptr_or_null(mul_weight), dz.data_ptr(), partial.data_ptr(), rows, channels, num_groups,
        team, rows_per_chunk), dev)
    sums = _reduce_partials(partial, dout.dtype, spec.shares_bias_slot)
    if whole:  # (a row past the slots repeats slot 0: see Chain.grad_rows)
        sums = _whole_sums(sums, partial, [(row, row if row < spec.slots else 0) for row in whole])
    return dz, sums


def _backward_fake(dout: torch.Tensor, z: torch.Tensor, stats: torch.Tensor,
                   lin_bias: Optional[torch.Tensor], extra_bias: Optional[torch.Tensor],
                   gn_weight: Optional[torch.Tensor], gn_bias: Optional[torch.Tensor],
                   mul_weight: Optional[torch.Tensor], chain: str, num_groups: int,
                   bias_in_z: bool,
                   eager_rounding: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(z), dout.new_empty((CHAINS[chain].grad_rows, z.shape[1]))


def _setup_context(ctx, inputs, output):
    (z, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain, num_groups, _, _, in_z,
     eager_rounding, _) = inputs
    ctx.save_for_backward(z, output[1], lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    ctx.chain = chain
    ctx.num_groups = num_groups
    ctx.bias_in_z = in_z
    ctx.eager_rounding = eager_rounding


def _parameter_grads(chain: str, sums: torch.Tensor, lin_bias, extra_bias, gn_weight, gn_bias,
                     mul_weight) -> tuple:
    """The gradients of (lin_bias, extra_bias, gn_weight, gn_bias,
    mul_weight): rows of the backward's ``sums`` [Chain.grad_rows, C] (one
    row per parameter, :func:`_common._vector_grads`), None for an absent
    vector."""
    lengths = tuple(None if v is None else v.shape[0]
                    for v in (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight))
    return _vector_grads(sums, lengths, _GRAD_ROW_OF[chain])


def _backward_formula(ctx, grads, run_backward):
    z, stats, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = ctx.saved_tensors
    dz, sums = run_backward(grads[0], z, stats, lin_bias, extra_bias, gn_weight, gn_bias,
                            mul_weight, ctx.chain, ctx.num_groups, ctx.bias_in_z,
                            ctx.eager_rounding)
    return (dz,) + _parameter_grads(ctx.chain, sums, lin_bias, extra_bias, gn_weight, gn_bias,
                                    mul_weight) + (None,) * 7


_GN_CHAIN = FusedOp("gn_chain", _launch_forward, _forward_fake, _setup_context, _backward_formula,
                    _launch_backward, _backward_fake, nondifferentiable=(1,))


def check_chain(chain) -> None:
    if not isinstance(chain, str) or chain not in CHAINS:
        raise ValueError(f"chain must be one of {sorted(CHAINS)}, got {chain!r}")


# The vectors' argument names in gn_chain and linear_gn_chain.
VECTOR_NAMES = ("lin_bias", "extra_bias", "gn_weight", "gn_bias", "mul_weight")


def _zero_dim(v) -> bool:
    """Whether ``v`` is a 0-dim tensor."""
    return isinstance(v, torch.Tensor) and v.dim() == 0


def check_chain_vectors(chain: str, channels: int, like: torch.Tensor, like_name: str, lin_bias,
                        extra_bias, gn_weight, gn_bias, mul_weight,
                        autocast: bool = False, names: Tuple[str, ...] = VECTOR_NAMES) -> tuple:
    """The per-channel vectors of ``chain``, validated against ``like``:
    (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight), each flat and
    contiguous or None (mul_weight is required by the chains that use it).
    A vector the chain has no place for (extra_bias in 88's, mul_weight in
    37's and 94's) is refused: it would be ignored.  ``autocast``: float32,
    float16 and bfloat16 vectors cast to float32 (autograd ops), the dtype
    autocast runs the GroupNorm in; others (float64) refused.  Outside
    autocast a 0-dim vector is cast to ``like``'s dtype (torch's promotion
    lets it change no float dtype: a float32 one in a float16 chain gives
    float16).  Every vector is checked before any is cast.  ``names``:
    the vectors' argument names in the caller's signature, for the
    errors."""
    spec = CHAINS[chain]
    for name, value, slot in ((names[1], extra_bias, spec.extra_bias),
                              (names[4], mul_weight, spec.mul_weight)):
        if slot is None and value is not None:
            raise ValueError(f"{name} must be None for chain {chain!r}, which has no such "
                             f"vector (it would be ignored)")
    # (Each vector but the linear bias, which a GEMM's epilogue may add, may
    # be one value for every channel: see check_vector.)  Every vector is
    # checked before any is cast (a cast is a launch).  The common cases are
    # written out: this runs on every call.
    if not (autocast or _zero_dim(lin_bias) or _zero_dim(extra_bias) or _zero_dim(gn_weight)
            or _zero_dim(gn_bias) or _zero_dim(mul_weight)):
        # Each in like's dtype, nothing to cast.
        return (check_vector(names[0], lin_bias, channels, like, like_name),
                check_vector(names[1], extra_bias, channels, like, like_name, one=True),
                check_vector(names[2], gn_weight, channels, like, like_name, one=True),
                check_vector(names[3], gn_bias, channels, like, like_name, one=True),
                check_vector(names[4], mul_weight, channels, like, like_name,
                             optional=spec.mul_weight is None, one=True))
    if autocast:  # each any of the three, then float32 (all checked first)
        any_float, f32 = FLOAT_DTYPES, torch.float32
        a = check_vector(names[0], lin_bias, channels, like, like_name, dtype=any_float)
        b = check_vector(names[1], extra_bias, channels, like, like_name, dtype=any_float, one=True)
        c = check_vector(names[2], gn_weight, channels, like, like_name, dtype=any_float, one=True)
        d = check_vector(names[3], gn_bias, channels, like, like_name, dtype=any_float, one=True)
        e = check_vector(names[4], mul_weight, channels, like, like_name,
                         optional=spec.mul_weight is None, dtype=any_float, one=True)
        return cast(a, f32), cast(b, f32), cast(c, f32), cast(d, f32), cast(e, f32)
    # A 0-dim vector outside autocast: any of the three, then like's dtype
    # (torch's promotion lets it change no float dtype); the others in
    # like's dtype.
    vectors = (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    zero = [_zero_dim(v) for v in vectors]
    checked = [check_vector(names[i], v, channels, like, like_name,
                            optional=i != 4 or spec.mul_weight is None,
                            dtype=FLOAT_DTYPES if zero[i] else None, one=i > 0)
               for i, v in enumerate(vectors)]
    return tuple(cast(v, like.dtype) if z else v for v, z in zip(checked, zero))


def gn_chain(z: torch.Tensor, chain: str, num_groups: int, *, lin_bias=None, extra_bias=None,
             gn_weight=None, gn_bias=None, mul_weight=None, eps: float = 1e-5,
             linear_bias_in_z: bool = False, eager_rounding: bool = False) -> torch.Tensor:
    """The GroupNorm op chain ``chain`` on z (a linear layer's output),
    forward in one kernel, differentiable in z and every vector.  The
    vectors (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight) have C
    values each, shape (C,), z's dtype and device; None is absent
    (GroupNorm weight 1, bias 0).  All but lin_bias may also be one value
    for every channel (e.g. shape (1,)): its gradient is then the sum over
    the channels, rounded once.

    Args:
        z: [M, C], float32, float16 or bfloat16 on a CUDA device (or a CuPy
            array, with CuPy arrays for the vectors: the result is then one
            too).
        chain: a key of :data:`CHAINS`: ``"swish_bias_gn"`` (problem 37:
            ``group_norm(swish(z + lin_bias) + extra_bias)``),
            ``"gn_swish_mul_swish"`` (88: ``swish(swish(group_norm(z +
            lin_bias)) * mul_weight)``) or ``"bias_hardtanh_mish_gn"`` (94:
            ``group_norm(mish(hardtanh(z + lin_bias + extra_bias)))``).
        num_groups: GroupNorm groups; divides C.
        lin_bias: the linear layer's bias, or None.
        extra_bias: the chain's second bias (37 and 94), or None.
        gn_weight, gn_bias: GroupNorm's affine vectors, or None.
        mul_weight: the multiplier of ``"gn_swish_mul_swish"``; required by
            that chain.
        eps: GroupNorm's epsilon, finite and non-negative.
        linear_bias_in_z: z already holds the linear bias (added by the
            GEMM's epilogue, e.g. ``F.linear(x, W, lin_bias.detach())``,
            before z is rounded to its dtype); the kernels then only produce
            its gradient.
        eager_rounding: (float16 / bfloat16; no effect in float32) round
            the chain's intermediates to z's dtype where eager PyTorch does
            (eps too, and the GroupNorm's mean and rstd where the installed
            torch rounds them: :data:`EAGER_GN_ROUNDS_STATISTICS`), to match
            eager's output on CUDA to about one unit in the last place.  By
            default the chain runs in float32 and rounds once: closer to the
            exact result, but a few units away from eager's where the
            normalisation magnifies eager's roundings.

    Returns:
        [M, C] in z's dtype; float32 under autocast.

    Under ``torch.autocast("cuda")`` the chain runs in float32, as autocast
    runs ``group_norm``: the vectors are cast to float32, z keeps its dtype,
    and the result is float32 (``eager_rounding`` then has no effect).

    Raises:
        TypeError, ValueError: an argument of another type, dtype, device or
            shape, an unknown chain, groups that do not divide C, before
            anything runs.
    """
    return _gn_chain_entry(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight,
                           eps, linear_bias_in_z, eager_rounding, VECTOR_NAMES)


def _gn_chain_entry(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, eps,
                    linear_bias_in_z, eager_rounding, names: Tuple[str, ...]) -> torch.Tensor:
    """:func:`gn_chain`, and the per-problem forms below, whose arguments
    have other names (``names``, as in :func:`check_chain_vectors`)."""
    if not isinstance(z, torch.Tensor):
        vectors = (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
        if any(map(_bridge.is_cupy_array, (z,) + vectors)):  # (else the error of z, below)
            for name, v in zip(names, vectors):
                if isinstance(v, torch.Tensor):  # named as the caller's form names it
                    raise mixed_arguments_error(name)
        return call_with_cupy_arrays(
            _gn_chain_entry, "z", z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias,
            mul_weight, eps, linear_bias_in_z, eager_rounding, names)
    refuse_jit("gn_chain")
    check_chain(chain)
    check_tensor("z", z, ndim=(2,))
    channels = z.shape[1]
    num_groups = check_groups(num_groups, channels)
    eps = check_eps(eps)
    linear_bias_in_z = check_flag("linear_bias_in_z", linear_bias_in_z)
    eager_rounding = check_flag("eager_rounding", eager_rounding)
    amp = autocast_enabled()  # (to any dtype: group_norm runs in float32 under each)
    # (last: the vectors' casts, once all are checked)
    lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = check_chain_vectors(
        chain, channels, z, "z", lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, amp, names)
    return _run_gn_chain(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias,
                         mul_weight, eps, linear_bias_in_z, eager_rounding,
                         amp and z.dtype != torch.float32)


def _run_gn_chain(z: torch.Tensor, chain: str, num_groups: int, lin_bias, extra_bias, gn_weight,
                  gn_bias, mul_weight, eps: float, linear_bias_in_z: bool,
                  eager_rounding: bool = False, float_out: bool = False) -> torch.Tensor:
    """:func:`gn_chain` on arguments it (or a caller applying the same
    checks, as :func:`.linear_gn_chain.linear_gn_chain`) has already validated:
    the vectors flat and contiguous or None, in z's dtype, or float32 with
    ``float_out`` (a float16 / bfloat16 z under autocast; float32 result)."""
    z = z if z.is_contiguous() else z.contiguous()
    grad = needs_grad(z, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    return _GN_CHAIN.run(grad, z, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                         num_groups, eps, grad, linear_bias_in_z, eager_rounding, float_out)[0]


# The vectors' argument names in the per-problem forms.
_WRAPPER_NAMES = ("linear_bias", "bias", "gn_weight", "gn_bias", "multiply_weight")


def swish_bias_group_norm(z, linear_bias, bias, gn_weight, gn_bias, num_groups: int,
                          eps: float = 1e-5, linear_bias_in_z: bool = False,
                          eager_rounding: bool = False):
    """Problem 37's epilogue: ``group_norm(swish(z + linear_bias) + bias)``,
    :func:`gn_chain` with ``chain="swish_bias_gn"``; the vectors in z's
    dtype, on its device: the linear bias C values, the others C values or
    one for every channel.

    Args:
        z: [M, C], float32, float16 or bfloat16 on a CUDA device.
        linear_bias: (C,) or None.
        bias: (C,), added after the swish, or None.
        gn_weight, gn_bias: GroupNorm's affine vectors, (C,) each, or None.
        num_groups, eps, linear_bias_in_z, eager_rounding: as for
            :func:`gn_chain`.

    Returns:
        [M, C] in z's dtype (float32 under autocast).

    Raises:
        TypeError, ValueError: as :func:`gn_chain`, before anything runs.
    """
    return _gn_chain_entry(z, "swish_bias_gn", num_groups, linear_bias, bias, gn_weight, gn_bias, None,
                           eps, linear_bias_in_z, eager_rounding, _WRAPPER_NAMES)


def group_norm_swish_multiply_swish(z, linear_bias, gn_weight, gn_bias, multiply_weight,
                                    num_groups: int, eps: float = 1e-5,
                                    linear_bias_in_z: bool = False, eager_rounding: bool = False):
    """Problem 88's epilogue: ``g = group_norm(z + linear_bias);
    m = swish(g) * multiply_weight; swish(m)``, :func:`gn_chain` with
    ``chain="gn_swish_mul_swish"``; the vectors in z's dtype, on its device:
    the linear bias C values, the others C values or one for every channel.

    Args:
        z: [M, C], float32, float16 or bfloat16 on a CUDA device.
        linear_bias: (C,) or None.
        gn_weight, gn_bias: GroupNorm's affine vectors, (C,) each, or None.
        multiply_weight: (C,).
        num_groups, eps, linear_bias_in_z, eager_rounding: as for
            :func:`gn_chain`.

    Returns:
        [M, C] in z's dtype (float32 under autocast).

    Raises:
        TypeError, ValueError: as :func:`gn_chain`, before anything runs.
    """
    return _gn_chain_entry(z, "gn_swish_mul_swish", num_groups, linear_bias, None, gn_weight, gn_bias,
                           multiply_weight, eps, linear_bias_in_z, eager_rounding, _WRAPPER_NAMES)


def bias_hardtanh_mish_group_norm(z, linear_bias, bias, gn_weight, gn_bias, num_groups: int,
                                  eps: float = 1e-5, linear_bias_in_z: bool = False,
                                  eager_rounding: bool = False):
    """Problem 94's epilogue:
    ``group_norm(mish(hardtanh(z + linear_bias + bias)))``, :func:`gn_chain`
    with ``chain="bias_hardtanh_mish_gn"``; the vectors in z's dtype, on
    its device: the linear bias C values, the others C values or one for
    every channel.

    Args:
        z: [M, C], float32, float16 or bfloat16 on a CUDA device.
        linear_bias: (C,) or None.
        bias: (C,), added with the linear bias, or None.
        gn_weight, gn_bias: GroupNorm's affine vectors, (C,) each, or None.
        num_groups, eps, linear_bias_in_z, eager_rounding: as for
            :func:`gn_chain`.

    Returns:
        [M, C] in z's dtype (float32 under autocast).

    Raises:
        TypeError, ValueError: as :func:`gn_chain`, before anything runs.
    """
    return _gn_chain_entry(z, "bias_hardtanh_mish_gn", num_groups, linear_bias, bias, gn_weight,
                           gn_bias, None, eps, linear_bias_in_z, eager_rounding, _WRAPPER_NAMES)
