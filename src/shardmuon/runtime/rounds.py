"""``Muon.step_chunk``'s rounds: which chunks are stepped, which one failed, and when to stop.

A round is one pass over the optimizer's chunks. :class:`ChunkRounds` keeps the open
round's bookkeeping and makes every rule of ``step_chunk`` one check: a chunk is stepped
once per round; chunks that communicate go in the order of the chunk list (every rank must
pair the same collectives); a chunk that raised before any collective keeps its progress
and resumes; one that raised after its collectives began breaks the round until a
checkpoint is restored (:meth:`ChunkRounds.end`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from shardmuon.planning.chunks import Chunk, communicates

__all__ = ["ChunkRounds"]


class ChunkRounds:
    """The open ``step_chunk`` round, if any (one per optimizer)."""

    def __init__(self) -> None:
        self.stepped: set[int] | None = None  # None: no round open
        self.pending: dict[int, Any] = {}  # progress of chunks that raised and may resume
        self.broken: str | None = None  # why the open round cannot go on

    @property
    def is_open(self) -> bool:
        return self.stepped is not None

    def check_usable(self) -> None:
        """Raise if a failed collective broke the round (only a restore ends it)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def refuse_while_open(self, action: str) -> None:
        """Raise naming ``action`` if a round is open (it would change what the round steps)."""
        if self.is_open:
            raise RuntimeError(
                f"{action} during a step_chunk round; step the remaining chunks first"
            )

    def check_step(self, total: int) -> None:
        """What ``step()`` needs: a usable optimizer and no open round of ``total`` chunks."""
        self.check_usable()
        if self.is_open:
            raise RuntimeError(
                f"step() called while a step_chunk() round is open ({len(self.stepped)} of "
                f"{total} chunks stepped); step the remaining chunks first"
            )

    def key_of(self, chunk: Chunk, chunks: Sequence[Chunk]) -> int:
        """``chunk``'s position in ``chunks`` (by identity), checked against every rule."""
        key = next((i for i, c in enumerate(chunks) if c is chunk), None)
        if key is None:
            raise ValueError(
                "step_chunk got a chunk that is not in this optimizer's chunks() (chunks "
                "are rebuilt when a planned setting changes: call chunks() again)"
            )
        self.check_usable()
        done = self.stepped or set()
        if key in done:
            raise RuntimeError(
                f"chunk {key} was already stepped in this round; step the other "
                f"{len(chunks) - len(done)} chunks first"
            )
        if communicates(chunk):
            earlier = [i for i, c in enumerate(chunks[:key]) if communicates(c) and i not in done]
            if earlier:
                raise RuntimeError(
                    f"step_chunk: chunk {key} exchanges data with other ranks, and so does "
                    f"chunk {earlier[0]}, not yet stepped in this round; chunks that "
                    "communicate must be stepped in the order of chunks() (the same on every "
                    "rank, so the collectives pair up); local and AdamW chunks may go in any "
                    "order"
                )
        return key

    def open(self) -> None:
        self.stepped = set()

    def run(
        self, key: int, start: Callable[[], Any], step: Callable[[Any], None], total: int
    ) -> None:
        """Step chunk ``key`` from its kept progress (or ``start()``); on success it is done
        and the round closes after ``total`` chunks. On failure the progress is kept for a
        retry, unless the chunk's collectives had begun: then the round is broken."""
        progress = self.pending.pop(key, None) or start()
        try:
            step(progress)
        except BaseException as error:
            if getattr(progress, "communicated", False):
                self.broken = _unreplayable(key, error)
            else:
                self.pending[key] = progress
            raise
        self.stepped.add(key)
        if len(self.stepped) == total:
            self.stepped = None

    def end(self) -> None:
        """A restored checkpoint ends any round, broken or not."""
        self.pending.clear()
        self.stepped, self.broken = None, None


def _unreplayable(key: Hashable, error: BaseException) -> str:
    """Why a round whose communicating chunk ``key`` failed midway cannot go on."""
    return (
        f"step_chunk: chunk {key} raised ({type(error).__name__}: {error}) after its "
        "collectives with other ranks began; they cannot be replayed (the peers have "
        "completed or abandoned their side), so this step_chunk round cannot go on. Restore "
        "a checkpoint with load_state_dict (which ends the round) and step again. Chunks "
        "that failed before any collective (local and AdamW chunks, and checks before an "
        "exchange) can be retried"
    )
