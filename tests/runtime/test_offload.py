"""``offload="state"``: the same update bit for bit, state streamed chunk by chunk within
``offload_prefetch`` chunks, checkpoints across the two modes, and the chunk inspection API.

Single-process cases here; 2-rank FSDP2 cases (gloo) in ``dist_offload_cases``.
"""

from __future__ import annotations

import dist_offload_cases
import pytest
import torch
from checks import assert_same_optimizers, set_random_grads
from dist_harness import WorldPlan

import shardmuon.runtime.phases as phases_module
from shardmuon import ChunkInfo, Muon

SHAPES = [(48, 32)] * 3 + [(32, 80)] * 2 + [(3, 24, 40)] + [(64, 32)]
ADAMW_SHAPES = [(32,), (16, 8)]
STEPS = 3


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.02 for s in SHAPES + ADAMW_SHAPES]
    params[1] = params[1].bfloat16()  # a low-precision weight too
    return [torch.nn.Parameter(p) for p in params]


def _optimizer(params, **kwargs) -> Muon:
    muon, adamw = params[: len(SHAPES)], params[len(SHAPES) :]
    return Muon(
        [dict(params=muon), dict(params=adamw, algorithm="adamw")],
        lr=0.02,
        nesterov=True,
        weight_decay=0.1,
        matrix_partitions={muon[-1]: (16, 48)},
        workspace_bytes=64 * 1024,  # several local batches
        **kwargs,
    )


def _run(chunked: bool, steps: int = STEPS, **kwargs):
    params = _params()
    opt = _optimizer(params, **kwargs)
    for step in range(steps):
        set_random_grads(params, 100 + step)
        if chunked:
            for chunk in opt.chunks():
                opt.step_chunk(chunk)
        else:
            opt.step()
    return params, opt


@pytest.mark.parametrize("chunked", [False, True], ids=["step", "step_chunk"])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_offload_is_bitwise_the_same_update(chunked, prefetch) -> None:
    ref_params, reference = _run(chunked=False)
    params, offloaded = _run(chunked, offload="state", offload_prefetch=prefetch)
    assert_same_optimizers(reference, ref_params, offloaded, params)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_state_streams_once_each_way_within_prefetch_chunks(prefetch) -> None:
    params, opt = _run(chunked=False, steps=1, offload="state", offload_prefetch=prefetch)
    infos = [opt.chunk_info(c) for c in opt.chunks()]
    total = sum(i.state_bytes for i in infos)
    largest = max(i.state_bytes for i in infos)
    set_random_grads(params, 101)
    opt.step()
    stats = opt.last_step_stats
    assert stats.offload_bytes_loaded == stats.offload_bytes_stored == total
    assert stats.offload_workspace_peak_bytes <= prefetch * largest
    if prefetch == 1:
        assert stats.offload_workspace_peak_bytes == largest
    assert stats.offload_workspace_peak_bytes < total  # never the whole state at once


def test_state_stays_in_its_host_tensors() -> None:
    params, opt = _run(chunked=False, steps=1, offload="state")
    pointers = {id(p): opt.state[p]["momentum"].data_ptr() for p in params}
    before = {id(p): opt.state[p]["momentum"].clone() for p in params}
    set_random_grads(params, 101)
    opt.step()
    for p in params:
        momentum = opt.state[p]["momentum"]
        assert momentum.data_ptr() == pointers[id(p)]  # updated in place, not replaced
        assert not torch.equal(momentum, before[id(p)])
        assert momentum.device.type == "cpu" and momentum.is_contiguous()


def test_no_offload_moves_no_state() -> None:
    _, opt = _run(chunked=False, steps=1)
    stats = opt.last_step_stats
    assert (stats.offload_bytes_loaded, stats.offload_bytes_stored) == (0, 0)


@pytest.mark.parametrize(("first", "second"), [(None, "state"), ("state", None)])
def test_checkpoints_load_across_modes(first, second) -> None:
    ref_params, uninterrupted = _run(chunked=False, steps=4)
    params, opt = _run(chunked=False, steps=2, offload=first)
    saved = opt.state_dict()
    resumed = _optimizer(params, offload=second)
    resumed.load_state_dict(saved)
    for step in (2, 3):
        set_random_grads(params, 100 + step)
        resumed.step()
    assert_same_optimizers(uninterrupted, ref_params, resumed, params)
    if second == "state":
        for p in params:
            assert resumed.state[p]["momentum"].is_contiguous()


def test_failed_chunk_keeps_host_state_consistent(monkeypatch) -> None:
    """A chunk that fails after its momentum update stores the update; the retry resumes."""
    ref_params, reference = _run(chunked=False)
    params = _params()
    opt = _optimizer(params, offload="state")
    set_random_grads(params, 100)
    opt.step()
    set_random_grads(params, 101)
    opt.step()
    set_random_grads(params, 102)
    real = phases_module.StepContext.orthogonalize
    calls = {"n": 0}

    def fail_once(ctx, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(ctx, *args)

    monkeypatch.setattr(phases_module.StepContext, "orthogonalize", fail_once)
    chunks = opt.chunks()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step_chunk(chunks[0])
    for chunk in chunks:
        opt.step_chunk(chunk)
    assert_same_optimizers(reference, ref_params, opt, params)


def test_chunk_info_describes_each_chunk() -> None:
    params, opt = _run(chunked=False, steps=1)
    infos = [opt.chunk_info(c) for c in opt.chunks()]
    assert all(isinstance(i, ChunkInfo) for i in infos)
    muon = [i for i in infos if i.kind == "muon"]
    adamw = [i for i in infos if i.kind == "adamw"]
    assert len(adamw) == 1 and adamw[0].params == tuple(params[len(SHAPES) :])
    assert adamw[0].state_bytes == 2 * sum(p.numel() * 4 for p in params[len(SHAPES) :])
    # every Muon matrix appears once, with its global shape; state = fp32 momentum
    shapes = sorted(s for i in muon for s in i.matrix_shapes)
    expected = []
    for shape in SHAPES:
        count = shape[0] if len(shape) == 3 else 1
        expected += [tuple(shape[-2:])] * count
    assert shapes == sorted(expected)
    momentum_bytes = sum(
        p.numel() * opt.state[p]["momentum"].itemsize for p in params[: len(SHAPES)]
    )
    assert sum(i.state_bytes for i in muon) == momentum_bytes
    assert not any(i.communicates for i in infos)
    with pytest.raises(ValueError, match="not in this optimizer's chunks"):
        _optimizer(_params()).chunk_info(opt.chunks()[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offload": "cpu"}, "unknown offload 'cpu'; accepted: None, 'state'"),
        ({"offload": True}, "unknown offload True"),
        ({"offload_prefetch": 0}, "offload_prefetch must be an int >= 1, got 0"),
        ({"offload_prefetch": 1.5}, "offload_prefetch must be an int >= 1, got 1.5"),
    ],
)
def test_bad_offload_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _optimizer(_params(), **kwargs)


# ------------------------------------------------------------------ two ranks


WORLDS = WorldPlan("dist_offload_cases:CASES", lambda _: list(dist_offload_cases.CASES), (2,))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(dist_offload_cases.CASES))
def test_distributed(worlds, name) -> None:
    worlds[2].check(name)


def test_a_new_stager_waits_for_the_old_ones_stores(monkeypatch):
    """Changing ``offload_prefetch`` (or the device) makes a new stager; its loads read host
    memory the old one may still be writing back (CUDA: its own store stream), so the old
    one's stores land first. Then the steps go on bitwise."""
    import copy

    from shardmuon.runtime import offload

    waited = []
    original = offload.StateStager.wait_host
    monkeypatch.setattr(
        offload.StateStager, "wait_host", lambda self: (waited.append(self), original(self))
    )
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12, 8)), torch.nn.Parameter(torch.randn(6, 10))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = Muon(params, lr=0.02, offload="state")
    reference = Muon(twins, lr=0.02, offload="state")
    for step in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        old = opt.runner.stager
        opt.offload_prefetch = 1 + step % 2
        opt.step()
        reference.step()
        if old is not None and old is not opt.runner.stager:
            assert old in waited, "the replaced stager's stores were not waited for"
    assert all(torch.equal(p, q) for p, q in zip(params, twins))
    waited.clear()
    copy.deepcopy(opt)  # a copy reads the host state: it waits for the stores too
    assert opt.runner.stager in waited
