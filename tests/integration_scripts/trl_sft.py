"""TRL's `SFTTrainer`, launched as TRL's docs show for DeepSpeed ZeRO-2 ("no script
changes"):

    accelerate launch --config_file deepspeed_zero2.yaml trl_sft.py --output_dir OUT ...
    evenzero run accelerate launch --config_file deepspeed_zero2.yaml trl_sft.py ...

The model is a small Llama built from its config and the tokenizer a word-level one built
here, so nothing is downloaded. `--record PATH` writes, per rank, the Trainer's log
history and every micro-batch loss (PATH.rank<r>.json).
"""

import json
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "mat", "log", "a", "big", "small", "red",
         "blue", "fast", "slow", "and", "then", "it", "saw", "bird"]


@dataclass
class ScriptArguments:
    record: str = field(default="", metadata={"help": "write the run's losses here"})
    samples: int = field(default=64)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def build_dataset(samples: int) -> Dataset:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(6, 14, (samples,), generator=g)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
             for n in lengths]
    return Dataset.from_dict({"text": texts})


class RecordingSFTTrainer(SFTTrainer):
    micro_losses: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            loss = out[0] if return_outputs else out
            self.micro_losses.append(loss.detach().float().item())
        return out


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = RecordingSFTTrainer(model=model, args=args, train_dataset=build_dataset(script.samples),
                                  processing_class=tokenizer)
    trainer.micro_losses = []
    trainer.train()
    if script.record:
        rank = args.process_index
        with open(f"{script.record}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "world_size": args.world_size,
                       "micro_losses": trainer.micro_losses,
                       "log_history": trainer.state.log_history,
                       "distributed_type": str(trainer.accelerator.distributed_type)}, f)


if __name__ == "__main__":
    main()
