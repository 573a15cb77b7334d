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

Use it in a subprocess (``PYTHONPATH=<tree>``): a ``megatron.bridge`` on ``sys.path`` would make
the rest of the suite believe Bridge is installed.
"""

from __future__ import annotations

import shutil
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


def bridge_data_tree(cache: Path = CACHE) -> Path:
    """The dir to put on ``PYTHONPATH`` (built once per pinned version)."""
    with cache_lock(cache):
        return _bridge_data_tree(cache)


def _bridge_data_tree(cache: Path) -> Path:
    root = cache / ("bridge-data-" + "+".join(PINNED))
    stamp = root / ".ok"
    if stamp.is_file():
        return root
    src = _fetch_sources(cache)
    tmp = root.with_name(root.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for rel in MODULES:
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dest)
    for rel, names in PLACEHOLDERS.items():
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(_placeholder_source(names))
    # An empty __init__.py per package level below the namespace package ``megatron``
    # (which Energon shares).
    for d in sorted({p.parent for p in tmp.rglob("*.py")}):
        while d != tmp / "megatron":
            (d / "__init__.py").touch()
            d = d.parent
    stamp_text = "\n".join(PINNED)
    (tmp / ".ok").write_text(stamp_text)
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root
