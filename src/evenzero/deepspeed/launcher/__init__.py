"""`deepspeed.launcher`: the `deepspeed` command (`launcher.runner`) as a single-node
torchrun launch, and the per-rank program torchrun starts (`launcher/rank_exec.py`)."""
