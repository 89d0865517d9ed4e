"""QK-clip on CUDA (run by ``scripts/gpu-check.sh``; skipped without a GPU): bf16 scores on
tensor cores stay within 1% of the fp64 recomputation, and the bound holds after apply()."""

from __future__ import annotations

import pytest
import torch
from attention_reference import capture_attention_inputs, reference_max_logits
from qk_models import make_model, tokens

from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_recording_and_clip(dtype) -> None:
    model = make_model("llama", kv_heads=2).to("cuda", dtype)
    clip = QKClip(model, threshold=6.0)
    try:
        modules = [layer.module for layer in clip.layers]
        with capture_attention_inputs(model, modules) as captured:
            model(tokens().cuda())
        stats = clip.apply()
        for layer, layer_stats in zip(clip.layers, stats.layers):
            # Recomputed in fp64 on the GPU from the captured inputs and the weights before
            # the clip: apply() ran after, so compare with the stats' maxima.
            reference = reference_max_logits(layer, captured[layer.module])
            got = torch.tensor(layer_stats.max_logits, dtype=torch.float64)
            predicted = torch.tensor(layer_stats.max_logits_after, dtype=torch.float64)
            torch.testing.assert_close(predicted, reference, rtol=1e-2, atol=1e-2)
            assert (got >= predicted).all()
        assert stats.max_logit_after <= 6.0 * (1 + 1e-6)
    finally:
        clip.remove()
