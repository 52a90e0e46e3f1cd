"""Host time of a step's grammar masks (StepMasks.build) on this machine's CPU, and the sweep that writes the
engine's thread counts for xgrammar's batch filler (structured_output/fill_threads.py).

    python benchmarks/step_masks_host.py [--model smollm2-135m] [--rows 1,8,64] [--drafts 3] [--tree FILE] [--repeats 200]
    python benchmarks/step_masks_host.py --sweep [--rows 1,8,16,32,64,128,256] [--threads 1,2,4,8,16] [--write]

Each request is under structured_output_cost.py's JSON schema. --states random (default): each at the end of its
own random walk of 0..63 tokens the grammar allows, picked uniformly, as a model with random weights (that
benchmark's shapes) picks them: most rows sit inside a string, where a fill costs several times a structural
state's. --states text: each at its own point of a JSON text that follows the schema (short strings).

The default run prints, per row count, the median over the repeats of: StepMasks.build for that many sampling
rows, as the engine runs it (threads from this host's table); the same fill as one bare xgrammar call on one
thread (what is left is Python around it); one accept_token a row and a rollback (Scheduler.update's accepts,
outside StepMasks); and with --drafts k, StepMasks.build for that many rows verifying chains of k drafts (the
model's own continuation, every draft accepted), the same with the drafter's masks of the step before
carried (only the position after the last draft filled), and the drafter's masks of the k drafts that follow
(DraftMasks.masks at each depth, after the step's new token, the same continuation drafted). With --tree FILE (a
speculative_token_tree, e.g. benchmarks/trees/*.txt), StepMasks.build for that many rows verifying that tree of
drafts (each node's guess the r-th token its parent's state allows, r its rank among its siblings), as the engine
builds it (tree_masks.py), and the same tree walked in Python per request (RequestGrammar.fill_masks).

--sweep times one bare batch fill of each row count on each thread count (at most this process's CPUs) and
prints the table with the thread count chosen for each row count: the fewest within SAME_WITHIN of the fastest.
--write stores the choices as this host's table, which the engine then reads (fill_threads.table_path).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.models.loader import load_tokenizer, open_model_source
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.tree import DraftTree
from specserve.structured_output.draft_masks import DraftMasks
from specserve.structured_output.fill_threads import SAME_WITHIN, FillThreads, fill_threads, usable_cpus, write_table
from specserve.structured_output.manager import StructuredOutputManager
from specserve.structured_output.request_grammar import RequestGrammar
from specserve.structured_output.spec import StructuredOutput, StructuredOutputKind
from specserve.structured_output.step_masks import StepMasks
from specserve.worker.input_buffers import TokenBitmaskBuffer
from structured_output_cost import SCHEMA

ANSWER = {"topic": "the weather in spring", "score": 7, "kind": "opinion"}
MAX_WALK = 64


def allowed_tokens(matcher, bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    matcher.fill_next_token_bitmask(bitmask, 0)
    return np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab].nonzero()[0]


def grammars(model: str, count: int, states: str) -> tuple[list[RequestGrammar], int]:
    """count grammar states of the schema (see --states) and the model's vocabulary size."""
    source = open_model_source(model)
    tokenizer = load_tokenizer(source)
    vocab = source.hf_config["vocab_size"]
    manager = StructuredOutputManager(tokenizer, vocab, {tokenizer.eos_token_id})
    spec = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA)
    text = tokenizer.encode(json.dumps({"answers": [ANSWER] * 40}), add_special_tokens=False)
    rng = random.Random(0)
    scratch = xgr.allocate_token_bitmask(1, vocab)
    out = []
    for i in range(count):
        grammar = manager.grammar_for(spec)
        if states == "text":
            tokens = text[:(i * 7) % len(text)]
        else:
            tokens = []
            for _ in range(rng.randrange(MAX_WALK)):
                token = int(rng.choice(allowed_tokens(grammar.matcher, scratch, vocab)))
                grammar.matcher.accept_token(token)
                tokens.append(token)
            grammar.matcher.rollback(len(tokens))
        for token in tokens:
            if not grammar.accept(token):
                raise SystemExit(f"token {token} is refused: the schema and the {states} states disagree")
        out.append(grammar)
    return out, vocab


def continuations(grammar: RequestGrammar, k: int, vocab: int, scratch: torch.Tensor) -> list[int]:
    """k tokens the grammar allows after its state (fewer where it ends), the first allowed each time."""
    m, taken = grammar.matcher, []
    while len(taken) < k and not m.is_terminated():
        token = int(allowed_tokens(m, scratch, vocab)[0])
        m.accept_token(token)
        taken.append(token)
    m.rollback(len(taken))
    return taken


def scheduled(grammar: RequestGrammar, i: int, drafts: list[int]) -> ScheduledRequest:
    request = Request(f"r{i}", [1], SamplingParams(temperature=0, max_tokens=8), set(), 4096, grammar=grammar)
    return ScheduledRequest(request, 1 + len(drafts), drafts, [], True, 1)


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def buffer_for(rows: int, vocab: int) -> TokenBitmaskBuffer:
    # One tensor for the host's and the device's buffer, as a CPU engine has: on a GPU the copy is a DMA from
    # pinned memory, which takes no host time, and here it would time torch's CPU copy instead.
    host = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32)
    return TokenBitmaskBuffer(host, host, torch.ones(1, dtype=torch.int64))


def step_times(gs: list[RequestGrammar], vocab: int, rows: list[int], drafts: int, tree: DraftTree | None,
               repeats: int) -> None:
    print(f"{'rows':>5} {'threads':>7} {'StepMasks.build':>16} {'bare fill, 1 thread':>20} {'accepts + rollback':>19}"
          + (f" {f'build, {drafts} drafts':>16} {'carried':>8} {f'drafter, {drafts} drafts':>18}" if drafts else "")
          + (f" {f'build, tree of {tree.num_nodes}':>18} {'walked in Python':>16}" if tree else "")
          + "   (median us a step)")
    scratch = xgr.allocate_token_bitmask(1, vocab)
    one = xgr.BatchGrammarMatcher(max_threads=1)
    for n in rows:
        group = gs[:n]
        matchers = [g.matcher for g in group]
        sampling = SchedulerOutput([scheduled(g, i, []) for i, g in enumerate(group)])
        buffer = buffer_for(n * (1 + drafts), vocab)
        build = median_us(lambda: StepMasks.build(sampling, list(range(n)), [], buffer, lambda s: []), repeats)
        bare = median_us(lambda: one.batch_fill_next_token_bitmask(matchers, buffer.host), repeats)
        nexts = [int(allowed_tokens(m, scratch, vocab)[0]) for m in matchers]

        def accepts():
            for m, t in zip(matchers, nexts):
                m.accept_token(t)
            for m in matchers:
                m.rollback(1)

        line = f"{n:5d} {fill_threads(n):7d} {build:16.1f} {bare:20.1f} {median_us(accepts, repeats):19.1f}"
        if drafts:
            verifying = SchedulerOutput([scheduled(g, i, continuations(g, drafts, vocab, scratch))
                                         for i, g in enumerate(group)])
            line += f" {median_us(lambda: StepMasks.build(verifying, [], list(range(n)), buffer, lambda s: s.spec_token_ids), repeats):16.1f}"
            carried = carried_masks(verifying, drafts, vocab)
            line += f" {median_us(lambda: StepMasks.build(verifying, [], list(range(n)), buffer, lambda s: s.spec_token_ids, None, carried), repeats):8.1f}"
            line += f" {median_us(drafter_masks(group, drafts, vocab, scratch), repeats):18.1f}"
        if tree:
            trees = SchedulerOutput([scheduled(g, i, tree_continuation(g, tree, vocab, scratch))
                                     for i, g in enumerate(group)])
            tree_buffer = buffer_for(n * (1 + tree.num_nodes), vocab)
            line += f" {median_us(lambda: StepMasks.build(trees, [], list(range(n)), tree_buffer, lambda s: s.spec_token_ids, tree.parents), repeats):18.1f}"

            def walked() -> None:
                tree_buffer.allow_all(0, n * (1 + tree.num_nodes))
                for i, s in enumerate(trees.scheduled):
                    s.request.grammar.fill_masks(tree_buffer.host, i * (1 + tree.num_nodes), s.spec_token_ids,
                                                 tree.parents)
            line += f" {median_us(walked, repeats):16.1f}"
        print(line)


def tree_continuation(grammar: RequestGrammar, tree: DraftTree, vocab: int, scratch: torch.Tensor) -> list[int]:
    """A token for each node of the tree: the r-th its parent's state allows (r: its rank among its siblings; the
    last allowed where there are fewer), or 0 below a state that ended."""
    m, drafts = grammar.matcher, []
    for j in range(1, len(tree.parents)):
        path, node = [], tree.parents[j]
        while node:
            path.append(drafts[node - 1])
            node = tree.parents[node]
        taken = grammar.walk(path[::-1])
        if taken == len(path) and not m.is_terminated():
            options = allowed_tokens(m, scratch, vocab)
            drafts.append(int(options[min(tree.ranks[j], len(options) - 1)]))
        else:
            drafts.append(0)
        m.rollback(taken)
    return drafts


def carried_masks(verifying: SchedulerOutput, drafts: int, vocab: int):
    """The drafter's masks of the step before, as the engine carries them to this one: built from each
    request's state now (no step tokens), along the drafts it verifies."""
    requests = [s.request for s in verifying.scheduled]
    n = len(requests)
    chains = torch.tensor([s.spec_token_ids + [0] * (drafts - len(s.spec_token_ids)) for s in verifying.scheduled])
    masks = DraftMasks([r.grammar for r in requests], torch.tensor([[-1, 0]] * n), None, buffer_for(n * drafts, vocab))
    for j in range(drafts):
        masks.masks(range(j, j + 1))
        masks.follow(chains[:, j:j + 1])
    masks.close()
    return masks.carried([r.request_id for r in requests])


def drafter_masks(group: list[RequestGrammar], drafts: int, vocab: int, scratch: torch.Tensor):
    """A function that builds a chain step's drafter masks for group as a grammar step does: each request's
    step emitted its continuation's first token and drafts the next `drafts`, masks(j) before draft j."""
    paths = [continuations(g, drafts + 1, vocab, scratch) for g in group]
    width = max(map(len, paths))
    padded = torch.tensor([p + [0] * (width - len(p)) for p in paths])
    step_tokens = torch.cat([torch.zeros(len(group), 1, dtype=torch.int64), padded[:, :1]], dim=1)
    buffer = buffer_for(len(group) * drafts, vocab)

    def build() -> None:
        masks = DraftMasks(group, step_tokens, None, buffer)
        for j in range(drafts):
            masks.masks(range(j, j + 1))
            masks.follow(padded[:, j + 1:j + 2])
        masks.close()
    return build


def sweep(gs: list[RequestGrammar], vocab: int, rows: list[int], threads: list[int], repeats: int) -> list[FillThreads]:
    cpus = usable_cpus()
    threads = sorted({1, *(t for t in threads if t <= cpus)})  # one thread, the engine's, is the baseline
    buffer = buffer_for(max(rows), vocab)
    fillers = {t: xgr.BatchGrammarMatcher(max_threads=t) for t in threads}
    print(f"bare batch fill, median us a call, {cpus} usable CPUs")
    print(f"{'rows':>5} " + " ".join(f"{f'{t} threads':>10}" for t in threads) + "   chosen")
    chosen = []
    for n in rows:
        matchers = [g.matcher for g in gs[:n]]
        times = {t: median_us(lambda f=f: f.batch_fill_next_token_bitmask(matchers, buffer.host), repeats)
                 for t, f in fillers.items()}
        best = min(times.values())
        pick = min(t for t, us in times.items() if us <= best * (1 + SAME_WITHIN))
        chosen.append(pick)
        print(f"{n:5d} " + " ".join(f"{times[t]:10.1f}" for t in threads) + f"   {pick}")
    # Rows from one measured count up to the next take the smaller count's choice.
    buckets = [FillThreads(nxt - 1, pick) for nxt, pick in zip(rows[1:], chosen)] + [FillThreads(rows[-1], chosen[-1])]
    merged: list[FillThreads] = []
    for b in buckets:
        if merged and merged[-1].threads == b.threads:
            merged[-1] = FillThreads(b.max_rows, b.threads)
        else:
            merged.append(b)
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--states", choices=("random", "text"), default="random")
    ap.add_argument("--rows", help="row counts (default 1,8,64; with --sweep 1,8,16,32,64,128,256)")
    ap.add_argument("--drafts", type=int, default=0, help="also time rows verifying chains of this many drafts")
    ap.add_argument("--tree", help="also time rows verifying this tree of drafts (a speculative_token_tree file)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--sweep", action="store_true", help="time the batch fill on each thread count")
    ap.add_argument("--threads", default="1,2,4,8,16", help="thread counts of the sweep")
    ap.add_argument("--write", action="store_true", help="with --sweep: store the choices as this host's table")
    a = ap.parse_args()
    if a.write and not a.sweep:
        raise SystemExit("--write stores the sweep's choices: give --sweep as well")
    rows = sorted({int(r) for r in (a.rows or ("1,8,16,32,64,128,256" if a.sweep else "1,8,64")).split(",")})
    # torch's intra-op threads stay as the engine has them: mask building must not wake them.
    gs, vocab = grammars(a.model, max(rows), a.states)
    print(f"{a.states} states, vocabulary {vocab}, {usable_cpus()} usable CPUs")
    if not a.sweep:
        tree = DraftTree.build(Path(a.tree).read_text().strip()) if a.tree else None
        step_times(gs, vocab, rows, a.drafts, tree, a.repeats)
        return
    buckets = sweep(gs, vocab, rows, [int(t) for t in a.threads.split(",")], a.repeats)
    print("choices: " + ", ".join(f"up to {b.max_rows} rows: {b.threads}" for b in buckets))
    if a.write:
        print(f"wrote {write_table(usable_cpus(), buckets)}")


if __name__ == "__main__":
    main()
