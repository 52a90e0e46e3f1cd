"""specserve's server beside vLLM's and beside specserve's own offline engine, in one run on one GPU.

    python benchmarks/compare_serving.py --model HF_DIR --dataset mt_bench.jsonl --out OUT \
        [--vllm-site SITE] [--spec JSON] [--vllm-spec JSON] [--concurrency 1,16,64,256] [--max-tokens 256]

Each server starts fresh and is loaded by the same client (`specserve bench serve`, greedy, every
request streamed) at each concurrency, lowest first, so the c=1 run's TTFT covers the first requests
after start-up. The offline figure is `specserve bench offline` with max_num_seqs = c on the same
prompts. vLLM (SITE: a folder holding vLLM 0.26.0, see the peers kit) is skipped without --vllm-site.
Prints one table; every client report and server log goes to OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_ROWS = {"output_tok_s": r"Output token throughput \(tok/s\): +([\d.]+)", "p99_ttft_ms": r"P99 TTFT \(ms\): +([\d.]+)",
         "mean_tpot_ms": r"Mean TPOT \(ms\): +([\d.]+)", "failed": r"Failed requests: +(\d+)",
         "acceptance_rate": r"Acceptance rate \(%\): +([\d.]+)"}


def parse_report(text: str) -> dict:
    return {k: float(m.group(1)) for k, rx in _ROWS.items() if (m := re.search(rx, text))}


def wait_up(port: int, proc: subprocess.Popen, timeout_s: float = 600) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def num_prompts(c: int) -> int:
    return 24 if c < 16 else 4 * c


class Run:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict[int, dict]] = {}
        self.deadline = time.monotonic() + a.time_budget

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "specserve.entrypoints.cli", *args]

    def load(self, name: str, port: int) -> None:
        for c in self.a.concurrency:
            if time.monotonic() > self.deadline:
                print(f"{name} c={c}: skipped, out of time", flush=True)
                continue
            cmd = self._cli("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset", self.a.dataset,
                            "--num-prompts", str(num_prompts(c)), "--concurrency", str(c), "--max-tokens",
                            str(self.a.max_tokens))
            text = subprocess.run(cmd, capture_output=True, text=True).stdout
            (self.out / f"{name}_c{c}.txt").write_text(text)
            self.results.setdefault(name, {})[c] = parse_report(text)
            print(f"{name} c={c}: {self.results[name][c]}", flush=True)

    def serve(self, name: str, cmd: list[str], port: int, env: dict) -> None:
        log = open(self.out / f"{name}_server.log", "w")
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            if wait_up(port, proc):
                print(f"{name}: up in {time.monotonic() - start:.0f} s", flush=True)
                self.load(name, port)
            else:
                print(f"{name} did not start: {(self.out / f'{name}_server.log').read_text()[-500:]}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()

    def vllm(self) -> None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.a.model, "--port", "8012",
               "--max-num-seqs", str(max(self.a.concurrency)), "--gpu-memory-utilization", "0.5",
               "--max-model-len", "4096"]
        if self.a.vllm_spec:
            cmd += ["--speculative-config", self.a.vllm_spec]
        path = self.a.vllm_site + os.pathsep + os.environ.get("PYTHONPATH", "")
        self.serve("vllm", cmd, 8012, {**os.environ, "PYTHONPATH": path, "VLLM_USE_FLASHINFER_SAMPLER": "0"})

    def specserve(self) -> None:
        cmd = self._cli("serve", "--model", self.a.model, "--port", "8011", "--max-num-seqs",
                        str(max(self.a.concurrency)))
        if self.a.spec:
            cmd += ["--speculative-config", self.a.spec]
        self.serve("specserve", cmd, 8011, dict(os.environ))

    def offline(self) -> None:
        for c in self.a.offline_concurrency:
            if time.monotonic() > self.deadline:
                print(f"offline c={c}: skipped, out of time", flush=True)
                continue
            cmd = self._cli("bench", "offline", "--model", self.a.model, "--dataset", self.a.dataset,
                            "--num-prompts", str(num_prompts(c)), "--max-tokens", str(self.a.max_tokens),
                            "--max-num-seqs", str(c))
            if self.a.spec:
                cmd += ["--speculative-config", self.a.spec]
            text = subprocess.run(cmd, capture_output=True, text=True).stdout
            (self.out / f"offline_c{c}.txt").write_text(text)
            self.results.setdefault("offline", {})[c] = parse_report(text)
            print(f"offline c={c}: {self.results['offline'][c]}", flush=True)

    def table(self) -> str:
        lines = ["| c | vLLM serve tok/s | specserve serve tok/s | specserve offline tok/s | serve / vLLM | "
                 "serve / offline | P99 TTFT ms (specserve, vLLM) |", "|---|---|---|---|---|---|---|"]
        get = lambda name, c, key: self.results.get(name, {}).get(c, {}).get(key)  # noqa: E731
        fmt = lambda x, spec="{:,.0f}": "-" if x is None else spec.format(x)  # noqa: E731
        for c in self.a.concurrency:
            v, s, o = (get(n, c, "output_tok_s") for n in ("vllm", "specserve", "offline"))
            lines.append(f"| {c} | {fmt(v)} | {fmt(s)} | {fmt(o)} | {fmt(s / v if s and v else None, '{:.2f}x')} | "
                         f"{fmt(s / o if s and o else None, '{:.0%}')} | {fmt(get('specserve', c, 'p99_ttft_ms'))}, "
                         f"{fmt(get('vllm', c, 'p99_ttft_ms'))} |")
        return "\n".join(lines)


def main() -> None:
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face directory both servers load")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vllm-site", help="folder holding vLLM; without it vLLM is not run")
    ap.add_argument("--spec", help="specserve's --speculative-config")
    ap.add_argument("--vllm-spec", help="vLLM's --speculative-config")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64, 256])
    ap.add_argument("--offline-concurrency", type=ints, default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--time-budget", type=float, default=540, help="seconds after which nothing new starts")
    ap.add_argument("--skip", default="", help="comma-separated parts not to run: vllm, specserve, offline")
    a = ap.parse_args()
    run = Run(a)
    skip = set(a.skip.split(","))
    if a.vllm_site and "vllm" not in skip:
        run.vllm()
    if "specserve" not in skip:
        run.specserve()
    if "offline" not in skip:
        run.offline()
    (run.out / "results.json").write_text(json.dumps(run.results, indent=1))
    print(run.table())


if __name__ == "__main__":
    main()
