"""QK-clip across Hugging Face architectures (issue #28): each is either clipped, with the
bound checked against an independent float64 reference, or refused when the clip is built,
naming the module and why; never accepted and then failing (or silently doing nothing) at
``apply()``.

The reference reads the query and key at the attention interface itself: a test-only
implementation, ``qk_reference``, registered beside sdpa, that keeps what each call was
given (after rotary, partial rotary, QK-norm or a pre-scaled query, whatever the model does)
and recomputes every causal logit in float64 with the scaling it was passed.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import transformers
from torch import nn

from shardmuon.config import MuonConfig, build_qk_clip
from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("no_leftover_clips")

VOCAB = 96
SIZES = dict(
    hidden_size=64, n_embd=64, d_model=64, num_hidden_layers=1, n_layer=1, num_layers=1,
    num_attention_heads=4, n_head=4, num_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, ffn_dim=96, n_inner=96, vocab_size=VOCAB, max_position_embeddings=64,
    n_positions=64, rotary_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def tiny(model_type: str, impl: str = "sdpa", **extra) -> nn.Module:
    """A one-layer model of ``model_type`` from its config (the sizes it knows of
    ``SIZES``), dropout off, in training mode: a forward run twice sees the same inputs."""
    known = transformers.AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in SIZES.items() if hasattr(known, k)}
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **extra})
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


@pytest.fixture
def reference_calls():
    """Register ``qk_reference`` (sdpa, keeping each call's query, key and scaling); yield
    the list the calls go to."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    calls: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        calls.append((query.detach().double(), key.detach().double(), float(scale)))
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )

    AttentionInterface.register("qk_reference", attention)
    yield calls
    AttentionInterface._global_mapping.pop("qk_reference")


def causal_max_logits(calls) -> torch.Tensor:
    """Per query head, the largest causal ``scaling * q . k`` over ``calls``, float64."""
    best = None
    for query, key, scaling in calls:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        logits = query @ key.mT * scaling
        q_len, kv_len = logits.shape[-2:]
        valid = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        heads = logits.masked_fill(~valid, -math.inf).amax(dim=(0, 2, 3))
        best = heads if best is None else torch.maximum(best, heads)
    return best


SUPPORTED = {
    "qwen2": {}, "mistral": {}, "phi": {}, "gemma": {}, "gptj": {}, "opt": {},
    "stablelm": {}, "cohere": {}, "olmo2": {}, "starcoder2": {}, "granite": {}, "glm": {},
    "helium": {}, "exaone4": {},
}  # fmt: skip


def test_supported_architectures_record_their_logits_and_end_at_most_tau(reference_calls):
    """Rotary or not, partial rotary (Phi, GPT-J), a pre-scaled query (OPT), QK-norm over
    the whole projection (OLMo2, Exaone4), an attention multiplier (Granite): the recorded
    maxima are the reference's, and after ``apply()`` the same inputs give no logit above
    tau (fp32: exactly)."""
    x = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    for model_type, extra in SUPPORTED.items():
        model = tiny(model_type, impl="qk_reference", **extra)
        clip = QKClip(model, threshold=1.0)
        try:
            assert len(clip.layers) == 1, model_type
            reference_calls.clear()
            model(x)
            before = causal_max_logits(reference_calls)
            clip.threshold = 0.5 * float(before.min())
            stats = clip.apply()
            got = torch.tensor(stats.layers[0].max_logits, dtype=torch.float64)
            torch.testing.assert_close(got, before, rtol=1e-5, atol=1e-6, msg=model_type)
            assert stats.clipped_heads == 4, model_type
            reference_calls.clear()
            model(x)
            after = causal_max_logits(reference_calls)
            assert (after <= clip.threshold).all(), (model_type, after / clip.threshold)
        finally:
            clip.remove()


# Accepted before, and then recorded nothing (apply(): "no forward pass was recorded"), or
# scaled rows that are not the query and key heads (CodeGen: 65x tau after the clip).
REFUSED = [
    ("gpt_neo", dict(attention_types=[[["global"], 1]], num_layers=1), "eager",
     r"transformer\.h\.0\.attn\.attention \(GPTNeoSelfAttention\) computes its attention "
     r"scores itself: its forward does not go through transformers' attention interface"),
    ("xglm", {}, "eager", r"model\.layers\.0\.self_attn \(XGLMAttention\) computes its"),
    ("mpt", {}, "eager", r"transformer\.blocks\.0\.attn \(MptAttention\) computes its"),
    ("trocr", {}, "eager", r"self_attn \(TrOCRAttention\) computes its attention scores"),
    ("codegen", {}, "sdpa",
     r"transformer\.h\.0\.attn\.qkv_proj: its rows interleave Q, V and K over mp_num = 4 "
     r"model-parallel blocks"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "extra", "impl", "pattern"), REFUSED, ids=[case[0] for case in REFUSED]
)
def test_attention_that_cannot_be_recorded_or_split_is_refused_at_build(
    model_type, extra, impl, pattern
):
    model = tiny(model_type, impl=impl, **extra)
    with pytest.raises(ValueError, match=pattern):
        QKClip(model, threshold=5.0)


def test_gpt_neo_is_refused_by_build_qk_clip_too():
    model = tiny("gpt_neo", impl="eager", attention_types=[[["global"], 1]], num_layers=1)
    with pytest.raises(
        ValueError, match=r"transformer\.h\.0\.attn\.attention .*cannot be recorded"
    ):
        build_qk_clip(model, MuonConfig(qk_clip_threshold=5.0))


def _llama():
    return tiny("llama", num_key_value_heads=4)


def test_the_rule_reads_the_forward_that_runs_not_the_class_name():
    """A Llama attention whose forward computes its own scores is refused, by its qualified
    name; one whose forward is decorated and calls ``super().forward`` (which dispatches)
    is kept and records."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    class OwnScores(LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            b, t, _ = hidden_states.shape
            q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
            out = torch.softmax(q @ k.mT * self.scaling, dim=-1) @ v
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None

    def logged(forward):
        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            return forward(*args, **kwargs)

        return wrapper

    class Wrapped(LlamaAttention):
        @logged
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = _llama()
    attention = model.model.layers[0].self_attn
    attention.__class__ = OwnScores
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(OwnScores\) computes"):
        QKClip(model, threshold=5.0)
    attention.__class__ = Wrapped
    clip = QKClip(model, threshold=1e-3)
    try:
        model(torch.randint(3, VOCAB, (2, 8)))
        assert clip.apply().clipped_heads == 4
    finally:
        clip.remove()


def test_eager_attention_runs_the_eager_function_each_module_passes():
    """Under eager, ``get_interface`` returns the caller's default (Llama4's vision tower
    and Phi-4's audio one pass their own): with a clip installed, a recorded module and one
    of a model without a clip still run theirs, outputs unchanged. Before, the clip's eager
    entry ran the model file's ``eager_attention_forward`` for every module instead."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as llama

    ran, calls = [], []

    def own_eager(module, query, key, value, attention_mask, scaling, **kwargs):
        ran.append(module)
        calls.append((query.detach().double(), key.detach().double(), scaling))
        return llama.eager_attention_forward(
            module, query, key, value, attention_mask, scaling, **kwargs
        )

    class OwnEager(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            heads = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (p(hidden_states).view(heads).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
            q, k = llama.apply_rotary_pos_emb(q, k, *position_embeddings)
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, own_eager
            )
            out, weights = attention(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights

    clipped, other = tiny("llama", impl="eager"), tiny("llama", impl="eager")
    for model in (clipped, other):
        model.model.layers[0].self_attn.__class__ = OwnEager
    x = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = [clipped(x).logits, other(x).logits]
    ran.clear()
    calls.clear()
    clip = QKClip(clipped, threshold=1e-3)
    try:
        logits = [clipped(x).logits, other(x).logits]
        assert ran == [clipped.model.layers[0].self_attn, other.model.layers[0].self_attn]
        assert all(torch.equal(a, b) for a, b in zip(logits, plain))
        stats = clip.apply(scale=False)
        got = torch.tensor(stats.layers[0].max_logits, dtype=torch.float64)
        torch.testing.assert_close(got, causal_max_logits(calls[:1]), rtol=1e-5, atol=1e-6)
    finally:
        clip.remove()
    from transformers.modeling_utils import AttentionInterface

    assert AttentionInterface.get_interface is vars(AttentionInterface)["get_interface"]
    assert "eager" not in AttentionInterface._global_mapping
