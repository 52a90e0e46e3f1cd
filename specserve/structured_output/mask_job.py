"""A step's grammar masks filled on a worker thread while the engine thread enqueues the step (ModelRunner.launch).

The masks of a step start from the tokens of the step before. Under asynchronous scheduling those tokens are
on the host by the time the step is launched on a host-bound batch (the device finished the step before while
the host scheduled this one), yet the engine thread would read them only once this step's forward is enqueued,
and then wait for the masks with nothing left to do before the sampling. Here the worker thread reads the step
before's results itself as the launch begins (waiting for them if the device is still busy), advances the
requests' grammars past its tokens and fills this step's masks on the host; meanwhile the engine thread stages
the inputs, enqueues the forward, and appends the step before's tokens to their requests; it waits for the masks
only to queue their copy, before the sampling. xgrammar's fills release the GIL, so they run on a CPU of their
own beside the engine thread (docs/design.md, 'Structured output').

What must hold, from start() until masks() returns:
- Only the worker uses the requests' matchers. The engine thread's Request.append_token takes the results the
  worker recorded (RequestGrammar.advance), after resolved() returns: the worker advances every grammar the
  scheduler's update will append tokens to (a sampling row of a request still running), and only those.
- The step before is read once: its handle's `resolved` is this job's, which ModelRunner.resolve returns.
- Which rows are masked is decided before the engine thread appends the tokens (which may end requests): a
  request's rows are masked if it had a grammar, had not finished and its grammar had not ended.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from specserve.engine.request import RequestStatus
from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from specserve.structured_output.step_masks import FilledMasks, StepMasks
from specserve.worker.input_buffers import TokenBitmaskBuffer
from specserve.worker.step_handle import StepHandle


class MaskJob:
    """One step's masks on their way: resolved() gives the step before's results, masks() the step's masks."""

    def __init__(self, previous: StepHandle | None):
        self.previous = previous
        self._resolved: Future = Future()
        self._filled: Future | None = None
        if previous is not None:
            previous.resolved = self._resolved

    def masks(self, buffer: TokenBitmaskBuffer) -> StepMasks:
        """Wait for the host rows and queue them to the device (the engine thread: its stream runs the step)."""
        return StepMasks.upload(self._filled.result(), buffer)


class MaskWorker:
    """The runner's one worker thread for grammar masks."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-masks")

    def start(self, previous: StepHandle | None, read_results: Callable[[StepHandle], object],
              sched: SchedulerOutput, fill: Callable[[Callable[[ScheduledRequest], bool]], FilledMasks]) -> MaskJob:
        """Start a step's masks: read the step before's results (read_results: the runner's read of a step's
        outputs, whose RunnerOutput the job then hands to ModelRunner.resolve), advance the grammars past them,
        and fill (given which requests' rows are masked) the masks of the step scheduled in sched."""
        job = MaskJob(previous)
        job._filled = self._pool.submit(_run, job, read_results, sched, fill)
        return job


def _run(job: MaskJob, read_results: Callable[[StepHandle], object], sched: SchedulerOutput,
         fill: Callable[[Callable[[ScheduledRequest], bool]], FilledMasks]) -> FilledMasks:
    try:
        if job.previous is not None:
            result = read_results(job.previous)
            _advance(job.previous.sched, result)
        else:
            result = None
        masked = {id(s.request) for s in sched.scheduled if _masked(s)}
    except BaseException as e:
        job._resolved.set_exception(e)
        raise
    job._resolved.set_result(result)
    return fill(lambda s: id(s.request) in masked)


def _advance(sched: SchedulerOutput, result) -> None:
    """Each grammar past the tokens Scheduler.update will append to its request: a sampling row of a request
    still running."""
    for s in sched.scheduled:
        req = s.request
        if s.samples and req.grammar is not None and req.status is RequestStatus.RUNNING:
            req.grammar.advance(result.sampled.get(req.request_id, []))


def _masked(s: ScheduledRequest) -> bool:
    grammar = s.request.grammar
    return grammar is not None and not s.request.is_finished and not grammar.matcher.is_terminated()
