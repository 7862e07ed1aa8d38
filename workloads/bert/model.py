"""BERT for pretraining: masked-LM and next-sentence heads over a post-LayerNorm encoder. Reads top to bottom.

As in the reference: token + position + segment embeddings, then blocks of self-attention and
a 4x GELU MLP, each added to its input and then normalised; the MLM head's output layer shares
the token embedding's weights. Packed inputs (several sequences in one row) work through two
tensors: `position_ids` restart at each sequence and `sequence_ids` (0 for padding) keep
attention inside a sequence. `load_reference_state_dict` reads checkpoints that use the
reference's (NVIDIA's and Hugging Face's) parameter names, such as MLPerf's starting checkpoint.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from workloads.bert.config import BertConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = (linear(x).view(batch, seq, self.n_head, -1).transpose(1, 2) for linear in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, mask)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc(x)))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.seg = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.ln_emb = nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        # Masked LM: transform, then the (tied) token embedding and a per-token bias.
        self.mlm_transform = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlm_ln = nn.LayerNorm(cfg.d_model, eps=1e-12)
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        # Next sentence: the pooled [CLS] state of each sequence.
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
        self.nsp = nn.Linear(cfg.d_model, 2)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        """The reference's initialisation: normal(0, 0.02) weights, zero biases, unit LayerNorms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor,
                sequence_ids: torch.Tensor, mlm_positions: torch.Tensor, cls_positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq) inputs -> MLM logits at the flat positions `mlm_positions` (masked, vocab) and NSP
        logits at `cls_positions` (sequences, 2). Only the positions scored are sent through the heads."""
        x = self.drop(self.ln_emb(self.tok(input_ids) + self.pos(position_ids) + self.seg(segment_ids)))
        # Each token attends to the tokens of its own sequence (padding, id 0, only to padding).
        mask = (sequence_ids[:, None, :, None] == sequence_ids[:, None, None, :])
        for layer in self.layers:
            x = layer(x, mask)
        x = x.flatten(0, 1)
        masked = self.mlm_ln(F.gelu(self.mlm_transform(x[mlm_positions])))
        mlm_logits = masked @ self.tok.weight.t() + self.mlm_bias
        nsp_logits = self.nsp(torch.tanh(self.pooler(x[cls_positions])))
        return mlm_logits, nsp_logits


# Reference name (NVIDIA's and Hugging Face's BertForPreTraining) -> ours; applied in order, first match wins.
REFERENCE_NAMES = [
    (r"bert\.embeddings\.word_embeddings\.", "tok."),
    (r"bert\.embeddings\.position_embeddings\.", "pos."),
    (r"bert\.embeddings\.token_type_embeddings\.", "seg."),
    (r"bert\.embeddings\.LayerNorm\.", "ln_emb."),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attn.q."),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attn.k."),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attn.v."),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.proj."),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.ln1."),
    (r"bert\.encoder\.layer\.(\d+)\.intermediate\.dense(_act)?\.", r"layers.\1.fc."),
    (r"bert\.encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.fc2."),
    (r"bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ln2."),
    (r"bert\.pooler\.dense(_act)?\.", "pooler."),
    (r"cls\.predictions\.transform\.dense(_act)?\.", "mlm_transform."),
    (r"cls\.predictions\.transform\.LayerNorm\.", "mlm_ln."),
    (r"cls\.predictions\.bias$", "mlm_bias"),
    (r"cls\.seq_relationship\.", "nsp."),
]
# TensorFlow-converted checkpoints name LayerNorm parameters gamma and beta.
_TF_NORM = {"gamma": "weight", "beta": "bias"}
# Not parameters of ours: the tied decoder (the token embedding again) and Hugging Face's position buffer.
_SKIPPED = ("cls.predictions.decoder.weight", "bert.embeddings.position_ids")


def from_reference_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in the reference's names (or already in ours) -> ours. Unknown names are kept, so
    that loading reports them."""
    ours = {}
    for name, tensor in state.items():
        name = name.removeprefix("module.")
        if name in _SKIPPED:
            continue
        for pattern, replacement in REFERENCE_NAMES:
            renamed, hits = re.subn(pattern, replacement, name)
            if hits:
                head, _, leaf = renamed.rpartition(".")
                name = f"{head}.{_TF_NORM.get(leaf, leaf)}" if head else renamed
                break
        ours[name] = tensor
    return ours


def load_reference_state_dict(model: Bert, state: dict[str, torch.Tensor]) -> None:
    """Load a starting checkpoint; any missing, unexpected or misshapen parameter is an error that names it."""
    state = from_reference_names(state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = [f"{k} {tuple(state[k].shape)} (model: {tuple(v.shape)})" for k, v in expected.items()
                 if k in state and state[k].shape != v.shape]
    if missing or unexpected or misshapen:
        problems = [f"{label}: {', '.join(items[:6])}{' ...' if len(items) > 6 else ''}"
                    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
                    if items]
        raise ValueError("the starting checkpoint does not fit this BERT: " + "; ".join(problems))
    model.load_state_dict(state)


def model_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's MLM and NSP logits for a collated batch."""
    return model(batch["input_ids"], batch["segment_ids"], batch["position_ids"], batch["sequence_ids"],
                 batch["mlm_positions"], batch["cls_positions"])


def pretraining_loss(mlm_logits: torch.Tensor, nsp_logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masked-LM plus next-sentence cross entropy, as the reference sums them."""
    return (F.cross_entropy(mlm_logits.float(), batch["mlm_labels"]) +
            F.cross_entropy(nsp_logits.float(), batch["nsp_labels"]))
