"""The choices of the config's enumerated keys (``packing.algorithm``, ``train.backend``, ...).

A leaf: it imports nothing of packline, so the config tree (``schemas/config.py``) and the
rules about it (``schemas/rules.py``) both use these without importing each other.
``schemas.config`` exports them too.
"""

from __future__ import annotations

from enum import Enum

STAGES = ("prepare", "connect", "validate", "train")
"""The pipeline's stages, in order: each publishes ``<work_dir>/<stage>``."""

#: The Qwen3-VL language model's weights LoRA can adapt, by their HF names: the attention
#: and dense-MLP Linear layers (PEFT ``target_modules``) and the MoE experts' 3-D parameters
#: (PEFT ``target_parameters``; Linear names match nothing there). The ViT is never adapted.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Balance(Enum):
    """What else selection balances (``packline/packing/balance.py``)."""

    none = "none"
    """Fill only."""
    flops = "flops"
    """Packs of even compute as well: each pack's FLOPs (attention per conversation, the
    vision tower per image) close to a full row's at the stream's FLOPs per token, so
    data-parallel ranks finish each step together. Fill may drop by up to about 1%."""


class Algorithm(Enum):
    """Packing selection algorithm, run on each buffer round (``packline/packing/selection.py``)."""

    ffd = "ffd"
    """Plain first-fit decreasing: each sample, longest first, goes to the first pack with
    room. What Megatron-Bridge's own encoder runs; ``packing.packer: bridge`` requires it."""
    bfd = "bfd"
    """Plain best-fit decreasing: each sample goes to the fullest pack that still has room."""
    refined = "refined"
    """First-fit decreasing, then, while the round has more packs than its lower bound, the
    minimum-slack packing of the round when it needs fewer packs and a short, budgeted
    search for one pack fewer still. Never more packs than ``ffd``."""


class Packer(Enum):
    """Who packs with ``train.backend: megatron`` (``packing.packer``)."""

    packline = "packline"
    """packline's dataset for Bridge (``packline/megatron/dataset.py``): Bridge's encoder with
    lazy exact lengths from connect, ``packing.algorithm`` and carry-over."""
    bridge = "bridge"
    """Bridge's own ``EnergonDatasetConfig`` and encoder: every buffered sample processed
    before selection, plain first-fit decreasing, no carry-over (to compare, or fall back)."""


class SourceKind(Enum):
    """What ``data.source`` names (told apart by :func:`schemas.config.source_kind`)."""

    synthetic = "synthetic"
    """The built-in shapes set, generated into the work dir."""
    folder = "folder"
    """A folder holding ``conversations.jsonl`` and the media it names."""
    jsonl = "jsonl"
    """One ``.jsonl`` file or a glob of them (``data/*.jsonl``), rows as a folder's
    ``conversations.jsonl`` holds them, each row's media relative to its own file's folder."""
    llava = "llava"
    """A LLaVA-style ``.json`` file: one list of records with ``image``/``images`` and
    ``conversations`` of ``from``/``value`` turns, its media under ``data.media_dir``."""
    energon = "energon"
    """An existing Energon dataset (a dir with ``.nv-meta/dataset.yaml``) in
    Megatron-Bridge's ChatML layout, adopted in place: its shards are read, never rewritten."""
    arrow = "arrow"
    """A folder ``datasets``' ``save_to_disk`` wrote (``dataset_dict.json`` and a folder per
    split, or one split's ``state.json``): its Arrow files, split by split, read as Parquet
    rows are."""
    parquet = "parquet"
    """Parquet files (one file, a glob, or a folder of them: a Hugging Face dataset's
    layout), read a row group at a time: rows in one of the layouts of
    :mod:`packline.sources.layouts`, images and videos as bytes, HF ``Image`` structs or
    paths relative to the file's folder."""


class OverlengthPolicy(Enum):
    """What happens to a conversation longer than ``packing.seq_length``."""

    drop = "drop"
    """Drop it and count it in the ledger as ``overlength``."""
    fail = "fail"
    """Stop with an error naming the sample."""


class EncoderMode(Enum):
    """When the image processor runs relative to pack selection."""

    lazy = "lazy"
    """Only the exact length before selection; images processed once selected (less
    worker memory, so larger buffers)."""
    eager = "eager"
    """The full processor before selection, as Megatron-Bridge does (the baseline)."""


class Attention(Enum):
    """Attention of the language model in the local backend (the vision tower keeps sdpa);
    ``packline/qwen/attention.py`` holds the kernels."""

    auto = "auto"
    """``varlen`` on a CUDA GPU that runs it (Ampere or later), else ``thd``."""
    varlen = "varlen"
    """PyTorch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``)
    over the whole packed row, fed the packer's ``cu_seqlens``: one kernel per layer, Σ lᵢ²
    work (as Megatron's THD layout). CUDA only; padded batches and generation use sdpa."""
    thd = "thd"
    """A packed row attends once per conversation (causal sdpa on each one's slice, Σ lᵢ²):
    the CPU's varlen; padded batches and generation use sdpa."""
    flex = "flex"
    """HF's flex_attention with a document block mask built once per forward (compiled on
    first use). On CPU PyTorch's FlexAttention has no backward: it evaluates, it does not
    train there."""
    sdpa = "sdpa"
    """HF sdpa: a packed row gets a dense T×T block-diagonal mask (T² work per row; the
    ``flops/*`` counters still count attention per conversation, as thd runs it)."""
    eager = "eager"
    """HF eager (matmul + softmax), the same dense mask as sdpa; slowest, for checks."""


class Precision(Enum):
    """Compute precision of the local backend's training forwards (weights, gradients and
    optimizer state stay fp32)."""

    auto = "auto"
    """bf16 on a GPU that has it (Ampere and later), fp32 elsewhere: CPU runs stay exact
    (packed and unpacked agree to 1e-6, a resumed run repeats every loss bitwise)."""
    bf16 = "bf16"
    """bf16 autocast on any device: a GPU without bf16 is an error; CPUs emulate it where
    they lack native bf16 (``avx512_bf16``/AMX)."""
    fp32 = "fp32"
    """fp32 everywhere (for numerics checks on a GPU)."""


class LossWeighting(Enum):
    """How the loss of a global batch weighs its tokens (``train.loss``)."""

    token = "token"
    """Every target token alike: Σ token loss ÷ the global batch's target tokens (over all
    micro-batches and ranks). A long conversation weighs more; packed and unpacked agree."""
    sample = "sample"
    """Every conversation alike: each one's mean token loss, averaged over the global
    batch's conversations (over all micro-batches and ranks). Packed and unpacked agree:
    a conversation's weight comes from its own tokens, never from its row."""


class TrainBackend(Enum):
    local = "local"
    """HF transformers + PEFT in this process (CPU or one GPU), torchrun for DP."""
    megatron = "megatron"
    """Megatron-Bridge inside the NeMo container (cluster only)."""


class PipelineSchedule(Enum):
    """``torch.distributed.pipelining`` schedule of the local backend's pipeline stages."""

    gpipe = "gpipe"
    """All micro-batches forward, then all backward: simplest, holds every micro-batch's
    activations at once."""
    one_f_one_b = "1f1b"
    """One forward, one backward, interleaved after warm-up: at most P micro-batches'
    activations per stage; needs at least P micro-batches per step."""


class ExecutorKind(Enum):
    local = "local"
    slurm = "slurm"


class CudaGraphImpl(Enum):
    """Megatron's CUDA graph implementation (``cuda_graph_impl``)."""

    none = "none"
    """No CUDA graphs (what packing needs: packed rows change shape every step)."""
    local = "local"
    """Megatron-core's own CUDA graphs."""
    transformer_engine = "transformer_engine"
    """Transformer Engine's CUDA graphs."""
