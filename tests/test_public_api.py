"""Everything reachable as ``cupy_fused.ops.<module>.<name>`` without a
leading underscore either validates its arguments as the public ops do, or
takes no tensors and launches nothing.  Launchers and helpers that trust
their callers' checks are private (``_run_linear``, ``_launch_forward``,
...).  A new public function in ``cupy_fused/ops`` fails this test until it
is added to an allow-list below, or renamed with a leading underscore.
(CPU tier: nothing here touches a GPU.)"""
import importlib
import pkgutil

import pytest
import torch

from cupy_fused import ops

# Entry points that validate their tensor arguments (CUDA device, dtype,
# shape, ...) before anything launches: the documented ops.
VALIDATED = {
    "_common": {"call_with_cupy_arrays"},  # converts, then calls the (validating) op
    "gemm": set(),
    "gn_chain": {"gn_chain", "swish_bias_group_norm", "group_norm_swish_multiply_swish",
                 "bias_hardtanh_mish_group_norm", "check_chain", "check_chain_vectors"},
    "linear": {"linear"},
    "linear_gn_chain": {"linear_gn_chain"},
    "bias_relu": {"bias_relu"},
    "conv_bias_relu": {"conv_bias_relu"},
    "scale_add": {"scale_add"},
}

# Settings, shape rules and predicates: no tensor arguments, no launches.
PURE = {
    "_common": {"sm_count", "cdiv", "elementwise_grid", "row_chunks", "fast_divisor", "reduce_warps",
                "mixed_arguments_error"},
    "gemm": {"Tile", "splits_b", "has_tf32_tensor_cores", "has_wgmma", "available_tiles",
             "choose_tile", "uses_sgemm", "uses_cublas", "route"},
    "gn_chain": {"Chain", "vector_shape", "vector_grid", "team_shape", "backward_team_shape",
                 "forward_team_shape", "clear_launch_plans", "LaunchShapes", "launch_shapes"},
    "linear": set(),
    "linear_gn_chain": {"fusion_pays"},
    "bias_relu": {"forward_grid", "rows_launch", "plain_sums", "rows_kernel", "slab_grids"},
    "conv_bias_relu": {"route", "engine_layout", "engine_dtypes"},
    "scale_add": set(),
}



def _modules():
    """cupy_fused.ops and every module under it, private ones included (a
    module file that aliases another gives that module, walked once)."""
    yield ops
    seen = set()
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"{ops.__name__}.{info.name}")
        if module.__name__ not in seen:
            seen.add(module.__name__)
            yield module


def _short(module_name: str) -> str:
    return module_name.rpartition(".")[2]


def _public_callables(module):
    """(name, object) of every public function or class reachable in
    ``module``, wherever defined (imported ones included)."""
    for name, obj in sorted(vars(module).items()):
        if not name.startswith("_") and callable(obj) and not isinstance(obj, type(ops)):
            yield name, obj


def test_the_ops_modules_are_all_walked():
    names = {_short(m.__name__) for m in _modules()}
    assert {"_common", "bias_relu", "gemm", "gn_chain", "linear", "linear_gn_chain",
            "scale_add"} <= names
    assert set(VALIDATED) == set(PURE) == names - {"ops"}


@pytest.mark.parametrize("module", list(_modules()), ids=lambda m: m.__name__)
def test_every_public_function_is_validated_or_pure(module):
    """Each public function or class defined in ``module`` is in an
    allow-list; each one it imports from
    another ``cupy_fused.ops`` module is allowed there."""
    unlisted = []
    for name, obj in _public_callables(module):
        home = getattr(obj, "__module__", None) or ""
        if home == module.__name__:
            short = _short(home)
            if name not in VALIDATED[short] | PURE[short]:
                unlisted.append(name)
        elif home.startswith(ops.__name__ + "."):  # imported from a sibling module
            short = _short(home)
            if getattr(obj, "__name__", name) not in VALIDATED[short] | PURE[short]:
                unlisted.append(f"{name} (from {home})")
    assert not unlisted, (
        f"{module.__name__}: public names that neither validate their arguments nor are pure: "
        f"{unlisted}.  Validate the arguments and add them to VALIDATED, add them to PURE if "
        "they take no tensors and launch nothing, or rename them with a leading underscore.")


def test_the_allow_lists_name_only_what_exists():
    for module in _modules():
        short = _short(module.__name__)
        if module is ops:
            continue
        for name in VALIDATED[short] | PURE[short]:
            obj = getattr(module, name, None)
            assert obj is not None and obj.__module__ == module.__name__, (module.__name__, name)


@pytest.mark.parametrize("call", [
    lambda t: ops.linear(t(4, 8), t(16, 8)),
    lambda t: ops.bias_relu(t(4, 16), t(16)),
    lambda t: ops.scale_add(t(4), t(4)),
    lambda t: ops.gn_chain(t(4, 16), "swish_bias_gn", 4),
    lambda t: ops.linear_gn_chain(t(4, 8), t(16, 8), t(16), "swish_bias_gn", 4),
    lambda t: ops.swish_bias_group_norm(t(4, 16), t(16), t(16), t(16), t(16), 4),
    lambda t: ops.group_norm_swish_multiply_swish(t(4, 16), t(16), t(16), t(16), t(16), 4),
    lambda t: ops.bias_hardtanh_mish_group_norm(t(4, 16), t(16), t(16), t(16), t(16), 4),
    lambda t: ops.conv_bias_relu(t(1, 2, 5, 5), t(3, 2, 2, 2), t(3), t(3, 1, 1)),
], ids=["linear", "bias_relu", "scale_add", "gn_chain", "linear_gn_chain",
        "swish_bias_group_norm", "group_norm_swish_multiply_swish",
        "bias_hardtanh_mish_group_norm", "conv_bias_relu"])
def test_validated_ops_refuse_cpu_tensors_before_launching(call):
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        call(lambda *shape: torch.rand(*shape))
