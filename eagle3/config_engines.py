"""The engine schemas of the one typed configuration, and where training's features come from
(:mod:`eagle3.config` re-exports them).

``engine=hf`` runs the target in this process; ``engine=sglang`` and ``engine=vllm`` reach
a real server (connected by URL or launched with the engine's own Python, since each
server pins its own transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class HFEngineConfig:
    """In-process transformers engine (CPU or GPU)."""

    name: str = "hf"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"
    # Batch sizes; None = by device (cpu: 64 prompts, 16 sequences, 8192 tokens;
    # cuda: 256 prompts, 64 sequences, 65536 tokens).
    generate_batch_size: Optional[int] = None  # prompts per batched generate call
    capture_batch_size: Optional[int] = None  # sequences per batched capture forward
    max_batch_tokens: Optional[int] = None  # padded tokens per capture forward (caps memory)
    # On CUDA out-of-memory the failing stage's limits (generate: generate_batch_size and
    # max_batch_tokens; capture: capture_batch_size and max_batch_tokens) are halved for the
    # rest of the run and the work goes on (eagle3.engines.hf.oom; a warning says to what).
    # Generation KV cache: graphs = this project's batched decoder (eagle3.engines.hf.batch_decode):
    # a preallocated cache and the decode step replayed from one CUDA graph per batch shape, no
    # compilation (CUDA only); dynamic = DynamicCache, eager; static = transformers' StaticCache,
    # decode step compiled: it wins only at fixed shapes and was 1.9-2.7x slower on real extraction
    # (a compilation per prompt width). auto = graphs on CUDA (with gqa_fold: 1.56-1.60x compiled
    # static at batch 256 on one H100, 0.62-0.64x without; docs/performance.md), dynamic on CPU.
    generate_cache: str = "auto"
    # Evaluation's batch-1 decoding (baseline and speculative): static = preallocated KV caches
    # for target and drafter (eagle3.runtime.slots), forwards replayed from CUDA graphs on CUDA
    # when cuda_graphs; dynamic = DynamicCache, eager; auto = static on CUDA, dynamic on CPU.
    decode_cache: str = "auto"
    cuda_graphs: bool = True
    # Compile the decoder layers of the target (and, in evaluation, of the drafter) with inductor
    # (torch.compile, dynamic shapes: one compilation for every layer and batch shape;
    # eagle3.spec.compiled) so the CUDA graphs replay fused kernels. CUDA only (ignored on CPU).
    # null = auto: on for evaluation's batch-1 decoding in one process (one H200: plain decoding
    # 1.41x faster, speculative 1.24x; docs/performance.md; off with workers > 1), off for extraction (its batched decoder and
    # capture were 4-6x slower with the attention compiled: a per-layer mask kernel). Set true for
    # extraction, the hf engine keeps SDPA eager between the compiled pieces of each layer: its
    # batched decoder then ran 1.15x the uncompiled one at batch 256, and 1.48x with gqa_fold
    # (2.32-2.37x compiled static generate; docs/performance.md), not yet timed in a whole extraction.
    compile_layers: Optional[bool] = None
    # Attend with the query heads of each kv group folded into the query axis (eagle3.gqa) in
    # decode steps, verify passes and draft steps, instead of repeat_kv copies of the whole KV
    # cache: the same attention. null = auto: on CUDA with attn_implementation=sdpa (one H100:
    # batched regeneration 2.5x at batch 256, speculative rounds 3% faster; docs/performance.md).
    gqa_fold: Optional[bool] = None


@dataclass
class SGLangEngineConfig:
    """A live SGLang server: connect to ``url``/``urls`` or launch one.

    With neither ``url`` nor ``urls`` set, the engine launches
    ``python -m sglang.launch_server`` with flags rendered from the model's
    ``serve`` settings and the fields below, and waits on ``/health``.
    Extraction needs servers in capture mode (see docs/sglang.md); evaluation uses
    ``baseline_url`` (no drafter) and ``speculative_url`` (serving the drafter), or
    launches them when they are not set (on ``port`` and ``port + 1``; both up at once so
    batch-1 requests can alternate between them, unless ``launch_together`` is false or,
    unset, they are launched on GPUs, which the two would share: then one after the
    other), and refuses ``url``/``urls``.
    A launched server's environment is this process's, then the variables the shell
    line ``env_script`` exports (sourced with bash; the CPU build's ``env.sh VENV``),
    then ``env``. On a machine without CUDA (``device=auto``) the server is started
    with ``--device cpu --disable-overlap-schedule --max-total-tokens 8192
    --mem-fraction-static 0.5`` (what the CPU build of SGLang 0.5.23 was seen to run
    with; the fraction only when ``model.serve.mem_fraction_static`` is unset) and no
    CUDA-graph flag.
    """

    name: str = "sglang"
    url: Optional[str] = None  # extraction's capture server(s); refused by served evaluation
    urls: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 30000
    python: str = "python"
    launch_timeout_s: float = 1800.0
    request_timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 2.0
    concurrency: int = 32  # generation requests in flight per server
    capture_concurrency: int = 4  # capture requests in flight per server (large JSON answers)
    health_poll_s: float = 5.0
    connect_timeout_s: float = 30.0  # how long a configured server may take to answer /health
    baseline_url: Optional[str] = None  # evaluation: server without a drafter
    speculative_url: Optional[str] = None  # evaluation: server serving the drafter
    # None: --max-running-requests is not passed, and a speculative server caps itself at 48
    max_running_requests: Optional[int] = 128
    cuda_graph_max_bs: int = 128  # not rendered for a CPU server (no CUDA graphs there)
    chunked_prefill_size: int = -1
    # auto: cpu when this machine has no CUDA device (then --device cpu --disable-overlap-schedule)
    device: str = "auto"  # auto | cuda | cpu
    # evaluation: both servers up at once, batch-1 requests interleaved; None = yes with
    # both URLs given or CPU servers launched here, no when launching on GPUs (they share them)
    launch_together: Optional[bool] = None
    max_total_tokens: Optional[int] = None  # --max-total-tokens; unset on a CPU server: 8192
    env_script: Optional[str] = None  # shell line sourced before launching, e.g. "servers/sglang-cpu/env.sh VENV"
    env: dict[str, str] = field(default_factory=dict)  # variables set for the server process (after env_script)
    extra_args: list[str] = field(default_factory=list)


@dataclass
class VLLMEngineConfig:
    """Two live vLLM OpenAI-compatible servers for served evaluation: connect to
    ``baseline_url`` / ``speculative_url``, or launch both at once here (the baseline on
    ``port``, the speculative one on ``port + 1``).

    Launching runs ``<python> -m vllm.entrypoints.openai.api_server`` (``python`` is the
    server's own virtual environment: vLLM pins its own transformers) with every flag
    below explicit, the drafter given as ``--speculative-config '{"method": "eagle3",
    "model": <export/vllm>, "num_speculative_tokens": num_steps}'``, and
    ``VLLM_SERVER_DEV_MODE=1`` so that ``/server_info`` reports the effective config; it
    waits on ``/health`` up to ``launch_timeout_s`` (CPU startup compiles for 2-7 minutes).
    ``device`` (``auto`` asks the server's torch) picks the build's flags:
    ``kv_cache_space_gb`` sets ``VLLM_CPU_KVCACHE_SPACE`` on a CPU build,
    ``gpu_memory_utilization`` is passed on a GPU build only. ``max_num_seqs`` is vLLM's
    cap on running requests, read back from ``/server_info`` (or the launch log) and
    reported; a tested concurrency above it is warned about.

    Extraction (``extract.py engine=vllm``, :mod:`eagle3.engines.vllm.engine`) uses one
    server without a drafter, ``url`` or launched on ``port``, for the replies; ``capture``
    picks where their features come from. ``server`` (the default): the same server, through
    vLLM's ``extract_hidden_states`` method (:mod:`eagle3.engines.vllm.capture`), so the
    features are the serving numerics themselves, ``concurrency`` requests in flight; a
    launched server is started as a capture server, one given by ``url`` must already be
    one. ``hf``: the replies are teacher-forced in this process by the ``hf`` engine on
    ``capture_device``. Served evaluation refuses ``url``.
    """

    name: str = "vllm"
    url: Optional[str] = None  # extraction only: the generation server (no drafter); None = launch one
    concurrency: int = 16  # extraction: generation requests in flight
    capture: str = "server"  # extraction: server (vLLM's extract_hidden_states: the serving numerics) | hf (in process)
    capture_device: str = "auto"  # extraction with capture=hf: where the hf engine runs
    baseline_url: Optional[str] = None  # server without a drafter
    speculative_url: Optional[str] = None  # server serving the drafter
    host: str = "127.0.0.1"
    port: int = 8000
    python: str = "python"
    served_model_name: str = "target"
    device: str = "auto"  # auto | cpu | cuda: which vLLM build the launch flags are for
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_space_gb: int = 2
    enforce_eager: bool = False
    launch_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 30.0
    health_poll_s: float = 5.0
    max_retries: int = 3
    backoff_s: float = 2.0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class FeaturesConfig:
    """Where the drafter's features (aux hidden states, target top-k) come from: the ``features=``
    group (``conf/features/``).

    ``mode``: ``offline`` -- ``extract.py`` captures them into the features store and
    ``train.py`` reads them back; ``none`` (extract only) -- ``extract.py`` writes the kept
    replies alone (token ids, loss masks, provenance; about 5 bytes a token); ``online``
    (train only) -- ``train.py`` reads the kept replies of any features folder (``none`` or
    ``offline``) and the capture engine (``engine=``: ``hf`` in process on the trainer's
    device, or a capture server) computes the features of each micro-batch while the drafter
    trains, ``queue_depth`` micro-batches ahead (:mod:`eagle3.train.online`). With
    ``cache_gb > 0`` (hybrid) the features captured are kept on disk in ``cache_dir`` (default
    ``<output_dir>/feature_cache``) up to that many GB and read back instead of captured again
    in later epochs. A capture server that fails is retried on the same micro-batch for up to
    ``retry_timeout_s`` seconds (training waits; no batch is skipped or repeated).
    """

    mode: str = "offline"  # offline | online (train) | none (extract)
    queue_depth: int = 4  # online: captured micro-batches waiting for the trainer at most
    cache_gb: float = 0.0  # online: hybrid cache budget in GB (decimal); 0 = capture every epoch
    cache_dir: Optional[str] = None  # online: where the hybrid cache lives; None = <output_dir>/feature_cache
    retry_timeout_s: float = 600.0  # online with a capture server: how long one micro-batch is retried


FEATURE_MODES = {"extract": ("offline", "none"), "train": ("offline", "online")}


@dataclass
class RemoteEngineConfig:
    """``engine=remote`` (``train.py features=online`` only): a capture node on another host
    (``python -m eagle3.engines.remote``, :mod:`eagle3.engines.remote`), its tensors read from a
    Mooncake store (hs-connectors' ``MooncakeHiddenStatesStore``), only token ids and transfer
    manifests over HTTP."""

    name: str = "remote"
    url: Optional[str] = None  # the capture node, http://HOST:PORT
    master: Optional[str] = None  # the Mooncake master, HOST:PORT (mooncake_master --port PORT)
    local_hostname: str = "127.0.0.1"  # the address the node's store traffic reaches this trainer at
    protocol: str = "tcp"  # tcp | rdma (with device_name, e.g. mlx5_0)
    device_name: str = ""
    segment_mb: int = 256  # memory this trainer gives the store, MiB (the node's holds the captures)
    timeout_s: float = 600.0  # one capture request
    fetch_timeout_s: float = 120.0  # a published capture becoming readable


# The schema of each `engine=` choice (conf/engine/<name>.yaml), for checks made before Hydra runs.
ENGINE_SCHEMAS = {"hf": HFEngineConfig, "sglang": SGLangEngineConfig, "vllm": VLLMEngineConfig,
                  "remote": RemoteEngineConfig}
