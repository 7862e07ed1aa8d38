"""gpt_oss_20b: its parts of the decoder family (the router, the experts, the sliding window, the EOD loss mask),
its schedule and eval set, its closed preset and dry runs, and the tiny preset end to end. Expert parallelism
against one process holding every expert is in tests/test_llama_parallel.py (the `moe:` layouts)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.closed_proxy import GPT_OSS_MODEL
from tests.conftest import closed_proxy_run, compliance, failed_checks, harness, training_job
from tests.test_llama import closed_c4
from tests.test_resilience import _restored_step
from workloads.common.language_model import IGNORED, eod_masked_split
from workloads.decoder.config import GPT_OSS_20B, GPT_OSS_PRESETS, GPT_OSS_RCP_BATCHES, MoeConfig, plan_layout, \
    preset_config
from workloads.decoder.data import reference_validation_samples
from workloads.decoder.model import Decoder, visible, windowed_attention
from workloads.decoder.moe import MoE, Router
from workloads.decoder.pretrain import megatron_lr_factor

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mlperf-results" / "training_v6.0"


def test_the_router_takes_the_top_k_logits_then_a_softmax_over_them():
    """Megatron's softmax router with moe_router_pre_softmax false, token by token: the k largest fp32 logits, in
    order, and a softmax over those k alone (so each token's weights sum to 1)."""
    torch.manual_seed(0)
    router = Router(16, MoeConfig(experts=8, top_k=3, hidden=4))
    x = torch.randn(20, 16, dtype=torch.bfloat16)
    weights, experts = router(x)
    for token in range(len(x)):
        logits = [float(sum(float(x[token, i]) * float(router.gate.weight[e, i]) for i in range(16))) for e in range(8)]
        top = sorted(range(8), key=lambda e: -logits[e])[:3]
        exps = [math.exp(logits[e] - logits[top[0]]) for e in top]
        assert experts[token].tolist() == top
        assert weights[token].tolist() == pytest.approx([v / sum(exps) for v in exps], rel=1e-5)
    assert weights.dtype == torch.float32


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one at a time, weighted and summed."""
    out = torch.zeros_like(x)
    weights, experts = moe.router(x)
    e = moe.experts
    for token in range(len(x)):
        for weight, expert in zip(weights[token], experts[token]):
            h = F.silu(e.w1[expert] @ x[token]) * (e.w3[expert] @ x[token])
            out[token] += weight * (e.w2[expert] @ h)
    return out


def test_the_moe_layer_sends_each_token_through_its_k_experts_and_the_grouped_gemm_agrees_with_the_loop():
    """The layer (sorted dispatch, per-expert loop) against a token-by-token computation; then the grouped GEMM the
    GPUs run (torch._grouped_mm, here on CPU) against the loop, output and every gradient, with an expert that
    receives no token."""
    torch.manual_seed(1)
    moe = MoE(16, MoeConfig(experts=6, top_k=2, hidden=8))
    for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2, moe.router.gate.weight):
        torch.nn.init.normal_(w, std=0.3)
    with torch.no_grad():
        moe.router.gate.weight[5] = -100.0 * moe.router.gate.weight[5].sign()  # pushed away from most tokens
    x = torch.randn(24, 16)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-6)

    counts = [5, 0, 7, 3, 9, 0]
    tokens = torch.randn(sum(counts), 16, requires_grad=True)
    grads = []
    for grouped in (False, True):
        moe.zero_grad()
        tokens.grad = None
        out = moe.experts(tokens, counts, grouped=grouped)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), tokens.grad.clone(), *(w.grad.clone() for w in
                                                             (moe.experts.w1, moe.experts.w3, moe.experts.w2))))
    for loop, grouped in zip(*grads):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    assert grads[0][2][1].abs().sum() == 0 and grads[0][2][5].abs().sum() == 0  # the idle experts: zero gradient


@pytest.mark.parametrize("seq,window", [(64, 8), (61, 8), (16, 32), (33, 5), (256, 128)])
def test_sliding_window_attention_equals_a_masked_full_attention(seq, window):
    """Block-wise sliding-window attention against full attention under Megatron's mask for window_size (w, 0):
    each query sees itself and the w keys before it. Outputs and every gradient."""
    torch.manual_seed(seq)
    q, k, v = (torch.randn(2, h, seq, 16, requires_grad=True) for h in (4, 2, 2))
    positions = torch.arange(seq)
    mask = positions[:, None] - positions[None, :]
    mask = (mask >= 0) & (mask <= window)
    assert torch.equal(visible(positions, positions, window), mask)
    ours = windowed_attention(q, k, v, window)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad((ours * grad).sum(), (q, k, v)),
                    torch.autograd.grad((reference * grad).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_window_alternates_from_the_first_layer_as_megatrons_skip_frequency_says():
    """window_attn_skip_freq [1, 0, 1, 0, ...] (gpt_oss_20B-pretrain.yaml): 0-based layer 0 windowed, 1 full, ..."""
    model = Decoder(GPT_OSS_PRESETS["tiny"].model)
    assert [layer.attention.core.window for layer in model.layers] == [32, None]
    assert [GPT_OSS_20B.windowed(layer) for layer in range(4)] == [True, False, True, False]
    assert sum(GPT_OSS_20B.windowed(layer) for layer in range(24)) == 12


def test_the_eod_loss_mask_leaves_out_the_target_after_each_end_of_document():
    """Megatron's rule (gpt_dataset.py: loss_mask[tokens == eod] = 0, on the input tokens), position by position."""
    tokens = torch.tensor([[5, 9, 0, 7, 3, 0, 0, 4, 8]])
    (inputs,), targets = eod_masked_split(0)(tokens)
    for i in range(tokens.size(1) - 1):
        scored = int(tokens[0, i]) != 0
        assert inputs[0, i] == tokens[0, i]
        assert targets[0, i] == (tokens[0, i + 1] if scored else IGNORED)


def test_the_model_counts_its_parameters_and_active_parameters():
    model = Decoder(GPT_OSS_PRESETS["tiny"].model)
    assert sum(p.numel() for p in model.parameters()) == GPT_OSS_PRESETS["tiny"].model.params
    # gpt-oss 20B with the Llama 3.1 vocabulary: 20.5B parameters, 3.8B of them active per token.
    assert GPT_OSS_20B.params == pytest.approx(20.49e9, rel=1e-3)
    assert GPT_OSS_20B.active_params == pytest.approx(3.77e9, rel=1e-3)
    assert GPT_OSS_20B.head_dim == 64 and GPT_OSS_20B.q_dim == 4096


def test_the_schedule_is_megatrons_warmup_from_zero_then_cosine_to_min_lr():
    """OptimizerParamScheduler with init_lr 0: step 0 at LR 0, the peak at the warmup's end, min_lr 4e-5 past
    lr_decay_iters (1,200,000 - warmup)."""
    cfg = GPT_OSS_PRESETS["full"]
    end = cfg.floor_lr / cfg.base_lr
    assert cfg.warmup_steps == 192 and cfg.decay_steps == 1_200_000 - 192 and cfg.floor_lr == 4e-5
    assert megatron_lr_factor(0, 192, cfg.decay_steps, end) == 0
    assert megatron_lr_factor(1, 192, cfg.decay_steps, end) == pytest.approx(1 / 192)
    assert megatron_lr_factor(192, 192, cfg.decay_steps, end) == 1
    middle = 192 + (cfg.decay_steps - 192) // 2
    assert megatron_lr_factor(middle, 192, cfg.decay_steps, end) == pytest.approx((1 + end) / 2, rel=1e-6)
    assert megatron_lr_factor(cfg.decay_steps + 1, 192, cfg.decay_steps, end) == end


def test_the_closed_preset_takes_the_rcp_rows_and_interpolates_between_them():
    for batch, (lr, warmup) in GPT_OSS_RCP_BATCHES.items():
        cfg = preset_config("full", batch, benchmark="gpt_oss_20b")
        assert (cfg.base_lr, cfg.warmup_samples, cfg.eval_sequences, cfg.target) == (lr, warmup, 1024, 3.34)
    nvidia = preset_config("full", 36, benchmark="gpt_oss_20b")  # NVIDIA's v6.0 batch, between rows 32 and 64
    assert nvidia.hyperparameters.rows == (32, 64)
    assert nvidia.eval_every == 341  # 12,288 // 36, as NVIDIA's v6.0 log evaluates
    assert nvidia.base_lr == pytest.approx(8e-4 + (36 - 32) / 32 * 2e-4)
    with pytest.raises(ValueError, match="no reference convergence point"):
        preset_config("full", 128, benchmark="gpt_oss_20b")


def test_a_given_learning_rate_reaches_the_workers_and_one_below_the_floor_is_refused(tmp_path):
    """NVIDIA's v6.0 run: batch 36 at LR 4e-4, accepted by the harness and by every rank's own command line; a
    peak under min_lr (4e-5) would make the cosine climb: refused in one line."""
    from workloads.common.campaign import RunOptions

    opts = RunOptions.parse(["gpt_oss_20b", "--preset", "full", "--synthetic", "--out", str(tmp_path), "--global-batch", "36",
                             "--learning-rate", "4e-4", "--warmup-samples", "9216"])
    assert (opts.learning_rate, opts.warmup_samples) == (4e-4, 9216)
    cfg = preset_config("full", 36, learning_rate=4e-4, warmup_samples=9216, benchmark="gpt_oss_20b")
    assert (cfg.base_lr, cfg.warmup_steps) == (4e-4, 256)
    refused = harness("run", "gpt_oss_20b", "--preset", "full", "--synthetic", "--learning-rate", "1e-5",
                      "--dry-run", "--out", str(tmp_path / "o"))
    assert refused.returncode == 2 and "below the schedule's floor 4e-05" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_the_validation_split_is_asked_for_what_megatron_lm_asks():
    """(train_iters // eval_interval + 1) x eval_iters x GBS, eval_interval 12,288 / GBS and eval_iters 1,024 / GBS
    steps (config_*_1x8x1.sh)."""
    assert reference_validation_samples(64, 1_200_000, 12_288, 1024, "megatron") == (1_200_000 // 192 + 1) * 16 * 64
    assert reference_validation_samples(16, 1_200_000, 12_288, 1024, "megatron") == (1_200_000 // 768 + 1) * 64 * 16
    # batch 36: the shell's integer division, 341 steps between evals and 28 eval iterations
    assert reference_validation_samples(36, 1_200_000, 12_288, 1024, "megatron") == (1_200_000 // 341 + 1) * 28 * 36


def test_the_planner_splits_experts_inside_a_node_and_context_where_a_rank_has_less_than_a_sequence():
    cfg = GPT_OSS_PRESETS["full"]
    cisco = plan_layout(cfg, 128, 8)  # 16 x 8 H100, batch 64: two ranks share each sequence
    assert (cisco.context, cisco.tensor, cisco.expert, cisco.expert_shard, cisco.replicate) == (2, 1, 8, 1, 16)
    two = plan_layout(cfg, 16, 8)
    assert (two.context, two.expert, two.grad_accum, two.replicate) == (1, 8, 4, 2)
    tiny = plan_layout(GPT_OSS_PRESETS["tiny"], 2, 2)
    assert (tiny.expert, tiny.shard) == (2, 2)
    with pytest.raises(ValueError, match="tensor parallel 1"):
        plan_layout(dataclasses.replace(GPT_OSS_PRESETS["full"], tensor_parallel=2), 16, 8)


@pytest.mark.parametrize("backend,nodes", [("slurm", 16), ("k8s", 16), ("slurm", 2), ("k8s", 2)])
def test_the_full_preset_dry_run_prints_layout_memory_and_bytes(tmp_path, backend, nodes):
    result = harness("run", "gpt_oss_20b", "--preset", "full", "--backend", backend, "--profile", "coreweave-h100",
                     "--nodes", str(nodes), "--gpus-per-node", "8", "--dry-run", "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert "32 experts of SwiGLU 2880, top 4 (3.77B active)" in err and "20.49B parameters" in err
    assert "x expert 8 (each rank holds 4 experts of each layer" in err
    assert "gpt_oss_20b memory per GPU:" in err and "of 80 GiB" in err
    assert "expert all-to-all" in err and "GB over NVLink" in err and "GB over InfiniBand" in err
    assert ("x context 2" if nodes == 16 else "x context 1") in err
    if backend == "k8s":
        job = training_job(result.stdout)
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == nodes


@pytest.mark.slow
def test_tiny_gpt_oss_survives_a_killed_rank_reaches_its_target_and_passes_the_6_1_checker(tmp_path):
    """`harness run gpt_oss_20b` on the local default (2 processes, expert parallel 2), from scratch, with rank 1
    killed at step 6: one restart from step 4's checkpoint (the experts sharded in it), the same eval loss at step 8
    as a run never killed (to the last bit), and a log the 6.1.0 checker passes."""
    out = tmp_path / "run"
    result = harness("run", "gpt_oss_20b", "--seed", "5", "--inject-failure", "1:6", "--checkpoint-every", "4",
                     "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success" in result.stdout
    assert _restored_step(out) == 4
    unbroken = tmp_path / "unbroken"
    harness("run", "gpt_oss_20b", "--seed", "5", "--max-steps", "8", "--out", str(unbroken))  # stops short: exit 1
    first_eval = [_eval_values(folder / "result_0.txt")[0] for folder in (out, unbroken)]
    assert first_eval[0] == first_eval[1], first_eval
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    log = (out / "result_0.txt").read_text()
    assert '"key": "expert_parallelism", "value": 2' in log
    assert '"key": "max_sequence_length", "value": 8192' in log


def _eval_values(log: Path) -> list[float]:
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines() if ":::MLLOG " in line]
    return [e["value"] for e in events if e["key"] == "eval_accuracy"]


@pytest.mark.slow
def test_closed_proxy_draws_only_the_target_from_the_6_1_checker(tmp_path):
    """The full preset (GBS 64, sequence 8,192, 1,024 eval sequences, every closed key) with tests/closed_proxy.py's
    small model, for 1 step on 2 processes (expert parallel 2): the checker's only complaint is the target."""
    data = closed_c4(tmp_path / "c4", GPT_OSS_MODEL.vocab_size)
    out = tmp_path / "closed"
    result = closed_proxy_run("gpt_oss_20b", "--data", str(data), "--max-steps", "1", "--out", str(out), procs=2)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 64' in log and '"expert_parallelism", "value": 2' in log
    assert '"submission_benchmark", "value": "gpt_oss_20b"' in log
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert "closed_gpt_oss_20b.yaml" in checked.stdout + checked.stderr
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "3.34" in failures[0], checked.stdout


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/mlperf-results/training_v6.0 is absent")
def test_the_report_gives_each_real_v6_0_run_its_time_to_train(tmp_path):
    """Cisco's (16 x 8 H100, batch 64, 34.0 minutes) and NVIDIA's real v6.0 gpt_oss_20b runs, by the 6.0.0 rules."""
    logs = sorted(p for p in SHARED.rglob("*.txt") if "gpt_oss_20b" in str(p) and p.name.startswith("result_"))
    assert logs, f"no gpt_oss_20b result file under {SHARED}"
    result = harness("report", *map(str, {p.parent for p in logs}), "--ruleset", "6.0.0", "--format", "json")
    assert result.returncode == 0, result.stderr
    minutes = sorted(run["time_to_train_min"] for group in json.loads(result.stdout) for run in group["runs"])
    assert len(minutes) == len(logs)
    assert any(abs(m - 34.0) < 0.05 for m in minutes), minutes
