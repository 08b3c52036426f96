"""Launch helpers shared by the ops: kernel lookup, grid sizing, the
deterministic column reduction and the CuPy-array entry point."""
from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _bridge, _runtime
from .._cupy import require_cupy
from .._validation import FLOAT_DTYPES, cxx_type

BLOCK = 256
# The per-column parameter gradients are summed in two deterministic stages:
# per-chunk partial sums (a fixed set of rows per block), then a fixed-order
# sum over chunks.  This many blocks in flight keeps every SM busy.
BLOCKS_PER_SM = 8

# reduce_column_partials (column_reduce.cu): the sums of a column group
# (kColumns), and the most warps a group may have (kMaxWarps), which split
# the chunks; a block is REDUCE_BLOCK_WARPS warps, or one group of more.
REDUCE_COLUMNS = 32
REDUCE_MAX_WARPS = 32
REDUCE_BLOCK_WARPS = 8
# Chunks a warp of reduce_column_partials sums at least, where its group
# could have more warps: fewer would leave the group's warps mostly idle.
REDUCE_WARP_CHUNKS = 16


def reduce_warps(chunks: int) -> int:
    """Warps of a column group of reduce_column_partials for ``chunks`` (>=
    1): the largest power of two at most REDUCE_MAX_WARPS that gives each
    at least REDUCE_WARP_CHUNKS chunks (1 below that).  The order of the sums
    depends on it, so it depends on nothing but ``chunks``."""
    return min(REDUCE_MAX_WARPS, 1 << max(0, (chunks // REDUCE_WARP_CHUNKS).bit_length() - 1))


_REDUCE = _runtime.KernelFamily(
    "column_reduce.cu", {(d, split): f"cf::reduce_column_partials<{cxx_type(d)}, {str(split).lower()}>"
                         for d in FLOAT_DTYPES for split in (False, True)})

_sm_counts: Dict[int, int] = {}


def sm_count(device_index: int) -> int:
    n = _sm_counts.get(device_index)
    if n is None:
        n = torch.cuda.get_device_properties(device_index).multi_processor_count
        _sm_counts[device_index] = n
    return n


def _ptr_or_null(t) -> int:
    """Device pointer of an optional tensor for a kernel argument: 0 for None
    (the kernels read a null vector as absent)."""
    return t.data_ptr() if t is not None else 0


def _spread(v: Optional[torch.Tensor], channels: int) -> Optional[torch.Tensor]:
    """A checked per-channel vector as the kernels read it: C values.  A
    vector of one value for every channel (``check_vector(..., one=True)``)
    is spread over the C channels here, inside the op, so that autograd
    never sums C gradients rounded one by one: the op's backward gives such
    a vector the whole sum, rounded once (:func:`_whole_sums`)."""
    if v is None or v.shape[0] == channels:
        return v
    return v.expand(channels).contiguous()


def _whole_sums(sums: torch.Tensor, partial: torch.Tensor, rows) -> torch.Tensor:
    """``sums`` (the per-channel sums of :func:`_reduce_partials`) with, in
    each of ``rows`` (pairs of a row of sums and the slot of ``partial`` it
    reduces), column 0 replaced by the whole slot's sum, from the float64
    partials, rounded once: the gradient of a one-value vector
    (:func:`_spread`), read as ``sums[row, :1]``.  Fixed order, as
    :func:`_reduce_partials`."""
    for row, slot in rows:
        sums[row, :1] = partial[:, slot, :].sum().to(sums.dtype)
    return sums


def _one_value_rows(vectors: Sequence[Optional[torch.Tensor]], rows_of: Sequence[Optional[int]],
                    channels: int) -> List[int]:
    """The rows of an op's parameter-gradient sums whose vector (``vectors[i]``
    has its gradient in row ``rows_of[i]``, None for none) is one value for
    every channel: the rows to give :func:`_whole_sums`."""
    return [row for v, row in zip(vectors, rows_of)
            if v is not None and row is not None and v.shape[0] != channels]


def _vector_grads(sums: torch.Tensor, lengths: Sequence[Optional[int]],
                  rows_of: Sequence[Optional[int]]) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients of an op's per-channel vectors from its backward's
    ``sums`` [rows, C]: for a vector of ``lengths[i]`` values (None: absent)
    whose gradient is row ``rows_of[i]`` (None: none), that row, or for a
    one-value vector its column 0 (the whole sum, :func:`_whole_sums`).
    The rows are views of ``sums``, taken in one call."""
    sum_rows = sums.unbind(0)
    channels = sums.shape[1]
    return tuple(None if n is None or row is None else
                 sum_rows[row][:1] if n != channels else sum_rows[row]
                 for n, row in zip(lengths, rows_of))


@functools.lru_cache(maxsize=256)
def fast_divisor(d: int) -> int:
    """The kernels' ``FastDiv`` (kernels_cu/cf_common.cuh) of ``d`` (1 <= d
    < 2^31): multiplier | shift << 32, such that n // d == (umulhi(n, m) +
    n) >> shift for every n < 2^31 (umulhi: the high 32 bits of the 64-bit
    product).  Cached: bias_relu's forward asks for two on every call."""
    if not 1 <= d < 2**31:
        raise ValueError(f"a fast divisor needs 1 <= d < 2^31, got {d}")
    shift = (d - 1).bit_length()  # the least s with 2^s >= d
    multiplier = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return multiplier | shift << 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Blocks of BLOCK threads that fill a device 8 times over, per device index.
_full_grids: Dict[int, int] = {}


def elementwise_grid(n: int, device_index: int) -> int:
    """Blocks of :data:`BLOCK` threads for a grid-stride loop over ``n``
    items: enough to fill the GPU, never more than the work.  (Runs on every
    launch of the elementwise ops: one dict lookup, no further calls.)"""
    full = _full_grids.get(device_index)
    if full is None:
        full = _full_grids[device_index] = sm_count(device_index) * 8
    blocks = (n + BLOCK - 1) // BLOCK
    return blocks if 0 < blocks < full else (full if blocks else 1)


def row_chunks(rows: int, blocks_per_chunk: int, device_index: int,
               blocks_per_sm: int = BLOCKS_PER_SM, min_rows: int = 1,
               max_rows: Optional[int] = None) -> Tuple[int, int]:
    """Splits ``rows`` (> 0) into chunks for a (blocks_per_chunk x chunks)
    grid: enough chunks for ``blocks_per_sm`` blocks per SM, at most 65535
    and no more than leave ``min_rows`` rows to a chunk; then, with
    ``max_rows``, at least enough that no chunk has more (which may pass
    65535: the caller checks).  Returns (chunks, rows_per_chunk); every
    chunk is non-empty."""
    target = max(1, sm_count(device_index) * blocks_per_sm // max(1, blocks_per_chunk))
    chunks = max(1, min(cdiv(rows, min_rows), target, 65535))
    if max_rows is not None:
        chunks = max(chunks, cdiv(rows, max_rows))
    rows_per_chunk = cdiv(rows, chunks)
    return cdiv(rows, rows_per_chunk), rows_per_chunk


# Zeroed counters of the first stages that end in their own second stage
# (reduce_columns_in_last_block, column_reduce.cuh), one buffer per (device,
# stream): each launch leaves its counters at zero again, and a stream runs
# its launches one after another.  At most _MAX_COUNTERS buffers, the least
# recently used dropped first: a program that makes a stream per batch
# would otherwise keep a buffer for each.  The buffers come from CuPy's
# memory pool, made on their stream (_zeroed_counters), not from torch's
# caching allocator: kept across calls, a buffer of torch's could be one
# that torch.compile's CUDA-graph trees made in a graph's private pool
# while warming it up, and free again when they reset that pool.  (A
# dropped buffer goes back to CuPy's pool of the stream it was made and
# used on, so nothing reuses it before that stream's launches are done.)
_counters: "OrderedDict[Tuple[int, int], torch.Tensor]" = OrderedDict()
_MAX_COUNTERS = 64


def _column_counters(chunks: int, ranges: int, device: torch.device) -> Optional[torch.Tensor]:
    """The counters (int32, zero, at least ``ranges`` of them) for a first
    stage of ``ranges`` column ranges x ``chunks`` chunks that ends in its
    own second stage, on the current stream; None where the second stage is
    a launch of its own (:func:`_reduce_partials`): from 32 chunks on, where
    that launch splits a column's chunks over several warps (the two forms
    sum in the same order below that).  Inside a CUDA-graph capture, a
    buffer of the capture's own, which the graph zeroes on every replay."""
    if reduce_warps(chunks) > 1:
        return None
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(ranges, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    # (OrderedDict's own calls, each atomic under the GIL: threads that
    # launch on other streams meanwhile leave it consistent)
    counters = _counters.get(key)
    if counters is None or counters.numel() < ranges:
        counters = _zeroed_counters(max(ranges, 256), device, torch.cuda.current_stream(device))
        _counters.pop(key, None)  # (a buffer grown for a stream: inserted last, as a new one)
        _counters[key] = counters
        while len(_counters) > _MAX_COUNTERS:
            _counters.popitem(last=False)
    else:
        try:
            _counters.move_to_end(key)  # the most recently used
        except KeyError:  # dropped by another thread meanwhile: the buffer stays valid
            pass
    return counters


def _zeroed_counters(n: int, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
    """``n`` int32 zeros on ``device``, from CuPy's memory pool, zeroed on
    ``stream`` (torch's current one there), as a torch tensor (DLPack: the
    tensor keeps the memory alive)."""
    cupy = require_cupy()
    with torch.cuda.device(device.index), _cupy_stream(cupy, stream):
        return torch.from_dlpack(cupy.zeros(n, dtype=cupy.int32))


def _cupy_stream(cupy, stream: torch.cuda.Stream):
    """``stream`` as a CuPy stream: through the CUDA stream protocol where
    CuPy has it (14 on, which deprecates ``ExternalStream``), else by its
    handle."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def _reduce_partials(partial: torch.Tensor, dtype: torch.dtype,
                     duplicate_first_row: bool = False,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``partial``: float64 [chunks, slots, C] -> [slots, C] in ``dtype``,
    summed over chunks in double in an order fixed by the chunk count
    (column_reduce.cu), rounded at the end: bitwise reproducible.  With
    ``duplicate_first_row``, [slots + 1, C]: the last row repeats the first
    (for two parameters with the same gradient: rows of their own, so that
    accumulating into one never changes the other).  ``out``: that tensor,
    to write into (else a new one)."""
    chunks, slots, channels = partial.shape
    if out is None:
        out = torch.empty((slots + 1 if duplicate_first_row else slots, channels), dtype=dtype,
                          device=partial.device)
    n = slots * channels
    dev = partial.device.index
    warps = reduce_warps(chunks)
    block_warps = max(warps, REDUCE_BLOCK_WARPS)
    columns = REDUCE_COLUMNS * (block_warps // warps)  # per block
    _bridge.launch(_REDUCE.get((dtype, warps > 1), dev), (cdiv(n, columns), 1, 1), 32 * block_warps,
                   (partial.data_ptr(), out.data_ptr(), chunks, n,
                    channels if duplicate_first_row else 0, warps.bit_length() - 1), dev)
    return out


def _broadcast_or_dense(dy: torch.Tensor, memory_format=None):
    """Gradient of an output, as (tensor, dense flag).  A gradient that is one
    value broadcast everywhere (``out.sum().backward()``) is passed as that
    single value (flag 0) instead of being materialised; any other is made
    dense in ``memory_format`` (default: contiguous).  (Runs in every
    backward: the common cases first, in as few Python operations as
    possible.)"""
    if memory_format is None:
        if dy.is_contiguous():
            return dy, 1
    elif dy.is_contiguous(memory_format=memory_format):
        return dy, 1
    if dy.numel() > 0 and (not any(dy.stride()) or all(
            s == 0 for s, n in zip(dy.stride(), dy.shape) if n > 1)):
        return dy, 0
    if memory_format is None:
        return dy.contiguous(), 1
    return dy.contiguous(memory_format=memory_format), 1


# CUDA's special stream handles: the legacy default stream, and the
# per-thread default stream (CuPy's Stream.ptds).
_LEGACY_STREAMS = (0, 1)
_PER_THREAD_STREAM = 2


def _torch_stream(ptr: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream whose launches go to CuPy's stream ``ptr`` of
    ``device``.  CuPy's null stream (0, CUDA's legacy default stream) is
    torch's default stream: ``torch.cuda.ExternalStream(0)`` is not (torch
    makes it a stream of its own, unordered with the null stream's work).
    CuPy's per-thread default stream is refused: torch cannot take it (nor
    hand a tensor to CuPy on it through DLPack)."""
    if ptr in _LEGACY_STREAMS:
        return torch.cuda.default_stream(device)
    if ptr == _PER_THREAD_STREAM:
        raise ValueError("CuPy's current stream must be its null stream or a cupy.cuda.Stream, "
                         "got its per-thread default stream, which torch cannot run on")
    return torch.cuda.ExternalStream(ptr, device=device)


# The ops' arguments that take no array: a torch tensor given as one of them
# is left to the op's own check ("alpha must be a float, got Tensor"), as on
# the torch path.
_SCALAR_ARGUMENTS = frozenset({"alpha", "activation", "precision", "chain", "num_groups", "eps",
                               "linear_bias_in_z", "eager_rounding"})


def call_with_cupy_arrays(op: Callable, first_name: str, *args, **kwargs):
    """The CuPy-array entry of the functional op ``op``: calls ``op`` again
    with every CuPy array argument viewed as a torch tensor (zero-copy,
    DLPack), on the arrays' device and CuPy's current stream of that device
    (which need not be CuPy's current device: a stream belongs to one
    device), and returns its tensor results as CuPy arrays (zero-copy).
    Arrays are all CuPy or all torch: a torch tensor among CuPy arrays is
    refused with a TypeError naming it, before anything runs.  An array
    with a negative stride, which torch cannot view, is copied first.

    Each op calls this first thing when its first argument (named
    ``first_name``) is not a torch tensor: one ``isinstance`` on the torch
    path, where a wrapper function around every op would cost a Python call
    on every launch (``benchmarks/host_overhead.py``).  With no CuPy array
    among the arguments it raises the TypeError of the first argument."""
    values = args + tuple(kwargs.values())
    if not any(map(_bridge.is_cupy_array, values)):
        raise TypeError(f"{first_name} must be a torch.Tensor or a CuPy array, got "
                        f"{type(args[0]).__name__}")
    if any(isinstance(v, torch.Tensor) for v in values):
        bound = inspect.signature(op).bind(*args, **kwargs).arguments
        for name, v in bound.items():
            if isinstance(v, torch.Tensor) and name not in _SCALAR_ARGUMENTS:
                raise mixed_arguments_error(name)
    cupy = require_cupy()
    device = torch.device("cuda", next(filter(_bridge.is_cupy_array, values)).device.id)
    current = cupy.cuda.get_current_stream(device.index)
    if current.is_capturing():
        # (torch's allocator, which the ops allocate from, knows only its
        # own captures: buffers of this call would be handed out again
        # while the graph replays)
        raise ValueError("CuPy's current stream is capturing a CUDA graph, which ops called "
                         "with CuPy arrays cannot join: capture torch tensors with "
                         "torch.cuda.graph instead")
    stream = _torch_stream(current.ptr, device)

    def conv(a):
        if not _bridge.is_cupy_array(a):
            return a
        if any(s < 0 for s in a.strides):  # torch has no negative strides: a copy
            a = cupy.ascontiguousarray(a)
        return _bridge.to_torch(a)

    # The conversions too on the arrays' device and stream (CuPy's current
    # device is torch's: the runtime's), so that DLPack's exchange of
    # streams finds one stream on both sides and adds no wait.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        args = [conv(a) for a in args]
        kwargs = {k: conv(v) for k, v in kwargs.items()}
        result = op(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return _bridge.to_cupy(result)
        return tuple(_bridge.to_cupy(r) if isinstance(r, torch.Tensor) else r for r in result)


def mixed_arguments_error(name: str) -> TypeError:
    """The error of a CuPy-array call given a torch tensor as ``name``: the
    tensor would be read on CuPy's stream with nothing ordering it after
    the torch stream that wrote it."""
    return TypeError(f"{name} must be a CuPy array like the other arrays of the call (all CuPy "
                     "arrays or all torch tensors), got a torch.Tensor")
