"""The training loop: AdamW on the head, warm-up and cosine decay, bf16 autocast on CUDA, gradient
clipping, a progress bar with the loss and each unrolled step's accuracy, and checkpoints to resume from.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import Eagle3Head
from specserve.train.attention import UnrolledAttention
from specserve.train.batches import collate, epoch_batches
from specserve.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from specserve.train.config import TrainConfig
from specserve.train.data import Sequence
from specserve.train.export import hf_tensors
from specserve.train.features import TargetFeatures, plain_torch
from specserve.train.initial_head import InitialHead
from specserve.train.schedule import WarmupCosine
from specserve.train.ttt import unrolled_loss
from specserve.train.vocab import DraftVocab

logger = logging.getLogger(__name__)

# Steps timed to fit the run into train_seconds: after the first few (allocation, kernel selection).
_TIMING_START, _TIMING_END = 3, 23
# Share of the measured pace the fitted plan relies on, for slower batches and validation passes.
_TIME_MARGIN = 0.9
_EVAL_BATCH_SIZE = 32


@dataclass
class StepStats:
    """A training step's figures, loss and hits still on the device: reading them waits for the step to finish,
    so the loop reads each only once the next step is queued, and a step holds no sync of its own."""

    loss: torch.Tensor
    correct: torch.Tensor  # [steps]
    counted: torch.Tensor  # [steps], on the host
    lr: float

    def read(self) -> tuple[float, list[float]]:
        """(loss, accuracy of each unrolled step)."""
        loss, *correct = torch.cat((self.loss[None], self.correct)).tolist()
        return loss, [c / max(n, 1) for c, n in zip(correct, self.counted.tolist())]


@dataclass
class Evaluation:
    loss: float
    accuracy: list[float]  # per unrolled step

    def describe(self) -> str:
        return f"loss {self.loss:.3f}, accuracy per draft step {'/'.join(f'{a:.2f}' for a in self.accuracy)}"


def build_head(target: ArchConfig, head_arch: ArchConfig, vocab: DraftVocab, aux_layers: tuple[int, ...],
               target_model: torch.nn.Module, device: str, seed: int, warm_start: bool,
               initial: InitialHead | None = None) -> Eagle3Head:
    """An EAGLE-3 head over the target's (frozen, shared) token embedding: initial's weights, or fresh ones
    initialised from seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(head_arch, UnrolledAttention(), vocab.size, target.hidden_size, aux_layers)
    head.d2t.copy_(vocab.d2t)
    if initial is not None:
        # In float32 whatever the export's dtype: AdamW steps on bf16 weights would round most updates away.
        head.load_weights(initial.weights_for(hf_tensors(head, vocab)))
    head = head.to(device)
    if warm_start:
        start_from_target(head, target_model, vocab)
    # Not trained and not exported: both loaders give the head the target's embedding when serving.
    head.embed_tokens = target_model.model.embed_tokens
    plain_torch(head)
    return head


@torch.no_grad()
def start_from_target(head: Eagle3Head, target_model: torch.nn.Module, vocab: DraftVocab) -> None:
    """Start the head where the target already is: its lm_head rows and final norm are the target's for the
    draft vocabulary, and fc passes the last auxiliary layer's input through. The head's first prediction is
    then the target's own reading of that layer (a rough guess at the next token), so training only has to
    move it one token on, and rare tokens begin with the target's output directions instead of noise."""
    head.lm_head.weight.copy_(target_model.lm_head.weight[vocab.draft_to_target.to(head.lm_head.weight.device)])
    head.norm.weight.copy_(target_model.model.norm.weight)
    hidden = head.cfg.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, -hidden:] = torch.eye(hidden)


class Trainer:
    def __init__(self, cfg: TrainConfig, features: TargetFeatures, head: Eagle3Head, vocab: DraftVocab,
                 train: list[Sequence], val: list[Sequence], identity: dict):
        self.cfg = cfg
        self.features = features
        self.head = head
        self.train_set, self.val_set = train, val
        self.identity = identity
        self.device = torch.device(cfg.device)
        self.target_to_draft = vocab.target_to_draft.to(self.device)
        self.draft_to_target = vocab.draft_to_target.to(self.device)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.batches_per_epoch = len(epoch_batches(train, cfg.batch_size, cfg.seed, 0))
        total = cfg.steps or cfg.epochs * self.batches_per_epoch
        # A short run still spends most of its steps at the full rate.
        self.schedule = WarmupCosine(cfg.lr, min(cfg.warmup_steps, total // 4), total)
        self.step = 0
        self.checkpoint_path = Path(cfg.work_dir) / CHECKPOINT_NAME

    # ---- checkpoints ----------------------------------------------------------------------------

    def save(self) -> None:
        head_state = {k: v for k, v in self.head.state_dict().items() if not k.startswith("embed_tokens.")}
        save_checkpoint(self.checkpoint_path, {
            "step": self.step, "schedule": self.schedule.state_dict(), "head": head_state,
            "optimizer": self.optimizer.state_dict(), "identity": self.identity,
        })

    def resume(self) -> bool:
        """Continue from the work directory's checkpoint, if there is one."""
        if not self.checkpoint_path.is_file():
            return False
        state = load_checkpoint(self.checkpoint_path, self.identity)
        missing, unexpected = self.head.load_state_dict(state["head"], strict=False)
        assert not unexpected and all(k.startswith("embed_tokens.") for k in missing), (missing, unexpected)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule = WarmupCosine(**state["schedule"])
        self.step = state["step"]
        logger.info("Resumed from %s at step %d of %d", self.checkpoint_path, self.step, self.schedule.total_steps)
        return True

    # ---- training -------------------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.on_cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, sequences: list[Sequence]):
        batch = collate(sequences, 64 if self.cfg.on_cuda else 1).to(self.device)
        # cuDNN's attention builds an execution plan for every new shape, a second each: batches
        # of varying length made that most of a step. Flash and memory-efficient kernels need none.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return self._unrolled_loss(batch)

    def _unrolled_loss(self, batch):
        states = self.features(batch)
        teacher = self.features.next_tokens(states.final, self.draft_to_target) if self.cfg.soft_labels else None
        with self._autocast():
            return unrolled_loss(self.head, states.aux, batch, self.target_to_draft, self.draft_to_target,
                                 self.cfg.ttt_steps, self.cfg.step_weight_decay, teacher)

    def train_step(self, sequences: list[Sequence]) -> StepStats:
        """One optimizer step, queued on the device; its loss and accuracy are read later (StepStats.read)."""
        result = self._loss(sequences)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        lr = self.schedule.lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step += 1
        return StepStats(result.loss.detach(), result.correct, result.counted, lr)

    @torch.no_grad()
    def evaluate(self, sequences: list[Sequence]) -> Evaluation | None:
        """Mean loss and per-step accuracy over sequences (None for none)."""
        if not sequences:
            return None
        ordered = sorted(sequences, key=lambda s: len(s.ids))
        loss, correct, counted = 0.0, 0, 0
        for start in range(0, len(ordered), _EVAL_BATCH_SIZE):
            chunk = ordered[start:start + _EVAL_BATCH_SIZE]
            result = self._loss(chunk)
            loss += float(result.loss) * len(chunk)
            correct, counted = correct + result.correct.cpu(), counted + result.counted
        accuracy = (correct / counted.clamp(min=1)).tolist()
        return Evaluation(loss / len(ordered), accuracy)

    def run(self, max_steps: int | None = None) -> None:
        """Train until the schedule ends (or for at most max_steps more), checkpointing on the way."""
        cfg = self.cfg
        stop = self.step + max_steps if max_steps is not None else None

        def finished() -> bool:
            return self.step >= self.schedule.total_steps or (stop is not None and self.step >= stop)

        started, first_step, timing_from = time.monotonic(), self.step, 0.0
        bar = tqdm(total=self.schedule.total_steps, initial=self.step, desc="Training", unit="step",
                   disable=not cfg.progress)
        unread = None
        try:
            while not finished():
                epoch, offset = divmod(self.step, self.batches_per_epoch)
                for indices in epoch_batches(self.train_set, cfg.batch_size, cfg.seed, epoch)[offset:]:
                    queued = self.train_step([self.train_set[i] for i in indices])
                    bar.update(1)
                    # The previous step's figures: reading them keeps the host one step ahead, no further.
                    if unread is not None:
                        _show(bar, unread)
                    unread = queued
                    done = self.step - first_step
                    if done == _TIMING_START:
                        timing_from = time.monotonic()
                    elif done == _TIMING_END:
                        self._fit_to_time(started, (time.monotonic() - timing_from) / (_TIMING_END - _TIMING_START))
                        bar.total = self.schedule.total_steps
                    if self.step % cfg.save_every == 0:
                        self.save()
                    if finished():
                        break
                if self.step % self.batches_per_epoch == 0:
                    self._end_of_epoch(self.step // self.batches_per_epoch, bar)
        except KeyboardInterrupt:
            self.save()
            logger.warning("Interrupted at step %d; saved %s (resume with --resume)", self.step, self.checkpoint_path)
            raise
        finally:
            bar.close()
        self.save()

    def _fit_to_time(self, started: float, seconds_per_step: float) -> None:
        """Shrink the planned steps to what fits in train_seconds, once, so the schedule still completes."""
        if self.cfg.train_seconds is None or self.schedule.fitted:
            return
        self.schedule.fitted = True
        remaining = self.cfg.train_seconds - (time.monotonic() - started)
        fits = self.step + int(_TIME_MARGIN * remaining / seconds_per_step)
        if fits < self.schedule.total_steps:
            logger.info("At %.0f ms per step, %d of the %d planned steps fit in --train-seconds %.0f",
                        1000 * seconds_per_step, fits, self.schedule.total_steps, self.cfg.train_seconds)
            self.schedule.total_steps = max(fits, self.step + 1)

    def _end_of_epoch(self, epoch: int, bar: tqdm) -> None:
        result = self.evaluate(self.val_set)
        if result is not None:
            bar.write(f"epoch {epoch} (step {self.step}): held-out {result.describe()}")


def _show(bar: tqdm, stats: StepStats) -> None:
    loss, accuracy = stats.read()
    bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accuracy), lr=f"{stats.lr:.1e}",
                    refresh=False)
