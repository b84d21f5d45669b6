"""Built-in model specs: the seed case and transformer shapes from published configs.

Arrival orders follow what autograd does for these models: gradients arrive roughly in
reverse order of forward use, and within an `nn.Linear` the bias before the weight
(the weight's gradient passes through a transpose node first). Tied embeddings arrive
last, when their final (input-side) use is differentiated.

For compute estimates (`evenzero.cost.compute`) each preset also says how many tokens
one rank processes per micro-batch: the seed case's 32 rows per rank (the report's
batch), and one sequence at the published context length for the transformers (the
smallest micro-batch anyone trains with, so the least compute to hide communication
behind; `evenzero plan --tokens N` changes it). Embedding tables are marked as such
(a gather, not a matmul), each layer's causal attention products are charged to its
value projection, and an expert layer sees ep_size / num_experts of the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from evenzero.spec import DENSE, GroupSpec, ModelSpec, ParamSpec, SpecError


class _Builder:
    """Collects params in registration order and their forward-use order."""

    def __init__(self, dtype: str = "float32") -> None:
        self.params: list[ParamSpec] = []
        self.uses: list[str] = []
        self.dtype = dtype
        self.compute: dict[str, dict[str, object]] = {}
        """Compute fields (`ParamSpec.layer`, ...) set after a param was added."""

    def add(self, name: str, shape: tuple[int, ...], group: str = DENSE, **compute) -> str:
        self.params.append(ParamSpec(name, shape, group, self.dtype, **compute))
        return name

    def charge(self, name: str, **compute) -> None:
        self.compute.setdefault(name, {}).update(compute)

    def linear(self, name: str, n_in: int, n_out: int, bias: bool = True, group: str = DENSE,
               register: bool = True, use: bool = True, token_share: float = 1.0) -> None:
        if register:
            self.add(f"{name}.weight", (n_out, n_in), group, token_share=token_share)
            if bias:
                self.add(f"{name}.bias", (n_out,), group, token_share=token_share)
        if use:
            # Forward uses weight then bias; reversed, the bias arrives first.
            self.uses += [f"{name}.weight"] + ([f"{name}.bias"] if bias else [])

    def norm(self, name: str, dim: int, bias: bool = True) -> None:
        self.add(f"{name}.weight", (dim,))
        self.uses.append(f"{name}.weight")
        if bias:
            self.add(f"{name}.bias", (dim,))
            self.uses.append(f"{name}.bias")

    def spec(self, name: str, tokens: int, groups: tuple[GroupSpec, ...] = (GroupSpec(DENSE),),
             last: tuple[str, ...] = ()) -> ModelSpec:
        arrival = [n for n in reversed(self.uses) if n not in last]
        seen: set[str] = set()
        arrival = [n for n in arrival if not (n in seen or seen.add(n))] + list(last)
        params = tuple(replace(p, **self.compute.get(p.name, {})) for p in self.params)
        return ModelSpec(params, groups, tuple(arrival), "preset", name, tokens)


SEED_TOKENS = 32
"""Rows of the global batch each rank trains on per step in the seed case
(`evenzero.repro.seedmodel.SeedModelConfig.tokens_per_rank`)."""


def seed_moe(gate_grad: bool = True, dtype: str = "float32") -> ModelSpec:
    """The model of DeepSpeed issue #3151 (deepspeedai/DeepSpeed#3151), per rank.

    fc1, fc2 = Linear(1000, 1000); an MoE layer with gate Linear(1000, 16, bias=False),
    16 experts at expert-parallel size 4 (4 local experts, each fc1/fc2 Linear(1000, 1000)).
    Forward x -> moe -> relu(fc1) -> fc2. With `gate_grad=False` the gate's gradient is
    never produced, as in the DeepSpeed version of the report.
    """
    b = _Builder(dtype)
    b.linear("fc1", 1000, 1000, use=False)
    b.linear("fc2", 1000, 1000, use=False)
    b.add("moe.gate.wg.weight", (16, 1000))
    for e in range(4):  # top-1 over 16 experts, ep_size 4: each expert sees 4/16 of the tokens
        b.linear(f"moe.experts.{e}.fc1", 1000, 1000, group="experts", use=False, token_share=0.25)
        b.linear(f"moe.experts.{e}.fc2", 1000, 1000, group="experts", use=False, token_share=0.25)
    b.uses.append("moe.gate.wg.weight")
    for e in range(4):
        b.linear(f"moe.experts.{e}.fc1", 1000, 1000, group="experts", register=False)
        b.linear(f"moe.experts.{e}.fc2", 1000, 1000, group="experts", register=False)
    b.linear("fc1", 1000, 1000, register=False)
    b.linear("fc2", 1000, 1000, register=False)
    spec = b.spec("seed-moe" if gate_grad else "seed-moe-gate-lost", SEED_TOKENS,
                  (GroupSpec(DENSE), GroupSpec("experts", 4)))
    return spec if gate_grad else spec.without_grads(["moe.gate.wg.weight"])


@dataclass(frozen=True)
class TransformerShape:
    """Shapes of a decoder-only transformer, from a published config."""

    layers: int
    dim: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int | None = None
    context: int = 0
    """Learned position embeddings (GPT-2); 0 for rotary models."""
    gated_mlp: bool = False
    """SwiGLU/GeGLU MLP with gate, up and down projections."""
    bias: bool = False
    norm_bias: bool = False
    tied: bool = False
    head_dim: int | None = None
    post_norms: bool = False
    """Gemma-2 style extra norms after attention and MLP."""
    seq: int = 4096
    """Training sequence length: tokens per micro-batch of one sequence."""


def transformer(name: str, s: TransformerShape, dtype: str = "bfloat16") -> ModelSpec:
    b = _Builder(dtype)
    hd = s.head_dim or s.dim // s.heads
    kv = (s.kv_heads or s.heads) * hd
    q = s.heads * hd
    # Causal attention's two products (scores, weighted values) cost 2 * 2 * (seq/2) * q
    # FLOPs per token forward, twice that backward; they run between the output
    # projection's gradient and the value projection's.
    attention = 4.0 * s.seq * q
    b.add("embed.weight", (s.vocab, s.dim), layer="embedding")
    b.uses.append("embed.weight")
    if s.context:
        b.add("pos_embed.weight", (s.context, s.dim), layer="embedding")
        b.uses.append("pos_embed.weight")
    for i in range(s.layers):
        p = f"layers.{i}"
        b.norm(f"{p}.attn_norm", s.dim, s.norm_bias)
        if s.kv_heads is None and s.bias:  # GPT-2 fuses q, k, v
            b.linear(f"{p}.attn.qkv", s.dim, 3 * q, s.bias)
            value = f"{p}.attn.qkv"
        else:
            b.linear(f"{p}.attn.q", s.dim, q, s.bias)
            b.linear(f"{p}.attn.k", s.dim, kv, s.bias)
            b.linear(f"{p}.attn.v", s.dim, kv, s.bias)
            value = f"{p}.attn.v"
        # Within a Linear the bias's gradient arrives first (see the module docstring).
        b.charge(f"{value}.bias" if s.bias else f"{value}.weight",
                 extra_backward_flops_per_token=attention)
        b.linear(f"{p}.attn.o", q, s.dim, s.bias)
        if s.post_norms:
            b.norm(f"{p}.attn_post_norm", s.dim, False)
        b.norm(f"{p}.mlp_norm", s.dim, s.norm_bias)
        if s.gated_mlp:
            b.linear(f"{p}.mlp.gate", s.dim, s.ffn, s.bias)
            b.linear(f"{p}.mlp.up", s.dim, s.ffn, s.bias)
        else:
            b.linear(f"{p}.mlp.fc", s.dim, s.ffn, s.bias)
        b.linear(f"{p}.mlp.down", s.ffn, s.dim, s.bias)
        if s.post_norms:
            b.norm(f"{p}.mlp_post_norm", s.dim, False)
    b.norm("final_norm", s.dim, s.norm_bias)
    if s.tied:
        b.uses.append("embed.weight")
    else:
        b.linear("lm_head", s.dim, s.vocab, bias=False)
    # The embeddings' gradients come from their input-side use, differentiated last.
    last = ("pos_embed.weight", "embed.weight") if s.context else ("embed.weight",)
    return b.spec(name, s.seq, last=last)


# GPT-2 XL (1.56B): n_layer 48, n_embd 1600, n_head 25, n_ctx 1024, vocab 50257, tied.
GPT2_XL = TransformerShape(48, 1600, 6400, 50257, 25, context=1024, bias=True, norm_bias=True,
                           tied=True, seq=1024)
# Llama-2 7B: dim 4096, 32 layers, 32 heads, ffn 11008, vocab 32000, RMSNorm, untied;
# Llama-2 trains on 4096-token sequences.
LLAMA_7B = TransformerShape(32, 4096, 11008, 32000, 32, kv_heads=32, gated_mlp=True)
# Gemma-2 27B: dim 4608, 46 layers, 32 heads x 128, 16 KV heads, ffn 36864, vocab 256000;
# context 8192.
GEMMA2_27B = TransformerShape(46, 4608, 36864, 256000, 32, kv_heads=16, head_dim=128,
                              gated_mlp=True, tied=True, post_norms=True, seq=8192)
# Llama-2 70B: dim 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672, vocab 32000.
LLAMA_70B = TransformerShape(80, 8192, 28672, 32000, 64, kv_heads=8, gated_mlp=True)

PRESETS: dict[str, tuple[str, Callable[[], ModelSpec]]] = {
    "seed-moe": ("DeepSpeed #3151 MoE model, 10.0M params per rank, gate gradient present",
                 lambda: seed_moe(True)),
    "seed-moe-gate-lost": ("seed-moe with the gate gradient lost, as in the report",
                           lambda: seed_moe(False)),
    "gpt2-xl": ("GPT-2 XL, 1.56B params, 48 layers x 1600", lambda: transformer("gpt2-xl", GPT2_XL)),
    "llama-7b": ("Llama-2 7B, 6.7B params", lambda: transformer("llama-7b", LLAMA_7B)),
    "gemma2-27b": ("Gemma-2 27B, ~27B dense params",
                   lambda: transformer("gemma2-27b", GEMMA2_27B)),
    "llama-70b": ("Llama-2 70B, 69B params", lambda: transformer("llama-70b", LLAMA_70B)),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name][1]()
    except KeyError:
        raise SpecError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} "
                        f"or pass a JSON model file") from None
