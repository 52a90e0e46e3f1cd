"""What ranks 1..N-1 must run of rank 0's step (docs/design.md, 'Tensor parallelism'): rank 0 chooses the
step's path once (worker/step_path.py) and names here every collective that path makes, so that the
others run the same ones in the same order without choosing anything themselves."""
from __future__ import annotations

import numpy as np

from specserve.distributed.messages import DraftFollow, WorkerStep
from specserve.worker.cudagraph import BatchDescriptor
from specserve.worker.staged_inputs import StagedExtra
from specserve.worker.step_path import Sampling, StepPath, Verification, WholeStep
from specserve.worker.step_plan import StepPlan

# The parts that take logits (an all-gather of lm_head's shards) of the hidden rows the plan stages.
_SAMPLING_LOGITS = (Sampling.ARGMAX, Sampling.SAMPLER)
_VERIFYING_LOGITS = (Verification.GREEDY, Verification.REJECTION, Verification.TREE_ARGMAX, Verification.TREE_LOGITS)


def worker_step(input_ids: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                tree_layout: tuple[np.ndarray | None, np.ndarray | None], plan: StepPlan, desc: BatchDescriptor,
                path: StepPath, tree_depth: int, shares_outputs: bool, drafting: DraftFollow | None) -> WorkerStep:
    """The step the other ranks follow: the forward's inputs as rank 0 stages them, its descriptor and path
    (the graphs replayed: the whole step's, or the target's and the greedy one's), lm_head over the rows rank 0
    samples from (first) and verifies at (then) outside graphs, the KV moves of trees verified outside graphs,
    tree_depth per verifying request, whether the step ends with rank 0 sharing its outputs, and a sharded
    drafter's drafting outside the whole step."""
    rows = []
    if path.whole is WholeStep.NONE:
        if path.sampling in _SAMPLING_LOGITS:
            rows.append(plan.extras[StagedExtra.SAMPLE_INDEX])
        if path.verification in _VERIFYING_LOGITS:
            rows.append(plan.extras[StagedExtra.VERIFY_INDEX].reshape(-1))
    moves = len(plan.verify_rows) * tree_depth if broadcasts_tree_moves(path, drafting) else 0
    return WorkerStep(input_ids, query_lens, seq_lens, block_table, desc, path, *tree_layout, lm_head_rows=rows,
                      num_tree_moves=moves, extras=plan.extras, masked=path.masked, shares_outputs=shares_outputs,
                      drafting=drafting)


def broadcasts_tree_moves(path: StepPath, drafting: DraftFollow | None) -> bool:
    """Whether rank 0 sends the other ranks the KV moves of the trees it verifies outside graphs: yes, but where a
    sharded drafter drafts in the step (drafting), for then rank 0 shares its outputs right after verifying and
    every rank retraces the walk from them, moves included (ModelRunner.retrace_trees)."""
    return path.verifies_trees and drafting is None
