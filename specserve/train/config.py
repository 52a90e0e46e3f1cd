"""TrainConfig: everything `specserve train-eagle` can be told, validated at construction.

The defaults are sized for SmolLM2-135M on one H100 within about seven
minutes: at most four for the data (the target writing ~1000 prompts, and
answering them and 512 long-document requests, ~2000 requests and a few
hundred thousand tokens) and two and a half for training (20 epochs, or fewer
when they would not fit: the time budgets cut a phase short rather than let a
slower machine overrun).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from specserve.errors import ConfigError
from specserve.train.documents import MIN_PROMPT_TOKENS
from specserve.train.initial_head import InitialHead
from specserve.train.request_templates import CATEGORIES

DEFAULT_DRAFT_VOCAB_SIZE = 8192
# The answers a run trains on, in its work directory (train/data.py writes them).
SEQUENCES_NAME = "sequences.jsonl"


@dataclass
class TrainConfig:
    target: str
    out: str
    # JSONL prompts (see prompt_files.py); None: the target writes its own from built-in topics.
    prompts: str | None = None
    # Data and checkpoints; default OUT.work beside the head, so the head directory stays small enough to ship.
    work_dir: str | None = None
    # Reuse the work directory's data and continue from its checkpoint.
    resume: bool = False
    # Stop once the data is in the work directory; a later run with resume trains on it (the two phases
    # then fit in jobs of their own).
    data_only: bool = False
    # Work directories of data-only runs (several may run at once on one GPU) whose answers, joined into this
    # run's work directory, it trains on instead of generating its own.
    data_from: tuple[str, ...] | None = None

    # ---- data ----
    num_prompts: int = 1024
    # Long-document requests (documents.py: summaries, questions over retrieved passages, extraction, with
    # prompts of up to 3,800 tokens) answered beside the other prompts; 0: none.
    document_prompts: int = 512
    max_new_tokens: int = 384
    # Covers the longest document prompt and its answer. Training memory grows with the longest sequence of a
    # batch (batches group similar lengths): a batch of 32 such sequences holds about 150k tokens of the
    # head's activations, each kept for every unrolled step (README.md gives the memory this takes).
    max_seq_len: int = 4608
    # Every prompt is answered greedily; this fraction is answered again at sampled_temperature,
    # so the data resembles both greedy and sampled serving.
    sampled_fraction: float = 0.5
    sampled_temperature: float = 0.7
    question_temperature: float = 0.9
    # Without a prompt file: share of the prompts built from hand-written templates (request_templates.py)
    # rather than written by the target.
    templated_fraction: float = 0.5
    # Without a prompt file: share of prompt topics that are words of the target's vocabulary rather than
    # the curated list (questions.py): MT-bench asks about subjects no curated list foresees, and a head drafts
    # poorly the content words its data never showed.
    word_topic_fraction: float = 0.6
    # Without a prompt file: the template categories (request_templates.CATEGORIES) the templated prompts take
    # turns over; None: all of them. A run can then weigh its data towards the kinds of request a head drafts
    # worst.
    template_categories: tuple[str, ...] | None = None
    # Share of the greedy first answers that get a follow-up request, answered in a second round.
    follow_up_fraction: float = 1.0
    max_num_seqs: int = 256
    # KV cache of the generating engine in bytes; None: 8 GiB on CUDA (256 SmolLM2 sequences of 1024 tokens
    # fit, and the GPU keeps room for training after it), the engine's default on CPU.
    kv_cache_memory: int | None = None
    # Stop generating after this many seconds and keep what finished (None: no limit).
    data_seconds: float | None = 240.0

    # ---- head ----
    # An exported head (directory or shipped name) to continue training from, on this run's data;
    # None: a fresh head. The run then keeps that head's draft vocabulary and auxiliary layers.
    init_from: str | None = None
    # None: 8192, or the size of init_from's vocabulary.
    draft_vocab_size: int | None = None
    # Target layers whose inputs the head reads; None: EAGLE-3's early, middle and late layers (or init_from's).
    aux_layers: tuple[int, ...] | None = None
    # Width of the head's MLP; None: the target's, or init_from's. Wider than init_from's widens that head:
    # it keeps its units and gains new ones that start silent, so the run starts from what it computed with
    # room to learn more than a head the target's width holds.
    head_intermediate_size: int | None = None
    # Largest weight file of the exported head, in MB of tensor data (15 keeps files under 16 MB to ship in a repo).
    max_shard_mb: float = 15.0

    # ---- training ----
    epochs: int = 20
    # Total optimizer steps; None: epochs over the training data.
    steps: int | None = None
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    # Unrolled draft steps per position (training-time test); the head then drafts this many tokens well.
    ttt_steps: int = 6
    # Weight of unrolled step j's loss is step_weight_decay ** j: early drafts gate the later ones.
    step_weight_decay: float = 0.8
    # Score each draft against the target's whole next-token distribution (as EAGLE-3 trains) rather than
    # the one token the data holds; accuracy is then agreement with the target's greedy choice. On the same
    # data and steps it accepted at least as much in every suite category, at temperature 0 and more at 1
    # (BENCHMARKS.md, 'Acceptance per category (the suite)').
    soft_labels: bool = True
    # Start the head's lm_head, final norm and fc from the target (trainer.start_from_target) rather than
    # noise. Off by default: no evaluation has shown it to help.
    warm_start: bool = False
    # Share of sequences held out to report accuracy on data the head did not train on.
    val_fraction: float = 0.05
    # Shrink the planned steps, after timing the first ones, so training ends within this (None: no limit).
    train_seconds: float | None = 150.0
    save_every: int = 100
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise ConfigError(field, message)

        check(bool(self.target), "target", "give the target model: a built-in name, Hugging Face directory or .gguf")
        check(bool(self.out), "out", "give the directory to write the head to")
        if self.init_from is not None:
            self._take_initial_head(check)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = DEFAULT_DRAFT_VOCAB_SIZE
        check(self.head_intermediate_size is None or (isinstance(self.head_intermediate_size, int)
                                                     and self.head_intermediate_size >= 1),
              "head_intermediate_size", f"must be an integer >= 1 (or unset), got {self.head_intermediate_size!r}")
        for name in ("num_prompts", "max_new_tokens", "max_num_seqs", "draft_vocab_size", "epochs", "batch_size",
                     "ttt_steps", "save_every"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        check(self.steps is None or self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        check(not (self.data_only and self.resume), "data_only",
              "makes new data and resume reuses the old: give one of --data-only and --resume")
        if self.data_from is not None:
            self.data_from = tuple(self.data_from)
            check(bool(self.data_from), "data_from", "give at least one work directory of a --data-only run")
            check(not (self.data_only or self.resume or self.prompts), "data_from",
                  "trains a fresh run on data already made: leave out --data-only, --resume and --prompts")
            missing = [d for d in self.data_from if not (Path(d).expanduser() / SEQUENCES_NAME).is_file()]
            check(not missing, "data_from", f"{', '.join(missing)} hold no {SEQUENCES_NAME}; give work directories "
                  "that --data-only runs wrote")
        check(self.max_seq_len >= 16, "max_seq_len", f"must be >= 16 tokens, got {self.max_seq_len}")
        check(isinstance(self.document_prompts, int) and self.document_prompts >= 0, "document_prompts",
              f"must be an integer >= 0, got {self.document_prompts!r}")
        room = self.max_seq_len - self.max_new_tokens
        check(self.document_prompts == 0 or room >= MIN_PROMPT_TOKENS, "document_prompts",
              f"need prompts of {MIN_PROMPT_TOKENS} tokens or more, and max_seq_len {self.max_seq_len} leaves {room} "
              f"beside max_new_tokens {self.max_new_tokens}; raise --max-seq-len or give --document-prompts 0")
        if self.template_categories is not None:
            self.template_categories = tuple(self.template_categories)
            unknown = sorted(set(self.template_categories) - set(CATEGORIES))
            check(bool(self.template_categories) and not unknown, "template_categories",
                  f"unknown {unknown}; give some of {', '.join(CATEGORIES)}" if unknown else "give at least one")
            check(self.prompts is None and self.templated_fraction > 0, "template_categories",
                  "choose the templated prompts, which a run builds only without --prompts and with "
                  "--templated-fraction above 0")
        for name in ("sampled_fraction", "follow_up_fraction", "templated_fraction", "word_topic_fraction"):
            check(0.0 <= getattr(self, name) <= 1.0, name, f"must be in [0, 1], got {getattr(self, name)}")
        for name in ("sampled_temperature", "question_temperature", "lr", "grad_clip", "step_weight_decay",
                     "max_shard_mb"):
            check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0.0 <= self.val_fraction < 0.5, "val_fraction", f"must be in [0, 0.5), got {self.val_fraction}")
        for name in ("data_seconds", "train_seconds", "kv_cache_memory"):
            value = getattr(self, name)
            check(value is None or value > 0, name, f"must be > 0 (or unset), got {value}")
        if self.prompts is not None:
            check(Path(self.prompts).expanduser().is_file(), "prompts", f"{self.prompts} is not a file; give a JSONL "
                  "prompt file, or leave it out to let the target write its own prompts")
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
            check(len(self.aux_layers) >= 1 and all(isinstance(i, int) and i >= 0 for i in self.aux_layers),
                  "aux_layers", f"must be layer indices >= 0, got {self.aux_layers}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        check(self.device.split(":")[0] in ("cpu", "cuda"), "device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        check(not self.device.startswith("cuda") or torch.cuda.is_available(), "device",
              "CUDA was asked for but torch sees no GPU; use --device cpu or a CUDA build of torch")
        check(self.dtype in (None, "float32", "bfloat16", "float16"), "dtype",
              f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.on_cuda else "float32"
        if self.kv_cache_memory is None and self.on_cuda:
            self.kv_cache_memory = 8 << 30
        if self.work_dir is None:
            self.work_dir = str(Path(self.out).expanduser()) + ".work"

    def _take_initial_head(self, check) -> None:
        """Settings init_from fixes: its vocabulary size and auxiliary layers (given ones must agree)."""
        head = self.initial_head
        check(not self.warm_start, "warm_start", "starts a fresh head from the target, and --init-from continues "
              "an existing head: give one of them")
        check(self.draft_vocab_size in (None, head.draft_vocab_size), "draft_vocab_size",
              f"{head.path} drafts from {head.draft_vocab_size} tokens and a run from it keeps them; leave "
              f"--draft-vocab-size out or give {head.draft_vocab_size}")
        self.draft_vocab_size = head.draft_vocab_size
        if head.aux_layers is not None:
            check(self.aux_layers is None or tuple(self.aux_layers) == head.aux_layers, "aux_layers",
                  f"{head.path} reads target layers {list(head.aux_layers)} and a run from it keeps them; leave "
                  "--aux-layers out or give those")
            self.aux_layers = head.aux_layers
        width = head.intermediate_size
        check(self.head_intermediate_size is None or self.head_intermediate_size >= width, "head_intermediate_size",
              f"{head.path}'s MLP is {width} wide and a run from it can only widen it; give at least {width} or "
              "leave --head-intermediate-size out")
        self.head_intermediate_size = self.head_intermediate_size or width

    @cached_property
    def initial_head(self) -> InitialHead | None:
        """init_from, opened once for every phase that reads it (None for a fresh head)."""
        return InitialHead.open(self.init_from) if self.init_from is not None else None

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_mb * 1e6)
