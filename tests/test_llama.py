"""llama31_8b: the model's parts against their definitions, the closed config against the rules and RCPs,
the layout and its figures at scale, the data reader on the real file names, and end to end: the tiny
preset to its target through the 6.1.0 checker, and the closed proxy with only the target left unmet."""

from __future__ import annotations

import math
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from tests.closed_proxy import LLAMA_MODEL as LLAMA_PROXY
from tests.conftest import closed_proxy_run, compliance, failed_checks, harness, training_job
from tests.test_kubernetes import CRD, pytorchjob_schema
from tests.test_resilience import _restored_step
from workloads.common.megatron_data import IndexedDataset, gpt_dataset_indices, write_indexed_dataset
from workloads.decoder.config import LLAMA31_8B, PRESETS, RCP_BATCHES, DecoderConfig, \
    estimate_traffic, plan_layout, preset_config
from workloads.decoder.data import TINY_VOCAB, TRAIN, VALIDATION, c4_loaders, reference_validation_samples, \
    tiny_entropy
from workloads.decoder.model import CausalAttention, Decoder, apply_rope, rope_frequencies
from workloads.decoder.parallelize import ContextParallelAttention, context_chunks
from workloads.decoder.pretrain import lr_factor


def test_the_8b_shape_has_its_8_03_billion_parameters():
    assert LLAMA31_8B.params == 8_030_261_248 and LLAMA31_8B.head_dim == 128 and LLAMA31_8B.kv_dim == 1024
    small = DecoderConfig(vocab_size=50, seq_len=8, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24)
    assert sum(p.numel() for p in Decoder(small).parameters()) == small.params


def test_rope_scaling_keeps_short_wavelengths_slows_long_ones_and_blends_between():
    """Meta's apply_scaling for Llama 3.1 (factor 8, low 1, high 4, original context 8192), term by term."""
    unscaled = rope_frequencies(DecoderConfig(**{**LLAMA31_8B.__dict__, "rope_scaling": None})).double()
    scaled = rope_frequencies(LLAMA31_8B).double()
    wavelength = 2 * math.pi / unscaled
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.allclose(scaled[short], unscaled[short])
    assert torch.allclose(scaled[long], unscaled[long] / 8)
    between = ~short & ~long
    smooth = (8192 / wavelength[between] - 1) / (4 - 1)
    assert torch.allclose(scaled[between], (1 - smooth) * unscaled[between] / 8 + smooth * unscaled[between])
    assert torch.allclose(unscaled[:2].float(), torch.tensor([1.0, 500_000 ** (-2 / 128)]))


def test_rope_rotates_interleaved_pairs_by_position_times_frequency():
    x = torch.randn(1, 3, 2, 4)
    freqs = torch.tensor([0.5, 0.1])
    positions = torch.tensor([0, 1, 5])
    angles = positions[:, None] * freqs[None, :]
    out = apply_rope(x, angles.cos(), angles.sin())
    as_complex = torch.view_as_complex(x.reshape(1, 3, 2, 2, 2))
    want = torch.view_as_real(as_complex * torch.polar(torch.ones_like(angles), angles)[None, :, None, :])
    assert torch.allclose(out, want.reshape(1, 3, 2, 4), atol=1e-6)


def test_grouped_query_attention_shares_each_key_value_head_across_its_query_heads():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             is_causal=True)
    assert torch.allclose(CausalAttention()(q, k, v, torch.arange(6)), want, atol=1e-6)


def test_context_parallel_attention_on_each_ranks_chunks_matches_the_whole_sequence():
    """Two context ranks simulated in one process: each rank's two chunks, attending over the gathered keys and
    values, give exactly the whole sequence's causal attention at those positions."""
    torch.manual_seed(0)
    size, seq = 2, 16
    q, k, v = torch.randn(1, 4, seq, 8), torch.randn(1, 2, seq, 8), torch.randn(1, 2, seq, 8)
    whole = CausalAttention()(q, k, v, torch.arange(seq))
    gathered = {name: torch.cat([context_chunks(t, r, size, dim=2) for r in range(size)], dim=2)
                for name, t in (("k", k), ("v", v))}

    class Group:  # the mesh dimension's two questions, for one rank
        def __init__(self, rank):
            self.rank = rank

        def size(self):
            return size

        def get_local_rank(self):
            return self.rank

    for rank in range(size):
        attention = ContextParallelAttention(Group(rank))
        attention._gather = lambda t, name=iter("kv"): gathered[next(name)]
        positions = context_chunks(torch.arange(seq), rank, size, dim=0)
        out = attention(context_chunks(q, rank, size, dim=2), context_chunks(k, rank, size, dim=2),
                        context_chunks(v, rank, size, dim=2), positions)
        assert torch.allclose(out, context_chunks(whole, rank, size, dim=2), atol=1e-6)


def test_the_schedule_is_nemos_cosine_annealing():
    """Warmup from peak / (W + 1) to the peak at step W, then cosine to 0.1 x peak at max_steps."""
    assert lr_factor(0, 96, 1_200_000, 0.1) == pytest.approx(1 / 97)
    assert lr_factor(96, 96, 1_200_000, 0.1) == pytest.approx(1.0)
    assert lr_factor(600_048, 96, 1_200_000, 0.1) == pytest.approx(0.55)
    assert lr_factor(1_200_000, 96, 1_200_000, 0.1) == pytest.approx(0.1)


def test_the_closed_preset_follows_the_rules_and_the_rcp_table():
    full = PRESETS["full"]
    assert (full.model, full.global_batch, full.base_lr, full.warmup_steps) == (LLAMA31_8B, 64, 8e-4, 96)
    assert (full.max_steps, full.eval_interval, full.eval_sequences, full.target) == (1_200_000, 12_288, 1024, 3.3)
    assert (full.adam_betas, full.adam_eps, full.weight_decay, full.clip_norm) == ((0.9, 0.95), 1e-5, 0.1, 1.0)
    for batch, (lr, warmup) in RCP_BATCHES.items():
        cfg = preset_config("full", batch)
        assert (cfg.global_batch, cfg.base_lr, cfg.warmup_samples) == (batch, lr, warmup)
    with pytest.raises(ValueError, match=r"no reference convergence point .* global batch 256.*16: LR 0.0004"):
        preset_config("full", 256)
    assert preset_config("full", 256, force=True).global_batch == 256


def test_a_batch_between_two_rcp_rows_interpolates_the_peak_lr_and_the_warmup_linearly():
    """rcps_llama31_8b.json has rows 32 (LR 8e-4, warmup 4,096 samples), 64 (8e-4, 6,144) and 96 (1e-3, 16,348): batch 48
    lies halfway between the first two, batch 80 halfway between the others; what the user gives wins."""
    cfg = preset_config("full", 48)
    assert (cfg.global_batch, cfg.base_lr, cfg.warmup_samples) == (48, 8e-4, 5_120)
    assert cfg.hyperparameters.rows == (32, 64) and cfg.hyperparameters.lr_from == "interpolated"
    cfg = preset_config("full", 80)
    assert (cfg.base_lr, cfg.warmup_samples) == (9e-4, 11_246)
    cfg = preset_config("full", 80, learning_rate=7e-4, warmup_samples=8_000)
    assert (cfg.base_lr, cfg.warmup_samples, cfg.warmup_steps) == (7e-4, 8_000, 100)
    assert (cfg.hyperparameters.lr_from, cfg.hyperparameters.warmup_from) == ("given", "given")
    cfg = preset_config("full", 80, warmup_samples=8_000)  # one given, the other still interpolated
    assert (cfg.base_lr, cfg.warmup_samples) == (9e-4, 8_000)
    with pytest.raises(ValueError, match="below every row.*16 to 128"):
        preset_config("full", 8)


def test_the_tiny_target_is_reachable_under_the_open_rules():
    """The open rules ask for an eval under 1.0 at least once: the text allows it, a guess does not."""
    assert tiny_entropy() < PRESETS["tiny"].target - 0.2 < 1.0 < math.log(TINY_VOCAB)


def test_the_layout_at_512_gpus_fills_nodes_and_hsdp_keeps_fsdp_on_nvlink():
    """GBS 64 on 64 nodes x 8: a data rank would get 1/8 of a sequence, so context parallel 4 with tensor 2
    fills each node; FSDP shards over the node's 4 context ranks, and only the
    gradient all-reduce crosses nodes."""
    cfg = PRESETS["full"]
    layout = plan_layout(cfg, 512, 8)
    assert (layout.replicate, layout.shard, layout.context, layout.tensor, layout.grad_accum) == (64, 1, 4, 2, 1)
    traffic = estimate_traffic(cfg, layout)
    assert traffic.infiniband == traffic.replicate_reduce  # only the replicas' all-reduce leaves the node
    # 4 bytes x 8.03B / (tensor 2 x FSDP 4), all-reduced across 64 replicas (2 x 63/64 of the shard)
    assert traffic.infiniband == pytest.approx(2 * 4 * LLAMA31_8B.params / 8 * 63 / 64)
    # Batch 96 at 512 GPUs: context 4 would leave 64 data ranks, which 96 does not split over; context 8 does.
    layout = plan_layout(preset_config("full", 96), 512, 8)
    assert (layout.context, layout.data, layout.grad_accum) == (8, 32, 3)
    # 448 nodes x 8: every data-rank count has a factor 7, which no RCP batch has.
    with pytest.raises(ValueError, match="does not split evenly over 3584 processes"):
        plan_layout(preset_config("full", 64), 448 * 8, 8)


def test_the_residual_projections_start_smaller_as_megatrons_do():
    """init_method_std 0.02 everywhere, 0.02 / sqrt(2 x layers) for attention's wo and SwiGLU's w2."""
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, seq_len=8, n_layer=8, n_head=4, n_kv_head=2, d_model=256, ffn_hidden=512)
    model = Decoder(cfg)
    stds = {name: param.std().item() for name, param in model.named_parameters() if param.ndim == 2}
    for name, std in stds.items():
        want = 0.02 / math.sqrt(16) if name.endswith(("wo.weight", "w2.weight")) else 0.02
        assert std == pytest.approx(want, rel=0.05), name


def test_the_reader_names_missing_files_and_reads_int32_tokens(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{TRAIN}.{{bin,idx}}, {VALIDATION}.{{bin,idx}}")):
        c4_loaders(tmp_path, 8, 1, 4, 2, seed=0, data_rank=0, data_world=1)
    write_indexed_dataset(tmp_path / TRAIN, [np.arange(3)], dtype=np.int32)
    (tmp_path / f"{TRAIN}.bin").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"lacks {TRAIN}.bin, {VALIDATION}.{{bin,idx}}")):
        c4_loaders(tmp_path, 8, 1, 4, 2, seed=0, data_rank=0, data_world=1)
    big = np.array([128_000, 128_255, 5, 7] * 20, dtype=np.int32)
    for prefix in (TRAIN, VALIDATION):
        write_indexed_dataset(tmp_path / prefix, [big], dtype=np.int32)
    assert IndexedDataset(tmp_path / TRAIN).dtype == np.int32
    loaders = c4_loaders(tmp_path, 8, 1, 4, 2, seed=0, data_rank=0, data_world=1)
    assert int(next(iter(loaders.train)).max()) == 128_255 and loaders.eval_sequences == 2
    with pytest.raises(ValueError, match="holds 9 sequences of 9 tokens; the eval scores 1024"):
        c4_loaders(tmp_path, 8, 1, 4, 1024, seed=0, data_rank=0, data_world=1)


def _megatron_core_validation_split(prefix, seq_len, num_samples, seed, cache):
    """The validation split as the reference builds it: NeMo's PreTrainingDataModule gives Megatron-Core's
    BlendedMegatronDatasetBuilder the file as its own split (blend_per_split) and asks it for num_samples."""
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset",
                              reason="megatron-core (the test extra) is not installed: no reference to compare with")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    class Tokenizer:  # what GPTDataset reads of one
        eod, pad, vocab_size = 0, -1, None
        special_tokens_dict: dict = {}
        unique_identifiers = {"class": "Tokenizer"}

    config = gpt.GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, tokenizer=Tokenizer(),
                                  blend_per_split=[None, ([str(prefix)], None), None], path_to_cache=str(cache),
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(gpt.GPTDataset, [None, num_samples, None], lambda: True, config).build()[1]


# (requested validation samples, what GPTDataset makes of them): the small file below holds 701 tokens, 43
# windows of 17 an epoch.
@pytest.mark.parametrize("num_samples, epochs, separate", [(None, 1, False), (40, 1, False), (80, 2, False),
                                                           (47, 2, True), (500, 12, True), (516, 12, False)])
def test_the_eval_scores_megatron_cores_validation_items_for_the_seed(tmp_path, num_samples, epochs, separate):
    """The reference's eval scores items 0..count-1 of Megatron-Core's GPTDataset over the validation file, whose
    documents and samples are shuffled by the seed over as many epochs as the requested samples need: the
    harness's eval set is those windows, in that order, and its indices are Megatron-Core's."""
    rng = np.random.default_rng(3)
    lengths = [1, 5, 16, 17, 18, 40, 3, 100, 2, 60, 33, 7, 250, 9, 34, 106]  # shorter, as long as, longer than a window
    docs = [np.append(rng.integers(1, 1000, n - 1), 0).astype(np.int32) for n in lengths]
    write_indexed_dataset(tmp_path / VALIDATION, docs, dtype=np.int32)
    write_indexed_dataset(tmp_path / TRAIN, docs, dtype=np.int32)
    seq_len, seed, count = 16, 1234, 12
    reference = _megatron_core_validation_split(tmp_path / VALIDATION, seq_len, num_samples, seed, tmp_path / "npy")
    ours = gpt_dataset_indices(IndexedDataset(tmp_path / VALIDATION).sizes, seq_len, num_samples, seed)
    assert (ours.epochs, ours.separate_final_epoch) == (epochs, separate)
    assert np.array_equal(ours.document, reference.document_index)
    assert np.array_equal(ours.shuffle, reference.shuffle_index)
    assert np.array_equal(ours.starts, reference.sample_index[reference.shuffle_index])
    assert np.array_equal(ours.ends, reference.sample_index[reference.shuffle_index.astype(np.int64) + 1])

    loaders = c4_loaders(tmp_path, seq_len, 1, 4, count, seed=seed, data_rank=0, data_world=1,
                         validation_samples=num_samples)
    scored = loaders.eval.dataset.data
    assert len(scored) == loaders.eval_sequences == count
    for i in range(count):
        item = reference[i]
        want = torch.cat([item["tokens"], item["labels"][-1:]])
        assert torch.equal(scored[i], want), i
    in_order = [torch.from_numpy(np.concatenate(docs)[i * seq_len:(i + 1) * seq_len + 1].astype(np.int64))
                for i in range(count)]
    assert not all(torch.equal(scored[i], in_order[i]) for i in range(count))  # not the README's first, in order
    other = c4_loaders(tmp_path, seq_len, 1, 4, count, seed=seed + 1, data_rank=0, data_world=1,
                       validation_samples=num_samples).eval.dataset.data
    assert not all(torch.equal(scored[i], other[i]) for i in range(count))  # another seed, other sequences


def test_the_validation_split_is_asked_for_what_nemo_asks_at_each_rcp_batch():
    """pretrain_llama31.py's val_check_interval (ceil(12,288 / GBS) / GBS) and limit_val_batches (ceil(1,024 /
    GBS)) through PreTrainingDataModule.build: (max_steps // val_check_interval + 1) x limit_val_batches x GBS."""
    assert reference_validation_samples(32, 1_200_000, 12_288, 1024) == (1_200_000 // 12 + 1) * 32 * 32
    assert reference_validation_samples(64, 1_200_000, 12_288, 1024) == 409_601_024
    assert reference_validation_samples(128, 1_200_000, 12_288, 1024) == int((1_200_000 // 0.75 + 1) * 8 * 128)


@pytest.mark.parametrize("backend", ["slurm", "k8s"])
def test_full_preset_on_64_h100_nodes_shows_its_layout_memory_and_traffic(tmp_path, backend):
    args = ("run", "llama31_8b", "--preset", "full", "--backend", backend, "--profile", "coreweave-h100",
            "--nodes", "64", "--gpus-per-node", "8", "--dry-run", "--out", str(tmp_path / "o"))
    result = harness(*args)
    assert result.returncode == 0, result.stderr
    assert "512 processes = replicate 64 x shard 1 (HSDP: FSDP over shard x context = 4) x context 4 x tensor 2" \
        in result.stderr
    assert "llama31_8b memory per GPU:" in result.stderr and "of 80 GiB" in result.stderr
    assert "GB over NVLink" in result.stderr and "GB over InfiniBand" in result.stderr
    assert "give --data" in result.stderr  # a dry run names what a real run still needs
    if backend == "k8s":
        job = training_job(result.stdout)
        if CRD.is_file():
            jsonschema.validate(job, pytorchjob_schema())
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 64
    between = harness(*args, "--global-batch", "80")
    assert between.returncode == 0, between.stderr
    assert ("llama31_8b hyperparameters: global batch 80 lies between the RCP rows 64 and 96 (rcps_llama31_8b.json"
            in between.stderr and "peak LR 0.0009 interpolated" in between.stderr
            and "warmup 11,246 samples interpolated" in between.stderr)
    for args, says in ((("--global-batch", "256"), "no reference convergence point"),
                       (("--batch-size", "2"), "takes its batch as --global-batch"),
                       (("--force-batch",), "give --global-batch too")):
        refused = harness("run", "llama31_8b", "--preset", "full", *args, "--dry-run", "--synthetic",
                          "--out", str(tmp_path / "p"))
        assert refused.returncode != 0 and says in refused.stderr and "Traceback" not in refused.stderr, args


@pytest.mark.slow
def test_tiny_llama_survives_a_killed_rank_reaches_its_target_and_passes_the_6_1_checker(tmp_path):
    """`harness run llama31_8b` on the local default (2 processes, FSDP over both), from scratch, with rank 1
    killed at step 6: one restart from step 4's checkpoint (the sharded state), and a log the 6.1.0 checker
    passes."""
    out = tmp_path / "run"
    result = harness("run", "llama31_8b", "--inject-failure", "1:6", "--checkpoint-every", "4", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success" in result.stdout
    assert _restored_step(out) == 4
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    log = (out / "result_0.txt").read_text()
    for key in ("context_parallelism", "micro_batch_size", "max_steps", "eval_samples"):
        assert f'"key": "{key}"' in log


def closed_c4(folder: Path, vocab_size: int) -> Path:
    """The C4 files a closed proxy of llama31_8b or gpt_oss_20b reads: random int32 tokens, enough for a step of
    batch 64 and the 1,024 eval sequences of 8,193 tokens, under the real names."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, tokens in ((TRAIN, 64 * 8193 + 1), (VALIDATION, 1024 * 8193 + 1)):
        write_indexed_dataset(folder / prefix, [rng.integers(1, vocab_size, tokens).astype(np.int32)], dtype=np.int32)
    return folder


@pytest.mark.slow
def test_closed_proxy_draws_only_the_target_from_the_6_1_checker(tmp_path):
    """The full preset (GBS 64, sequence 8,192, 1,024 eval sequences, every closed key) with tests/closed_proxy.py's
    small model, for 1 step on 2 processes (tensor parallel 2, as in a node): the checker's only complaint is the
    target."""
    data = closed_c4(tmp_path / "c4", LLAMA_PROXY.vocab_size)
    out = tmp_path / "closed"
    result = closed_proxy_run("llama31_8b", "--data", str(data), "--max-steps", "1", "--out", str(out), procs=2)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 64' in log and '"tensor_parallelism", "value": 2' in log
    checked = compliance(out / "result_0.txt", "6.1.0", cwd=tmp_path)
    assert "closed_llama31_8b.yaml" in checked.stdout + checked.stderr
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "3.3" in failures[0], checked.stdout
