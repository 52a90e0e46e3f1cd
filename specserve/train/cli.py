"""The `specserve train-eagle` subcommand: one flag per TrainConfig field."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from specserve.entrypoints.cli import memory_size
from specserve.train.config import TrainConfig
from specserve.train.request_templates import CATEGORIES

_HELP = {
    "target": "target model: built-in name (smollm2-135m), Hugging Face directory or .gguf file",
    "out": "directory to write the head to (Hugging Face layout)",
    "prompts": "JSONL prompts ({'prompt'}, MT-bench {'turns'}, ShareGPT {'conversations'} or {'messages'}); "
               "default: the target writes its own from built-in topics",
    "work_dir": "data and checkpoints (default: OUT.work)",
    "resume": "reuse the work directory's data and continue from its checkpoint",
    "data_only": "stop once the data is in the work directory; a later --resume run trains on it",
    "data_from": "train on the data of these work directories (--data-only runs, e.g. several at once on one "
                 "GPU), joined into this run's, instead of generating it",
    "num_prompts": "prompts to answer (written by the target, or the first ones of --prompts)",
    "document_prompts": "long-document requests answered beside the other prompts: summaries, questions over "
                        "retrieved passages and extraction over the standard library's pydoc help (0: none)",
    "max_new_tokens": "longest answer",
    "max_seq_len": "longest prompt + answer",
    "sampled_fraction": "share of prompts answered a second time by sampling",
    "sampled_temperature": "temperature of those sampled answers",
    "question_temperature": "temperature at which the target writes its prompts",
    "templated_fraction": "without --prompts: share of prompts built from hand-written templates rather than "
                          "written by the target",
    "word_topic_fraction": "without --prompts: share of prompt topics drawn from the words of the target's "
                           "vocabulary rather than the curated list",
    "template_categories": "without --prompts: the template categories the templated prompts take turns over "
                           "(default: all; specserve/train/request_templates.py's CATEGORIES)",
    "follow_up_fraction": "share of greedy answers followed up in a second round (another turn, or the answer "
                          "as a passage to summarise or extract from)",
    "max_num_seqs": "concurrent requests while generating",
    "kv_cache_memory": "KV cache of the generating engine, e.g. 8GiB or bytes (default: 8GiB on CUDA)",
    "data_seconds": "time budget of data generation; what finished is kept (0: no limit)",
    "init_from": "an exported head (directory or shipped name) to continue training on this run's data; it "
                 "keeps its draft vocabulary and auxiliary layers (default: a fresh head)",
    "head_intermediate_size": "width of the head's MLP (default: the target's, or --init-from's); wider than "
                              "--init-from's head widens it, computing the same at the start",
    "draft_vocab_size": "target tokens the head can draft, the most frequent in the answers (default: 8192, "
                        "or --init-from's)",
    "aux_layers": "target layers whose inputs the head reads (default: EAGLE-3's early, middle, late)",
    "max_shard_mb": "largest weight file of the head, in MB of tensors",
    "epochs": "passes over the data",
    "steps": "optimizer steps (overrides --epochs)",
    "batch_size": "sequences per step",
    "lr": "peak learning rate (AdamW)",
    "warmup_steps": "linear warm-up steps before the cosine decay",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient-norm clip",
    "ttt_steps": "draft steps unrolled per position in training (cover the k you serve with)",
    "step_weight_decay": "loss weight of unrolled step j is this to the power j",
    "soft_labels": "train against the target's next-token distribution over the draft vocabulary "
                   "(--no-soft-labels: against the data's tokens)",
    "warm_start": "start the head's lm_head, final norm and fc from the target's (--no-warm-start: random)",
    "val_fraction": "share of sequences held out to report accuracy",
    "train_seconds": "time budget of training: the planned steps shrink to fit, after timing the first (0: no limit)",
    "save_every": "checkpoint every this many steps",
    "device": "cpu or cuda (default: cuda when available)",
    "dtype": "target dtype (default: bfloat16 on CUDA, float32 on CPU)",
    "seed": "seed of prompts, sampling, data split and batch order",
    "progress": "progress bars (--no-progress to hide them)",
}
# Budgets take 0 on the command line for "no limit".
_BUDGETS = ("data_seconds", "train_seconds")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-eagle", help="train an EAGLE-3 head for a target on the target's own answers",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        required = f.default is MISSING
        default = None if required else f.default
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP[f.name])
        elif f.name == "aux_layers":
            p.add_argument(flag, type=int, nargs="+", default=default, help=_HELP[f.name])
        elif f.name == "data_from":
            p.add_argument(flag, nargs="+", metavar="WORK_DIR", default=default, help=_HELP[f.name])
        elif f.name == "template_categories":
            p.add_argument(flag, nargs="+", choices=list(CATEGORIES), default=default, help=_HELP[f.name])
        elif f.name == "kv_cache_memory":
            p.add_argument(flag, type=memory_size, metavar="SIZE", default=default, help=_HELP[f.name])
        else:
            cast = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
            p.add_argument(flag, type=cast, default=default, required=required, help=_HELP[f.name])
    p.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(a: argparse.Namespace) -> None:
    from specserve.train.pipeline import train_eagle3

    values = {f.name: getattr(a, f.name) for f in fields(TrainConfig)}
    for name in _BUDGETS:
        values[name] = values[name] or None
    summary = train_eagle3(TrainConfig(**values))
    if summary.files:
        print(f"=== head written to {summary.out} ({len(summary.files)} weight file(s))")
    else:
        print(f"=== data written to {summary.out}; train on it with the same flags and --resume")
    if summary.data is None:
        print(f"data: reused {summary.num_sequences} answers ({summary.num_response_tokens} answer tokens) "
              "from the work directory")
    else:
        d = summary.data
        print(f"data: {d.prompts} prompts ({d.documents} long-document), {d.follow_ups} follow-ups, {d.sequences} "
              f"answers, {d.tokens} answer tokens; engine loaded in {d.load_seconds:.1f} s, prompts written in "
              f"{d.question_seconds:.1f} s, "
              f"answers in {d.answer_seconds:.1f} s ({d.tokens / max(d.answer_seconds, 1e-9):.0f} tokens/s)")
    print(f"draft vocabulary covers {100 * summary.vocab_coverage:.1f}% of answer tokens; {summary.steps} steps")
    if summary.validation is not None:
        print(f"held-out {summary.validation.describe()}")
    print("time per phase: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.seconds.items())
          + f"; total {sum(summary.seconds.values()):.1f} s")
