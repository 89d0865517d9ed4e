"""Every parameter is really updated: a strided parameter (channels_last, permuted, transposed)
steps bitwise like its contiguous copy and keeps its strides.

Single process, CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from checks import assert_same_optimizers, grads_for_shapes
from fidelity_setup import param
from torch import Tensor, nn

from shardmuon import Muon

pytestmark = pytest.mark.usefixtures("one_thread")


def _channels_last_conv() -> Tensor:
    t = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(3))
    return t.to(memory_format=torch.channels_last)


def _permuted_stack() -> Tensor:
    t = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(4))
    return t.permute(1, 0, 2, 3)


def _transposed() -> Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).t()


@pytest.mark.parametrize(
    ("make", "flatten"),
    [
        (_channels_last_conv, True),
        (_channels_last_conv, False),
        (_permuted_stack, False),
        (_permuted_stack, True),
        (_transposed, False),
    ],
    ids=["channels_last-flatten", "channels_last", "permuted", "permuted-flatten", "transposed"],
)
def test_strided_params_update_like_contiguous_copies(make: Callable, flatten: bool) -> None:
    data = make()
    assert not data.is_contiguous()
    strided = nn.Parameter(data.clone(memory_format=torch.preserve_format))
    assert strided.stride() == data.stride()
    contiguous = nn.Parameter(data.contiguous())
    other, other_ref = param((16, 8), 9), param((16, 8), 9)
    kwargs = dict(lr=0.02, weight_decay=0.1, flatten=flatten, adjust_lr="rms_norm")
    opt = Muon([strided, other], **kwargs)
    ref = Muon([contiguous, other_ref], **kwargs)
    for s in range(3):
        g, g_other = grads_for_shapes([tuple(data.shape), (16, 8)], s)
        strided.grad = torch.empty_like(strided).copy_(g)  # laid out like the param
        contiguous.grad = g.clone()
        other.grad, other_ref.grad = g_other.clone(), g_other.clone()
        opt.step()
        ref.step()
    assert_same_optimizers(opt, [strided, other], ref, [contiguous, other_ref])
    assert not torch.equal(strided.detach(), data), "the update was lost"
    assert torch.count_nonzero(opt.state[strided]["momentum"]) > 0, "the momentum was lost"
    assert strided.stride() == data.stride()
