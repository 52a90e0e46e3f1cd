"""choose_step_path: one test per path a step can take, from its inputs alone (no model, no runner)."""
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.sampling_params import SamplingParams
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.cudagraph_mode import CUDAGraphMode as M
from specserve.worker.step_path import (Drafting, GraphsReady, RowsSampling, Sampling, SpeculatorKind, StepPath,
                                        StepRows, Verification, WholeStep, choose_step_path)

SAMPLED = RowsSampling(all_greedy=False)
LOGPROBS = RowsSampling(logprobs=True)
PENALTIES = RowsSampling(needs_host_tokens=True)
EVERY_GRAPH = GraphsReady(whole_step=True, greedy=True, drafting=True)


def decode(n: int, sample: RowsSampling = RowsSampling()) -> StepRows:
    """n requests decoding one token each."""
    return StepRows(n, (0,) * n, num_sample=n, sample=sample)


def verify(n: int, k: int, verify: RowsSampling = RowsSampling()) -> StepRows:
    """n requests verifying k drafts each."""
    return StepRows(n, (k,) * n, num_verify=n, verify=verify)


def full(n: int, q: int) -> BatchDescriptor:
    return BatchDescriptor(M.FULL, n * q, n, q)


def path(desc, rows, graphs=None, speculator=SpeculatorKind.ON_DEVICE, trees=False, mask_drafts=True) -> StepPath:
    """By default every graph that can serve desc: whole-step and greedy graphs are full graphs."""
    if graphs is None:
        graphs = EVERY_GRAPH if desc.mode is M.FULL else GraphsReady(drafting=True)
    return choose_step_path(desc, rows, graphs, speculator, trees, mask_drafts)


def test_a_greedy_decode_batch_with_a_whole_step_graph_runs_whole():
    assert path(full(4, 1), decode(3)) == StepPath(M.FULL, WholeStep.CHAIN, Sampling.IN_WHOLE_STEP,
                                                   Verification.NONE, Drafting.IN_WHOLE_STEP)


def test_a_greedy_batch_verifying_every_draft_runs_whole():
    assert path(full(4, 4), verify(3, 3)) == StepPath(M.FULL, WholeStep.CHAIN, Sampling.NONE,
                                                      Verification.IN_WHOLE_STEP, Drafting.IN_WHOLE_STEP)


def test_a_greedy_batch_verifying_whole_trees_runs_the_whole_tree_step():
    assert path(full(2, 6), verify(2, 5), trees=True) == StepPath(
        M.FULL, WholeStep.TREE, Sampling.NONE, Verification.IN_WHOLE_STEP, Drafting.IN_WHOLE_STEP)


def test_trees_whose_requests_draw_with_their_temperatures_alone_run_the_whole_sampled_tree_step():
    """A batch of whole trees with a request that samples runs whole where each request draws with its temperature
    alone from its own logits; anything the graph cannot draw or apply runs the parts."""
    graphs = GraphsReady(whole_step=True, greedy=True, drafting=True, sampled_tree=True, whole_sampled_tree=True)
    assert path(full(2, 6), verify(2, 5, SAMPLED), graphs, trees=True) == StepPath(
        M.FULL, WholeStep.SAMPLED_TREE, Sampling.NONE, Verification.IN_WHOLE_STEP, Drafting.IN_WHOLE_STEP)
    # A greedy batch keeps the whole tree step of top guesses.
    assert path(full(2, 6), verify(2, 5), graphs, trees=True).whole is WholeStep.TREE
    parts = [
        path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, temperature_only=False)), graphs, trees=True),
        path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, logprobs=True)), graphs, trees=True),
        path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, logit_bias=True)), graphs, trees=True),
        path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, needs_host_tokens=True)), graphs, trees=True),
        path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, grammar=True)), graphs, trees=True),
        path(full(2, 6), verify(2, 4, SAMPLED), graphs, trees=True),  # trees cut short
        path(full(2, 6), verify(2, 5, SAMPLED), EVERY_GRAPH, trees=True),  # no whole sampled tree graph
        path(full(2, 6), verify(2, 5, SAMPLED), graphs),  # chains
    ]
    assert all(p.whole is WholeStep.NONE for p in parts)


def test_a_greedy_decode_batch_kept_from_drafting_runs_the_whole_plain_step():
    """A speculative engine's step that proposes no drafts (the policy's decision) decodes in the plain step's graph
    where it has one; one that verifies, samples, or has no such graph runs the parts."""
    graphs = GraphsReady(greedy=True, drafting=True, plain_step=True)
    for trees in (False, True):
        assert path(full(4, 1), decode(3), graphs, SpeculatorKind.NONE, trees) == StepPath(
            M.FULL, WholeStep.PLAIN, Sampling.IN_WHOLE_STEP, Verification.NONE, Drafting.NONE)
    parts = [path(full(4, 1), decode(3), graphs),  # it drafts
             path(full(4, 4), verify(3, 3), graphs, SpeculatorKind.NONE),  # it verifies the step before's drafts
             path(full(4, 1), decode(3, SAMPLED), graphs, SpeculatorKind.NONE),
             path(full(4, 1), decode(3, RowsSampling(grammar=True)), graphs, SpeculatorKind.NONE),
             path(full(4, 1), decode(3), GraphsReady(greedy=True, drafting=True), SpeculatorKind.NONE)]
    assert all(p.whole is WholeStep.NONE for p in parts)


def test_a_whole_step_without_a_speculator_drafts_nothing_and_a_host_one_drafts_on_the_host():
    assert path(full(4, 1), decode(4), speculator=SpeculatorKind.NONE).drafting is Drafting.NONE
    host = path(full(4, 1), decode(4), speculator=SpeculatorKind.ON_HOST)
    assert host.whole is WholeStep.CHAIN and host.drafting is Drafting.ON_HOST


def test_a_step_runs_its_parts_when_any_condition_of_the_whole_step_fails():
    decoding = full(4, 1)
    parts = [
        path(decoding, decode(4), GraphsReady(greedy=True, drafting=True)),  # no whole-step graph
        path(decoding, decode(4, SAMPLED)),
        path(decoding, decode(4, LOGPROBS)),
        path(decoding, decode(4, PENALTIES)),  # the sampler applies them
        path(decoding, StepRows(4, (0,) * 4, num_sample=3)),  # a prompt chunk yields no token
        path(full(4, 4), verify(4, 3, LOGPROBS)),
        path(full(4, 4), StepRows(4, (3, 3, 2, 3), num_verify=4)),  # a request verifies fewer drafts
    ]
    assert all(p.whole is WholeStep.NONE for p in parts)


def test_the_target_runs_in_its_descriptors_mode():
    mixed = StepRows(2, (0, 0), num_sample=1)
    assert path(BatchDescriptor(M.NONE, 9, 2), mixed).target is M.NONE
    assert path(BatchDescriptor(M.PIECEWISE, 16, 2), mixed).target is M.PIECEWISE
    assert path(BatchDescriptor(M.FULL, 16, 2), mixed).target is M.FULL


def test_a_greedy_decode_batch_samples_in_its_greedy_graph():
    p = path(full(4, 1), decode(4), GraphsReady(greedy=True))
    assert (p.whole, p.sampling, p.verification) == (WholeStep.NONE, Sampling.GREEDY_GRAPH, Verification.NONE)


def test_greedy_sampling_runs_eagerly_without_a_graph_or_for_part_of_the_batch():
    assert path(BatchDescriptor(M.PIECEWISE, 8, 4, 1), decode(4)).sampling is Sampling.ARGMAX
    # A uniform batch of 1 + k tokens that samples is a prefill with nothing to verify.
    assert path(full(2, 4), StepRows(2, (0, 0), num_sample=2)).sampling is Sampling.ARGMAX
    p = path(BatchDescriptor(M.PIECEWISE, 8, 2), StepRows(2, (0, 3), num_sample=1, num_verify=1))
    assert (p.sampling, p.verification) == (Sampling.ARGMAX, Verification.GREEDY)


def test_sampled_rows_logprobs_and_penalties_take_the_sampler():
    for rows in (SAMPLED, LOGPROBS, PENALTIES):
        assert path(full(4, 1), decode(4, rows)).sampling is Sampling.SAMPLER


def test_a_greedy_batch_verifying_every_draft_verifies_in_its_greedy_graph():
    p = path(full(4, 4), verify(4, 3), GraphsReady(greedy=True))
    assert (p.whole, p.sampling, p.verification) == (WholeStep.NONE, Sampling.NONE, Verification.GREEDY_GRAPH)


def test_greedy_verification_runs_eagerly_otherwise():
    ready = GraphsReady(greedy=True)
    assert path(full(4, 4), StepRows(4, (3, 2, 3, 3), num_verify=4), ready).verification is Verification.GREEDY
    assert path(BatchDescriptor(M.NONE, 8, 2, 4), verify(2, 3)).verification is Verification.GREEDY


def test_sampled_rows_or_logprobs_verify_by_rejection_sampling():
    assert path(full(4, 4), verify(4, 3, SAMPLED)).verification is Verification.REJECTION
    assert path(full(4, 4), verify(4, 3, LOGPROBS)).verification is Verification.REJECTION
    # Penalties do not stop greedy verification: only the sampler applies them, after it.
    assert path(full(4, 4), verify(4, 3, PENALTIES), GraphsReady(greedy=True)).verification is \
        Verification.GREEDY_GRAPH


def test_trees_are_walked_on_the_argmax_or_on_the_logits():
    desc = BatchDescriptor(M.PIECEWISE, 16, 2)
    assert path(desc, verify(2, 5), trees=True).verification is Verification.TREE_ARGMAX
    assert path(desc, verify(2, 5, SAMPLED), trees=True).verification is Verification.TREE_LOGITS
    assert path(desc, verify(2, 5, LOGPROBS), trees=True).verification is Verification.TREE_LOGITS


def test_a_greedy_chain_drafts_in_the_loop_graph_where_it_has_one():
    parts = GraphsReady(greedy=True, drafting=True)
    assert path(full(4, 1), decode(4), parts).drafting is Drafting.GREEDY_LOOP_GRAPH
    assert path(full(4, 1), decode(4), GraphsReady(greedy=True)).drafting is Drafting.STEPS
    assert path(full(4, 1), decode(4, SAMPLED), parts).drafting is Drafting.STEPS
    # Logprobs do not change what the drafter does.
    assert path(full(4, 1), decode(4, LOGPROBS), parts).drafting is Drafting.GREEDY_LOOP_GRAPH


def test_a_greedy_tree_drafts_in_the_tree_graph_and_a_sampled_one_in_its_own():
    """The tree graph drafts top guesses; a sampling request's children are drawn (spec_decode/sampled_tree.py),
    in the sampled tree graph where every request draws with its temperature alone, else pass by pass."""
    desc = BatchDescriptor(M.PIECEWISE, 16, 2)
    both = GraphsReady(whole_step=True, greedy=True, drafting=True, sampled_tree=True)
    assert path(desc, verify(2, 5), both, trees=True).drafting is Drafting.TREE_GRAPH
    assert path(desc, verify(2, 5, SAMPLED), both, trees=True).drafting is Drafting.SAMPLED_TREE_GRAPH
    filtered = RowsSampling(all_greedy=False, temperature_only=False)
    assert path(desc, verify(2, 5, filtered), both, trees=True).drafting is Drafting.TREE_PASSES
    assert path(desc, verify(2, 5, SAMPLED), trees=True).drafting is Drafting.TREE_PASSES  # no sampled tree graph
    no_graph = GraphsReady(greedy=True)
    assert path(desc, verify(2, 5), no_graph, trees=True).drafting is Drafting.TREE_PASSES


def test_nothing_samples_verifies_or_drafts_in_a_step_of_prompt_chunks_alone():
    p = path(BatchDescriptor(M.PIECEWISE, 64, 2), StepRows(2, (0, 0)))
    assert (p.sampling, p.verification, p.drafting) == (Sampling.NONE, Verification.NONE, Drafting.NONE)


def test_a_host_speculator_drafts_on_the_host():
    p = path(BatchDescriptor(M.NONE, 9, 2), StepRows(2, (0, 3), num_sample=1, num_verify=1),
             speculator=SpeculatorKind.ON_HOST)
    assert p.drafting is Drafting.ON_HOST and not p.drafts_on_device


def test_step_rows_of_a_schedule():
    def request(rid: str, params: SamplingParams) -> Request:
        return Request(rid, [1, 2, 3], params, eos_token_ids=set(), max_model_len=64)

    sched = SchedulerOutput([
        ScheduledRequest(request("a", SamplingParams(temperature=0)), 1, [], [], samples=True, start=3),
        ScheduledRequest(request("b", SamplingParams(temperature=0.5)), 4, [7, 8, 9], [], samples=True, start=3),
        ScheduledRequest(request("c", SamplingParams(temperature=0, logprobs=2)), 2, [], [], samples=False, start=0),
    ])
    rows = StepRows.of(sched)
    # c runs a prompt chunk; a decodes and b verifies its drafts.
    assert rows == StepRows(3, (0, 3, 0), num_sample=1, num_verify=1, sample=RowsSampling(),
                            verify=RowsSampling(all_greedy=False), prompt_tokens=True)
    assert rows.num_sampling == 2 and not rows.all_verify(4) and StepRows(2, (3, 3)).all_verify(4)
    assert not StepRows.of(SchedulerOutput(sched.scheduled[:2])).prompt_tokens


def test_a_step_that_drafts_nothing_prefills_the_drafters_cache_over_its_prompt_tokens():
    """A step of prompt chunks alone, or one the policy keeps from drafting that runs prompt tokens, runs the
    drafter's prefill alone where there is a device drafter; a step of decodes does not."""
    cache = GraphsReady(drafter_cache=True)
    chunks = StepRows(2, (0, 0), prompt_tokens=True)
    mixed = StepRows(2, (0, 0), num_sample=1, prompt_tokens=True)
    desc = BatchDescriptor(M.NONE, 40, 2)
    assert path(desc, chunks, cache).drafting is Drafting.PREFILL_ONLY
    assert path(desc, mixed, cache, SpeculatorKind.NONE).drafting is Drafting.PREFILL_ONLY
    assert not path(desc, mixed, cache, SpeculatorKind.NONE).drafts_on_device
    assert path(desc, mixed, cache).drafting is Drafting.STEPS  # it drafts, its prefill included
    assert path(desc, decode(2), cache, SpeculatorKind.NONE).drafting is Drafting.NONE
    assert path(desc, chunks, GraphsReady()).drafting is Drafting.NONE  # no drafter on the device


def test_grammar_rows_take_the_masked_greedy_graphs_but_never_the_whole_step():
    """A greedy grammar row's masks are built while the target's forward runs, so it never runs the whole step; the
    greedy graphs (decode and chain verification), the eager argmax and greedy verification and the tree walk on
    the argmax apply the masks; sampled rows and rows with logprobs take the samplers."""
    grammar = RowsSampling(grammar=True)
    sampled = path(full(4, 1), decode(4, grammar))
    assert (sampled.whole, sampled.sampling, sampled.masked) == (WholeStep.NONE, Sampling.GREEDY_GRAPH, True)
    verified = path(full(4, 4), verify(4, 3, grammar))
    assert (verified.whole, verified.verification, verified.masked) == (WholeStep.NONE, Verification.GREEDY_GRAPH,
                                                                       True)
    # Without a greedy graph for the descriptor: the eager argmax paths.
    eager = BatchDescriptor(M.PIECEWISE, 16, 4)
    assert path(eager, decode(4, grammar)).sampling is Sampling.ARGMAX
    assert path(BatchDescriptor(M.PIECEWISE, 16, 4, 4), verify(4, 3, grammar)).verification is Verification.GREEDY
    assert path(full(2, 6), verify(2, 5, grammar), trees=True).verification is Verification.TREE_ARGMAX
    # Sampled, with logprobs, or needing the sampler's host tokens: the samplers.
    for other in (RowsSampling(all_greedy=False, grammar=True), RowsSampling(logprobs=True, grammar=True)):
        assert path(full(4, 4), verify(4, 3, other)).verification is Verification.REJECTION
        assert path(full(4, 1), decode(4, other)).sampling is Sampling.SAMPLER
    assert path(full(4, 1), decode(4, RowsSampling(needs_host_tokens=True, grammar=True))).sampling is Sampling.SAMPLER
    assert path(full(2, 6), verify(2, 5, RowsSampling(all_greedy=False, grammar=True)),
                trees=True).verification is Verification.TREE_LOGITS
    assert not path(full(4, 1), decode(4)).masked and not path(full(4, 4), verify(4, 3, SAMPLED)).masked


def test_logit_bias_rows_take_the_logits_paths_unmasked():
    """A bias changes the logits, so greedy rows with one never run the whole step, a greedy graph or the bare
    argmax, for chains and trees alike; no grammar mask is built for them, and their tokens are not needed on
    the host."""
    biased = RowsSampling(logit_bias=True)
    sampled = path(full(4, 1), decode(4, biased))
    assert (sampled.whole, sampled.sampling, sampled.masked) == (WholeStep.NONE, Sampling.SAMPLER, False)
    verified = path(full(4, 4), verify(4, 3, biased))
    assert (verified.whole, verified.verification) == (WholeStep.NONE, Verification.REJECTION)
    assert verified.drafting is Drafting.GREEDY_LOOP_GRAPH
    assert path(full(2, 6), verify(2, 5, biased), trees=True).verification is Verification.TREE_LOGITS
    assert (RowsSampling() | biased).logit_bias and not (RowsSampling() | RowsSampling()).logit_bias
    request = Request("r", [1, 2], SamplingParams(temperature=0, logit_bias={5: 1.0}), set(), 64)
    assert RowsSampling.of([request]) == RowsSampling(logit_bias=True)


def test_grammar_steps_draft_masked_steps_and_tree_passes_and_others_keep_their_graphs():
    """The drafter's logits of a grammar step are masked depth by depth from host-built masks, so such a step
    drafts eagerly, never in the loop or tree graph; a step without a grammar request keeps them."""
    grammar = RowsSampling(needs_host_tokens=True, grammar=True)
    assert path(full(4, 4), verify(4, 3, grammar)).drafting is Drafting.MASKED_STEPS
    assert path(full(4, 1), decode(4, grammar)).drafting is Drafting.MASKED_STEPS
    desc = BatchDescriptor(M.PIECEWISE, 16, 2)
    assert path(desc, verify(2, 5, grammar), trees=True).drafting is Drafting.MASKED_TREE_PASSES
    mixed = StepRows(2, (0, 3), num_sample=1, num_verify=1, verify=grammar)
    assert path(BatchDescriptor(M.NONE, 5, 2), mixed).drafting is Drafting.MASKED_STEPS
    assert Drafting.MASKED_STEPS.masked and Drafting.MASKED_TREE_PASSES.masked
    assert not any(d.masked for d in Drafting if d not in (Drafting.MASKED_STEPS, Drafting.MASKED_TREE_PASSES))
    # A host speculator's drafts are not masked.
    assert path(full(4, 1), decode(4, grammar), speculator=SpeculatorKind.ON_HOST).drafting is Drafting.ON_HOST
    assert path(full(4, 1), decode(4), GraphsReady(greedy=True, drafting=True)).drafting is Drafting.GREEDY_LOOP_GRAPH
    assert path(desc, verify(2, 5), trees=True).drafting is Drafting.TREE_GRAPH


def test_grammar_steps_without_masked_drafts_draft_in_the_graphs_but_still_build_masks():
    """With mask_drafts false a grammar step drafts as a step without a grammar does (the loop or tree graph), and
    still masks its sampling and verification; it never runs the whole step, whose graph applies no masks."""
    grammar = RowsSampling(grammar=True)
    chain = path(full(4, 4), verify(4, 3, grammar), mask_drafts=False)
    assert (chain.whole, chain.verification, chain.drafting, chain.masked) == (
        WholeStep.NONE, Verification.GREEDY_GRAPH, Drafting.GREEDY_LOOP_GRAPH, True)
    assert path(full(4, 1), decode(4, grammar), mask_drafts=False).drafting is Drafting.GREEDY_LOOP_GRAPH
    desc = BatchDescriptor(M.PIECEWISE, 16, 2)
    tree = path(desc, verify(2, 5, grammar), trees=True, mask_drafts=False)
    assert (tree.verification, tree.drafting, tree.masked) == (Verification.TREE_ARGMAX, Drafting.TREE_GRAPH, True)
    sampled = RowsSampling(all_greedy=False, grammar=True)
    assert path(full(4, 4), verify(4, 3, sampled), mask_drafts=False).drafting is Drafting.STEPS
