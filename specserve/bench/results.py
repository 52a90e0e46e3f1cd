"""The figures of `specserve bench decode`: a row per (model, system, mode, speculation, batch), the engines built
and the models measured, as bench/report.py prints them and the JSON file keeps them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    model: str
    system: str  # "specserve" or "transformers"
    mode: str  # graph mode; "eager" for transformers
    spec: str  # "none" or SpecSetting.label
    batch: int
    tok_s: float | None = None
    # Tokens emitted per verification step (accepted drafts + 1), measured.
    accept_len: float | None = None
    # The share of the timed steps whose requests drafted (the dynamic policy's decisions).
    drafting_share: float | None = None
    # Under tensor parallelism: the time of one step's collectives alone (distributed/collective_probe.py).
    collectives_ms: float | None = None
    error: str | None = None

    @property
    def ms_per_token(self) -> float | None:
        """Time between two tokens of one request."""
        return None if not self.tok_s else 1000.0 * self.batch / self.tok_s


@dataclass
class EngineRecord:
    model: str
    mode: str
    spec: str
    # Engine construction, graph capture included.
    build_s: float | None = None
    # From the runner where it has them (ModelRunner.capture_seconds, .graph_memory_bytes).
    capture_s: float | None = None
    graph_memory_bytes: int | None = None
    capture_sizes: list[int] | str = "default"


@dataclass
class ModelInfo:
    name: str
    random_weights: bool
    num_params: int
    weight_bytes: int  # read by one GPU each step: under tensor parallelism, rank 0's shard
    tensor_parallel_size: int = 1
    # How the ranks all-reduced (EngineConfig.all_reduce as the engine resolved it); None at one rank.
    all_reduce: str | None = None


@dataclass
class BenchResults:
    config: dict
    device_name: str
    versions: dict
    bandwidth_bytes_s: float
    bandwidth_measured: bool
    models: dict[str, ModelInfo] = field(default_factory=dict)
    engines: list[EngineRecord] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def limit_tok_s(self, row: Row) -> float | None:
        """Weight-read limit without speculation: every step reads all weights once for `batch` tokens (under
        tensor parallelism each GPU its shard, all at once: the GPUs' bandwidths add up)."""
        info = self.models.get(row.model)
        if info is None or row.spec != "none":
            return None
        return row.batch * self.bandwidth_bytes_s / info.weight_bytes

    def find(self, model: str, system: str, batch: int, mode: str | None = None, spec: str = "none") -> Row | None:
        for r in self.rows:
            if (r.model, r.system, r.batch, r.spec) == (model, system, batch, spec) and r.tok_s \
                    and (mode is None or r.mode == mode):
                return r
        return None
