"""QK-clip beside ``Muon(overlap="forward")`` (issue #32): ``QKClip.apply`` right after
``step()`` waits for the step still running in the background (it scales the weights the
step writes), so six steps of a tiny Llama with the clip binding are bitwise those of the
sequential step."""

from __future__ import annotations

import pytest
import torch
from qk_models import make_model, tokens

from shardmuon import Muon
from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(overlap: str | None) -> tuple[list[float], list[int], list[torch.Tensor]]:
    model = make_model("llama", layers=2)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    others = [p for n, p in model.named_parameters() if p.ndim != 2 or "embed" in n]
    opt = Muon(
        [{"params": matrices}, {"params": others, "algorithm": "adamw"}],
        lr=0.02, newton_schulz_dtype="float32", overlap=overlap,
    )  # fmt: skip
    clip = QKClip(model, threshold=8.0)
    if overlap:
        opt.overlap_with(model)
    losses, clipped = [], []
    for step in range(6):
        batch = tokens(seed=step)
        loss = model(batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        clipped.append(clip.apply().clipped_heads)
        opt.zero_grad()
    opt.synchronize()
    clip.remove()
    return losses, clipped, [p.detach().clone() for p in model.parameters()]


def test_qk_clip_after_an_overlapped_step_is_the_sequential_clip():
    plain, overlapped = _run(None), _run("forward")
    assert sum(plain[1]) > 0  # the clip binds
    assert overlapped[0] == plain[0] and overlapped[1] == plain[1]
    assert all(torch.equal(a, b) for a, b in zip(plain[2], overlapped[2]))
