"""Export a trained run for use without packline: the LoRA adapter (PEFT layout), or the
base with the adapter merged in as one Hugging Face checkpoint.

- ``train.backend: local``: the adapter is the PEFT dir the train stage saved
  (:func:`packline.catalog.adapter_dir`), copied as it is (``adapter_config.json``,
  ``adapter_model.safetensors``, its ``README.md`` model card). Merged: base + adapter loaded
  as :mod:`packline.serving.chat` loads them (fp32), PEFT's ``merge_and_unload()``, then
  ``save_pretrained`` of the model (safetensors) and of connect's processor into one dir that
  ``AutoModelForImageTextToText`` / ``AutoProcessor.from_pretrained`` load on their own.
- ``train.backend: megatron``: Megatron-Bridge's checkpoint under
  ``<work>/train/megatron/checkpoints`` holds the adapters only (a PEFT run saves no base
  weights; the base is the HF dir ``model.path``). Bridge's own export path turns it into a
  PEFT adapter: ``AutoBridge.from_hf_pretrained(model.path).export_adapter_ckpt(<latest
  iter_*>, DIR)`` (Bridge's ``examples/conversion/adapter/export_adapter.py``); merged, that
  adapter then goes through the same merge as a local run's. Bridge's ``export_ckpt`` wants a
  whole Megatron checkpoint, which a PEFT run never writes, and its ``merge_lora.py`` example
  a Megatron base checkpoint, which packline never makes. Bridge imports only in the
  training container: elsewhere :func:`bridge_export_command` is the command that runs this
  export there.

Which of the two a run takes is its backend's (:meth:`packline.backends.Backend.export`,
behind :func:`packline.backends.export_run`). Every export is written to a temp dir beside
DIR and renamed into place
(:func:`packline.workdir.publish`); a DIR packline did not make is refused when it is not
empty (:func:`packline.workdir.claim_dir`), never overwritten.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from packline.catalog import validated_config_path
from packline.workdir import MARKER, claim_dir, new_temp_dir, publish, publish_modes
from schemas.config import PipelineConfig
from schemas.errors import UserError

#: The adapter files a PEFT ``save_pretrained`` writes (the model card when it wrote one).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")


def publish_into(to: Path, write) -> Path:
    """Run ``write(tmp)`` on a fresh temp dir beside ``to``, then rename it to ``to``."""
    try:
        claim_dir(to, "export")  # before any work: a non-empty dir packline did not make
    except UserError:
        raise UserError(
            [
                f"--to {to} exists and was not made by packline (it is a link, or a dir that "
                f"is not empty and has no {MARKER}): export writes a new or empty dir, or "
                "replaces an earlier export; fix: choose another --to"
            ],
            "refusing to overwrite data packline did not create",
        ) from None
    tmp = new_temp_dir(to.parent, f".tmp-export-{to.name}-")
    try:
        write(tmp)
        publish_modes(tmp)  # some writers leave their files private (0600)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, to)
    return to


def copy_adapter(adapter: Path, out: Path) -> None:
    """The PEFT adapter files of ``adapter`` into dir ``out``."""
    for name in ADAPTER_FILES:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, out / name)


def merge_adapter(cfg: PipelineConfig, adapter: Path, out: Path) -> None:
    """Base + ``adapter`` merged (PEFT ``merge_and_unload``), saved with connect's processor
    into dir ``out`` as one HF checkpoint (safetensors, fp32)."""
    from packline.qwen.generate import quiet_libraries
    from packline.serving.chat import load_tuned

    model, processor = load_tuned(cfg, adapter)
    with quiet_libraries():
        merged = model.merge_and_unload()
        # training turns the cache off (packed rows); generation wants it
        getattr(merged.config, "text_config", merged.config).use_cache = True
        merged.save_pretrained(out)
        processor.save_pretrained(out)


# --- train.backend: megatron -----------------------------------------------------------------


def bridge_checkpoint_dir(cfg: PipelineConfig) -> Path:
    """Where the megatron train stage's Bridge run saves (``checkpoint.save``)."""
    from packline.megatron.overrides import checkpoint_dir

    return Path(checkpoint_dir(cfg))


def latest_iteration(checkpoints: Path) -> Path:
    """The newest ``iter_NNNNNNN`` dir of a Bridge checkpoint dir (the one Bridge's own
    ``AutoBridge.load_megatron_model`` picks); UserError when there is none."""
    iters = [d for d in Path(checkpoints).glob("iter_*") if d.is_dir() and d.name[5:].isdigit()]
    if not iters:
        raise UserError(
            [f"no Bridge checkpoint (iter_*) in {checkpoints}; fix: train first (packline run)"]
        )
    return max(iters, key=lambda d: int(d.name[5:]))


def _bridge_base(cfg: PipelineConfig) -> str:
    if not cfg.model.path:
        raise UserError(
            ["train.backend megatron exports against the HF base model.path, which is null"]
        )
    return str(cfg.model.path)


def bridge_export(cfg: PipelineConfig, out: Path, *, merge: bool = False) -> None:
    """In Bridge's container: Bridge's checkpoint as a PEFT adapter in ``out`` (Bridge's
    ``export_adapter_ckpt``, on CPU), or with ``merge`` that adapter merged into the base
    (:func:`merge_adapter`) and the adapter left out."""
    from megatron.bridge import AutoBridge

    base = _bridge_base(cfg)
    checkpoint = latest_iteration(bridge_checkpoint_dir(cfg))
    adapter = out / "bridge-adapter" if merge else out
    bridge = AutoBridge.from_hf_pretrained(base)
    bridge.export_adapter_ckpt(
        peft_checkpoint=str(checkpoint), output_path=str(adapter), show_progress=False
    )
    if merge:
        merge_adapter(cfg, adapter, out)
        shutil.rmtree(adapter)


def validated_config(cfg: PipelineConfig) -> Path:
    """The resolved config the validate stage checked (what the megatron run trained with)."""
    path = validated_config_path(cfg)
    if not path.is_file():
        raise UserError([f"no validated config at {path}; fix: run the pipeline first"])
    return path


def bridge_export_command(cfg: PipelineConfig, to: Path, *, merge: bool = False) -> str:
    """The shell command that runs :func:`bridge_export` in the training container: one
    SLURM task (no GPU: Bridge exports on CPU) on the train job's image, with the work dir
    and ``to``'s parent mounted at their own paths, running ``packline export`` on the
    validated config."""
    s = cfg.executor.slurm
    _bridge_base(cfg)
    work = str(cfg.work_path)
    mounts = list(s.container_mounts)
    for path in (work, str(Path(to).parent)):
        if not any(
            path == m.split(":")[0] or path.startswith(m.split(":")[0] + "/") for m in mounts
        ):
            mounts.append(f"{path}:{path}")
    srun = ["srun", "--nodes=1", "--ntasks=1"]
    if s.account:
        srun.append(f"--account={s.account}")
    if s.partition:
        srun.append(f"--partition={s.partition}")
    if s.time:
        srun.append(f"--time={s.time}")
    if s.env:
        srun.append("--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in s.env.items())]))
    if s.container_image:
        srun += [f"--container-image={s.container_image}", "--container-mounts=" + ",".join(mounts)]
    export = ["packline", "export", str(validated_config(cfg)), "--to", str(to)]
    lines = [shlex.join(srun), shlex.join([*export, *(["--merge"] if merge else [])])]
    return " \\\n  ".join(lines)
