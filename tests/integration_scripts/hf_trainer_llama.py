"""A Hugging Face Trainer script with DeepSpeed, written the way HF users write one: the
command line fills `TrainingArguments` (`--deepspeed ds.json`, ...), the model is a small
Llama built from its config (no download), and `trainer.train(resume_from_checkpoint=...)`.

The same file runs under real DeepSpeed and under evenzero; only the launch differs:

    torchrun --nproc-per-node 2 hf_trainer_llama.py --deepspeed ds_zero2.json ...
    evenzero run torchrun --nproc-per-node 2 hf_trainer_llama.py --deepspeed ds_zero2.json ...

`--record PATH` writes, per rank, what the run computed (PATH.rank<r>.json): every
micro-batch loss unrounded (a `compute_loss` override, as users write for logging), the
Trainer's log history, and the global step.
"""

import json
from dataclasses import dataclass, field

import torch
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)


@dataclass
class ScriptArguments:
    record: str = field(default="", metadata={"help": "write the run's losses here"})
    samples: int = field(default=96, metadata={"help": "training sequences"})
    seq_len: int = field(default=16, metadata={"help": "tokens per sequence"})


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences (the same on every rank and in every run)."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, vocab, (samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class RecordingTrainer(Trainer):
    micro_losses: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            loss = out[0] if return_outputs else out
            self.micro_losses.append(loss.detach().float().item())
        return out


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)) \
        .parse_args_into_dataclasses()
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = RecordingTrainer(model=model, args=args,
                               train_dataset=TokenDataset(script.samples, script.seq_len,
                                                          config.vocab_size))
    trainer.micro_losses = []
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    if script.record:
        rank = args.process_index
        with open(f"{script.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "world_size": args.world_size,
                       "micro_losses": trainer.micro_losses,
                       "log_history": trainer.state.log_history,
                       "global_step": trainer.state.global_step,
                       "cpu_offload": getattr(trainer.model_wrapped, "zero_cpu_offload",
                                              lambda: None)()}, f)


if __name__ == "__main__":
    main()
