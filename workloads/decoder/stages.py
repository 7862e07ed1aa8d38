"""Which blocks each pipeline stage of a decoder holds, and the preset with the stages asked for on the command line
(--pipeline-parallel). No torch here: `harness run --dry-run` plans with it (workloads.decoder.pipeline builds the
stages).
"""

from __future__ import annotations

from dataclasses import replace

from workloads.decoder.config import (PRETRAINING, RCP_GLOBAL_BATCHES, RCP_WARMUP_BENCHMARKS, Layout,
                                      LoraFinetuneConfig, PretrainConfig, layer_chunks)

# The benchmarks --pipeline-parallel applies to: the pretraining ones (LoRA's adapters draw after every base weight,
# which a stage cannot replay; plan_layout keeps llama2_70b_lora unpipelined).
PIPELINED_BENCHMARKS: tuple[str, ...] = tuple(PRETRAINING)


def worker_options(benchmark: str) -> dict[str, dict]:
    """The worker options `benchmark` takes by the decoders' tables (workloads.registry.Benchmark.options): the
    peak LR and its warmup where its RCP rows give them, the pipeline's stages where it pretrains."""
    options = {"--learning-rate": {"type": float}} if benchmark in RCP_GLOBAL_BATCHES else {}
    if benchmark in RCP_WARMUP_BENCHMARKS:
        options["--warmup-samples"] = {"type": int}
    if benchmark in PIPELINED_BENCHMARKS:
        options["--pipeline-parallel"] = {"type": int}
    return options


def with_pipeline(cfg: PretrainConfig | LoraFinetuneConfig, stages: int | None
                  ) -> PretrainConfig | LoraFinetuneConfig:
    """The preset with `stages` pipeline stages (--pipeline-parallel; None: the preset's own)."""
    return cfg if stages is None else replace(cfg, pipeline_parallel=stages)


def rank_stages(layout: Layout, pipeline_rank: int) -> list[int]:
    """The stages pipeline rank `pipeline_rank` holds: itself alone, or with virtual stages one in each round of
    the pipeline (rank r holds r, r + pipeline, ...: the looped order the interleaved 1F1B schedule runs)."""
    return [pipeline_rank + chunk * layout.pipeline for chunk in range(layout.virtual)]


def describe_stages(cfg: PretrainConfig, layout: Layout) -> str:
    """One line for the dry run: which blocks each pipeline stage holds (and where the embedding and the output
    layer are), on which ranks; empty without a pipeline."""
    if layout.pipeline == 1:
        return ""
    ranges = layer_chunks(cfg.model.n_layer, layout.pipeline * layout.virtual)
    per_rank = layout.world // layout.pipeline
    parts = []
    for stage, blocks in enumerate(ranges):
        held = [f"blocks {blocks.start}-{blocks.stop - 1}" if len(blocks) > 1 else f"block {blocks.start}"]
        if stage == 0:
            held.insert(0, "the embedding")
        if stage == len(ranges) - 1:
            held.append("the final norm and output layer")
        first = stage % layout.pipeline * per_rank
        parts.append(f"stage {stage} (ranks {first}-{first + per_rank - 1}): {', '.join(held)}")
    schedule = f"interleaved 1F1B, {layout.virtual} stages a rank" if layout.virtual > 1 else "1F1B"
    return (f"pipeline {layout.pipeline} ranks, {len(ranges)} stages, {schedule} over {layout.grad_accum} micro "
            f"batches per data rank: " + "; ".join(parts))
