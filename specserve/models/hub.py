"""Models by Hugging Face id (org/name): a snapshot in huggingface_hub's cache, downloaded when missing.

huggingface_hub does the resolution, so its settings apply as they do for transformers: HF_HOME and
HF_HUB_CACHE place the cache, HF_HUB_OFFLINE=1 reads the cache only, and HF_TOKEN (or a `hf auth login`)
opens private and gated repositories. Only the files the engine reads are downloaded.
"""
from __future__ import annotations

import re
from pathlib import Path

from specserve.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
# Weights under transformers' names only: some repositories also hold the same weights in another layout
# (Mistral's consolidated.safetensors), which would double the download.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", *TOKENIZER_FILES)
# org/name, each part starting with a letter or digit: "./model" or "../model" stay local paths.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    return _REPO_ID.fullmatch(name) is not None


def hub_snapshot(repo_id: str, revision: str | None = None, files: tuple[str, ...] = MODEL_FILES) -> Path:
    """The directory of repo_id at revision (None: main) in the hub's cache, with `files` (glob patterns)
    downloaded into it where the hub is reachable and they are missing."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files)))
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ModelLoadError(
            f"{repo_id}{at} is neither a local path nor in the Hugging Face cache at {constants.HF_HUB_CACHE}, and "
            f"{why}; download it with `{command}` where the hub is reachable (the same HF_HOME or HF_HUB_CACHE), "
            "or give a local directory") from e
    except GatedRepoError as e:
        raise ModelLoadError(f"{repo_id} is gated on the Hugging Face hub: accept its terms on huggingface.co, then "
                             "log in with `hf auth login` or set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"{repo_id} is neither a local path nor a model on the Hugging Face hub; check the "
                             "name, or for a private model log in with `hf auth login` or set HF_TOKEN") from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"{repo_id} has no revision {revision!r} on the Hugging Face hub; give a branch, tag "
                             "or commit it has") from e
    except HFValidationError as e:
        raise ModelLoadError(f"{repo_id!r} is not a valid Hugging Face model id ({e}); give org/name or a local "
                             "path") from e
