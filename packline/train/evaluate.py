"""Evaluation on the val split: per-token loss over packed rows, and answer accuracy of
greedy generation on the built-in set's checkable questions."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from packline.energon.loader import read_conversations, val_loader
from packline.energon.packing import PackingSettings, make_encoder
from packline.packing.thd import to_device
from packline.qwen.forward import packed_loss
from packline.qwen.generate import generate_answer, message_text, sample_prompt


@torch.no_grad()
def eval_loss(
    model,
    dataset_path: Path,
    processor_dir: Path,
    settings: PackingSettings,
    *,
    buffer: int,
    image_token_id: int,
    video_token_id: int | None = None,
) -> tuple[float, float, int]:
    """(mean token loss, token accuracy, target tokens) over the whole val split, packed;
    token accuracy: the share of target tokens that are the model's top prediction."""
    model.eval()
    loader = val_loader(
        dataset_path, make_encoder("lazy", processor_dir, settings), packing_buffer_size=buffer
    )
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    targets = hits = 0
    for pack in loader:
        batch = to_device(pack.batch, device)
        if not batch.num_conversations:
            continue
        loss, n, right = packed_loss(
            model,
            batch,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            with_hits=True,
        )
        total += loss.double().cpu()
        targets += n
        hits += right
    if not targets:
        return float("nan"), float("nan"), 0
    return float(total / targets), hits / targets, targets


def _val_questions(dataset_path: Path, max_samples: int):
    """(sample, its first checkable question) for the first ``max_samples`` val
    conversations that have one, in the val split's fixed order."""
    asked = 0
    for sample in read_conversations(dataset_path, "val"):
        if asked >= max_samples:
            return
        answers = sample.meta.get("answers") or []
        if answers:
            asked += 1
            yield sample, answers[0]


class AnswerScorer(Protocol):
    """How a data set grades the answers its val samples ask (``meta.answers``: the turn, the
    question kind, the expected answer); the built-in set's is
    :data:`packline.shapes.answers.SHAPES_SCORER`."""

    #: every answer a question of a kind can have, for the kinds with a closed set
    choices: Mapping[str, tuple[str, ...]]

    def normalize(self, text: str) -> str: ...

    def matches(self, expected: str, generated: str, kind: str) -> bool: ...


def guess_chance(
    asked: list[tuple[str, str]], choices: Mapping[str, tuple[str, ...]]
) -> tuple[float, dict[str, float]]:
    """Accuracy of guessing uniformly among the answers a question kind can have, over the
    ``asked`` (kind, normalized answer) pairs: (Σ 1/|answers of the question's kind| / N,
    that per kind). A kind's answers are its ``choices`` (a closed set), or else at least
    the distinct ones asked; a kind with no closed set whose questions were all answered
    alike has no chance to tell (one answer is not a choice): it is left out of both, and
    the overall figure is over the other kinds' questions.

        >>> guess_chance([("colour", "red"), ("count", "3"), ("count", "4")],
        ...              {"colour": ("red", "green", "blue", "yellow")})
        (0.4166666666666667, {'colour': 0.25, 'count': 0.5})
        >>> guess_chance([("colour", "red"), ("shape", "star"), ("shape", "star")],
        ...              {"colour": ("red", "green", "blue", "yellow")})  # shape: one answer
        (0.25, {'colour': 0.25})
    """
    distinct = Counter(kind for kind, _ in set(asked))
    by_kind = {
        kind: 1 / max(n, len(choices.get(kind, ())))
        for kind, n in sorted(distinct.items())
        if n > 1 or len(choices.get(kind, ())) > 1
    }
    counted = [kind for kind, _ in asked if kind in by_kind]
    if not counted:
        return float("nan"), {}
    return sum(by_kind[kind] for kind in counted) / len(counted), by_kind


def chance_accuracy(
    dataset_path: Path, *, max_samples: int, scorer: AnswerScorer
) -> tuple[float, dict[str, float]]:
    """:func:`guess_chance` of the questions :func:`eval_accuracy` asks."""
    asked = [
        (q["kind"], scorer.normalize(q["answer"]))
        for _, q in _val_questions(dataset_path, max_samples)
    ]
    return guess_chance(asked, scorer.choices)


@torch.no_grad()
def eval_accuracy(
    model,
    processor,
    dataset_path: Path,
    *,
    max_samples: int,
    scorer: AnswerScorer,
    max_new_tokens: int = 32,
) -> tuple[float, int, dict[str, dict[str, float]], list[dict[str, Any]]]:
    """(share of correct answers, questions asked, per question kind: its questions and
    share of correct answers, every answer): for each val conversation with a checkable
    answer, the model answers the first such question greedily. An answer is the sample's
    ``key``, the question's ``kind``, the ``question`` (the last user message's text), the
    ``expected`` answer, the model's ``reply`` and whether it is ``right``."""
    model.eval()
    asked: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    answers = []
    for sample, first in _val_questions(dataset_path, max_samples):
        prompt = sample_prompt(sample, first["turn"])
        text = generate_answer(model, processor, prompt, max_new_tokens=max_new_tokens)
        right = scorer.matches(first["answer"], text, first["kind"])
        asked[first["kind"]] += 1
        correct[first["kind"]] += right
        answers.append(
            {
                "key": sample.__key__,
                "kind": first["kind"],
                "question": message_text(prompt.conversation[-1]),
                "expected": first["answer"],
                "reply": text,
                "right": bool(right),
            }
        )
    total = sum(asked.values())
    by_kind = {
        kind: {"questions": n, "accuracy": correct[kind] / n} for kind, n in sorted(asked.items())
    }
    accuracy = sum(correct.values()) / total if total else float("nan")
    return accuracy, total, by_kind, answers


@dataclass
class EvalResult:
    """One evaluation of the model on the val split."""

    loss: float
    """Mean token loss over the whole val split, packed."""
    token_accuracy: float
    """Share of the val split's target tokens that are the model's top prediction."""
    accuracy: float
    """Share of the asked questions answered correctly (nan when none was asked)."""
    questions: int
    by_kind: dict[str, dict[str, float]]
    """Per question kind: its ``questions`` and ``accuracy``."""
    answers: list[dict[str, Any]]
    """Every question asked and the model's reply (:func:`eval_accuracy`)."""


class Evaluator:
    """The trainer's validator: :func:`eval_loss` and :func:`eval_accuracy` of one model on
    the prepared val split, with the run's packing settings."""

    def __init__(
        self,
        *,
        dataset_path: Path,
        processor_dir: Path,
        processor,
        packing: PackingSettings,
        packing_buffer_size: int,
        image_token_id: int,
        eval_samples: int,
        scorer: AnswerScorer,
        video_token_id: int | None = None,
    ):
        self.dataset_path = Path(dataset_path)
        self.processor_dir = Path(processor_dir)
        self.processor = processor
        self.packing = packing
        self.packing_buffer_size = packing_buffer_size
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.eval_samples = eval_samples
        self.scorer = scorer

    def chance(self) -> tuple[float, dict[str, float]]:
        """:func:`chance_accuracy` of the questions :meth:`evaluate` asks."""
        return chance_accuracy(self.dataset_path, max_samples=self.eval_samples, scorer=self.scorer)

    def evaluate(self, model) -> EvalResult:
        loss, token_accuracy, _ = eval_loss(
            model,
            self.dataset_path,
            self.processor_dir,
            self.packing,
            buffer=self.packing_buffer_size,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
        )
        acc, asked, by_kind, answers = eval_accuracy(
            model,
            self.processor,
            self.dataset_path,
            max_samples=self.eval_samples,
            scorer=self.scorer,
        )
        return EvalResult(
            loss=loss,
            token_accuracy=token_accuracy,
            accuracy=acc,
            questions=asked,
            by_kind=by_kind,
            answers=answers,
        )


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor of ``model.state_dict()``: its name, dtype, shape and bytes.
    Equal digests mean the very same weights, bit for bit.

    >>> torch.manual_seed(0) and None
    >>> a = torch.nn.Linear(2, 1)
    >>> b = torch.nn.Linear(2, 1)
    >>> weights_digest(a) == weights_digest(b)
    False
    >>> _ = b.load_state_dict(a.state_dict())
    >>> weights_digest(a) == weights_digest(b)
    True
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().contiguous().reshape(-1)
        h.update(f"{name} {flat.dtype} {tuple(t.shape)}\n".encode())
        h.update(flat.view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class EvalMemo:
    """One evaluation kept in ``path`` under what it evaluated: the model's weights
    (:func:`weights_digest`) and ``key``, which names everything else the evaluation reads
    (the train stage's fingerprint: the val split, the processor, the settings). Packing on
    and off start from the very same weights, so the run that starts second reads the first
    one's start evaluation instead of repeating it (about 10 s of ``make run``'s train stage
    on 2 cores); any other weights or key evaluate afresh."""

    path: Path
    key: str

    def get(self, digest: str) -> tuple[EvalResult, str] | None:
        """The kept result for weights ``digest`` and the run that evaluated it, if any."""
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if kept.get("key") != self.key or kept.get("digest") != digest:
            return None
        return EvalResult(**kept["result"]), kept["run"]

    def put(self, digest: str, result: EvalResult, run: str) -> None:
        """Keep ``result``, evaluated by ``run`` on weights ``digest`` (replacing any other)."""
        record = {"key": self.key, "digest": digest, "run": run, "result": asdict(result)}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)
