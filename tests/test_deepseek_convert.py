"""DeepSeek-V3 in the decoder family, held to Hugging Face transformers' DeepseekV3ForCausalLM: a tiny random model
saved in several shards converts into the harness's Decoder with the same logits, and the harness's
write_hugging_face gives a folder transformers loads to the same logits; a config.json that disagrees with the
preset is refused by name. And the DeepSeek-V3 parts on their own: the grouped sigmoid router against a plain
reference, the expert bias update, the sequence balance loss's gradient against the loss added by hand, the FP8
dequantization, the dense first layers beside the MoE ones under expert parallelism's parallelize."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from workloads.decoder import config
from workloads.decoder.config import DEEPSEEK_V3_671B, DecoderConfig, MlaConfig, MoeConfig
from workloads.decoder.convert import convert, deepseek_config_differences, dequantize_fp8, load_base, main, \
    read_deepseek, write_hugging_face
from workloads.decoder.model import Decoder
from workloads.decoder.moe import MoE, SigmoidRouter, grouped_top_k, update_expert_bias

# transformers' DeepseekV3ForCausalLM has no multi-token prediction (it ignores the release's layer 61): the
# comparisons with it use the tiny shape without its depth; test_the_mtp_depth_goes_to_the_layer_after_the_decoders
# covers the depth's names both ways.
DEEPSEEK_TINY = replace(config.DEEPSEEK_TINY, mtp_layers=0, mtp_loss_scale=0.0)
SEQ = 96  # longer than DEEPSEEK_TINY's YaRN original context (64): the stretched frequencies matter

# A variant with one query projection, three layers (two with experts), YaRN's two mscales apart (the cos/sin gain
# differs from 1), and a checkpoint whose RoPE rows are halves.
ONE_Q_PROJECTION = replace(DEEPSEEK_TINY, n_layer=3,
                           rope_scaling=replace(DEEPSEEK_TINY.rope_scaling, mscale=0.7, mscale_all_dim=1.0),
                           mla=MlaConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                         v_head_dim=16))


def hf_config(cfg: DecoderConfig, rope_interleave: bool = True):
    """transformers' own config for the shape, written field by field (not through the harness's writer)."""
    transformers = pytest.importorskip("transformers")
    mla, moe, yarn = cfg.mla, cfg.moe, cfg.rope_scaling
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
        moe_intermediate_size=moe.hidden, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, n_shared_experts=moe.shared_experts, n_routed_experts=moe.experts,
        routed_scaling_factor=moe.routed_scale, kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, qk_nope_head_dim=mla.qk_nope_head_dim,
        n_group=moe.groups, topk_group=moe.top_groups, num_experts_per_tok=moe.top_k,
        first_k_dense_replace=cfg.dense_layers, rms_norm_eps=cfg.norm_eps, rope_interleave=rope_interleave,
        max_position_embeddings=256,
        rope_scaling={"type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn.factor,
                      "original_max_position_embeddings": yarn.original_context, "beta_fast": yarn.beta_fast,
                      "beta_slow": yarn.beta_slow, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim})


def random_hf_model(cfg: DecoderConfig, rope_interleave: bool = True):
    """Every weight random (norms around 1), the expert bias too, so that each part is seen in the logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config(cfg, rope_interleave)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.08 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def harness_logits(folder, cfg: DecoderConfig, tokens: torch.Tensor) -> torch.Tensor:
    model = Decoder(cfg).eval()
    load_base(model, folder)
    with torch.no_grad():
        return model(tokens)


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 2e-5 * scale, float((ours - theirs).abs().max() / scale)


@pytest.mark.parametrize("cfg, interleave", [(DEEPSEEK_TINY, True), (ONE_Q_PROJECTION, False)],
                         ids=["tiny", "one-q-projection-rope-halves"])
def test_a_transformers_checkpoint_in_shards_converts_to_the_same_logits(tmp_path, cfg, interleave):
    hf = random_hf_model(cfg, interleave)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    convert(tmp_path / "hf", tmp_path / "dcp", cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
    close(harness_logits(tmp_path / "dcp", cfg, tokens), theirs)


def test_the_harness_writes_a_folder_transformers_loads_to_the_same_logits_and_the_converter_reads_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    model = Decoder(DEEPSEEK_TINY).eval()
    with torch.no_grad():
        model.layers[1].feed_forward.router.expert_bias.copy_(0.1 * torch.randn(8))
    write_hugging_face(model, DEEPSEEK_TINY, tmp_path / "hf", max_shard_bytes=60_000)
    assert len(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens), hf.eval()(tokens).logits
    close(ours, theirs)
    convert(tmp_path / "hf", tmp_path / "dcp", DEEPSEEK_TINY)
    close(harness_logits(tmp_path / "dcp", DEEPSEEK_TINY, tokens), ours)


def test_a_config_that_disagrees_with_the_preset_is_refused_naming_the_fields(tmp_path, capsys):
    torch.manual_seed(4)
    write_hugging_face(Decoder(DEEPSEEK_TINY), DEEPSEEK_TINY, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(n_group=4, hidden_size=96)
    config["rope_scaling"]["factor"] = 8.0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main([str(tmp_path / "hf"), str(tmp_path / "out"), "--benchmark", "deepseekv3_671b",
                 "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "disagrees with the preset on 3 field(s)" in err and "Traceback" not in err
    assert "hidden_size 96 (preset 64)" in err and "n_group 4 (preset 2)" in err and "rope factor 8.0" in err
    assert not (tmp_path / "out").exists()


def test_the_full_preset_is_refused_for_a_tiny_folder_and_a_missing_folder_is_named(tmp_path, capsys):
    torch.manual_seed(5)
    write_hugging_face(Decoder(DEEPSEEK_TINY), DEEPSEEK_TINY, tmp_path / "hf")
    assert main([str(tmp_path / "hf"), str(tmp_path / "out"), "--benchmark", "deepseekv3_671b"]) == 2
    assert "num_hidden_layers 2 (preset 61)" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing"), str(tmp_path / "out"), "--benchmark", "deepseekv3_671b",
                 "--preset", "tiny"]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_layers_past_the_decoder_the_mtp_module_are_skipped_and_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(6)
    model = Decoder(DEEPSEEK_TINY)
    write_hugging_face(model, DEEPSEEK_TINY, tmp_path / "hf")
    mtp = tmp_path / "hf" / "mtp.safetensors"
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128)}, str(mtp))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.eh_proj.weight"] = "mtp.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    convert(tmp_path / "hf", tmp_path / "dcp", DEEPSEEK_TINY)

    shutil.copytree(tmp_path / "hf", tmp_path / "lacking")
    del index["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight"]
    (tmp_path / "lacking" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks experts \[5\] of layers.1.feed_forward.experts.w3"):
        convert(tmp_path / "lacking", tmp_path / "dcp2", DEEPSEEK_TINY)


# deepseek-ai/DeepSeek-V3's config.json as released (its fields that bear on the shape, routing and RoPE, and the
# ones around them), which the full preset must accept.
RELEASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


def test_the_releases_config_agrees_with_the_full_preset_and_the_tiny_one_does_not():
    assert deepseek_config_differences(RELEASE_CONFIG, DEEPSEEK_V3_671B) == []
    assert "hidden_size 7168 (preset 64)" in deepseek_config_differences(RELEASE_CONFIG, DEEPSEEK_TINY)


def test_an_fp8_weight_in_the_folder_is_read_dequantized_and_one_without_its_scale_is_named(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(12)
    write_hugging_face(Decoder(DEEPSEEK_TINY), DEEPSEEK_TINY, tmp_path / "hf")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # (64, 32): one partial block each way
    weight, scale = torch.randn(64, 32).to(torch.float8_e4m3fn), torch.tensor([[0.25]])
    save_file({name: weight, name + "_scale_inv": scale}, str(tmp_path / "hf" / "fp8.safetensors"))
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "fp8.safetensors", name + "_scale_inv": "fp8.safetensors"})
    index_path.write_text(json.dumps(index))
    state = read_deepseek(tmp_path / "hf", DEEPSEEK_TINY)
    assert torch.equal(state["layers.1.feed_forward.experts.w2"][3].float(), (weight.float() * 0.25).bfloat16().float())

    del index["weight_map"][name + "_scale_inv"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="down_proj.weight is FP8 without its .*weight_scale_inv"):
        read_deepseek(tmp_path / "hf", DEEPSEEK_TINY)


def test_fp8_weights_are_dequantized_by_their_128_by_128_block_scales():
    weight = (torch.randn(130, 200) * 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 2.0], [3.0, 0.25]])
    out = dequantize_fp8(weight, scale)
    assert out.dtype == torch.bfloat16
    want = weight.float().clone()
    want[:128, :128] *= 0.5
    want[:128, 128:] *= 2.0
    want[128:, :128] *= 3.0
    want[128:, 128:] *= 0.25
    assert torch.equal(out, want.to(torch.bfloat16))


# --- the DeepSeek-V3 parts ------------------------------------------------------------------------------------------

def reference_choice(biased: list[float], k: int, groups: int, top_groups: int) -> set[int]:
    """Plainly: score each group by its two best, keep the best groups, take the k best of their experts."""
    size = len(biased) // groups
    group_score = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
    kept = sorted(range(groups), key=lambda g: -group_score[g])[:top_groups]
    allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return set(sorted(allowed, key=lambda e: -biased[e])[:k])


def test_the_grouped_sigmoid_router_picks_what_a_plain_reference_picks_and_weighs_by_unbiased_scores():
    torch.manual_seed(7)
    moe = MoeConfig(experts=16, top_k=3, hidden=4, score="sigmoid", groups=4, top_groups=2, routed_scale=2.5)
    router = SigmoidRouter(8, moe)
    with torch.no_grad():
        router.expert_bias.copy_(0.3 * torch.randn(16))
    x = torch.randn(50, 8)
    weights, experts, scores = router(x)
    sigmoid = torch.sigmoid(x @ router.gate.weight.T)
    assert torch.allclose(scores, sigmoid, atol=1e-6)
    for token in range(50):
        biased = (sigmoid[token] + router.expert_bias).tolist()
        assert set(experts[token].tolist()) == reference_choice(biased, 3, 4, 2)
        chosen = sigmoid[token, experts[token]]
        assert torch.allclose(weights[token], chosen / chosen.sum() * 2.5, atol=1e-6)
    assert torch.equal(grouped_top_k(torch.tensor([[0.9, 0.1, 0.8, 0.7]]), 2, 2, 1).sort().values,
                       torch.tensor([[2, 3]]))  # group 1 (0.8 + 0.7) beats group 0 (0.9 + 0.1)


def test_the_bias_update_moves_under_loaded_experts_up_and_over_loaded_ones_down_then_restarts_the_count():
    torch.manual_seed(8)
    moe = MoE(8, MoeConfig(experts=4, top_k=1, hidden=4, score="sigmoid", bias_update_rate=0.01))
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[2, 0] = 10.0  # every token with x[0] > 0 goes to expert 2
    x = torch.randn(2, 16, 8)
    x[..., 0] = x[..., 0].abs() + 0.1
    moe.eval()(x)
    assert moe.router.tokens_per_expert.sum() == 0  # only training counts
    moe.train()(x)
    moe(x)  # two micro batches of one step
    assert moe.router.tokens_per_expert.tolist() == [0, 0, 64, 0]
    update_expert_bias(moe)
    assert moe.router.expert_bias.tolist() == pytest.approx([0.01, 0.01, -0.01, 0.01])
    assert moe.router.tokens_per_expert.sum() == 0
    moe.router.tokens_per_expert.copy_(torch.tensor([4.0, 4.0, 4.0, 4.0]))
    update_expert_bias(moe)  # balanced: no move
    assert moe.router.expert_bias.tolist() == pytest.approx([0.01, 0.01, -0.01, 0.01])


def aux_loss_by_hand(x: torch.Tensor, gate: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    """Megatron's sequence loss written out per sequence: p the sigmoid scores normalized per token, f_i = E / (k T)
    x the tokens whose top k of p holds expert i, P_i the mean of p_i; coeff x sum_i f_i P_i, averaged."""
    losses = []
    for seq in x:
        p = torch.sigmoid(seq @ gate.T)
        p = p / p.sum(-1, keepdim=True)
        tokens, experts = p.shape
        counts = torch.zeros(experts)
        for token in range(tokens):
            for e in p[token].topk(k).indices.tolist():
                counts[e] += 1
        losses.append(sum(counts[i] * experts / (k * tokens) * p[:, i].mean() for i in range(experts)))
    return coeff * torch.stack(losses).mean()


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_the_sequence_balance_loss_adds_the_gradient_of_the_loss_written_out_by_hand(micro_batches):
    torch.manual_seed(9)
    cfg = MoeConfig(experts=8, top_k=2, hidden=8, score="sigmoid", groups=2, top_groups=1, shared_experts=1,
                    aux_loss_coeff=0.3)
    with_aux = MoE(16, cfg).train()
    with torch.no_grad():
        for p in with_aux.parameters():
            p.normal_(0, 0.3)
    by_hand = MoE(16, replace(cfg, aux_loss_coeff=0.0)).train()
    by_hand.load_state_dict(with_aux.state_dict())
    with_aux.aux_loss_scale = 1 / micro_batches  # as accumulate_gradients divides each micro batch's loss
    x, target = torch.randn(3, 10, 16), torch.randn(3, 10, 16)

    (F.mse_loss(with_aux(x), target) / micro_batches).backward()
    loss = F.mse_loss(by_hand(x), target) + aux_loss_by_hand(x, by_hand.router.gate.weight, 2, 0.3)
    (loss / micro_batches).backward()
    with torch.no_grad():
        assert with_aux.aux_loss == pytest.approx(float(aux_loss_by_hand(x, with_aux.router.gate.weight, 2, 0.3)),
                                                  rel=1e-5)
    for (name, ours), theirs in zip(with_aux.named_parameters(), by_hand.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), name
    assert with_aux.router.gate.weight.grad.abs().sum() > 0


def test_dense_first_layers_and_shared_experts_go_through_parallelize_and_a_train_step_moves_the_bias(tmp_path):
    """One process on gloo: the tiny DeepSeek-V3 (a dense layer, then one with experts and a shared expert) is
    parallelized with its expert mesh, and PretrainWorkload's step (the workload around it built bare: its model,
    mesh and layout) scales the balance loss by the micro batches and moves every expert's bias after the step."""
    import torch.distributed as dist

    from workloads.common.language_model import next_token_split
    from workloads.decoder.config import Layout
    from workloads.decoder.parallelize import build_expert_mesh, build_mesh, parallelize
    from workloads.decoder.pretrain import PretrainWorkload

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        layout = Layout(world=1, procs_per_node=1, replicate=1, shard=1, context=1, tensor=1, micro_batch=1,
                        grad_accum=2)
        device = torch.device("cpu")
        with torch.device("meta"):
            model = Decoder(DEEPSEEK_TINY)
        mesh = build_mesh(layout, device)
        parallelize(model, mesh, device, expert_mesh=build_expert_mesh(layout, device))
        model.to_empty(device=device)
        torch.manual_seed(10)
        model.init_weights()
        moe = model.layers[1].feed_forward
        assert not isinstance(model.layers[0].feed_forward, MoE) and isinstance(moe, MoE)
        assert moe.router.expert_bias.abs().sum() == 0

        work = object.__new__(PretrainWorkload)
        work.layout, work.mesh, work.model, work.split, work.clip_norm = layout, mesh, model, next_token_split, 1.0
        work.cfg, work.pipeline = type("Cfg", (), {"model": DEEPSEEK_TINY})(), None
        work.ctx = type("Ctx", (), {"device": device})()
        work.balance_group = work._expert_balance(model)
        assert moe.aux_loss_scale == 0.5
        work.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        work.scheduler = torch.optim.lr_scheduler.LambdaLR(work.optimizer, lambda step: 1.0)
        batches = iter(torch.randint(0, 128, (2, 1, 33), generator=torch.Generator().manual_seed(11)))
        work.train_step(batches)
        assert moe.aux_loss is not None and moe.aux_loss > 0
        moved = {round(b / 1e-3) for b in moe.router.expert_bias.tolist()}  # -1, 0 (a load at the mean) or 1 x rate
        assert moved <= {-1, 0, 1} and {-1, 1} <= moved
        assert moe.router.tokens_per_expert.sum() == 0
    finally:
        dist.destroy_process_group()


def test_the_mtp_depth_goes_to_the_layer_after_the_decoders_and_back(tmp_path):
    """The tiny preset's shape with its multi-token-prediction depth: written as the release lays it out (layer
    n_layer's enorm, hnorm, eh_proj, shared_head.norm and a decoder layer; mlcommons/training's
    deepseek_mtp_module_conversion.patch), and converted back to every tensor unchanged. The depth's copies of the
    shared embedding and head, which the release carries, are skipped."""
    from safetensors.torch import save_file

    shape = config.DEEPSEEK_TINY
    torch.manual_seed(0)
    model = Decoder(shape)
    write_hugging_face(model, shape, tmp_path / "hf", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    depth = f"model.layers.{shape.n_layer}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight"):
        assert depth + name in index, name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    save_file({depth + "embed_tokens.weight": torch.zeros(shape.vocab_size, shape.d_model),
               depth + "shared_head.head.weight": torch.zeros(shape.vocab_size, shape.d_model)},
              str(tmp_path / "hf" / "copies.safetensors"))
    index.update({depth + "embed_tokens.weight": "copies.safetensors",
                  depth + "shared_head.head.weight": "copies.safetensors"})
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    assert main([str(tmp_path / "hf"), str(tmp_path / "dcp"), "--benchmark", "deepseekv3_671b", "--preset", "tiny"]) == 0
    state = read_deepseek(tmp_path / "hf", shape)
    want = model.state_dict()
    assert sorted(state) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    assert "mtp.0.eh_proj.weight" not in read_deepseek(tmp_path / "hf", replace(shape, mtp_layers=0))


def test_a_folder_without_the_presets_mtp_depth_is_refused_naming_it(tmp_path):
    """transformers saves no depth (its model has none): converting its folder to the tiny preset's shape, which has
    one, names the depth's tensors it lacks."""
    torch.manual_seed(0)
    write_hugging_face(Decoder(DEEPSEEK_TINY), DEEPSEEK_TINY, tmp_path / "hf")
    with pytest.raises(ValueError, match="lacks .* tensors, e.g. mtp.0."):
        convert(tmp_path / "hf", tmp_path / "dcp", config.DEEPSEEK_TINY)
