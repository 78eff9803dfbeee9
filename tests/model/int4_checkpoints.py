"""GPTQ and AWQ folders for tests, written from a float checkpoint by this file's own packer.

:func:`make_int4_checkpoint` quantizes every attention/MLP projection of a float folder to
4-bit codes with integer zero points (round to nearest per group), packs them the way
AutoGPTQ / AutoAWQ lay out their tensors, and writes two folders: the quantized one, and the
*dequantized reference* (float32 ``scale * (q - z)``, no ``quantization_config``), so a test
can compare llmserve on the packed folder with any engine on exactly the values it encodes.
Nothing here calls llmserve's unpacking code: the packing is written from the formats'
descriptions, so a layout mistake on either side shows as a mismatch.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Projections that read the same input (one GPTQ Hessian, so one act-order permutation).
_SAME_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp",
               "up_proj": "mlp", "o_proj": "o", "down_proj": "down"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    """One linear's codes ``q (N, K)``, zero points ``z (N, G)``, fp16 scales ``s (N, G)``
    and the group of each input ``g_idx (K,)``."""

    q: np.ndarray
    z: np.ndarray
    s: np.ndarray
    g_idx: np.ndarray

    def dequantize(self) -> np.ndarray:
        return (self.s[:, self.g_idx].astype(np.float32)
                * (self.q.astype(np.float32) - self.z[:, self.g_idx]))


def quantize(w: np.ndarray, g_idx: np.ndarray, groups: int, zmin: int = 0) -> Quantized:
    """Asymmetric RTN of ``w (N, K)`` with the input groups ``g_idx``; zero points in
    ``zmin..15``."""
    n, _ = w.shape
    q = np.zeros(w.shape, np.int64)
    z = np.zeros((n, groups), np.int64)
    s = np.zeros((n, groups), np.float16)
    for g in range(groups):
        cols = np.flatnonzero(g_idx == g)
        lo = np.minimum(w[:, cols].min(1), 0.0)
        hi = np.maximum(w[:, cols].max(1), 0.0)
        scale = np.maximum((hi - lo) / 15.0, 1e-4).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), zmin, 15).astype(np.int64)
        s[:, g], z[:, g] = scale, zero
        q[:, cols] = np.clip(np.round(w[:, cols] / scale[:, None].astype(np.float32))
                             + zero[:, None], 0, 15)
    return Quantized(q, z, s, g_idx)


def _pack_rows(codes: np.ndarray) -> np.ndarray:
    """``(R, C)`` codes -> ``(R/8, C)`` int32: row 8r + j in bits 4j of word r."""
    r, c = codes.shape
    words = (codes.reshape(r // 8, 8, c) << (4 * np.arange(8))[None, :, None]).sum(1)
    return words.astype(np.uint32).view(np.int32)


def _pack_columns(codes: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """``(R, C)`` codes -> ``(R, C/8)`` int32: column 8c + order[j] in bits 4j of word c."""
    r, c = codes.shape
    blocks = codes.reshape(r, c // 8, 8)[..., list(order)]
    words = (blocks << (4 * np.arange(8))).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def _group_index(k: int, group_size: int, perm: Optional[np.ndarray]) -> tuple[np.ndarray, int]:
    size = k if group_size < 0 else group_size
    groups = -(-k // size)
    if perm is None:
        return np.arange(k) // size, groups
    g_idx = np.empty(k, np.int64)
    g_idx[perm] = np.arange(k) // size      # GPTQ act-order: the i-th column quantized -> i // g
    return g_idx, groups


def make_int4_checkpoint(float_dir: str, out_dir: str, method: str = "gptq",
                         group_size: int = 32, act_order: bool = False,
                         shared_order: bool = True, checkpoint_format: str = "gptq",
                         seed: int = 0, keep_float: tuple[str, ...] = ()) -> tuple[str, str]:
    """Write ``out_dir`` (``method`` "gptq" or "awq") and ``out_dir + "-dequantized"``;
    return both paths.

    ``act_order``: GPTQ ``desc_act`` with a random input order per projection input
    (``shared_order``: q/k/v share one, gate/up one, as GPTQ's shared Hessians give; else
    each projection its own). ``checkpoint_format`` "gptq" stores zeros minus one (so the
    zero points stay in 1..15), "gptq_v2" the zeros. ``keep_float``: projection names
    left in float (AWQ's ``modules_to_not_convert``).
    """
    rng = np.random.default_rng(seed)
    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    orders: dict[tuple[str, str], np.ndarray] = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        proj = parts[-2] if len(parts) > 2 else ""
        if parts[-1] != "weight" or proj not in PROJECTIONS or proj in keep_float:
            packed[name] = reference[name] = tensor
            continue
        w = tensor.float().numpy()
        k = w.shape[1]
        perm = None
        if act_order:
            key = (name.rsplit(".", 3)[0], _SAME_INPUT[proj] if shared_order else proj)
            perm = orders.setdefault(key, rng.permutation(k))
        g_idx, groups = _group_index(k, group_size, perm)
        quant = quantize(w, g_idx, groups, zmin=1 if method == "gptq"
                         and checkpoint_format == "gptq" else 0)
        prefix = name[:-len(".weight")]
        stored_z = quant.z - (1 if method == "gptq" and checkpoint_format == "gptq" else 0)
        if method == "gptq":
            packed[f"{prefix}.qweight"] = torch.from_numpy(_pack_rows(quant.q.T.copy()))
            packed[f"{prefix}.qzeros"] = torch.from_numpy(
                _pack_columns(stored_z.T.copy(), tuple(range(8))))
            packed[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            packed[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # AutoGPTQ's
        else:
            packed[f"{prefix}.qweight"] = torch.from_numpy(_pack_columns(quant.q.T.copy(),
                                                                         AWQ_ORDER))
            packed[f"{prefix}.qzeros"] = torch.from_numpy(_pack_columns(stored_z.T.copy(),
                                                                        AWQ_ORDER))
        packed[f"{prefix}.scales"] = torch.from_numpy(quant.s.T.copy())
        reference[name] = torch.from_numpy(quant.dequantize())
    cfg = json.load(open(os.path.join(float_dir, "config.json")))
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "gptq":
        qc.update(desc_act=act_order, sym=False, checkpoint_format=checkpoint_format)
    else:
        qc.update(zero_point=True, version="gemm", modules_to_not_convert=list(keep_float))
    paths = []
    for folder, tensors, quant_cfg in ((out_dir, packed, qc),
                                       (out_dir + "-dequantized", reference, None)):
        shutil.copytree(float_dir, folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file({n: t.contiguous() for n, t in tensors.items()},
                  os.path.join(folder, "model.safetensors"))
        out_cfg = dict(cfg, quantization_config=quant_cfg) if quant_cfg else dict(cfg)
        json.dump(out_cfg, open(os.path.join(folder, "config.json"), "w"), indent=1)
        paths.append(folder)
    return paths[0], paths[1]
