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
        """GPT-2/3 initialisation; called again after a model built on the meta device gets real storage."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # Residual projections scaled by 1/sqrt(2 x layers) keep the residual stream O(1).
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for each position: (batch, seq) token ids -> (batch, seq, vocab)."""
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            # Checkpointing keeps only each block's input and recomputes the rest in backward.
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training \
                else block(x)
        return self.lm_head(self.ln_f(x))
