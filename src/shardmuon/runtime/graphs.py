"""Newton–Schulz calls replayed as CUDA graphs (``Muon(cuda_graphs=...)``: ``True`` every
call, ``None`` (default) the guarded calls only, ``False`` none).

A call's Newton–Schulz is some twenty kernels (the GEMMs of five iterations, the
normalisation, the casts) launched from Python; on a GPU the host time of an expert stack's
call is about its device time, so the host, not the GPU, sets the pace. A CUDA graph
replays a captured call with one launch.

What is captured: one call of the step's orthogonalizer on a contiguous bf16 ``[B, m, n]``
CUDA stack, per :func:`call_key` (shape, device, engine and its settings, coefficients,
eps). Its first call runs eagerly, on the capture stream (Triton compiles, cuBLAS
initialises there); its second is captured, then replayed; every later one copies its input
into the graph's static input, replays, and clones the static output and the call's report
(non-finite mask, guard verdict), so that a result a batch in flight still holds is not
overwritten by the next replay. The replay runs the captured kernels on the same data: the
same bits as the eager call.

A guarded call (``newton_schulz_guard``) is captured with its recompute as a conditional
node (:func:`shardmuon.ops.newton_schulz_guard.guarded_on_device`): the device decides
whether a matrix is recomputed, and the call makes no host synchronisation (eager, it makes
one).

Replays are ordered by an event recorded after each: a replay (or a capture) on another
stream than the last one's waits for it, so the static buffers and the shared pool are
never used by two streams at once. The kernels a call launches also depend on process-wide
settings (TF32, reduced-precision reductions, the fused kernels on or off): they are part
of the key. A change of device starts the cache afresh.

Memory: each captured key keeps its static input and output (twice the stack's bf16 bytes),
all of them within a budget (the optimizer's ``workspace_bytes``; a call past it runs eagerly);
the intermediates of all captures share one pool, as large as the largest call's. At most
``MAX_GRAPHS`` keys are captured; later ones run eagerly. A capture that fails (a driver
without conditional nodes, an operation capture refuses) is warned about once and its key
runs eagerly from then on; nothing is lost.

The hyperparameters (lr, momentum, weight decay, the step) stay host numbers: the
captured calls read none of them, and the fused passes that do take them as kernel
arguments (a new value neither recompiles nor re-captures anything).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from shardmuon.ops.fused_normalize import kernels_enabled
from shardmuon.ops.newton_schulz_guard import Branch, GuardVerdict, fp32_output_refusals
from shardmuon.ops.orthogonalizer import Orthogonalizer

__all__ = [
    "MAX_GRAPHS",
    "CudaCapture",
    "GraphCache",
    "GraphedOrthogonalizer",
    "call_key",
    "graphs_available",
]

# Distinct calls captured per optimizer (each keeps its static input and output).
MAX_GRAPHS = 64


class Capture(Protocol):
    """Where calls are warmed, captured and replayed (:class:`CudaCapture` on a GPU; a test
    stands in its own on a CPU)."""

    def warm(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run eagerly where captures run, its result usable by the caller."""
        ...

    def capture(self, fn: Callable[[Branch], Any]) -> tuple[Any, Callable[[], None]]:
        """``fn(branch)``'s outputs (static tensors: nested lists, tuples and verdicts of
        them) and a replay that recomputes them in place from the inputs ``fn`` read."""
        ...


class CudaCapture:
    """CUDA graphs on one device: a capture stream (where the first call of a key warms up,
    and captures run), one memory pool shared by every capture, conditional nodes for the
    guard's recompute."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.pool = torch.cuda.graph_pool_handle()

    def warm(self, fn: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        for tensor in _tensors(out):  # made on the capture stream, used on the caller's
            tensor.record_stream(current)
        return out

    def capture(self, fn: Callable[[Branch], Any]) -> tuple[Any, Callable[[], None]]:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        try:
            # thread_local: the overlapped step captures on its own thread while the
            # caller's forward runs on another.
            with (
                torch.cuda.device(self.device),
                torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ),
            ):
                out = fn(_conditional_node)
        finally:
            # torch's graph context does not restore the caller's stream when the capture
            # fails (capture_end raises first): the rest of the step must not run on the
            # capture stream.
            torch.cuda.set_stream(current)
            current.wait_stream(self.stream)
        return out, graph.replay


def _conditional_node(pred: Tensor, body: Callable[[], None]) -> None:
    """``body`` captured as a conditional node of the graph being captured: the device runs
    it when ``pred`` holds (CUDA 12.4+)."""
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        body()
    finally:
        graph.end_capture_to_conditional_node()


def _always(pred: Tensor, body: Callable[[], None]) -> None:
    """A branch that runs its body whatever ``pred`` says (the guard's recompute keeps a
    recomputed matrix only where it failed, so running it changes nothing)."""
    body()


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, GuardVerdict):
        return [value.fallback_count, value.worst_ratio_tensor]
    return []


def _process_settings() -> tuple:
    """The process-wide settings that choose the kernels a call launches (the GEMMs'
    precision and reductions, the fused kernels on or off, the guard's fp32-output GEMM): a
    replay must not keep kernels a changed setting would no longer choose."""
    matmul = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        bool(matmul.allow_tf32),
        bool(matmul.allow_bf16_reduced_precision_reduction),
        bool(matmul.allow_fp16_reduced_precision_reduction),
        bool(getattr(matmul, "allow_fp16_accumulation", False)),
        kernels_enabled(),
        fp32_output_refusals(),
    )


def call_key(orthogonalizer: Orthogonalizer, X: Tensor, coefficients, eps: float) -> tuple:
    """What identifies a captured call: everything its kernels depend on but the data."""
    coefficients = tuple(map(tuple, coefficients)) if coefficients is not None else None
    return (
        tuple(X.shape),
        X.dtype,
        str(X.device),
        orthogonalizer.engine_key(X),
        coefficients,
        float(eps),
        _process_settings(),
    )


@dataclass
class _Graph:
    static_in: Tensor
    static_out: Tensor
    masks: list[Tensor]
    verdicts: list[GuardVerdict]
    replay: Callable[[], None]


@dataclass
class GraphCache:
    """An optimizer's captured calls on one device, across steps (rebuilt, empty, after a
    copy, and when the parameters move to another device)."""

    capture: Capture | None = None
    device: torch.device | None = None
    graphs: dict[tuple, _Graph] = field(default_factory=dict)
    warmed: set[tuple] = field(default_factory=set)
    refused: dict[tuple, str] = field(default_factory=dict)  # key -> why it runs eagerly
    # Recorded after each replay: the next replay (on whatever stream) waits for it, so two
    # streams never use the static buffers and the shared pool at once.
    last_use: Any = None

    # The most the captures' static inputs and outputs may hold.
    max_static_bytes: int | None = None

    @property
    def static_bytes(self) -> int:
        """The bytes the captures' static inputs and outputs hold."""
        return sum(g.static_in.nbytes + g.static_out.nbytes for g in self.graphs.values())

    def wrap(
        self,
        orthogonalizer: Orthogonalizer,
        device: torch.device,
        guarded_only: bool = False,
        max_static_bytes: int | None = None,
    ) -> GraphedOrthogonalizer:
        """``orthogonalizer`` with its calls captured and replayed on ``device``
        (``guarded_only``: only the guarded ones, whose eager form reads the device once a
        call); the captures keep at most ``max_static_bytes`` of static buffers (``None``:
        no limit beyond :data:`MAX_GRAPHS`)."""
        self.max_static_bytes = max_static_bytes
        if self.device != device:  # new, or the parameters moved: nothing captured applies
            self.graphs.clear()
            self.warmed.clear()
            self.refused.clear()
            self.capture, self.device, self.last_use = CudaCapture(device), device, None
        return GraphedOrthogonalizer(orthogonalizer, self, guarded_only)

    def ordered(self) -> None:
        """The current stream waits for the last use of the captured buffers (CUDA)."""
        if self.last_use is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last_use)

    def used(self) -> None:
        """Record this use of the captured buffers on the current stream (CUDA)."""
        if self.device is not None and self.device.type == "cuda":
            self.last_use = torch.cuda.Event()
            self.last_use.record(torch.cuda.current_stream(self.device))


def graphs_available(device: torch.device) -> bool:
    """Whether ``cuda_graphs`` applies on ``device``: CUDA (elsewhere it is ignored)."""
    return device.type == "cuda"


def capturable(X: Tensor) -> bool:
    """Whether a call on ``X`` can be captured: a non-empty contiguous bf16 CUDA stack (the
    pipeline's own buffer; a CPU test's stand-in device is ``cpu``)."""
    return X.dtype == torch.bfloat16 and X.dim() == 3 and X.numel() > 0 and X.is_contiguous()


class GraphedOrthogonalizer:
    """An :class:`~shardmuon.ops.orthogonalizer.Orthogonalizer` whose calls are replayed
    from CUDA graphs where :func:`capturable` (the same interface: call, ``take_report``)."""

    def __init__(
        self, inner: Orthogonalizer, cache: GraphCache, guarded_only: bool = False
    ) -> None:
        self.inner, self.cache, self.guarded_only = inner, cache, guarded_only
        self._masks: list[Tensor] = []
        self._verdicts: list[GuardVerdict] = []

    def take_report(self) -> tuple[list[Tensor], list[GuardVerdict]]:
        """The non-finite masks and guard verdicts of the calls since the last take."""
        report = (self._masks, self._verdicts)
        self._masks, self._verdicts = [], []
        return report

    def _eager(self, X: Tensor, coefficients, eps: float) -> Tensor:
        out = self.inner(X, coefficients, eps)
        self._take_inner_report()
        return out

    def _take_inner_report(self) -> tuple[list[Tensor], list[GuardVerdict]]:
        masks, verdicts = self.inner.take_report()
        self._masks.extend(masks)
        self._verdicts.extend(verdicts)
        return masks, verdicts

    def __call__(self, X: Tensor, coefficients, eps: float) -> Tensor:
        cache = self.cache
        if not capturable(X) or (self.guarded_only and not self.inner.is_guarded(X)):
            return self._eager(X, coefficients, eps)
        key = call_key(self.inner, X, coefficients, eps)
        if key in cache.refused:
            return self._eager(X, coefficients, eps)
        graph = cache.graphs.get(key)
        if graph is None:
            if len(cache.graphs) >= MAX_GRAPHS:
                cache.refused[key] = f"more than {MAX_GRAPHS} distinct calls"
                return self._eager(X, coefficients, eps)
            static = 2 * X.numel() * X.element_size()  # its static input and output
            limit = cache.max_static_bytes
            if limit is not None and cache.static_bytes + static > limit:
                return self._eager(X, coefficients, eps)  # may fit after a device change
            if key not in cache.warmed:
                # The guard's recompute runs too (on no matrix that passed: the same
                # result), so that the capture finds its kernels compiled.
                assert cache.capture is not None  # set by GraphCache.wrap
                out, masks, verdicts = cache.capture.warm(
                    lambda: self._reported(X, coefficients, eps, _always)
                )
                cache.warmed.add(key)  # only once it ran: a retry after a failure warms
                self._masks.extend(masks)
                self._verdicts.extend(verdicts)
                return out
            graph = self._capture(key, X, coefficients, eps)
            if graph is None:
                return self._eager(X, coefficients, eps)
        cache.ordered()
        graph.static_in.copy_(X)
        graph.replay()
        self._masks.extend(mask.clone() for mask in graph.masks)
        self._verdicts.extend(
            GuardVerdict(v.checked, v.fallback_count.clone(), v.worst_ratio_tensor.clone())
            for v in graph.verdicts
        )
        out = graph.static_out.clone()
        cache.used()
        return out

    def _reported(
        self, X: Tensor, coefficients, eps: float, branch: Branch
    ) -> tuple[Tensor, list[Tensor], list[GuardVerdict]]:
        """One call of the inner orthogonalizer and its report: ``(out, masks, verdicts)``."""
        self.inner.take_report()  # nothing of an earlier call may join this one's report
        out = self.inner(X, coefficients, eps, branch=branch)
        masks, verdicts = self.inner.take_report()
        return out, list(masks), list(verdicts)

    def _capture(self, key: tuple, X: Tensor, coefficients, eps: float) -> _Graph | None:
        static_in = torch.empty_like(X)
        static_in.copy_(X)  # a capture computes nothing; the replay after it does
        self.cache.ordered()
        assert self.cache.capture is not None  # set by GraphCache.wrap
        try:
            (static_out, masks, verdicts), replay = self.cache.capture.capture(
                lambda branch: self._reported(static_in, coefficients, eps, branch)
            )
        except torch.OutOfMemoryError:
            self.inner.take_report()
            raise  # memory, not a refusal: the step fails as an eager one would; a retry captures
        except Exception as err:  # refused by the driver or by capture: eager from now on
            self.inner.take_report()
            self.cache.refused[key] = repr(err)
            warnings.warn(
                f"shardmuon could not capture a Newton-Schulz call of shape {tuple(X.shape)} "
                f"in a CUDA graph ({err!r}); it runs eagerly (same results)",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        graph = _Graph(static_in, static_out, masks, verdicts, replay)
        self.cache.graphs[key] = graph
        return graph
