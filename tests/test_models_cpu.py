"""Drop-in contract of the fused modules (CPU tier): constructor, parameter
names and seeded initial values identical to the reference."""
import copy

import pytest
import torch

from cupy_fused import models, reference


def test_state_dict_and_seeded_init_match_reference():
    """Same parameter names, shapes and seeded values both ways."""
    for problem, (ref_cls, args, _) in reference.SMALL_PROBLEMS.items():
        torch.manual_seed(123)
        ref = ref_cls(*args)
        torch.manual_seed(123)
        ours = models.MODELS[problem](*args)
        rs, os_ = ref.state_dict(), ours.state_dict()
        assert list(rs) == list(os_)
        for k in rs:
            assert torch.equal(rs[k], os_[k]), (problem, k)
        ref2 = ref_cls(*args)
        ref2.load_state_dict(ours.state_dict())
        ours.load_state_dict(ref.state_dict())
        assert all(p.requires_grad for p in ours.parameters())


# The submodules each fused forward reads but never calls.
BYPASSED = {1: ["conv"], 37: ["matmul", "group_norm"], 76: ["gemm"],
            88: ["gemm", "group_norm"], 94: ["gemm", "groupnorm", "hardtanh", "mish"]}


def _model_and_input(problem):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    return models.MODELS[problem](*args), torch.rand(shape)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_hooks_on_a_bypassed_submodule_are_refused(problem):
    for name in BYPASSED[problem]:
        for register in ("register_forward_hook", "register_forward_pre_hook",
                         "register_full_backward_hook"):
            model, x = _model_and_input(problem)
            getattr(getattr(model, name), register)(lambda *a: None)
            with pytest.raises(RuntimeError, match=f"{name} has hooks registered"):
                model(x)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_a_replaced_submodule_is_refused(problem):
    for name in BYPASSED[problem]:
        model, x = _model_and_input(problem)
        plain = getattr(model, name)

        class Wrapped(type(plain)):  # e.g. LoRA: a subclass with its own forward
            pass

        wrapped = copy.deepcopy(plain)
        wrapped.__class__ = Wrapped
        setattr(model, name, wrapped)
        with pytest.raises(RuntimeError, match=f"{name} has been replaced by a Wrapped"):
            model(x)


def test_hardtanh_bounds_other_than_the_chains_are_refused():
    model, x = _model_and_input(94)
    model.hardtanh.max_val = 2.0
    with pytest.raises(ValueError, match=r"hardtanh must clamp to \[-1, 1\]"):
        model(x)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_plain_submodules_pass_the_check(problem):
    """Past the submodule checks, the input check is the one that speaks
    (a CPU tensor here)."""
    model, x = _model_and_input(problem)
    with pytest.raises(ValueError, match="CUDA"):
        model(x)
