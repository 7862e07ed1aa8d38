"""Convert MLPerf's GPT-3 reference checkpoint (Megatron's distributed layout) into this model's starting
checkpoint: weights, Adam's two moments, and the step it was trained to.

    python -m workloads.gpt3.convert_reference SRC DST [--heads 96]

SRC is the checkpoint as mlcommons/training's large_language_model/megatron-lm README describes it
(the PAXML checkpoint of step 4000 at batch 1536, converted to Megatron's format): one folder per
tensor, each an uncompressed Zarr (v2) array, named after Megatron's parameters, with the 96
layers stacked on a first axis:

    language_model.embedding.word_embeddings.weight                      [vocab, d]
    language_model.encoder.layers.self_attention.query_key_value.weight  [layers, 3 d, d]
    optimizer.state.exp_avg.<name>, optimizer.state.exp_avg_sq.<name>   Adam's moments
    optimizer.state.fp32_from_fp16.<name>                                fp32 master weights (bf16 checkpoints)

Megatron fuses q, k and v into one linear whose output rows run head by head, each head's
q, k and v rows together ([heads, 3, head_dim]); this model keeps q, k and v apart, so those rows
are regrouped. DST is a torch.distributed.checkpoint folder with {"model", "optimizer"} keyed by
this model's parameter names, and harness-init.json with the step and batch it was trained to;
`harness run gpt3 --init-checkpoint DST` loads all of it and continues the LR schedule from there.
Memory: about 3 x 4 bytes per parameter at once (2.1 TB for 175B, as the reference's converter needs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from workloads.gpt3.config import INIT_INFO, PRESETS, REFERENCE_BATCH, REFERENCE_INIT_CHECKPOINT_STEP

MOMENTS = {"exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq."}
MASTER_WEIGHTS = "optimizer.state.fp32_from_fp16."
ZARR_DTYPES = {"<f4": torch.float32, "<f2": torch.float16, "bfloat16": torch.bfloat16}
# Megatron's parameter names (per layer ones stacked on a first axis) -> this model's.
EMBEDDINGS = {"language_model.embedding.word_embeddings.weight": "wte.weight",
              "language_model.embedding.position_embeddings.weight": "wpe.weight",
              "language_model.encoder.final_layernorm.weight": "ln_f.weight",
              "language_model.encoder.final_layernorm.bias": "ln_f.bias"}
LAYER_PREFIX = "language_model.encoder.layers."
LAYERS = {"input_layernorm": "ln1", "self_attention.dense": "attn.proj", "post_attention_layernorm": "ln2",
          "mlp.dense_h_to_4h": "mlp.fc", "mlp.dense_4h_to_h": "mlp.fc2"}
FUSED_QKV = "self_attention.query_key_value"


class ConversionError(ValueError):
    """A checkpoint that is not in the reference's layout; the message names what is wrong."""


def read_zarr(folder: Path) -> torch.Tensor:
    """One uncompressed Zarr v2 array (what Megatron's zarr strategy writes: compressor None, C order)."""
    meta_path = folder / ".zarray"
    if not meta_path.is_file():
        raise ConversionError(f"{folder} is not a Zarr array (no .zarray)")
    meta = json.loads(meta_path.read_text())
    if meta.get("compressor") or meta.get("filters") or meta.get("order", "C") != "C":
        raise ConversionError(f"{folder}: only uncompressed, unfiltered C-order arrays are read (as Megatron "
                              f"writes them); this one has compressor {meta.get('compressor')}")
    if meta["dtype"] not in ZARR_DTYPES:
        raise ConversionError(f"{folder}: dtype {meta['dtype']} is not one of {', '.join(ZARR_DTYPES)}")
    dtype, shape, chunks = ZARR_DTYPES[meta["dtype"]], meta["shape"], meta["chunks"]
    separator = meta.get("dimension_separator", ".")
    out = torch.empty(shape, dtype=dtype)
    for index in np.ndindex(*(-(-size // chunk) for size, chunk in zip(shape, chunks))):
        chunk_file = folder / separator.join(map(str, index))
        if not chunk_file.is_file():
            raise ConversionError(f"{folder}: chunk {chunk_file.name} is missing")
        raw = chunk_file.read_bytes()
        if len(raw) != math.prod(chunks) * dtype.itemsize:
            raise ConversionError(f"{chunk_file} holds {len(raw)} bytes, not a chunk of {chunks} {meta['dtype']}")
        chunk = torch.frombuffer(bytearray(raw), dtype=dtype).view(chunks)
        region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))
        out[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]  # edge chunks are stored whole
    return out.float()


def split_qkv(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV rows ([heads, 3, head_dim] along the first axis) -> q, k, v (each heads x head_dim)."""
    if fused.shape[0] % (3 * heads):
        raise ConversionError(f"a fused QKV of {fused.shape[0]} rows does not split into q, k and v of {heads} heads")
    grouped = fused.reshape(heads, 3, fused.shape[0] // (3 * heads), *fused.shape[1:])
    return tuple(grouped[:, i].reshape(-1, *fused.shape[1:]).contiguous() for i in range(3))


def convert_tensors(read, heads: int, n_layer: int) -> dict[str, torch.Tensor]:
    """This model's state dict from `read(megatron_name)`, for one kind of tensor (weights or a moment)."""
    out = {ours: read(theirs) for theirs, ours in EMBEDDINGS.items()}
    for kind in ("weight", "bias"):
        stacked = {ours: read(f"{LAYER_PREFIX}{theirs}.{kind}") for theirs, ours in LAYERS.items()}
        fused = read(f"{LAYER_PREFIX}{FUSED_QKV}.{kind}")
        for name, tensor in (*stacked.items(), ("qkv", fused)):
            if tensor.shape[0] != n_layer:
                raise ConversionError(f"{name}.{kind} stacks {tensor.shape[0]} layers; the model has {n_layer}")
        for layer in range(n_layer):
            for ours, tensor in stacked.items():
                out[f"blocks.{layer}.{ours}.{kind}"] = tensor[layer]
            for ours, tensor in zip(("q", "k", "v"), split_qkv(fused[layer], heads)):
                out[f"blocks.{layer}.attn.{ours}.{kind}"] = tensor
    return out


def convert(src: Path, dst: Path, heads: int, step: int = REFERENCE_INIT_CHECKPOINT_STEP,
            global_batch: int = REFERENCE_BATCH) -> dict[str, tuple[int, ...]]:
    """Write DST from SRC; returns this model's parameter shapes (what a caller can check against a config)."""
    def reader(prefix: str):
        def read(name: str) -> torch.Tensor:
            folder = src / f"{prefix}{name}"
            if not folder.is_dir():
                raise ConversionError(f"{src} lacks {prefix}{name}: not MLPerf's reference checkpoint layout")
            return read_zarr(folder)
        return read

    n_layer = reader("")(f"{LAYER_PREFIX}input_layernorm.weight").shape[0]
    # bf16 checkpoints keep the fp32 master weights under the optimizer; fp32 ones are the weights themselves.
    weights_prefix = MASTER_WEIGHTS if (src / f"{MASTER_WEIGHTS}{next(iter(EMBEDDINGS))}").is_dir() else ""
    model = convert_tensors(reader(weights_prefix), heads, n_layer)
    moments = {kind: convert_tensors(reader(prefix), heads, n_layer) for kind, prefix in MOMENTS.items()}
    state = {name: {"step": torch.tensor(float(step)), **{kind: moments[kind][name] for kind in MOMENTS}}
             for name in model}
    model["lm_head.weight"] = model["wte.weight"]  # tied, as in the reference; the optimizer sees it once
    dcp.save({"model": model, "optimizer": {"state": state}}, checkpoint_id=str(dst), no_dist=True)
    (dst / INIT_INFO).write_text(json.dumps({"step": step, "global_batch": global_batch}) + "\n")
    return {name: tuple(t.shape) for name, t in model.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.gpt3.convert_reference", description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path, help="the reference checkpoint (Megatron layout, one Zarr folder a tensor)")
    parser.add_argument("dst", type=Path, help="where to write the torch.distributed.checkpoint folder")
    parser.add_argument("--heads", type=int, default=PRESETS["full"].model.n_head,
                        help="attention heads (the fused QKV is split by them); default: the full preset's")
    args = parser.parse_args(argv)
    try:
        shapes = convert(args.src, args.dst, args.heads)
    except ConversionError as error:
        print(f"convert_reference: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}: {len(shapes)} tensors with Adam's moments, step {REFERENCE_INIT_CHECKPOINT_STEP} at "
          f"batch {REFERENCE_BATCH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
