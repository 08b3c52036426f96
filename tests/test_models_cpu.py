"""Drop-in contract of the fused modules (CPU tier): constructor, parameter
names and seeded initial values identical to the reference."""
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
