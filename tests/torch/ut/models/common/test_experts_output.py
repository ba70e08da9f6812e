"""Expert parallel: the experts' output is not an autograd view (FSDP2 warned "returned a view tensor" for
the experts' own FSDP unit); the launch check is in tests/torch/st/test_trainer_layouts.py.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_experts_output_is_not_a_view(impl):
    """FSDP2 warns "returned a view tensor" for a unit (the experts under EP) whose output is an autograd view;
    the grouped kernel's path returned one (an identity autograd Function hands back its input as a view)."""
    from hyper_parallel.models.common.grouped_mm import can_use_grouped_mm
    from hyper_parallel.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts.Config(hidden_dim=16, grouped_mm_impl=impl).build(dim=16, num_experts=4)
    experts.init_weights()
    x = torch.randn(12, 16, requires_grad=True)
    if impl == "grouped_mm" and not can_use_grouped_mm(x, experts.gate_up_proj):
        pytest.skip("this torch build has no CPU grouped_mm")
    counts = torch.tensor([3, 0, 5, 4])
    y = experts(x, counts)
    assert y._base is None and not y._is_view()
    # and the gradients are the per-expert matmuls' (the identity still makes the incoming gradient contiguous)
    y.pow(2).sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    w1, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    outs = []
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 8), (8, 12)]):
        gate_up = ref_x[lo:hi] @ w1[e].T
        g_, u_ = gate_up.chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(g_) * u_) @ w2[e].T)
    torch.cat(outs).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
