"""A load generator for any OpenAI-compatible server, in the spirit of `vllm bench serve`.

Each request streams, so time to first token (TTFT) is when the first text
arrives and time per output token (TPOT) is the rest of the latency over the
remaining tokens; token counts come from the server's usage chunk. Against a
specserve server it also reports speculative decoding's acceptance over the
run, from the difference of two /metrics scrapes.

The streams are shared among client processes (`STREAMS_PER_PROCESS` each by
default): one Python process reads some tens of thousands of events a second,
and a load generator that saturates first measures itself, not the server.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import queue
import random
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

STREAMS_PER_PROCESS = 16
_SPEC_COUNTERS = {"specserve:spec_decode_num_drafted_tokens": "drafted",
                  "specserve:spec_decode_num_accepted_tokens": "accepted"}


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "chat"
    max_tokens: int = 128
    temperature: float = 0.0
    concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    timeout: float = 600.0
    ignore_eos: bool = False  # every request generates max_tokens (servers that accept it: specserve, vLLM)
    client_processes: int | None = None  # None: one per STREAMS_PER_PROCESS streams, at most the CPU count

    def __post_init__(self):
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.client_processes is not None and self.client_processes < 1:
            raise ValueError(f"client_processes must be at least 1, got {self.client_processes}")

    def num_processes(self, num_prompts: int) -> int:
        """Client processes for a run of num_prompts: never more than there are streams or prompts."""
        streams = min(self.concurrency or num_prompts, num_prompts)
        wanted = self.client_processes or min(math.ceil(streams / STREAMS_PER_PROCESS), os.cpu_count() or 1)
        return max(1, min(wanted, streams))


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""


def load_prompts(path: str, num_prompts: int) -> list[str]:
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["turns"][0] if "turns" in row else row["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


async def _send(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str) -> RequestResult:
    payload = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
               "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.endpoint == "chat":
        url, payload["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, payload["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    ttft, last, pending = None, None, b""
    try:
        async with client.stream("POST", cfg.base_url + url, json=payload) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            # Only the events that matter are parsed: until the first text (the time to first token), an
            # error, and the last one (the usage); at tens of thousands of events a second, parsing every
            # one would make this client the bottleneck of a fast server.
            async for data in r.aiter_bytes():
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    if event.startswith(b'data: {"error"'):
                        error = json.loads(event[6:])["error"]
                        return RequestResult(False, error=error.get("message", str(error)))
                    last = event
                    if ttft is None and _has_text(json.loads(event[6:])):
                        ttft = time.perf_counter() - start
    except httpx.HTTPError as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    usage = None if last is None else json.loads(last[6:]).get("usage")
    if usage is None:
        return RequestResult(False, error="the stream carried no usage")
    return RequestResult(True, usage["prompt_tokens"], usage["completion_tokens"],
                         latency if ttft is None else ttft, latency)


def _has_text(event: dict) -> bool:
    for choice in event.get("choices", []):
        if choice.get("text") if "text" in choice else choice.get("delta", {}).get("content"):
            return True
    return False


def _spec_counters(client: httpx.Client, base_url: str) -> dict[str, float]:
    """Speculative decoding counters from /metrics; empty for servers that do not export them."""
    try:
        r = client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    return {_SPEC_COUNTERS[f.name]: f.samples[0].value for f in text_string_to_metric_families(r.text)
            if f.name in _SPEC_COUNTERS and f.samples}


async def _run_share(cfg: BenchConfig, model: str, prompts: list[str]) -> tuple[list[RequestResult], float, float]:
    """One process's share of the run: its prompts, at most cfg.concurrency in flight, arriving at
    cfg.request_rate. Returns the results and the share's start and end (time.perf_counter, which is
    the system's monotonic clock and so comparable across processes)."""
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(timeout=cfg.timeout, limits=limits) as client:
        slots = asyncio.Semaphore(cfg.concurrency or len(prompts))
        rng = random.Random(cfg.seed)

        async def limited(prompt: str) -> RequestResult:
            async with slots:
                return await _send(client, cfg, model, prompt)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(cfg.request_rate) and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
    return list(results), start, time.perf_counter()


def _client_process(cfg: BenchConfig, model: str, prompts: list[str], index: int, barrier, results) -> None:
    barrier.wait()  # every process has imported its modules: the first wave of requests leaves together
    results.put((index, *asyncio.run(_run_share(cfg, model, prompts))))


def _shares(cfg: BenchConfig, prompts: list[str], processes: int) -> list[tuple[BenchConfig, list[str]]]:
    """Process p sends prompts p, p + P, ...; the concurrency splits as evenly as it can and the arrival
    rate splits evenly (P Poisson processes of rate r / P merge into one of rate r)."""
    streams = cfg.concurrency or len(prompts)
    return [(replace(cfg, concurrency=streams // processes + (p < streams % processes),
                     request_rate=cfg.request_rate / processes, seed=cfg.seed + p), prompts[p::processes])
            for p in range(processes)]


def _run_processes(cfg: BenchConfig, model: str, prompts: list[str], processes: int):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(share, model, share_prompts, p, barrier, results),
                           daemon=True) for p, (share, share_prompts) in enumerate(_shares(cfg, prompts, processes))]
    for w in workers:
        w.start()
    shares = {}
    try:
        while len(shares) < processes:
            try:
                index, *share = results.get(timeout=1.0)
                shares[index] = share
            except queue.Empty:
                dead = [w for p, w in enumerate(workers) if p not in shares and not w.is_alive()]
                if dead:
                    raise RuntimeError(f"a client process exited with code {dead[0].exitcode} before reporting; "
                                       "its error is printed above") from None
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
    return ([r for p in range(processes) for r in shares[p][0]], min(s[1] for s in shares.values()),
            max(s[2] for s in shares.values()))


def run_benchmark(cfg: BenchConfig, prompts: list[str]) -> dict:
    with httpx.Client(timeout=cfg.timeout) as client:
        model = cfg.model or client.get(cfg.base_url + "/v1/models").json()["data"][0]["id"]
        before = _spec_counters(client, cfg.base_url)
        processes = cfg.num_processes(len(prompts))
        if processes == 1:
            results, start, end = asyncio.run(_run_share(cfg, model, prompts))
        else:
            results, start, end = _run_processes(cfg, model, prompts, processes)
        after = _spec_counters(client, cfg.base_url)
    spec = {k: after[k] - before.get(k, 0.0) for k in after}
    return summarize(results, end - start, spec)


def summarize(results: list[RequestResult], duration: float, spec: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    # TPOT excludes the first token, so requests that produced a single token have none.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("e2el", [r.latency for r in ok])):
        ms = np.asarray(values or [math.nan]) * 1000
        summary[f"mean_{name}_ms"] = float(ms.mean())
        for p in (50, 90, 99):
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    if spec.get("drafted"):
        summary["spec_drafted_tokens"] = spec["drafted"]
        summary["spec_accepted_tokens"] = spec["accepted"]
        summary["spec_acceptance_rate"] = spec["accepted"] / spec["drafted"]
    return summary


def print_report(s: dict) -> None:
    width = 50

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<{width - 12}}{text:>12}")

    print(" Serving Benchmark Result ".center(width, "="))
    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("e2el", "End-to-end Latency")):
        print(f" {title} ".center(width, "-"))
        row(f"Mean {name.upper()} (ms):", s[f"mean_{name}_ms"])
        for p in (50, 90, 99):
            row(f"P{p} {name.upper()} (ms):", s[f"p{p}_{name}_ms"])
    if "spec_drafted_tokens" in s:
        print(" Speculative Decoding ".center(width, "-"))
        row("Drafted tokens:", int(s["spec_drafted_tokens"]))
        row("Accepted tokens:", int(s["spec_accepted_tokens"]))
        row("Acceptance rate (%):", 100 * s["spec_acceptance_rate"])
    for error in s["errors"]:
        print(f"error: {error}")
    print("=" * width)
