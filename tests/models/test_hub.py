"""Models by Hugging Face id, read from a hub cache laid out on disk as huggingface_hub lays it out, offline.

Each run is a fresh process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set, as a user sets them: huggingface_hub
reads both when it is imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import make_hf_model
from specserve import LLM, SamplingParams
from specserve.models.hub import MODEL_FILES, is_hub_id

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 8, 30]]


def add_to_hub_cache(cache: Path, repo_id: str, directory: Path, ref: str) -> str:
    """Lay directory out as the snapshot of repo_id that ref points to: files in blobs/ named by their hash,
    snapshots/COMMIT/ linking to them, refs/REF holding COMMIT. Returns COMMIT."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in directory.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def run_offline(cache: Path, code: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_ids_and_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name_v1.5")
    assert not any(map(is_hub_id, ["smollm2-135m", "./model", "../model", "/abs/model", "a/b/c", "model.gguf"]))


def test_only_what_the_engine_reads_is_downloaded():
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "consolidated.safetensors",
            "pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx", "README.md", ".gitattributes",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
            "chat_template.jinja", "params.json"]
    assert sorted(filter_repo_objects(repo, allow_patterns=list(MODEL_FILES))) == sorted(
        repo[:5] + ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja"])


def test_an_id_loads_from_the_cache_at_its_revision_and_names_what_is_missing(tmp_path, tiny_llama, tokenizer_dir):
    main, v2 = tiny_llama[0], tmp_path / "v2"
    make_hf_model(v2, tokenizer_dir, "llama", seed=1)
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "org/tiny", main, "main")
    add_to_hub_cache(cache, "org/tiny", v2, "v2")
    got = run_offline(cache, f"""
import json
from specserve import LLM, ModelLoadError, SamplingParams
prompts = {PROMPTS}
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
def greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
def error(**kwargs):
    try:
        LLM(**kwargs)
    except ModelLoadError as e:
        return str(e)
main = LLM("org/tiny", device="cpu", num_kv_blocks=64)
v2 = LLM("org/tiny", revision="v2", tokenizer="org/tiny", device="cpu", num_kv_blocks=64)
print(json.dumps(dict(main=greedy(main), v2=greedy(v2),
                      missing=error(model="org/missing"), missing_revision=error(model="org/tiny", revision="v3"))))
""")
    assert got["main"] == greedy(LLM(str(main), device="cpu", num_kv_blocks=64))
    assert got["v2"] == greedy(LLM(str(v2), device="cpu", num_kv_blocks=64))
    assert got["main"] != got["v2"]
    assert got["missing"] == (
        f"org/missing is neither a local path nor in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set; "
        "download it with `hf download org/missing` where the hub is reachable (the same HF_HOME or HF_HUB_CACHE), "
        "or give a local directory")
    assert got["missing_revision"].startswith("org/tiny at revision 'v3' is neither a local path nor in the Hugging")
    assert "`hf download org/tiny --revision v3`" in got["missing_revision"]
