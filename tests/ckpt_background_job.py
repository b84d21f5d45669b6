"""A training job whose checkpoints are background saves, run under torchrun by
tests/test_checkpoint_background.py:

    torchrun --standalone --nproc-per-node 2 tests/ckpt_background_job.py OUT kill|exit

Both modes train the model of ckpt_train_job.py and save into OUT/ckpt with
`blocking=False` at steps 2 and 4, training on while the files are written.

* `kill`: rank 1's background writer SIGKILLs its process half-way through writing its
  shard of step 4 (after touching OUT/killed-while-writing); the job dies.
* `exit`: the writes of step 4 are slowed down and the script ends right after that
  save, without `checkpoint.wait()` or destroying the process group; the interpreter's
  exit must wait for the writer (OUT/returned-before-publish says the save had
  returned before its checkpoint was published).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt_train_job import JobOptions, build, train


def _arm(out: Path, mode: str) -> None:
    from evenzero.checkpoint import files

    real = files.write_file

    def write(path, tensors, rank, metadata=None):
        if threading.current_thread() is threading.main_thread():
            return real(path, tensors, rank, metadata)
        if mode == "exit":
            threading.Event().wait(1.0)
            return real(path, tensors, rank, metadata)
        record = real(path, tensors, rank, metadata)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        (out / "killed-while-writing").touch()
        os.kill(os.getpid(), signal.SIGKILL)
        return record

    files.write_file = write


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    from evenzero import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt = build(JobOptions())
    ckpt = out / "ckpt"
    train(model, opt, 0, 2)
    checkpoint.save(opt, ckpt, blocking=False)
    train(model, opt, 2, 4)
    checkpoint.wait()
    if mode == "exit" or dist.get_rank() == 1:
        _arm(out, mode)
    path = checkpoint.save(opt, ckpt, blocking=False)
    if mode == "exit":
        if dist.get_rank() == 0 and not path.exists():
            (out / "returned-before-publish").touch()
        return  # no wait(), no destroy_process_group(): the exit waits for the writer
    train(model, opt, 4, 8)
    checkpoint.wait()


if __name__ == "__main__":
    main()
