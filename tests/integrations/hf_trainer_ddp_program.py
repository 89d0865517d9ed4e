"""Run by ``test_hf_trainer_ddp.py`` under ``torchrun --nproc-per-node 2`` (gloo, CPU): the
Trainer wraps the model in DDP and builds Muon through ``MuonFactory``. Checked on every
rank, raising on a failure: the ranks end with equal parameters; a resume from the Trainer's
checkpoint at step 2 ends bitwise the uninterrupted run; ``split_replicas=True`` (each rank
orthogonalizes half of the matrices, the results broadcast) ends bitwise the same."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import transformers

from shardmuon import Muon
from shardmuon.harness.processes import exit_worker
from shardmuon.integrations.hf import MuonFactory


class Tokens(torch.utils.data.Dataset):
    """``n`` random sequences of ``length`` tokens, each its own label (seeded)."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 1200) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> transformers.LlamaForCausalLM:
    """A 2-layer Llama of width 32 over 1,200 tokens, seeded."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def trainer(folder: str, **muon) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=folder, max_steps=4, per_device_train_batch_size=4, learning_rate=0.02,
        weight_decay=0.1, save_steps=2, save_strategy="steps", logging_steps=1, report_to=[],
        use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    return transformers.Trainer(
        model=tiny_llama(),
        args=args,
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "weight_decay": 0.1, **muon}),
    )


def parameters(t: transformers.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def main(folder: str) -> None:
    problems = []
    whole = trainer(f"{folder}/resumed")  # uninterrupted; saves at steps 2 and 4
    whole.train()
    if type(whole.model_wrapped).__name__ != "DistributedDataParallel":
        problems.append(f"the Trainer wrapped the model in {type(whole.model_wrapped).__name__}")
    optimizer = getattr(whole.optimizer, "optimizer", whole.optimizer)
    if not isinstance(optimizer, Muon) or optimizer.last_step_stats.matrices_orthogonalized == 0:
        problems.append(
            f"the Trainer's optimizer is {type(optimizer).__name__}, not a working Muon"
        )
    want = parameters(whole)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: t.sum().item() for n, t in want.items()})
    if any(g != gathered[0] for g in gathered):
        problems.append("the ranks' parameters differ after training")

    resumed = trainer(f"{folder}/resumed")
    resumed.train(resume_from_checkpoint=f"{folder}/resumed/checkpoint-2")
    problems += [
        f"resumed: {n}" for n, t in parameters(resumed).items() if not torch.equal(t, want[n])
    ]

    shared = trainer(f"{folder}/split", split_replicas=True)
    shared.train()
    opt = getattr(shared.optimizer, "optimizer", shared.optimizer)
    alone = optimizer.last_step_stats.matrices_orthogonalized
    if not opt.split_replicas or opt.last_step_stats.matrices_orthogonalized >= alone:
        problems.append(
            f"split_replicas: this rank orthogonalized {opt.last_step_stats.matrices_orthogonalized}"
            f" matrices a step, {alone} without it"
        )
    problems += [
        f"split: {n}" for n, t in parameters(shared).items() if not torch.equal(t, want[n])
    ]
    if problems:
        raise SystemExit(f"rank {dist.get_rank()}: " + "; ".join(problems[:8]))
    dist.barrier()
    print(f"rank {dist.get_rank()}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without finalising the interpreter: a gloo thread that frees a finished
    # collective's work during finalisation aborts the process ("terminate called without an
    # active exception") after all work succeeded (shardmuon.harness.processes).
    exit_worker(0)
