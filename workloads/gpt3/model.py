"""GPT-3: a decoder-only transformer, from the tiny preset up to the 175B shape. Reads top to bottom.

Pre-LayerNorm blocks of causal self-attention (PyTorch's scaled_dot_product_attention,
which picks flash attention on GPUs) and a 4x GELU MLP; learned positions; the output
layer shares the token embedding's weights (as MLPerf's reference model does). q, k and v
are separate linears so that tensor parallelism can split them by heads (see parallel.py;
convert_reference.py splits the reference checkpoint's fused QKV), and the attention reads
its head count from the shapes it gets, so the same code runs whole or split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.gpt3.config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim); heads are this rank's share under TP.
        q, k, v = (linear(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for linear in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2/3 initialisation; called again after a model built on the meta device gets real storage. A pipeline
        stage (workloads.gpt3.pipeline: some of the blocks, the embeddings or the output layer missing) makes every
        draw the whole model makes, in its order, and keeps those of its own parameters, so that its initial weights
        equal the whole model's whatever the layout."""
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        whole = self if self.wte is not None and self.lm_head is not None else _meta_whole(self.cfg)
        own = self._drawn_parameters()
        device = next(self.parameters()).device
        for name, shape, std in whole._draws():
            if name in own:
                nn.init.normal_(own[name], mean=0.0, std=std)
            else:  # another stage's: drawn and dropped, so that the generator moves on as the whole model's does
                torch.empty(shape, device=device).normal_(mean=0.0, std=std)

    def _draws(self) -> list[tuple[str, torch.Size, float]]:
        """The whole model's random draws, in order: every linear's and embedding's weight (the tied output layer
        draws the token embedding again: its draw is the one that stays), then the residual projections again,
        scaled by 1/sqrt(2 x layers) to keep the residual stream O(1)."""
        draws = [(f"{name}.weight", module.weight.shape, 0.02) for name, module in self.named_modules()
                 if isinstance(module, (nn.Linear, nn.Embedding))]
        return draws + [(name, param.shape, 0.02 / math.sqrt(2 * self.cfg.n_layer))
                        for name, param in self.named_parameters() if name.endswith(("proj.weight", "fc2.weight"))]

    def _drawn_parameters(self) -> dict[str, nn.Parameter]:
        """This model's parameters by every name they have; on a first pipeline stage, which holds the token
        embedding but not the output layer, the output layer's draw goes to the embedding, as the tie does whole."""
        own = dict(self.named_parameters(remove_duplicate=False))
        if self.wte is not None and self.lm_head is None:
            own["lm_head.weight"] = self.wte.weight
        return own

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for each position: (batch, seq) token ids -> (batch, seq, vocab). A pipeline stage without the
        embeddings reads the previous stage's hidden states, and one without the output layer returns its own;
        `positions` (default 0..seq-1) are the tokens' (the pipeline passes them to every stage)."""
        if self.wte is not None:
            positions = torch.arange(x.size(1), device=x.device) if positions is None else positions
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks:
            # Checkpointing keeps only each block's input and recomputes the rest in backward.
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training \
                else block(x)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))


def _meta_whole(cfg: GPTConfig) -> GPT:
    """The whole model without storage: the shapes and order of its draws, for a pipeline stage's."""
    with torch.device("meta"):
        return GPT(cfg)
