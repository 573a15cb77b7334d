"""What a training run's ``adapter/`` holds, so that it travels: PEFT's layout
(``adapter_config.json``, ``adapter_model.safetensors``) naming its base as the user gave it,
with ``task_type`` set, a model card (``README.md``) from the run, and the user's file modes.

One home for the adapter dir: the train stage writes it here; ``packline chat`` and
``packline export`` read it through :func:`packline.catalog.adapter_dir`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from packline.progress import si
from packline.report.summary import RunSummary
from packline.workdir import publish_modes
from schemas.config import PROJECT_ROOT, PipelineConfig

TASK_TYPE = "CAUSAL_LM"
"""PEFT's task type of a Qwen3-VL adapter: it generates text (the image and video inputs ride
along as keyword arguments), as TRL's vision-language fine-tunes record it."""


def base_reference(cfg: PipelineConfig) -> str:
    """``model.path`` as a user would write it: inside this checkout, relative to its root
    (the shipped ``models/tiny-base``, which ``${project:...}`` resolved to an absolute path);
    elsewhere as given (an absolute dir, or an HF id that was never a path)."""
    return _as_given(cfg.model.path or f"tiny Qwen3-VL at random init (seed {cfg.train.seed})")


def _as_given(given: str) -> str:
    path = Path(given)
    if path.is_absolute() and path.resolve().is_relative_to(PROJECT_ROOT):
        return path.resolve().relative_to(PROJECT_ROOT).as_posix()
    return given


def save_adapter(
    model, dest: Path, cfg: PipelineConfig, run: RunSummary, forecast: dict[str, Any], fp: str
) -> Path:
    """Save ``model``'s adapters (a PEFT model) to ``dest`` as a dir that travels."""
    # The LM head, when adapted, stays frozen: save the adapters alone, not its base weights.
    model.save_pretrained(dest, save_embedding_layers=False)
    config_path = dest / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_reference(cfg)
    config["task_type"] = TASK_TYPE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (dest / "README.md").write_text(model_card(cfg, run, forecast, fp))
    publish_modes(dest)
    return dest


def _start_end(start: float | None, end: float | None, fmt: str) -> str:
    if end is None:
        return "not evaluated"
    return format(end, fmt) if start is None else f"{start:{fmt}} → {end:{fmt}}"


def _what_ran(ran: dict[str, str]) -> list[str]:
    """The model card's line on what trained (none for a summary without it)."""
    if not ran:
        return []
    checkpointing = "on" if ran.get("activation_checkpointing") == "true" else "off"
    return [
        "",
        f"What trained: `{ran.get('attention')}` attention, the base in "
        f"{ran.get('base_dtype')} and the adapters in {ran.get('adapter_dtype')} (compute "
        f"{ran.get('compute')}), activation checkpointing {checkpointing}, sharding: "
        f"{ran.get('sharding')}.",
    ]


def model_card(cfg: PipelineConfig, run: RunSummary, forecast: dict[str, Any], fp: str) -> str:
    """The adapter's ``README.md``: what it was trained on and how, what packing did, the
    eval figures, the config's fingerprint, and how to load it."""
    base = base_reference(cfg)
    # The processor: processor.path, else the built-in tiny one, saved beside the shipped base
    processor = _as_given(cfg.processor.path) if cfg.processor.path else base
    packed = run.run == "packed"
    flops = forecast.get("flops", {})
    buffer = str(cfg.packing.packing_buffer_size)
    fill_on = forecast.get("buffers", {}).get(buffer, {}).get("fill")
    fill_off = forecast.get("unpacked", {}).get("fill")
    lora = cfg.lora
    lines = [
        "---",
        f"base_model: {base}",
        "library_name: peft",
        "pipeline_tag: image-text-to-text",
        "tags: [lora, qwen3-vl, packline, sequence-packing]",
        "---",
        "",
        f"# {cfg.name} · {run.run} · LoRA adapter of {base}",
        "",
        f"A LoRA adapter (rank {lora.rank}, alpha {lora.alpha}, on "
        f"{', '.join(lora.target_modules) or 'no modules'}) trained by packline with sequence "
        f"packing {'on' if packed else 'off'}: {run.steps} optimizer steps at "
        f"{run.precision} on {run.ranks} rank(s), rows of {run.seq_length:,} tokens.",
        *_what_ran(run.ran),
        "",
        "## Data",
        "",
        f"- source: `{cfg.data.source}`"
        + (
            f" ({cfg.data.num_train:,} train, {cfg.data.num_val:,} validation conversations)"
            if cfg.data.source == "synthetic"
            else ""
        ),
        f"- {forecast.get('samples', 0):,} training samples, "
        f"{forecast.get('tokens', 0):,} tokens (connect's exact lengths)",
        "",
        "## Packing on vs off",
        "",
        "| | packed | unpacked |",
        "|---|---:|---:|",
    ]
    if fill_on is not None and fill_off is not None:
        lines.append(f"| forecast fill (buffer {buffer}) | {fill_on:.3f} | {fill_off:.3f} |")
    if flops:
        lines += [
            f"| executed FLOPs per epoch | {si(flops['epoch_executed_packed'], 'FLOP')} "
            f"| {si(flops['epoch_executed_unpacked'], 'FLOP')} |",
            f"| padding share of executed FLOPs | {flops['padding_share_packed']:.3f} "
            f"| {flops['padding_share_unpacked']:.3f} |",
        ]
    lines += [
        "",
        f"This run ({run.run}): fill {run.fill:.3f}, {run.conversations_per_row:.2f} "
        f"conversations per row, {si(run.real_tokens_per_s, 'tokens/s')} (real tokens), "
        f"{si(run.tflops_useful * 1e12, 'FLOP')} useful.",
        "",
        "## Evaluation (held-out validation conversations)",
        "",
        f"- eval loss: {_start_end(run.eval_loss_start, run.eval_loss, '.4f')}",
        f"- token accuracy: "
        f"{_start_end(run.eval_token_accuracy_start, run.eval_token_accuracy, '.3f')}",
        f"- answer accuracy: {_start_end(run.eval_accuracy_start, run.eval_accuracy, '.3f')}"
        + (
            f" (chance {run.eval_accuracy_chance:.3f})"
            if run.eval_accuracy_chance is not None and math.isfinite(run.eval_accuracy_chance)
            else ""
        ),
        f"- final train loss: {run.final_train_loss:.4f}",
        "",
        "## Provenance",
        "",
        f"- config `{cfg.name}`, fingerprint `{fp}` (the train stage's inputs and settings); "
        "the resolved config is `../config.yaml` beside this dir",
        "",
        "## Load it",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForImageTextToText, AutoProcessor",
        "",
        f'base = AutoModelForImageTextToText.from_pretrained("{base}")',
        'model = PeftModel.from_pretrained(base, "path/to/this/adapter")',
        f'processor = AutoProcessor.from_pretrained("{processor}")',
        "```",
        "",
        'Or with packline: `packline chat CONFIG "a question"`, and '
        "`packline export CONFIG --merge` for a merged Hugging Face checkpoint.",
        "",
    ]
    return "\n".join(lines)
