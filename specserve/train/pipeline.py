"""`specserve train-eagle` end to end: data, draft vocabulary, training, export, each phase timed."""
from __future__ import annotations

import gc
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.errors import ConfigError
from specserve.models.arch_config import ArchConfig
from specserve.models.eagle3 import default_aux_layers
from specserve.models.loader import open_model_source
from specserve.spec_decode.factory import head_mismatch
from specserve.train.batches import split
from specserve.train.checkpoint import CHECKPOINT_NAME
from specserve.train.config import SEQUENCES_NAME, TrainConfig
from specserve.train.data import DataStats, Sequence, generate_data, load_sequences, save_sequences
from specserve.train.export import check_exportable, export_head, head_arch, head_config
from specserve.train.features import TargetFeatures
from specserve.train.trainer import Evaluation, Trainer, build_head
from specserve.train.vocab import DraftVocab, build_draft_vocab, given_draft_vocab

logger = logging.getLogger(__name__)

# Settings that shape the training trajectory: a checkpoint only resumes a run that agrees on all of them.
_IDENTITY_FIELDS = ("draft_vocab_size", "epochs", "steps", "batch_size", "lr", "warmup_steps", "weight_decay",
                    "grad_clip", "ttt_steps", "step_weight_decay", "soft_labels", "warm_start", "init_from",
                    "head_intermediate_size", "val_fraction", "seed")


@dataclass
class TrainSummary:
    out: Path  # the head's directory; the work directory after a data-only run
    files: list[Path]
    data: DataStats | None  # None when the data of an earlier run was reused
    num_sequences: int
    num_response_tokens: int
    vocab_coverage: float
    steps: int
    validation: Evaluation | None
    seconds: dict[str, float] = field(default_factory=dict)


def _check_target(cfg: TrainConfig, target: ArchConfig) -> tuple[int, ...]:
    """The auxiliary layers to read; raises ConfigError, before any work, for settings the target rules out."""
    if cfg.initial_head is not None:
        head = cfg.initial_head.config
        if (why := head_mismatch(head.get("hidden_size"), head.get("vocab_size"), target)) is not None:
            raise ConfigError("init_from", f"{cfg.init_from}'s {why}: it was trained for another target; give a "
                              "head of this one, or leave --init-from out")
    layers = cfg.aux_layers or default_aux_layers(target.num_layers)
    if any(i >= target.num_layers for i in layers) or min(layers) < 0:
        raise ConfigError("aux_layers", f"{layers} are not all layers of the {target.num_layers}-layer target; "
                          f"give indices below {target.num_layers}")
    if cfg.draft_vocab_size > target.vocab_size:
        raise ConfigError("draft_vocab_size", f"{cfg.draft_vocab_size} exceeds the target's vocabulary of "
                          f"{target.vocab_size}; give at most {target.vocab_size}")
    if cfg.max_seq_len > target.max_context:
        raise ConfigError("max_seq_len", f"{cfg.max_seq_len} exceeds the target's context of {target.max_context}")
    layers = tuple(layers)
    config = head_config(target, cfg.draft_vocab_size, layers, cfg.head_intermediate_size)
    check_exportable(config, layers, cfg.max_shard_bytes)
    return layers


def draft_vocab(cfg: TrainConfig, sequences: list[Sequence], target_vocab_size: int) -> DraftVocab:
    """The most frequent answer tokens, or the initial head's vocabulary when the run continues one."""
    answers = [s.response_ids for s in sequences]
    if cfg.initial_head is None:
        return build_draft_vocab(answers, target_vocab_size, cfg.draft_vocab_size)
    return given_draft_vocab(cfg.initial_head.draft_to_target(), answers, target_vocab_size)


def make_trainer(cfg: TrainConfig, target: ArchConfig, aux_layers: tuple[int, ...], sequences: list[Sequence],
                 vocab: DraftVocab, data_digest: str) -> tuple[Trainer, dict]:
    """A trainer for a fresh head (seeded) over the target's hidden states, and the head's config.json."""
    train, val = split(sequences, cfg.val_fraction, cfg.seed)
    features = TargetFeatures(cfg.target, aux_layers, cfg.torch_dtype, cfg.device)
    config = head_config(target, vocab.size, aux_layers, cfg.head_intermediate_size)
    head = build_head(target, head_arch(config), vocab, aux_layers, features.model, cfg.device, cfg.seed,
                      cfg.warm_start, cfg.initial_head)
    identity = {name: getattr(cfg, name) for name in _IDENTITY_FIELDS}
    identity.update(aux_layers=list(aux_layers), data=data_digest)
    return Trainer(cfg, features, head, vocab, train, val, identity), config


def joined_data(work_dirs: tuple[str, ...], out: Path) -> list[Sequence]:
    """The answers of data-only runs' work directories, in order, saved as this run's data (a later --resume
    reads them there)."""
    sequences = []
    for d in work_dirs:
        part = load_sequences(Path(d).expanduser() / SEQUENCES_NAME)
        logger.info("%d sequences from %s", len(part), d)
        sequences += part
    save_sequences(out, sequences)
    return sequences


def train_eagle3(cfg: TrainConfig) -> TrainSummary:
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        seconds[phase] = now - clock
        clock = now

    target = ArchConfig.from_hf_config(open_model_source(cfg.target).hf_config)
    aux_layers = _check_target(cfg, target)
    work = Path(cfg.work_dir)
    sequences_path = work / SEQUENCES_NAME
    data_stats = None
    if cfg.resume and sequences_path.is_file():
        sequences = load_sequences(sequences_path)
        logger.info("Reusing %d sequences from %s", len(sequences), sequences_path)
    else:
        # A fresh run must not later resume from an older run's checkpoint.
        (work / CHECKPOINT_NAME).unlink(missing_ok=True)
        if cfg.data_from:
            sequences = joined_data(cfg.data_from, sequences_path)
        else:
            sequences, data_stats = generate_data(cfg, work)
            # The generating engine's KV cache and graphs are garbage now: free them before the target loads again.
            gc.collect()
    if len(sequences) < 2:
        raise ConfigError("data_seconds", f"only {len(sequences)} answers finished; raise --data-seconds, or lower "
                          "--max-new-tokens")
    lap("data")

    vocab = draft_vocab(cfg, sequences, target.vocab_size)
    logger.info("Draft vocabulary: %d of %d target tokens, covering %.1f%% of the answers' tokens",
                vocab.size, target.vocab_size, 100 * vocab.coverage)
    lap("vocab")
    num_tokens = sum(len(s.response_ids) for s in sequences)
    if cfg.data_only:
        return TrainSummary(work, [], data_stats, len(sequences), num_tokens, vocab.coverage, 0, None, seconds)

    trainer, config = make_trainer(cfg, target, aux_layers, sequences, vocab,
                                   hashlib.sha256(sequences_path.read_bytes()).hexdigest())
    if cfg.resume:
        trainer.resume()
    trainer.run()
    validation = trainer.evaluate(trainer.val_set)
    lap("training")

    provenance = {"target": cfg.target, "sequences": len(sequences), "response_tokens": num_tokens,
                  "steps": trainer.step, "ttt_steps": cfg.ttt_steps, "draft_vocab_coverage": round(vocab.coverage, 4)}
    if validation is not None:
        provenance["held_out_accuracy"] = [round(a, 4) for a in validation.accuracy]
    if cfg.initial_head is not None:
        provenance["init_from"] = cfg.initial_head.lineage
    files = export_head(Path(cfg.out), trainer.head, vocab, {**config, "specserve_training": provenance},
                        cfg.max_shard_bytes)
    lap("export")
    return TrainSummary(Path(cfg.out), files, data_stats, len(sequences), num_tokens, vocab.coverage, trainer.step,
                        validation, seconds)
