"""Hugging Face ``Trainer`` over 2 processes (``torchrun``, gloo): DDP with Muon from
``MuonFactory``, a resume bitwise, ``split_replicas`` sharing the work bitwise
(``hf_trainer_ddp_program.py`` checks each on every rank).

FSDP2 through the Trainer cannot be tested on a CPU: accelerate turns its FSDP plugin on only
for accelerator back-ends (``MULTI_GPU`` and the like), and with ``use_cpu`` the Trainer's
``fsdp`` settings leave the model in DDP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PROGRAM = Path(__file__).with_name("hf_trainer_ddp_program.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_resume_and_share_bitwise(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(PROGRAM), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "rank 0: ok" in done.stdout and "rank 1: ok" in done.stdout
