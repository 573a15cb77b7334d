"""Megatron-Bridge's own data path, runnable here: its module files, unchanged, under a
namespace package.

Bridge's package ``__init__`` registers every model bridge and so imports megatron-core and
transformer-engine, which need CUDA and Python 3.12. Its data-path modules (the
``ChatMLWebdataset`` sample type, the conversation normaliser, the Qwen-VL task encoder and
collate function, the packing algorithms) import only torch, numpy, Energon, webdataset,
transformers and ``qwen_vl_utils``. :func:`bridge_data_tree` copies exactly those files from
the pinned wheel (:data:`tests.bridge_source.PINNED`) into ``tests/.cache/``, byte for byte,
with an empty ``__init__.py`` for each package level, so that
``import megatron.bridge.models.qwen_vl.data.energon`` runs Bridge's real code.

Placeholders: one module of the data path, ``megatron/bridge/data/datasets/utils.py`` (where
``IGNORE_INDEX`` and ``GENERATION_REGEX`` live), also imports three names that only its
dataset-building functions use, never the data path, and the dataset config's modules import
two names for type annotations only: :data:`PLACEHOLDERS` lists them. Each is a
stand-in that raises when it is called or used, so a test that reached one would fail loudly.
No Bridge function is replaced.

:func:`bridge_main_tree` does the same from Bridge *main* (native Energon packing, no release
has it), unpacked from the vendored archive :data:`MAIN_ARCHIVE`, with the modules of
:data:`MAIN_MODULES`: the data path above plus ``data/utils.py`` (``get_dataset_provider``),
whose other dataset builders and config classes are placeholders too
(:data:`MAIN_PLACEHOLDERS`: only its registry's ``isinstance`` checks see them, and a
placeholder class is an instance of nothing).

Use it in a subprocess (``PYTHONPATH=<tree>``): a ``megatron.bridge`` on ``sys.path`` would make
the rest of the suite believe Bridge is installed.
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

from tests.bridge_source import CACHE, PINNED, _fetch_sources, cache_lock

#: Bridge's data-path modules, copied unchanged from the pinned wheel.
MODULES = (
    "megatron/bridge/data/energon/task_encoder_utils.py",
    "megatron/bridge/data/energon/metadata.py",
    "megatron/bridge/data/conversation_processing.py",
    "megatron/bridge/data/datasets/utils.py",
    "megatron/bridge/data/collators/sequence.py",
    "megatron/bridge/data/collators/sequence_padding.py",
    "megatron/bridge/data/collators/visual.py",
    "megatron/bridge/data/packing/in_batch.py",
    "megatron/bridge/data/packing/algorithms.py",
    "megatron/bridge/data/token_utils.py",
    "megatron/bridge/models/qwen_vl/data/energon.py",
    "megatron/bridge/models/qwen_vl/data/collate_fn.py",
    "megatron/bridge/training/utils/visual_inputs.py",
    "megatron/bridge/utils/safe_pickle.py",
    # the declarative dataset config and the builder that turns it into the task encoder
    "megatron/bridge/data/builders/energon.py",
    "megatron/bridge/data/base.py",
    "megatron/bridge/data/energon/base_energon_datamodule.py",
    "megatron/bridge/models/hf_pretrained/utils.py",
)

_RAISING = '''\
"""Placeholder written by tests/bridge_data.py: the data path never uses these names."""


class _Placeholder(type):
    def __getattr__(cls, name):
        raise RuntimeError(f"placeholder {cls.__name__}.{name} reached: not part of the data path")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"placeholder {cls.__name__} called: not part of the data path")


def _function(*args, **kwargs):
    raise RuntimeError("placeholder function called: not part of the data path")
'''

#: Module → names it must provide, imported by ``data/datasets/utils.py`` and used only by its
#: dataset builders (multi-storage-client paths, Megatron tokenizers, the local rank).
PLACEHOLDERS = {
    "megatron/core/msc_utils.py": ("MultiStorageClientFeature",),
    "megatron/core/tokenizers.py": ("MegatronTokenizer",),
    "megatron/bridge/utils/common_utils.py": ("get_local_rank_preinit",),
    # type annotations of the dataset config / data module (distributed process groups and the
    # Megatron tokenizer object; the Qwen-VL task encoder takes HF's tokenizer instead)
    "megatron/core/process_groups_config.py": ("ProcessGroupCollection",),
    "megatron/bridge/training/tokenizers/tokenizer.py": ("MegatronTokenizer",),
}


def _placeholder_source(names: tuple[str, ...]) -> str:
    lines = [_RAISING]
    for name in names:
        if name[0].isupper():
            lines.append(f"\n\nclass {name}(metaclass=_Placeholder):\n    pass\n")
        else:
            lines.append(f"\n\n{name} = _function\n")
    return "".join(lines)


#: Bridge main at ``containers/Dockerfile``'s ``BRIDGE_COMMIT``, as ``git archive`` wrote it.
MAIN_ARCHIVE = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "vendor"
    / "megatron-bridge-main-067f987df.tar.gz"
)
#: Bridge main's data path: the release's modules plus ``get_dataset_provider``'s module.
MAIN_MODULES = (*MODULES, "megatron/bridge/data/utils.py")
#: The release's placeholders plus the names ``data/utils.py`` imports for its other dataset
#: kinds (GPT pretraining and SFT, mock VLM, FIM) and its rank-0 printing.
MAIN_PLACEHOLDERS = {
    **PLACEHOLDERS,
    "megatron/bridge/utils/common_utils.py": ("get_local_rank_preinit", "print_rank_0"),
    "megatron/core/datasets/blended_megatron_dataset_builder.py": (
        "BlendedMegatronDatasetBuilder",
    ),
    "megatron/core/datasets/blended_megatron_dataset_config.py": ("BlendedMegatronDatasetConfig",),
    "megatron/core/datasets/gpt_dataset.py": ("GPTDataset", "MockGPTDataset"),
    "megatron/core/pipeline_parallel/utils.py": ("is_pp_first_stage", "is_pp_last_stage"),
    "megatron/bridge/data/builders/direct_hf_sft.py": (
        "DirectHFSFTDatasetConfig",
        "direct_hf_sft_train_valid_test_datasets_provider",
    ),
    "megatron/bridge/data/builders/gpt_sft.py": (
        "GPTSFTDatasetConfig",
        "gpt_sft_train_valid_test_datasets_provider",
    ),
    "megatron/bridge/data/builders/mock_vlm_sft.py": (
        "MockVLMSFTDatasetConfig",
        "mock_vlm_sft_train_valid_test_datasets_provider",
    ),
    "megatron/bridge/data/datasets/fim_dataset.py": ("GPTFIMDataset",),
    "megatron/bridge/training/config.py": (
        "GPTDatasetConfig",
        "GPTFIMDatasetConfig",
        "MockGPTDatasetConfig",
    ),
}


def bridge_data_tree(cache: Path = CACHE) -> Path:
    """The dir to put on ``PYTHONPATH`` (built once per pinned version)."""
    with cache_lock(cache):
        root = cache / ("bridge-data-" + "+".join(PINNED))
        if (root / ".ok").is_file():
            return root
        return _build_tree(root, _fetch_sources(cache), MODULES, PLACEHOLDERS)


def bridge_main_tree(cache: Path = CACHE, archive: Path = MAIN_ARCHIVE) -> Path:
    """The dir to put on ``PYTHONPATH`` for Bridge main's data path (built once per archive)."""
    with cache_lock(cache):
        root = cache / ("bridge-data-" + archive.name.removesuffix(".tar.gz"))
        if (root / ".ok").is_file():
            return root
        src = cache / (archive.name + ".src")
        if src.exists():
            shutil.rmtree(src)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
        return _build_tree(root, src / "src", MAIN_MODULES, MAIN_PLACEHOLDERS)


def _build_tree(
    root: Path, src: Path, modules: tuple[str, ...], placeholders: dict[str, tuple[str, ...]]
) -> Path:
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for rel in modules:
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest)
    for rel, names in placeholders.items():
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(_placeholder_source(names))
    # An empty __init__.py per package level below the namespace package ``megatron``
    # (which Energon shares).
    for d in sorted({p.parent for p in tmp.rglob("*.py")}):
        while d != tmp / "megatron":
            (d / "__init__.py").touch()
            d = d.parent
    (tmp / ".ok").write_text(str(src))
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root
