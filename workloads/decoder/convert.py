"""Pretrained weights: Hugging Face safetensors -> the harness's sharded checkpoint, converted once (Llama 2 for
llama2_70b_lora, DeepSeek-V3 for deepseekv3_671b); and DeepSeek-V3's way back (write_hugging_face).

MLCommons gives llama2_70b_lora's submitters Llama 2 70B in Hugging Face's layout with a fused
`self_attn.qkv_proj` (the q, k and v rows stacked, mlcommons/training `llama2_70b_lora/scripts/
regiss_llama_70b_model_config/modeling_llama.py`); the public meta-llama/Llama-2-70b-hf has them unfused
(`q_proj`, `k_proj`, `v_proj`). Both read here, with the `safetensors` library, tensor by tensor.

Hugging Face's conversion of Meta's weights permutes the rows of q and k within each head so that its
rotate-half RoPE equals Meta's interleaved one; this model keeps Meta's interleaved pairs (model.apply_rope),
so the permutation is undone here.

The output is a torch.distributed.checkpoint folder of this model's parameter names: a run loads it with
DCP into its FSDP/tensor-parallel shards, so each rank reads only the slices it holds.

DeepSeek-V3 (Hugging Face's layout, transformers' modeling_deepseek_v3.py; deepseek-ai/DeepSeek-V3's release) is
read from its shards (model.safetensors.index.json) tensor by tensor, each expert's three matrices stacked into
this model's (experts, ...) tensors. Its config.json must agree with the preset's shape (the fields that differ are
named). The layers after num_hidden_layers are the multi-token-prediction depths (the release's layer 61;
`num_nextn_predict_layers`), read into this model's `mtp.K` as mlcommons/training's
`deepseek_mtp_module_conversion.patch` maps them for Megatron: enorm, hnorm and eh_proj as they are (eh_proj's
halves not swapped: embedding first), `shared_head.norm` as the depth's final norm, the rest as a decoder layer; the
depth's `embed_tokens` and `shared_head.head` are copies of the model's own, which the depth shares, so they are
not read. Depths past the preset's are skipped. The release's FP8 weights (e4m3, one fp32 `weight_scale_inv` per 128 x 128 block)
are dequantized to bf16 as DeepSeek's inference/fp8_cast_bf16.py does. Its RoPE dimensions are interleaved pairs
(rope_interleave, the default), as this model's; a checkpoint saved with rope_interleave false has its rope rows
in halves, put back into pairs here. The whole state is held in memory before DCP writes it (the full model:
about 1.3 TB in bf16).

    python -m workloads.decoder.convert HF_FOLDER OUT_FOLDER [--benchmark llama2_70b_lora|deepseekv3_671b]
                                                             [--preset full|tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from workloads.decoder.config import DEEPSEEK_TINY, DEEPSEEK_V3_671B, LORA_PRESETS, DecoderConfig, YarnScaling

# The shapes each benchmark's presets convert to (--benchmark, --preset).
MODELS: dict[str, dict[str, DecoderConfig]] = {
    "llama2_70b_lora": {name: preset.model for name, preset in LORA_PRESETS.items()},
    "deepseekv3_671b": {"full": DEEPSEEK_V3_671B, "tiny": DEEPSEEK_TINY},
}

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
    """Read a Hugging Face folder (DeepSeek-V3's layout for an MLA model, Llama's otherwise), check every parameter
    is there with its shape, write the DCP folder."""
    from workloads.decoder.model import Decoder

    state = read_deepseek(Path(hf_folder), cfg) if cfg.mla else convert_tensors(read_safetensors(hf_folder), cfg)
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
        raise ValueError(f"{folder} is not a checkpoint of this model's shape (convert one with `python -m "
                         f"workloads.decoder.convert`): {str(exc).splitlines()[0][:300]}") from None
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


# --- DeepSeek-V3 ------------------------------------------------------------------------------------------------

# Hugging Face name (after `model.layers.N.`) -> this model's (after `layers.N.`); the routed experts apart.
DEEPSEEK_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "feed_forward.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "feed_forward.router.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "feed_forward.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "feed_forward.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "feed_forward.shared_experts.w2.weight",
}
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# A multi-token-prediction depth's own tensors (after `model.layers.{n_layer + K}.`) -> this model's (after `mtp.K.`);
# the rest of the depth is a decoder layer (`block.`), and its copies of the shared embedding and head are skipped.
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "norm.weight"}
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight\Z")
FP8_BLOCK = 128  # DeepSeek-V3's quantization block (config.json quantization_config.weight_block_size)


def deepseek_hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of this shape in Hugging Face's DeepseekV3 fields (configuration_deepseek_v3.py), as
    deepseek-ai/DeepSeek-V3's release writes them (rope_theta and rope_scaling at the top)."""
    mla, moe, yarn = cfg.mla, cfg.moe, cfg.rope_scaling
    if not isinstance(yarn, YarnScaling):
        raise ValueError("DeepSeek-V3's layout has YaRN's RoPE scaling; this shape has another")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
        "moe_intermediate_size": moe.hidden, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "n_shared_experts": moe.shared_experts,
        "n_routed_experts": moe.experts, "routed_scaling_factor": moe.routed_scale,
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim, "n_group": moe.groups,
        "topk_group": moe.top_groups, "num_experts_per_tok": moe.top_k, "first_k_dense_replace": cfg.dense_layers,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_interleave": True,
        "rope_scaling": {"type": "yarn", "factor": yarn.factor, "original_max_position_embeddings":
                         yarn.original_context, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
                         "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim},
        "max_position_embeddings": int(yarn.original_context * yarn.factor),
        "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": cfg.mtp_layers,
        "initializer_range": cfg.init_std,
    }


# What a config.json must agree on with the preset: the shape, and the routing and RoPE rules this model follows.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                 "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                 "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                 "norm_topk_prob", "hidden_act", "rms_norm_eps", "rope_theta")
# Checked if present. Not num_nextn_predict_layers: transformers writes 1 and saves no depth (its model has none);
# a depth the preset needs and the folder lacks is named by convert's check of every tensor.
_OPTIONAL_FIELDS = ("scoring_func", "topk_method", "tie_word_embeddings", "attention_bias")
_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def deepseek_config_differences(hf: dict, cfg: DecoderConfig) -> list[str]:
    """`hf`'s (a config.json's) fields that differ from the preset's, as "field hf (preset want)". RoPE's fields are
    read from rope_scaling (the release's) or rope_parameters (transformers 5's)."""
    want = deepseek_hf_config(cfg)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    got = {**{k: hf.get(k) for k in _SHAPE_FIELDS}, **{k: hf[k] for k in _OPTIONAL_FIELDS if k in hf},
           "rope_theta": rope.get("rope_theta", hf.get("rope_theta")),
           "rope type": rope.get("rope_type", rope.get("type")),
           **{f"rope {k}": rope.get(k) for k in _YARN_FIELDS}}
    expected = {**{k: want[k] for k in got if k in want}, "rope type": "yarn",
                **{f"rope {k}": want["rope_scaling"][k] for k in _YARN_FIELDS}}

    def same(a, b) -> bool:
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return math.isclose(a, b, rel_tol=1e-9)
        return a == b

    return [f"{k} {got[k]} (preset {expected[k]})" for k in got if not same(got[k], expected[k])]


class SafetensorsFolder:
    """A Hugging Face folder's tensors by name, read one at a time: where the index (model.safetensors.index.json)
    says each lives, or every *.safetensors file's own names."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._open, self._handles = safe_open, {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                self.where = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
            except (ValueError, KeyError, AttributeError) as exc:
                raise ValueError(f"{index} is not a safetensors index (no weight_map): {exc}") from None
            missing = sorted({str(path.name) for path in self.where.values() if not path.is_file()})
            if missing:
                raise FileNotFoundError(f"{folder} lacks {', '.join(missing[:3])}, which its index names")
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder} holds no .safetensors files: give a Hugging Face model folder")
            self.where = {name: path for path in files for name in self._handle(path).keys()}

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open(str(path), framework="pt")
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.where[name]).get_tensor(name)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """An FP8 weight times its block's scale (DeepSeek's inference/fp8_cast_bf16.py `weight_dequant`: one fp32
    `weight_scale_inv` per block x block tile, the last tiles partial), in bf16."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (weight.float() * scale).to(torch.bfloat16)


def rope_rows_to_pairs(w: torch.Tensor, heads: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Each head's last `rope_dim` rows from halves (rotate_half's layout, rope_interleave false) to interleaved
    pairs (this model's apply_rope): row 2i is half-row i, row 2i + 1 is half-row i + rope_dim / 2."""
    w = w.view(heads, head_dim, -1)
    nope, rope = w.split([head_dim - rope_dim, rope_dim], dim=1)
    rope = rope.unflatten(1, (2, rope_dim // 2)).transpose(1, 2).flatten(1, 2)
    return torch.cat((nope, rope), dim=1).flatten(0, 1)


def read_deepseek(hf_folder: Path, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 folder -> this model's state dict, after checking its config.json against the preset."""
    config_path = hf_folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_folder} has no config.json: give a Hugging Face DeepSeek-V3 folder")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} is not a model config (a JSON object)")
    differences = deepseek_config_differences(hf, cfg)
    if differences:
        raise ValueError(f"{config_path} disagrees with the preset on {len(differences)} field(s): "
                         f"{'; '.join(differences)}")
    interleaved = hf.get("rope_interleave", True)
    source = SafetensorsFolder(hf_folder)
    mla = cfg.mla

    def read(name: str) -> torch.Tensor:
        tensor = source.get(name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = name + "_scale_inv"
            if scale not in source:
                raise ValueError(f"{name} is FP8 without its {scale}: cannot dequantize it")
            tensor = dequantize_fp8(tensor, source.get(scale))
        return tensor

    state: dict[str, torch.Tensor] = {}
    experts: dict[str, list[torch.Tensor | None]] = {}
    for name in source.names():
        if name.endswith("weight_scale_inv"):  # read with its weight
            continue
        if name in TOP_NAMES:
            state[TOP_NAMES[name]] = read(name)
            continue
        match = _LAYER.match(name)
        if not match:
            raise ValueError(f"unexpected tensor {name!r}: not a DeepSeek-V3 checkpoint in Hugging Face's layout")
        index, rest = int(match[1]), match[2]
        if index >= cfg.n_layer + cfg.mtp_layers or rest in MTP_SHARED_COPIES:
            continue
        if index >= cfg.n_layer and rest in MTP_NAMES:
            state[f"mtp.{index - cfg.n_layer}.{MTP_NAMES[rest]}"] = read(name)
            continue
        layer = f"layers.{index}." if index < cfg.n_layer else f"mtp.{index - cfg.n_layer}.block."
        expert = _EXPERT.match(rest)
        if expert:
            slots = experts.setdefault(f"{layer}feed_forward.experts.{EXPERT_NAMES[expert[2]]}",
                                       [None] * cfg.moe.experts)
            if int(expert[1]) >= len(slots):
                raise ValueError(f"{name}: the preset has {len(slots)} experts")
            slots[int(expert[1])] = read(name)
        elif rest in DEEPSEEK_LAYER_NAMES:
            tensor = read(name)
            if not interleaved and rest == "self_attn.kv_a_proj_with_mqa.weight":
                tensor = rope_rows_to_pairs(tensor, 1, tensor.size(0), mla.qk_rope_head_dim)
            elif not interleaved and rest in ("self_attn.q_proj.weight", "self_attn.q_b_proj.weight"):
                tensor = rope_rows_to_pairs(tensor, cfg.n_head, mla.qk_head_dim, mla.qk_rope_head_dim)
            state[layer + DEEPSEEK_LAYER_NAMES[rest]] = tensor
        else:
            raise ValueError(f"unexpected tensor {name!r}: not a DeepSeek-V3 checkpoint in Hugging Face's layout")
    for name, slots in experts.items():
        absent = [e for e, w in enumerate(slots) if w is None]
        if absent:
            raise ValueError(f"{hf_folder} lacks experts {absent[:5]} of {name}")
        state[name] = torch.stack(slots)
    return state


def hugging_face_tensors(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """This model's state dict -> DeepSeek-V3's Hugging Face names, each expert apart (views, no copies); MTP depth K
    as layer n_layer + K (read_deepseek's mapping, backwards)."""
    top = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    layer_names = {ours: theirs for theirs, ours in DEEPSEEK_LAYER_NAMES.items()}
    expert_names = {ours: theirs for theirs, ours in EXPERT_NAMES.items()}
    mtp_names = {ours: theirs for theirs, ours in MTP_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
            continue
        kind, layer, rest = name.split(".", 2)
        if kind == "mtp":
            layer = str(n_layer + int(layer))
            if rest in mtp_names:
                out[f"model.layers.{layer}.{mtp_names[rest]}"] = tensor
                continue
            rest = rest.removeprefix("block.")
        prefix = f"model.layers.{layer}."
        if rest.startswith("feed_forward.experts."):
            which = expert_names[rest.rsplit(".", 1)[1]]
            for e, w in enumerate(tensor):
                out[f"{prefix}mlp.experts.{e}.{which}.weight"] = w
        else:
            out[prefix + layer_names[rest]] = tensor
    return out


def write_hugging_face(model: nn.Module, cfg: DecoderConfig, folder: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """A whole (unsharded, one process) DeepSeek-V3 Decoder's weights as Hugging Face's layout: safetensors shards
    of at most `max_shard_bytes` each (a tensor larger than that alone in its shard), model.safetensors.index.json,
    and config.json (deepseek_hf_config). Needs no transformers: the tiny preset writes its starting checkpoint
    with it, and the converter reads it back."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    if any(isinstance(t, DTensor) for t in state.values()):
        raise ValueError("write_hugging_face takes a whole model on one process; this one is sharded")
    tensors = hugging_face_tensors(state, cfg.n_layer)
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: tensors[name].detach().contiguous() for name in names}, str(folder / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps({**deepseek_hf_config(cfg), "torch_dtype": dtype}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workloads.decoder.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_folder", type=Path, help="a Hugging Face model folder (*.safetensors): Llama (fused or "
                   "unfused qkv) or DeepSeek-V3")
    p.add_argument("out", type=Path, help="the checkpoint folder to write (give it to --init-checkpoint)")
    p.add_argument("--benchmark", choices=tuple(MODELS), default="llama2_70b_lora",
                   help="whose model it is (default: llama2_70b_lora)")
    p.add_argument("--preset", default="full", help="the model shape: full or tiny (default: full)")
    args = p.parse_args(argv)
    presets = MODELS[args.benchmark]
    if args.preset not in presets:
        p.error(f"{args.benchmark} has the presets {', '.join(presets)}, not {args.preset!r}")
    try:
        convert(args.hf_folder, args.out, presets[args.preset])
    except (FileNotFoundError, ValueError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
