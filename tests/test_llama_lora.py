"""llama2_70b_lora: the 70B shape and its adapters, the closed preset against the reference and the RCPs, the eval
cadence against NVIDIA's v5.1 logs, the GovReport parquet reader, the Hugging Face converter in both layouts, the
dry run at 8 x 8 GPUs, and end to end: the tiny preset through the 6.1.0 checker with a restart from an
adapters-only checkpoint, and the closed proxy with only the target left unmet."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlperf_logging.mllog import constants as C

from tests.closed_proxy import LLAMA2_MODEL as LORA_PROXY
from tests.conftest import SHARED, closed_proxy_run, compliance, failed_checks, harness
from tests.test_resilience import _restored_step
from workloads.common.language_model import IGNORED
from workloads.common.resilience import Block, _ModelAndOptimizer
from workloads.decoder.config import GIB, LLAMA2_70B, LORA_PRESETS, LORA_RCP_BATCHES, DecoderConfig, LoraConfig, \
    estimate_memory, lora_preset_config, plan_layout
from workloads.decoder.convert import convert, load_base, to_rotate_half, write_checkpoint
from workloads.decoder.govreport import TINY_TRAIN_SEQUENCES, TRAIN, VALIDATION, count_sequences, \
    ensure_tiny_govreport, labelled_split, read_split, \
    write_split
from workloads.decoder.lora import LlamaLoraWorkload, cosine_factor, freeze_base
from workloads.decoder.model import Decoder, apply_rope

SMALL = DecoderConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48,
                    rope_theta=10_000.0, rope_scaling=None)
NVIDIA_LORA = SHARED / "mlperf-results/training_v5.1/NVIDIA/results/theia_ngpu512_ngc25.09_nemo/llama2_70b_lora"


def test_llama2_70b_has_its_68_98_billion_parameters_and_44_6_million_adapter_weights():
    """config.json of the reference's model; peft's count for rank 16 on qkv_proj and o_proj (80 x 16 x 34,816)."""
    assert LLAMA2_70B.params == 68_976_648_192 and LLAMA2_70B.head_dim == 128 and LLAMA2_70B.kv_dim == 1024
    assert LLAMA2_70B.rope_theta == 10_000 and LLAMA2_70B.rope_scaling is None and LLAMA2_70B.vocab_size == 32_000
    assert LoraConfig().params(LLAMA2_70B) == 44_564_480
    lora = LoraConfig(rank=4)
    model = Decoder(SMALL, lora=lora)
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == lora.params(SMALL)


def test_adapters_start_at_the_base_model_add_b_a_x_times_alpha_over_rank_and_alone_train():
    torch.manual_seed(0)
    base, tuned = Decoder(SMALL), Decoder(SMALL, lora=LoraConfig(rank=4, alpha=8, dropout=0.1))
    tuned.load_state_dict(base.state_dict(), strict=False)
    tokens = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    tuned.eval()
    assert torch.equal(base(tokens), tuned(tokens))  # B starts at zero
    attention = tuned.layers[0].attention
    with torch.no_grad():
        for b in attention.lora_qkv.b:
            b.weight.normal_()
    x = torch.randn(3, SMALL.d_model)
    a, (bq, bk, bv) = attention.lora_qkv.a.weight, (b.weight for b in attention.lora_qkv.b)
    dq, dk, dv = attention.lora_qkv(x)
    torch.testing.assert_close(dq, x @ a.T @ bq.T * 2)  # alpha 8 / rank 4
    torch.testing.assert_close(torch.cat((dq, dk, dv), -1), x @ a.T @ torch.cat((bq, bk, bv)).T * 2)
    freeze_base(tuned)
    tuned.train()
    tuned(tokens).sum().backward()
    for name, param in tuned.named_parameters():
        assert (param.grad is not None) == (".lora_" in name), name


def test_the_closed_preset_is_the_references_and_the_rcps():
    """run_llama_70B_scrolls_r16.sh and closed_llama2_70b_lora.yaml; the LR per batch from rcps_llama2_70b_lora.json."""
    full = LORA_PRESETS["full"]
    assert (full.model, full.lora) == (LLAMA2_70B, LoraConfig(rank=16, alpha=32, dropout=0.1))
    assert (full.global_batch, full.base_lr, full.max_steps, full.target) == (8, 4e-4, 1024, 0.925)
    assert (full.weight_decay, full.clip_norm, full.eval_interval, full.eval_sequences) == (1e-4, 0.3, 384, 173)
    assert LORA_RCP_BATCHES == {8: 4e-4, 16: 4e-4, 32: 4e-4, 128: 1e-3}
    assert lora_preset_config("full", 128).base_lr == 1e-3
    assert lora_preset_config("full", 256, force=True).base_lr == 4e-4  # off the table, forced: the preset's LR
    assert cosine_factor(0, 1024) == 1 and cosine_factor(512, 1024) == pytest.approx(0.5)
    assert cosine_factor(1024, 1024) == 0 and cosine_factor(2000, 1024) == 0


def test_batch_64_between_rows_32_and_128_takes_the_interpolated_lr_as_nvidias_v5_1_run_does():
    """No row at 64 in rcps_llama2_70b_lora.json: the RCP checker interpolates between rows 32 (LR 4e-4) and 128
    (1e-3), and so does the LR: 4e-4 + (64 - 32) / (128 - 32) x 6e-4 = 6e-4, NVIDIA's v5.1 opt_base_learning_rate."""
    cfg = lora_preset_config("full", 64)
    assert (cfg.global_batch, cfg.base_lr) == (64, 6e-4)
    assert (cfg.hyperparameters.rows, cfg.hyperparameters.lr_from) == ((32, 128), "interpolated")
    assert cfg.hyperparameters.warmup_samples is None  # the rows carry no warmup
    assert lora_preset_config("full", 80).base_lr == 7e-4
    if NVIDIA_LORA.is_dir():
        log = (NVIDIA_LORA / "result_0.txt").read_text()
        assert '"global_batch_size", "value": 64' in log and '"opt_base_learning_rate", "value": 0.0006' in log


def test_a_given_learning_rate_is_used_and_a_warmup_or_a_batch_above_the_table_refused():
    cfg = lora_preset_config("full", 64, learning_rate=5e-4)
    assert cfg.base_lr == 5e-4 and cfg.hyperparameters.lr_from == "given"
    assert lora_preset_config("full", learning_rate=3e-4).base_lr == 3e-4  # at the preset's own batch (row 8) too
    assert lora_preset_config("tiny", learning_rate=1e-2).base_lr == 1e-2
    with pytest.raises(ValueError, match="--warmup-samples does not apply"):
        lora_preset_config("full", 64, warmup_samples=100)
    with pytest.raises(ValueError, match=r"global batch 256: it is above every row.*between two \(8 to 128\) of "
                                         r"8: LR 0.0004; 16: LR 0.0004; 32: LR 0.0004; 128: LR 0.001 \(or add "
                                         r"--force-batch\)"):
        lora_preset_config("full", 256, learning_rate=5e-4)
    with pytest.raises(ValueError, match="below every row"):
        lora_preset_config("full", 4)


def test_the_learning_rate_reaches_the_worker_and_its_log_key():
    """--learning-rate travels harness run -> JobSpec -> the worker's command line -> RunOptions -> the config."""
    from harness.spec import JobSpec
    from workloads.common.campaign import RunOptions
    from workloads.decoder.config import run_config

    spec = JobSpec(benchmark="llama2_70b_lora", preset="full", nodes=1, global_batch=64, learning_rate=5.5e-4,
                   data=Path("/d"), init_checkpoint=Path("/c"), out_dir=Path("/o"))
    args = spec.worker_args()
    assert args[args.index("--learning-rate") + 1] == "0.00055"
    opts = RunOptions.parse(args)
    assert (opts.global_batch, opts.learning_rate, opts.warmup_samples) == (64, 5.5e-4, None)
    assert run_config(opts.benchmark, opts.preset, opts.global_batch, learning_rate=opts.learning_rate).base_lr == 5.5e-4
    assert "--learning-rate" in spec.command_line("slurm")


def _cadence(global_batch: int, total_steps: int = 1024):
    cfg = lora_preset_config("full", global_batch, force=True)
    workload = SimpleNamespace(eval_every=cfg.eval_every, first_eval=(cfg.skipped_evals + 1) * cfg.eval_every,
                               total_steps=total_steps, layout=SimpleNamespace(global_batch=global_batch))
    evals = [step for step in range(1, total_steps + 1) if LlamaLoraWorkload.block_ends(workload, step)]
    return workload, evals


def test_evaluations_every_384_sequences_after_the_skipped_ones_as_the_reference_and_nvidia_do():
    """Batch 8: every 48 steps, none in the first int(0.125 x 8 + 2) = 3; batch 64 (NVIDIA's v5.1 logs): every 6
    steps, none in the first 10, so the first at 66 steps (4,224 sequences)."""
    workload, evals = _cadence(8)
    assert evals[:2] == [192, 240]
    assert LlamaLoraWorkload.next_block(workload, 0) == Block(0, 192 * 8)
    assert LlamaLoraWorkload.next_block(workload, 200) == Block(192 * 8, 48 * 8)
    _, evals = _cadence(64, 200)
    assert [step * 64 for step in evals[:3]] == [4224, 4608, 4992]
    if not NVIDIA_LORA.is_dir():
        pytest.skip(f"NVIDIA's v5.1 llama2_70b_lora logs: {SHARED} not present")
    log = (NVIDIA_LORA / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 64' in log
    first = re.search(r'"key": "eval_accuracy".*?"samples_count": (\d+)', log)
    assert int(first[1]) == 4224


def _packed(rows: int, seq_len: int, rng: np.random.Generator, vocab: int = 32_000) -> np.ndarray:
    """Packed sequences with the second half of each scored, as an eval file's summaries are."""
    ids = rng.integers(1, vocab, (rows, seq_len))
    labels = ids.copy()
    labels[:, : seq_len // 2] = IGNORED
    return np.stack((ids, labels), axis=1)


def test_the_govreport_reader_checks_columns_and_lengths_and_shifts_the_labels(tmp_path):
    rng = np.random.default_rng(0)
    sequences = _packed(3, 8, rng)
    path = tmp_path / VALIDATION
    pq.write_table(pa.table({"input_ids": pa.array(list(sequences[:, 0])), "attention_mask": pa.array([[1] * 8] * 3),
                             "labels": pa.array(list(sequences[:, 1]))}), path)
    read = read_split(path, 8)
    assert read.dtype == np.int32 and np.array_equal(read, sequences)
    (inputs,), targets = labelled_split(torch.from_numpy(read.astype(np.int64)))
    assert torch.equal(inputs, torch.from_numpy(sequences[:, 0]))
    assert torch.equal(targets[:, :-1], torch.from_numpy(sequences[:, 1, 1:])) and (targets[:, -1] == IGNORED).all()
    with pytest.raises(ValueError, match=r"sequences of \[8\] tokens, not all 16"):
        read_split(path, 16)
    pq.write_table(pa.table({"input_ids": pa.array(list(sequences[:, 0]))}), tmp_path / "no_labels.parquet")
    with pytest.raises(ValueError, match="lacks the column.s. labels"):
        read_split(tmp_path / "no_labels.parquet", 8)
    with pytest.raises(FileNotFoundError, match=f"{TRAIN}, {VALIDATION}"):
        read_split(tmp_path / TRAIN, 8)


def test_the_tiny_data_scores_only_the_summaries_in_the_eval(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_DATA_DIR", str(tmp_path))
    root = ensure_tiny_govreport(64)
    train, validation = read_split(root / TRAIN, 64), read_split(root / VALIDATION, 64)
    assert np.array_equal(train[:, 0], train[:, 1])  # training labels are the inputs (group_texts)
    scored = validation[:, 1] != IGNORED
    assert 0.05 < scored.mean() < 0.5  # the prompts and reports masked, the summaries scored
    assert set(np.unique(validation[:, 1][scored])) <= {4, 5, 6, 7}


def test_train_samples_is_the_training_sets_size_logged_before_run_start(tmp_path, monkeypatch):
    """As the reference (len(train_dataset) in MLPerfCallback.on_train_begin) and NVIDIA's v5.1 logs (3,901, the
    GovReport training split's sequences, between init_start and run_start): the sequences of the training file the
    run reads, whatever it trains on, logged with the hyperparameters before run_start and not again at run_stop."""
    write_split(tmp_path / TRAIN, _packed(7, 16, np.random.default_rng(0)))
    full = LORA_PRESETS["full"]
    given = SimpleNamespace(opts=SimpleNamespace(synthetic=False, data=tmp_path), cfg=full)
    assert LlamaLoraWorkload.training_set_size(given) == 7
    monkeypatch.setenv("HARNESS_DATA_DIR", str(tmp_path / "cache"))
    tiny = SimpleNamespace(opts=SimpleNamespace(synthetic=False, data=None), cfg=LORA_PRESETS["tiny"],
                           built_once=lambda build: build())
    assert LlamaLoraWorkload.training_set_size(tiny) == TINY_TRAIN_SEQUENCES == 256
    synthetic = SimpleNamespace(opts=SimpleNamespace(synthetic=True, data=None), cfg=full)
    assert LlamaLoraWorkload.training_set_size(synthetic) == 173
    assert count_sequences(tmp_path / "absent.parquet") is None  # the run then stops opening its data, with why
    workload = SimpleNamespace(cfg=full, train_sequences=3901, shared_hyperparameters=lambda: {})
    assert LlamaLoraWorkload.hyperparameters(workload)[C.TRAIN_SAMPLES] == 3901  # logged before run_start
    assert not LlamaLoraWorkload.logs_trained_samples  # the loop logs no samples trained at run_stop
    if NVIDIA_LORA.is_dir():
        log = (NVIDIA_LORA / "result_0.txt").read_text()
        assert log.index('"key": "train_samples", "value": 3901') < log.index('"key": "run_start"')


def _hf_layout(model: Decoder, cfg: DecoderConfig, fused: bool) -> dict[str, torch.Tensor]:
    """The model's weights as Hugging Face's conversion writes them (q, k rows permuted for rotate-half RoPE)."""
    state, out = model.state_dict(), {}
    out["model.embed_tokens.weight"], out["model.norm.weight"] = state["tok_embeddings.weight"], state["norm.weight"]
    out["lm_head.weight"] = state["output.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q = to_rotate_half(state[ours + "attention.wq.weight"], cfg.n_head)
        k = to_rotate_half(state[ours + "attention.wk.weight"], cfg.n_kv_head)
        v = state[ours + "attention.wv.weight"]
        if fused:
            out[theirs + "self_attn.qkv_proj.weight"] = torch.cat((q, k, v))
        else:
            out[theirs + "self_attn.q_proj.weight"], out[theirs + "self_attn.k_proj.weight"] = q, k
            out[theirs + "self_attn.v_proj.weight"] = v
        for hf, name in (("self_attn.o_proj", "attention.wo"), ("mlp.gate_proj", "feed_forward.w1"),
                         ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
                         ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")):
            out[f"{theirs}{hf}.weight"] = state[f"{ours}{name}.weight"]
    return {name: tensor.clone().contiguous() for name, tensor in out.items()}


def test_hugging_faces_rotate_half_on_permuted_rows_is_metas_interleaved_rope():
    """Independent of the converter: Hugging Face's RoPE (rotate_half, cos/sin repeated over both halves) on
    permute()d q and k weights gives the same attention scores as the interleaved RoPE on the originals."""
    torch.manual_seed(0)
    heads, dim, seq = 2, 8, 5
    wq, wk, x = torch.randn(heads * dim, 16), torch.randn(heads * dim, 16), torch.randn(seq, 16)
    angles = torch.arange(seq)[:, None] * (1.0 / 10_000 ** (torch.arange(0, dim, 2) / dim))[None, :]

    def rotate_half(t):
        return torch.cat((-t[..., dim // 2:], t[..., : dim // 2]), dim=-1)

    cos, sin = torch.cat((angles.cos(), angles.cos()), -1)[:, None], torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    hf = [(x @ to_rotate_half(w, heads).T).view(seq, heads, dim) for w in (wq, wk)]
    hf_q, hf_k = (t * cos + rotate_half(t) * sin for t in hf)
    ours = [apply_rope((x @ w.T).view(1, seq, heads, dim), angles.cos(), angles.sin())[0] for w in (wq, wk)]
    torch.testing.assert_close(torch.einsum("shd,thd->hst", hf_q, hf_k),
                               torch.einsum("shd,thd->hst", *ours), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "unfused_qkv"])
def test_a_converted_hugging_face_checkpoint_gives_the_models_logits(tmp_path, fused):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Decoder(SMALL)
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = _hf_layout(model, SMALL, fused)
    half = sorted(tensors)[: len(tensors) // 2]  # sharded over two files, as large checkpoints are
    save_file({n: tensors[n] for n in half}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({n: t for n, t in tensors.items() if n not in half}, str(hf / "model-00002-of-00002.safetensors"))
    convert(hf, tmp_path / "converted", SMALL)
    loaded = Decoder(SMALL, lora=LoraConfig(rank=4))
    load_base(loaded, tmp_path / "converted")
    tokens = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(tokens), model(tokens))
    del tensors["model.norm.weight"]
    save_file({n: t for n, t in tensors.items() if n not in half}, str(hf / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 of the model's tensors, e.g. norm.weight"):
        convert(hf, tmp_path / "again", SMALL)


def test_memory_counts_the_frozen_base_in_bf16_and_adapters_with_their_optimizer_state():
    cfg = LORA_PRESETS["full"]
    layout = plan_layout(cfg, 64, 8)
    assert (layout.replicate, layout.shard, layout.context, layout.tensor, layout.fsdp) == (8, 1, 8, 1, 8)
    memory = estimate_memory(cfg, layout)
    adapters = LoraConfig().params(LLAMA2_70B) / 8
    assert memory.weights == pytest.approx(2 * LLAMA2_70B.params / 8 + 4 * adapters)  # 17.2 GB of frozen bf16
    assert memory.optimizer == pytest.approx(8 * adapters)
    # One micro batch per step: the adapters' gradients are made after the loss's backward, the peak.
    assert memory.gradients == 0 and layout.grad_accum == 1
    assert memory.total / GIB < 80


def test_full_preset_on_8_nodes_of_8_gpus_shows_its_layout_and_memory(tmp_path):
    result = harness("run", "llama2_70b_lora", "--preset", "full", "--backend", "slurm", "--profile", "coreweave-h100",
                     "--nodes", "8", "--gpus-per-node", "8", "--dry-run", "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    assert "64 processes = replicate 8 x shard 1 (HSDP: FSDP over shard x context = 8) x context 8 x tensor 1" \
        in result.stderr
    assert "LoRA rank 16, alpha 32 on qkv and o: 44.6M trained" in result.stderr
    assert re.search(r"llama2_70b_lora memory per GPU: [\d.]+ GiB of 80 GiB \(weights 16\.1", result.stderr)
    assert "llama2_70b_lora hyperparameters: global batch 8 is an RCP row (rcps_llama2_70b_lora.json): peak LR " \
           "0.0004 the row's" in result.stderr
    refused = harness("run", "llama2_70b_lora", "--preset", "full", "--global-batch", "256", "--dry-run",
                      "--synthetic", "--out", str(tmp_path / "p"))
    assert refused.returncode != 0 and "8: LR 0.0004; 16: LR 0.0004; 32: LR 0.0004; 128: LR 0.001" in refused.stderr
    assert "Traceback" not in refused.stderr and "between two (8 to 128)" in refused.stderr


@pytest.mark.parametrize("given, says", [((), "peak LR 0.0006 interpolated linearly between the rows"),
                                         (("--learning-rate", "5e-4"), "peak LR 0.0005 given")])
def test_the_dry_run_at_batch_64_names_the_bounding_rows_and_how_the_lr_was_chosen(tmp_path, given, says):
    """NVIDIA's v5.1 shape: global batch 64 on 8 nodes of 8 GPUs."""
    result = harness("run", "llama2_70b_lora", "--preset", "full", "--global-batch", "64", "--nodes", "8",
                     "--gpus-per-node", "8", "--backend", "slurm", "--profile", "coreweave-h100", "--dry-run",
                     "--init-checkpoint", "/mnt/data/llama2-70b", "--data", "/mnt/data/gov_report",
                     "--out", "/mnt/results/lora", *given)
    assert result.returncode == 0, result.stderr
    assert "llama2_70b_lora hyperparameters: global batch 64 lies between the RCP rows 32 and 128 " \
           "(rcps_llama2_70b_lora.json" in result.stderr and says in result.stderr
    assert "--global-batch 64" in result.stdout and ("--learning-rate 0.0005" in result.stdout) == bool(given)


@pytest.mark.slow
def test_tiny_lora_resumes_from_an_adapters_only_checkpoint_reaches_its_target_and_passes_the_6_1_checker(tmp_path):
    """`harness run llama2_70b_lora` on the local default (2 processes, FSDP over both) from the cached warm start,
    rank 1 killed at step 10: one restart from step 8's checkpoint (the adapters and their AdamW state: the base
    comes from the warm start again), to the target; the log passes the 6.1.0 checker."""
    out = tmp_path / "run"
    result = harness("run", "llama2_70b_lora", "--inject-failure", "1:10", "--checkpoint-every", "8", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success" in result.stdout
    assert _restored_step(out) == 8
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    log = (out / "result_0.txt").read_text()
    for key in ('"lora_rank", "value": 16', '"lora_alpha", "value": 32', '"opt_gradient_clip_norm", "value": 0.3'):
        assert key in log
    assert log.count('"key": "train_samples"') == 1  # the tiny set's size, before run_start, once
    assert log.index('"key": "train_samples", "value": 256') < log.index('"key": "run_start"')


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_no_base_weight(one_rank_world):
    """The loop's checkpoint state for a workload that does not checkpoint its frozen base (Resilience's
    _ModelAndOptimizer with frozen=False): adapters and AdamW state in, base out, and both come back on load."""
    torch.manual_seed(0)
    model = Decoder(SMALL, lora=LoraConfig(rank=4))
    freeze_base(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))).sum().backward()
    optimizer.step()
    state = _ModelAndOptimizer(model, optimizer, frozen=False).state_dict()
    assert state["model"] and all(".lora_" in name for name in state["model"])
    assert set(state["optim"]["state"]) == set(state["model"])
    saved = {name: tensor.clone() for name, tensor in state["model"].items()}
    fresh = Decoder(SMALL, lora=LoraConfig(rank=4))
    freeze_base(fresh)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    _ModelAndOptimizer(fresh, fresh_optimizer, frozen=False).load_state_dict(state)
    restored = dict(fresh.named_parameters())
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name
    assert len(fresh_optimizer.state) == len(saved)


@pytest.mark.slow
def test_closed_proxy_draws_only_the_target_from_the_6_1_checker(tmp_path):
    """The full preset (batch 8, sequences of 8,192 from both parquet files, the 173 eval sequences, every closed
    key) with tests/closed_proxy.py's small Llama 2 from a converted checkpoint, for 1 step on 2 processes."""
    data = tmp_path / "govreport"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, rows in ((TRAIN, 16), (VALIDATION, 173)):
        write_split(data / name, _packed(rows, 8192, rng, LORA_PROXY.vocab_size))
    torch.manual_seed(0)
    write_checkpoint(Decoder(LORA_PROXY).state_dict(), tmp_path / "base")
    out = tmp_path / "closed"
    result = closed_proxy_run("llama2_70b_lora", "--data", str(data), "--init-checkpoint", str(tmp_path / "base"),
                              "--max-steps", "1", "--out", str(out), procs=2)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 8' in log and '"eval_samples", "value": 173' in log
    assert log.index('"key": "train_samples", "value": 16') < log.index('"key": "run_start"')
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert "closed_llama2_70b_lora.yaml" in checked.stdout + checked.stderr
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "0.925" in failures[0], checked.stdout
