"""deepseekv3_671b: the closed rules' hyperparameters and refusals, the eval cadence the 6.1.0 checker asks, the
model's size, and the benchmark end to end (the tiny preset in 2 pipeline stages from its converted checkpoint, the
closed proxy, the full preset's dry runs)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest

from tests.conftest import harness
from workloads.decoder.config import DEEPSEEK_PRESETS, DEEPSEEK_RCP_BATCHES, DEEPSEEK_V3_671B, preset_config
from workloads.decoder.data import reference_validation_samples
from workloads.decoder.pretrain import megatron_lr_factor
from workloads.decoder.workload import DecoderWorkload


def test_the_model_has_671b_parameters_and_37b_active():
    """DeepSeek-V3's 671B main model, 37B activated per token, and its multi-token-prediction depth (the release's
    README: "671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module weights", 14B counting
    the depth's copies of the 0.93B embedding and 0.93B output layer, which the harness's depth shares)."""
    main = DEEPSEEK_V3_671B.params - DEEPSEEK_V3_671B.mtp_params()
    assert round(main / 1e9) == 671
    shared_copies = 2 * DEEPSEEK_V3_671B.vocab_size * DEEPSEEK_V3_671B.d_model
    assert 13 < (DEEPSEEK_V3_671B.mtp_params() + shared_copies) / 1e9 < 15  # 13.5B: the README rounds up
    assert 37 < DEEPSEEK_V3_671B.active_params / 1e9 < 40


@pytest.mark.parametrize("batch", sorted(DEEPSEEK_RCP_BATCHES) + [17_000])
def test_the_closed_lr_is_the_rules_formula_at_every_batch(batch):
    """closed_deepseekv3_671b.yaml: opt_base_learning_rate == 2.4e-5 x sqrt(GBS / 16384) within 1e-9; the RCP rows
    carry the same values (rcps_deepseekv3_671b.json: 2.3238e-05, 2.4e-05, 2.5456e-05)."""
    cfg = preset_config("full", batch, benchmark="deepseekv3_671b")
    assert abs(cfg.base_lr - 2.4e-05 * (batch / 16384) ** 0.5) < 1e-9
    assert cfg.warmup_steps == 4 and cfg.decay_steps == 12_000 - 4 and cfg.schedule_decay_iters == 12_000
    assert cfg.first_eval_step == math.floor(42 + 24576 / batch) and cfg.eval_every == 1
    if batch in DEEPSEEK_RCP_BATCHES:
        assert cfg.base_lr == DEEPSEEK_RCP_BATCHES[batch][0]
    assert {15_360: 2.3238e-05, 16_384: 2.4e-05, 18_432: 2.5456e-05} == {b: lr for b, (lr, _) in DEEPSEEK_RCP_BATCHES.items()}


@pytest.mark.parametrize("args,words", [
    (("--global-batch", "8192"), "at least 15,360"),
    (("--global-batch", "8192", "--force-batch"), "at least 15,360"),
    (("--learning-rate", "1e-4"), "fix the peak LR at 2.4e-5 x sqrt(GBS / 16384) = 2.4e-05"),
    (("--warmup-samples", "100"), "warms up 4 steps, which its closed rules fix"),
    (("--global-batch", "20000"), "no reference convergence point (RCP) above global batch 18,432"),
])
def test_what_the_closed_rules_forbid_is_refused_in_one_line(tmp_path, args, words):
    result = harness("run", "deepseekv3_671b", "--preset", "full", "--synthetic", *args, "--dry-run",
                     "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_the_schedule_warms_up_from_zero_then_decays_to_1e_8_at_step_12000():
    """Megatron-Bridge's OptimizerParamScheduler: peak x step / 4 for 4 steps, then the cosine over lr_decay_iters
    12,000 (11,996 steps after the warmup), to min_lr 1e-8 (config_GB300_*.sh)."""
    cfg = DEEPSEEK_PRESETS["full"]
    end = cfg.floor_lr / cfg.base_lr
    factor = lambda step: megatron_lr_factor(step, cfg.warmup_steps, cfg.schedule_decay_iters, end)  # noqa: E731
    assert [factor(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert factor(12_000) == pytest.approx(end) and cfg.floor_lr == 1e-8
    assert factor(6_002) == pytest.approx(end + (1 - end) * 0.5)


def test_the_first_evaluation_follows_step_43_then_one_after_every_step():
    """The 6.1.0 checker's FIRST_CHECK: the first eval_accuracy at samples_count GBS x floor(42 + 24,576 / GBS)."""
    cfg = preset_config("full", 15_360, benchmark="deepseekv3_671b")
    run = SimpleNamespace(first_eval=cfg.first_eval_step, eval_every=cfg.eval_every, total_steps=50,
                          layout=SimpleNamespace(global_batch=15_360))
    evals = [step for step in range(1, 51) if DecoderWorkload.block_ends(run, step)]
    assert evals == list(range(43, 51))
    first = DecoderWorkload.next_block(run, 0)
    assert (first.first, first.count) == (0, 43 * 15_360)
    later = DecoderWorkload.next_block(run, 45)
    assert (later.first, later.count) == (45 * 15_360, 15_360)


def test_the_validation_split_is_asked_for_one_1024_batch_per_step():
    """(train_iters // eval_interval + 1) x eval_iters x the eval batch: 12,001 x 1 x 1,024."""
    cfg = DEEPSEEK_PRESETS["full"]
    assert reference_validation_samples(cfg.global_batch, cfg.max_steps, cfg.eval_interval, cfg.eval_sequences,
                                        cfg.framework, cfg.validation_batch) == 12_001 * 1024


@pytest.mark.slow
def test_closed_proxy_logs_every_closed_key_the_6_1_checker_checks(tmp_path):
    """The full preset (GBS 16,384, sequence 4,096, every closed key) with tests/closed_proxy.py's tiny DeepSeek in 2
    pipeline stages, from a checkpoint converted from Hugging Face's layout, up to run_start (one step is 67M
    tokens): every CHECK of closed_deepseekv3_671b.yaml passes; the checker misses only what a run logs after
    run_start (blocks, evaluations, train_samples at run_stop). The first eval's step (FIRST_CHECK) is the
    schedule's test above."""
    import torch

    from tests.closed_proxy import DEEPSEEK_MODEL, UNTIL_RUN_START
    from tests.conftest import closed_proxy_run, compliance
    from tests.test_llama import closed_c4
    from workloads.decoder.convert import convert, write_hugging_face
    from workloads.decoder.model import Decoder

    torch.manual_seed(0)
    write_hugging_face(Decoder(DEEPSEEK_MODEL), DEEPSEEK_MODEL, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "start", DEEPSEEK_MODEL)
    data = closed_c4(tmp_path / "c4", DEEPSEEK_MODEL.vocab_size)
    out = tmp_path / "closed"
    result = closed_proxy_run("deepseekv3_671b", "--data", str(data), "--init-checkpoint", str(tmp_path / "start"),
                              "--out", str(out), UNTIL_RUN_START, procs=2)
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 16384' in log and '"pipeline_parallelism", "value": 2' in log, \
        result.stdout + result.stderr
    assert '"moe_aux_loss_coeff", "value": 0.01' in log and '"opt_base_learning_rate", "value": 2.4e-05' in log
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    said = checked.stdout + checked.stderr
    assert "closed_deepseekv3_671b.yaml" in said and "CHECK for" not in said, said
    missing = set(re.findall(r"'(\w+)'", "\n".join(line for line in said.splitlines() if "Required" in line)))
    assert missing == {"train_samples", "eval_accuracy", "block_start", "block_stop", "eval_start", "eval_stop",
                       "epoch_start", "epoch_stop"}, said


@pytest.mark.slow
def test_tiny_deepseek_in_two_stages_survives_a_killed_rank_and_fails_only_the_checks_its_scale_cannot_meet(tmp_path):
    """`harness run deepseekv3_671b` on the local default: 2 processes, pipeline 2 (MLA, the grouped sigmoid router
    with its bias update and balance loss, a shared expert, MTP on the last stage), from the checkpoint the preset
    writes in Hugging Face's layout and converts. Rank 1 killed at step 30: one restart from step 20's checkpoint, and
    the first eval (step 40) equals a run never killed, to the last bit. The 6.1.0 checker fails its log on the three
    values the rules fix in every division (15,360 sequences of 4,096 tokens a step, 1,024 eval sequences) and on
    nothing else; the harness says so and counts the run as reaching its target."""
    from tests.conftest import compliance
    from tests.test_gpt_oss import _eval_values
    from tests.test_resilience import _restored_step

    out, unbroken = tmp_path / "run", tmp_path / "unbroken"
    result = harness("run", "deepseekv3_671b", "--seed", "5", "--inject-failure", "1:30", "--checkpoint-every", "20",
                     "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reached its target; its log fails only the checks of global_batch_size, max_sequence_length, " \
           "eval_samples" in result.stderr
    assert _restored_step(out) == 20
    assert (out / "start_checkpoint").is_dir()  # converted from the Hugging Face layout at this run's init
    assert harness("run", "deepseekv3_671b", "--seed", "5", "--out", str(unbroken)).returncode == 0
    assert _eval_values(out / "result_0.txt")[0] == _eval_values(unbroken / "result_0.txt")[0]
    log = (out / "result_0.txt").read_text()
    for key, value in (("pipeline_parallelism", 2), ("moe_aux_loss_coeff", 0.01), ("opt_learning_rate_warmup_steps", 4)):
        assert f'"key": "{key}", "value": {value}' in log, key
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    said = checked.stdout + checked.stderr
    assert "open_deepseekv3_671b.yaml" in said
    assert sorted(re.findall(r"CHECK for '(\w+)' failed", said)) == ["eval_samples", "global_batch_size",
                                                                     "max_sequence_length"], said
    assert [line for line in said.splitlines() if "ERROR" in line] == ["ERROR - FAILED"], said


@pytest.mark.parametrize("backend,nodes", [("slurm", 64), ("k8s", 64), ("slurm", 128), ("k8s", 128), ("slurm", 256),
                                           ("k8s", 256)])
def test_the_full_preset_dry_run_prints_the_layout_memory_and_bytes_on_h100s(tmp_path, backend, nodes):
    """The H100 layout (docs/benchmarks/deepseekv3_671b.md): 16 stages, the experts over a node, FSDP over 4 nodes of
    a stage; memory term by term on the stage that needs most, bytes per GPU per step by link, the bubble."""
    from tests.conftest import training_job

    result = harness("run", "deepseekv3_671b", "--preset", "full", "--synthetic", "--backend", backend, "--profile",
                     "coreweave-h100", "--nodes", str(nodes), "--gpus-per-node", "8", "--dry-run",
                     "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    said = result.stderr
    assert f"{nodes * 8} processes = pipeline 16 (virtual 1: 4/4/4/4/4/4/4/4/4/4/4/4/4/4/4/1 layers per stage)" in said
    assert "x expert 8 (each rank holds 32 experts of each layer" in said
    assert "memory per GPU (stage 1): 69.5 GiB of 80 GiB (weights" in said and "pipeline buffers" in said
    assert "GB over NVLink" in said and "GB over InfiniBand" in said and "pipeline sends" in said
    assert f"pipeline bubble: {dict([(64, '2.8'), (128, '5.5'), (256, '10.5')])[nodes]}% of a step" in said
    if backend == "k8s":
        replicas = training_job(result.stdout)["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == nodes


def test_a_node_count_whose_memory_does_not_fit_is_refused_with_the_arithmetic(tmp_path):
    result = harness("run", "deepseekv3_671b", "--preset", "full", "--synthetic", "--backend", "slurm", "--profile",
                     "coreweave-h100", "--nodes", "32", "--gpus-per-node", "8", "--dry-run", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "needs about 90.9 GiB (weights 10.7, gradients 10.7, optimizer 21.4, gathered 36.7" in result.stderr
    assert "32 nodes x 8 GPUs = pipeline 16" in result.stderr and "(64 nodes with FSDP over 32: 69.5 GiB)" in result.stderr
