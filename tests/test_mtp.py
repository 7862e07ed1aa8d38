"""DeepSeek-V3's multi-token prediction (workloads/decoder/mtp.py) against its definitions: a depth as Megatron-Core's
MultiTokenPredictionLayer computes it, the loss of all depths re-implemented here from DeepSeek-V3's equations 21-25
(on truncated sequences, as eq. 22 writes them, rather than Megatron's rolled and masked ones), the roll against
Megatron-Core's own, the shared embedding and output layer, the weight, what evaluation scores, the parameter counts,
and a model without depths exactly as before."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from workloads.common.language_model import IGNORED, accumulate_gradients, next_token_split, scored_loss_sum
from workloads.decoder.config import DEEPSEEK_TINY, DEEPSEEK_V3_671B, DecoderConfig, MoeConfig, PretrainConfig, \
    block_activation_bytes, estimate_memory, plan_layout
from workloads.decoder.model import Decoder, rope_tables
from workloads.decoder.mtp import roll_left

DENSE = DecoderConfig(vocab_size=50, seq_len=12, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                      mtp_layers=1, mtp_loss_scale=0.1)
MOE = replace(DENSE, moe=MoeConfig(experts=4, top_k=2, hidden=8))


def _model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(cfg)


def _batch(cfg: DecoderConfig, batch: int = 2, seed: int = 1) -> torch.Tensor:
    """(batch, seq_len + 1) tokens, as the loaders give them."""
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def formula_mtp_loss(model: Decoder, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP loss, eq. 21-25, with Megatron's order of eh_proj's inputs: depth k reads positions
    i = 0..n-1-k only (eq. 22's h_{1:T-k}): h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)],
    h^k = RMSNorm(TRM_k(h')), and predicts t_{i+k+1} = targets[i+k] with the shared output head;
    L = lambda / D x sum_k mean_i CE (eq. 25)."""
    cfg, n = model.cfg, tokens.size(1)
    positions = torch.arange(n)
    rope = rope_tables(model.rope_freqs, positions)
    x = model.tok_embeddings(tokens)
    for layer in model.layers:
        x = layer(x, rope, positions)
    hidden = _rms(x, model.norm.weight, cfg.norm_eps)  # h^0: the main model's output, after its final norm
    losses = []
    for k, depth in enumerate(model.mtp, start=1):
        kept = n - k
        embedded = _rms(model.tok_embeddings(tokens[:, k:]), depth.enorm.weight, cfg.norm_eps)
        previous = _rms(hidden[:, :kept], depth.hnorm.weight, cfg.norm_eps)
        joined = torch.cat((embedded, previous), dim=-1) @ depth.eh_proj.weight.T
        out = depth.block(joined, tuple(table[:kept] for table in rope), positions[:kept])
        hidden = _rms(out, depth.norm.weight, cfg.norm_eps)
        logits = hidden @ model.output.weight.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten(), ignore_index=IGNORED))
    return cfg.mtp_loss_scale * sum(losses) / len(losses)


def _builds(cfg: DecoderConfig) -> str | None:
    """Why Decoder(cfg) cannot be built (None: it can)."""
    try:
        Decoder(cfg)
    except Exception as error:  # noqa: BLE001 (the MLA and the sigmoid router come from another branch)
        return repr(error)
    return None


@pytest.mark.parametrize("cfg", [DENSE, MOE, replace(DENSE, mtp_layers=2), replace(MOE, mtp_layers=2)],
                         ids=["dense", "moe", "dense-2-depths", "moe-2-depths"])
def test_the_mtp_loss_is_deepseeks_equations_on_truncated_sequences(cfg):
    """The rolled and masked computation (Megatron's) equals the truncated one, with some targets unscored (an
    EOD mask's IGNORED) that roll with the others."""
    model = _model(cfg)
    inputs, targets = next_token_split(_batch(cfg))
    (tokens,) = inputs
    targets = targets.clone()
    targets[0, 3] = targets[1, 7] = IGNORED
    logits, loss = model(tokens, targets=targets)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    torch.testing.assert_close(loss, formula_mtp_loss(model, tokens, targets), rtol=1e-5, atol=1e-6)


TINY_DEEPSEEK_UNBUILT = _builds(DEEPSEEK_TINY)


@pytest.mark.skipif(TINY_DEEPSEEK_UNBUILT is not None,
                    reason=f"the decoder does not build DeepSeek-V3 yet (MLA, sigmoid router): {TINY_DEEPSEEK_UNBUILT}")
def test_the_mtp_loss_on_the_tiny_deepseek():
    model = _model(DEEPSEEK_TINY)
    assert DEEPSEEK_TINY.mtp_layers == 1 and sum(p.numel() for p in model.parameters()) == DEEPSEEK_TINY.params
    (tokens,), targets = next_token_split(_batch(replace(DEEPSEEK_TINY, seq_len=32)))
    _, loss = model(tokens, targets=targets)
    torch.testing.assert_close(loss, formula_mtp_loss(model, tokens, targets), rtol=1e-5, atol=1e-6)


def test_a_depth_concatenates_the_embedding_first_as_megatron_and_the_checkpoint_do():
    """eh_proj's first d inputs see the normalized embedding, its last d the normalized hidden state
    (Megatron's torch.cat((decoder_input, hidden_states), -1); the paper's eq. 21 writes the other order)."""
    model = _model(DENSE)
    depth, d = model.mtp[0], DENSE.d_model
    with torch.no_grad():
        depth.eh_proj.weight[:, d:] = 0
    positions = torch.arange(5)
    rope = rope_tables(model.rope_freqs, positions)
    embedded = torch.randn(1, 5, d)
    first, second = (depth(torch.randn(1, 5, d), embedded, rope, positions) for _ in range(2))
    assert torch.equal(first, second)  # the hidden state's half is zero: only the embedding is read


def test_roll_left_is_megatrons_roll_tensor():
    multi_token_prediction = pytest.importorskip(
        "megatron.core.transformer.multi_token_prediction",
        reason="megatron-core (the test extra) is not installed: no reference to compare with")
    tokens = torch.randint(1, 50, (3, 7))
    rolled, _ = multi_token_prediction.roll_tensor(tokens.clone(), shifts=-1, dims=-1)
    assert torch.equal(roll_left(tokens, 0), rolled)
    assert torch.equal(roll_left(tokens, IGNORED)[:, -1], torch.full((3,), IGNORED))


def test_gradients_reach_the_shared_embedding_and_output_layer_and_the_trunk():
    """The depths hold no copy of the embedding or the output layer: the MTP loss alone trains the model's own, the
    depths, and the main decoder beneath them (its hidden state is not detached)."""
    model = _model(DENSE)
    assert not [name for name, p in model.mtp.named_parameters() if DENSE.vocab_size in p.shape]
    (tokens,), targets = next_token_split(_batch(DENSE))
    model(tokens, targets=targets)[1].backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_the_loss_is_weighted_by_the_scale_over_the_depths_and_joins_each_micro_batchs_backward():
    weighted, unit = _model(DENSE), _model(replace(DENSE, mtp_loss_scale=1.0))
    (tokens,), targets = next_token_split(_batch(DENSE))
    torch.testing.assert_close(weighted(tokens, targets=targets)[1], 0.1 * unit(tokens, targets=targets)[1])

    model, by_hand = _model(DENSE), _model(DENSE)
    micro_batches = [_batch(DENSE, seed=seed) for seed in (1, 2)]
    loss = accumulate_gradients(model, iter(micro_batches), 2)
    main = torch.zeros(())
    for batch in micro_batches:
        (tokens,), targets = next_token_split(batch)
        logits = by_hand(tokens)
        cross_entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        ((cross_entropy + formula_mtp_loss(by_hand, tokens, targets)) / 2).backward()
        main += cross_entropy.detach() / 2
    torch.testing.assert_close(loss, main)  # the returned loss is the next-token one
    for (name, param), want in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(param.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_recomputes_the_depths_to_the_same_gradients():
    plain, recomputed = _model(MOE), _model(MOE)
    recomputed.activation_checkpointing = True
    micro_batches = [_batch(MOE, seed=seed) for seed in (1, 2)]
    torch.testing.assert_close(accumulate_gradients(recomputed, iter(micro_batches), 2),
                               accumulate_gradients(plain, iter(micro_batches), 2))
    for (name, param), want in zip(recomputed.named_parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, want.grad, msg=name)


def test_evaluation_scores_the_next_token_loss_only():
    model = _model(DENSE).eval()
    tokens = _batch(DENSE)
    (inputs,), targets = next_token_split(tokens)
    logits = model(inputs)
    assert isinstance(logits, torch.Tensor)  # no targets: no MTP
    loss_sum, count = scored_loss_sum(model, tokens, torch.ones(2))
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert count == targets.numel() and loss_sum.item() == pytest.approx(want.item(), rel=1e-6)


def test_without_depths_the_decoder_is_exactly_as_before():
    """mtp_layers 0 (every preset but DeepSeek's): no parameter, the same draws, and logits, loss and gradients
    bit-identical to the decoder before MTP (its forward and accumulate_gradients' loop, written out here)."""
    cfg = replace(DENSE, mtp_layers=0)
    model = _model(cfg)
    assert len(model.mtp) == 0 and not [name for name in model.state_dict() if name.startswith("mtp")]
    assert sum(p.numel() for p in model.parameters()) == cfg.params == replace(cfg, mtp_loss_scale=0.0).params
    (tokens,), targets = next_token_split(_batch(cfg))
    positions = torch.arange(cfg.seq_len)
    rope = rope_tables(model.rope_freqs, positions)
    x = model.tok_embeddings(tokens)
    for layer in model.layers:
        x = layer(x, rope, positions)
    assert torch.equal(model(tokens), model.output(model.norm(x)))

    before = copy.deepcopy(model)
    micro_batches = [_batch(cfg, seed=seed) for seed in (1, 2)]
    loss = accumulate_gradients(model, iter(micro_batches), 2)
    total = torch.zeros(())
    for batch in micro_batches:
        (tokens,), targets = next_token_split(batch)
        logits = before(tokens)
        step = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / 2
        step.backward()
        total += step.detach()
    assert torch.equal(loss, total)
    for param, want in zip(model.parameters(), before.parameters()):
        assert torch.equal(param.grad, want.grad)


@pytest.mark.parametrize("cfg", [DENSE, MOE, replace(MOE, mtp_layers=2)], ids=["dense", "moe", "moe-2-depths"])
def test_the_depths_parameters_are_counted(cfg):
    model = _model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.params
    assert sum(p.numel() for p in model.mtp.parameters()) == cfg.mtp_params()


def test_deepseek_v3_trains_one_depth_at_weight_0_1_and_its_parameters_are_the_checkpoints():
    """Megatron-Bridge's deepseek_v3.py: mtp_num_layers 1, mtp_loss_scaling_factor 0.1. DeepSeek-V3's README: "685B,
    which includes 671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module weights"; the
    checkpoint's layer 61 also stores its own copies of the embedding and the output head, which the model shares."""
    assert (DEEPSEEK_V3_671B.mtp_layers, DEEPSEEK_V3_671B.mtp_loss_scale) == (1, 0.1)
    main = replace(DEEPSEEK_V3_671B, mtp_layers=0).params
    copies = 2 * DEEPSEEK_V3_671B.vocab_size * DEEPSEEK_V3_671B.d_model
    assert main == pytest.approx(671e9, rel=1e-3)
    assert DEEPSEEK_V3_671B.mtp_params() + copies == pytest.approx(14e9, rel=0.05)
    assert DEEPSEEK_V3_671B.params + copies == pytest.approx(685e9, rel=1e-3)
    assert DEEPSEEK_V3_671B.params - main == DEEPSEEK_V3_671B.mtp_params()
    # Only the top 8 of the depth's 256 experts (and its shared one) see a token.
    assert DEEPSEEK_V3_671B.active_params - replace(DEEPSEEK_V3_671B, mtp_layers=0).active_params == (
        DEEPSEEK_V3_671B.mtp_params() - 248 * 3 * 7168 * 2048)


def test_the_memory_estimate_keeps_each_depths_block_activations_and_logits():
    without = PretrainConfig(model=replace(DENSE, mtp_layers=0), global_batch=8, base_lr=1e-3, warmup_samples=0,
                             end_lr_ratio=0.1, max_steps=10, eval_interval=8, eval_sequences=8, target=1.0)
    layout = plan_layout(without, world=8, procs_per_node=8)
    before, after = estimate_memory(without, layout), estimate_memory(replace(without, model=DENSE), layout)
    assert after.logits == 2 * before.logits  # the main logits and the depth's, both kept for backward
    # the depth's block: a third block's activations (on a GPU, 2-byte compute)
    depth_block = DENSE.seq_len * layout.micro_batch * block_activation_bytes(DENSE, DENSE.n_layer, 2, 1)
    assert after.activations - before.activations == depth_block
