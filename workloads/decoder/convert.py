"""Pretrained Llama weights: Hugging Face safetensors -> the harness's sharded checkpoint, converted once.

MLCommons gives llama2_70b_lora's submitters Llama 2 70B in Hugging Face's layout with a fused
`self_attn.qkv_proj` (the q, k and v rows stacked, mlcommons/training `llama2_70b_lora/scripts/
regiss_llama_70b_model_config/modeling_llama.py`); the public meta-llama/Llama-2-70b-hf has them unfused
(`q_proj`, `k_proj`, `v_proj`). Both read here, with the `safetensors` library, tensor by tensor.

Hugging Face's conversion of Meta's weights permutes the rows of q and k within each head so that its
rotate-half RoPE equals Meta's interleaved one; this model keeps Meta's interleaved pairs (model.apply_rope),
so the permutation is undone here.

The output is a torch.distributed.checkpoint folder of this model's parameter names: a run loads it with
DCP into its FSDP/tensor-parallel shards, so each rank reads only the slices it holds.

    python -m workloads.decoder.convert HF_FOLDER OUT_FOLDER [--preset full]
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from workloads.decoder.config import LORA_PRESETS, DecoderConfig

# Hugging Face name (after `model.layers.N.`) -> this model's (after `layers.N.`)
LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
UNFUSED = {"self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\Z")


def from_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo Hugging Face's permute() of q or k rows: each head's (2, dim / 2) halves back to interleaved pairs."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's permute(), as its convert_llama_weights_to_hf applies it to Meta's q and k."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def convert_tensors(tensors: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's names and layout (fused or unfused qkv) -> this model's state dict."""
    q_dim = cfg.n_head * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = tensor
            continue
        match = _LAYER.match(name)
        if not match:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed here
                continue
            raise ValueError(f"unexpected tensor {name!r}: not a Llama checkpoint in Hugging Face's layout")
        layer, rest = f"layers.{match[1]}.", match[2]
        if rest == "self_attn.qkv_proj.weight":
            q, k, v = tensor.split([q_dim, cfg.kv_dim, cfg.kv_dim])
        elif rest in UNFUSED:
            q, k, v = (tensor if UNFUSED[rest] == which else None for which in "qkv")
        elif rest in LAYER_NAMES:
            out[layer + LAYER_NAMES[rest]] = tensor
            continue
        else:
            raise ValueError(f"unexpected tensor {name!r}: not a Llama checkpoint in Hugging Face's layout")
        if q is not None:
            out[layer + "attention.wq.weight"] = from_rotate_half(q, cfg.n_head)
        if k is not None:
            out[layer + "attention.wk.weight"] = from_rotate_half(k, cfg.n_kv_head)
        if v is not None:
            out[layer + "attention.wv.weight"] = v
    return out


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors files: give a Hugging Face model folder")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def convert(hf_folder: Path, out: Path, cfg: DecoderConfig) -> None:
    """Read a Hugging Face folder, check every parameter is there with its shape, write the DCP folder."""
    from workloads.decoder.model import Decoder

    state = convert_tensors(read_safetensors(hf_folder), cfg)
    with torch.device("meta"):
        want = Decoder(cfg).state_dict()
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"{hf_folder} lacks {len(missing)} of the model's tensors, e.g. {', '.join(missing[:3])}")
    for name, tensor in state.items():
        if name not in want or tuple(tensor.shape) != tuple(want[name].shape):
            raise ValueError(f"{hf_folder}: {name} has shape {tuple(tensor.shape)}, the config wants "
                             f"{tuple(want[name].shape) if name in want else 'no such tensor'}")
    write_checkpoint(state, out)


def write_checkpoint(state: dict[str, torch.Tensor], out: Path) -> None:
    """Whole tensors from one process, as DCP writes them; any layout can load its shards of them."""
    Path(out).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # that one process writes it is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(out), no_dist=True)


def load_base(model: nn.Module, folder: Path) -> None:
    """Load the pretrained weights into a (sharded) model in place: every parameter but the adapters, each rank
    reading only its own slices."""
    state = {name: value for name, value in get_model_state_dict(model).items() if ".lora_" not in name}
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as exc:  # DCP raises its own CheckpointException for a missing key or folder
        raise ValueError(f"{folder} is not a Llama checkpoint of this model's shape (convert one with `python -m "
                         f"workloads.decoder.convert`): {str(exc).splitlines()[0][:300]}") from None
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workloads.decoder.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_folder", type=Path, help="a Hugging Face model folder (*.safetensors), fused or unfused qkv")
    p.add_argument("out", type=Path, help="the checkpoint folder to write (give it to --init-checkpoint)")
    p.add_argument("--preset", choices=tuple(LORA_PRESETS), default="full", help="the model shape (default: full)")
    args = p.parse_args(argv)
    try:
        convert(args.hf_folder, args.out, LORA_PRESETS[args.preset].model)
    except (FileNotFoundError, ValueError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
