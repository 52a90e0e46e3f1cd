"""Is a real batch-1 run bound by the host or by the GPU? The host's time per engine step, by part, while the
engine generates for real prompts (eval-acceptance's setting), with and without speculation.

    python benchmarks/host_per_step.py --prompts mt_bench.jsonl [--model smollm2-135m] [--k 0 4]
                                       [--head smollm2-135m-eagle3] [--num-prompts 32] [--repeats 3]
                                       [--kernels N] [--tree FILE]

Per k, each repeat prints tok/s and, per engine step (launches), the host's time in runner.launch (and
its parts, and how often each runs a step), in resolve, and in the completion event's wait alone: with asynchronous scheduling the host
enqueues step N+1 while the GPU runs step N, so a step that waits long is GPU-bound, one that hardly
waits is host-bound (the GPU then idles between steps). The timing wrappers add about 1 us a call.
--parts times every repeat a second time with the runner's whole-step graphs off (each part of a step
replayed from its own graph, with eager launches between), in the same process.
--tree FILE adds a run drafting that tree (speculative_token_tree, e.g. benchmarks/trees/*.txt) after the ks.
--kernels N then runs the first N prompts once more under the torch profiler and prints the GPU kernels
per engine step (their sum against the step's wall time is the GPU's idle share), and the GPU's idle time
between kernels by the kernels around it.
"""
from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import torch
from profile_kernels import idle_table, kernel_table, launch_parts, wrap_timed
from torch.profiler import ProfilerActivity, profile

from specserve.entrypoints.eval_acceptance import prime_prefix_cache
from specserve.llm import LLM
from specserve.prompt_files import load_prompt_file, prompt_token_ids
from specserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default="smollm2-135m-eagle3")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--k", type=int, nargs="+", default=[0, 4], help="drafts per step (0: no speculation)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernels", type=int, default=0, metavar="N", help="profile N prompts' kernels per step")
    ap.add_argument("--tree", help="a speculative_token_tree file: also time drafting that tree")
    ap.add_argument("--parts", action="store_true",
                    help="time each repeat twice: with the whole-step graphs, then with each part in its own graph")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_per_step needs a CUDA device")
    conversations = load_prompt_file(a.prompts, limit=a.num_prompts)
    settings = [(str(k), None if k == 0 else {"method": "eagle3", "model": a.head, "num_speculative_tokens": k})
                for k in a.k]
    if a.tree:
        with open(a.tree) as f:
            settings.append(("tree", {"method": "eagle3", "model": a.head, "speculative_token_tree": f.read().strip()}))
    for k, spec in settings:
        llm = LLM(a.model, speculative_config=spec, max_num_seqs=1)
        prompts = [prompt_token_ids(llm, c) for c in conversations]
        prime_prefix_cache(llm, prompts)
        spent, calls = defaultdict(float), defaultdict(int)
        runner, engine = llm.engine.runner, llm.engine
        parts = [(runner, "launch"), (runner, "resolve"), *launch_parts(runner), (engine.scheduler, "schedule"),
                 (engine.scheduler, "update"), (engine, "_output")]
        if getattr(runner.speculator, "tree_tables", None) is not None:
            parts.append((runner.speculator, "_draft_tree"))
        for owner, attr in parts:
            wrap_timed(owner, attr, f"{type(owner).__name__}.{attr}", spent, calls)
        whole = runner.whole_step_graphs
        wait = torch.cuda.Event.synchronize

        def timed_wait(event):
            start = time.perf_counter()
            wait(event)
            spent["event wait"] += time.perf_counter() - start
        torch.cuda.Event.synchronize = timed_wait
        try:
            for rep in range(a.repeats):
                for label in ("whole step", "parts") if a.parts and whole is not None else ("",):
                    runner.whole_step_graphs = None if label == "parts" else whole
                    spent.clear()
                    calls.clear()
                    start = time.perf_counter()
                    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.max_tokens),
                                        use_tqdm=False)
                    wall = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    steps = calls["ModelRunner.launch"]
                    print(f"k={k} repeat {rep}{' ' + label if label else ''}: {tokens / wall:.0f} tok/s, {steps} "
                          f"steps, {1e3 * wall / steps:.3f} ms a step; host ms a step: "
                          + ", ".join(f"{n} {1e3 * t / steps:.3f}" for n, t in spent.items()), flush=True)
                    print(f"k={k} repeat {rep}: calls a step: "
                          + ", ".join(f"{n} {c / steps:.3f}" for n, c in calls.items() if n != "ModelRunner.launch"))
        finally:
            torch.cuda.Event.synchronize = wait
            runner.whole_step_graphs = whole
        if a.kernels:
            steps_before = calls["ModelRunner.launch"]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts[: a.kernels], SamplingParams(temperature=0.0, max_tokens=a.max_tokens),
                             use_tqdm=False)
                torch.cuda.synchronize()
            steps = calls["ModelRunner.launch"] - steps_before
            print(f"k={k}: kernels per engine step over {steps} steps of {a.kernels} prompts:")
            print(kernel_table(prof, steps, 40))
            print(idle_table(prof, steps, 25))
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
