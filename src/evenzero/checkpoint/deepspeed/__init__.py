"""DeepSpeed ZeRO-1/2 checkpoints: resume them in a `ZeroOptimizer` at any world size,
or convert them offline. One concept per module:

    load.py         `load_deepspeed` and `DeepSpeedSource`, the staging source it and the
                    converter share (`evenzero.checkpoint.staging`)
    reader.py       the checkpoint directory read and checked (`read_deepspeed`), and
                    DeepSpeed's flat partitions cut back into parameters (`FlatGroup`)
    optim_state.py  DeepSpeed's optimizer and loss-scaler state mapped onto torch's
                    optimizer and evenzero's loss scaler
    allowlist.py    the pickle allow-list: DeepSpeed's files read with torch's
                    `weights_only` unpickler, never running code from them
    offline.py      `convert_deepspeed` and its one-rank stand-in optimizer `OfflineRun`
                    (`evenzero convert-deepspeed`)
"""

from __future__ import annotations

from evenzero.checkpoint.deepspeed.load import DeepSpeedCheckpoint, load_deepspeed
from evenzero.checkpoint.deepspeed.reader import (
    DeepSpeedFiles,
    is_deepspeed_checkpoint,
    read_deepspeed,
)

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedFiles", "is_deepspeed_checkpoint", "load_deepspeed",
           "read_deepspeed"]
