"""What recording the max logits costs: forward time with and without a ``QKClip``, on the
tiny model presets, in training mode, with autograd on (as in training).

    python scripts/qk_clip_overhead.py [--models tiny-llama,tiny-dense,tiny-moe]
        [--batch 8] [--seqs 64,256] [--repeats 7]

Per model and sequence length: the median of ``--repeats`` forwards without a clip, with a
clip recording, and with a clip whose recording is off (the wrapper alone); interleaved, so
that drift of the machine hits all three alike. Also the time of one ``apply()``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardmuon.harness.models import build_model
from shardmuon.qk_clip import QKClip


def _forward_s(model, x) -> float:
    start = time.perf_counter()
    model(x)
    return time.perf_counter() - start


def measure(name: str, batch: int, seq: int, repeats: int) -> dict[str, float]:
    model = build_model(name, seed=0).train()
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    model(x)  # warm-up
    clip = QKClip(model, threshold=100.0)
    times: dict[str, list[float]] = {"off": [], "recording": [], "paused": []}
    try:
        for _ in range(repeats):
            clip.remove()
            times["off"].append(_forward_s(model, x))
            clip = QKClip(model, threshold=100.0)
            times["recording"].append(_forward_s(model, x))
            clip.recording = False
            times["paused"].append(_forward_s(model, x))
            clip.recording = True
        model(x)
        start = time.perf_counter()
        clip.apply()
        apply_s = time.perf_counter() - start
    finally:
        clip.remove()
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["apply"] = apply_s * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-llama,tiny-dense,tiny-moe")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqs", default="64,256")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}")
    print()
    print("| model | seq | forward ms | recording ms | overhead | paused ms | apply() ms |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            t = measure(name, args.batch, seq, args.repeats)
            overhead = t["recording"] / t["off"] - 1
            print(
                f"| {name} | {seq} | {t['off']:.1f} | {t['recording']:.1f} | "
                f"{100 * overhead:+.0f}% | {t['paused']:.1f} | {t['apply']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
