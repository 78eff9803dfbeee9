"""docs/ARCHITECTURE.md describes the package as it is.

Every package or module path the document names (in backticks, in prose or in the layer
diagram) exists under src/llmserve, and every subpackage of src/llmserve (up to two
levels deep) is named somewhere in it. A module moved or renamed without its paragraph
fails here.

A path-like token is lowercase name segments joined by ``/`` that ends in ``/`` (a
directory, e.g. ``engine/kv/``) or ``.py`` (a module, e.g. ``model/executor/runner.py``),
or a bare module name such as ``core.py``. A token that starts with a top-level package
(``engine/``, ``model/`` ...) must exist at exactly that place; any other one (``kv/`` or
``core.py`` inside a package's box of the diagram) must be the tail of some existing path.
Paths of the repository outside the package (``tests/...``, ``tools/peers/``, ``docs/``)
are not checked; a leading ``src/llmserve/`` is dropped.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "llmserve"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

_SEGMENT = r"[a-z_][a-z0-9_]*"
# Not glued to a longer word or path on either side (so `/v1/chat/completions`,
# `~/.cache/llmserve/kernels` and `docs/SCALING.md` are not tokens); a sentence's full
# stop may follow.
TOKEN = re.compile(
    rf"(?<![\w./~-])((?:{_SEGMENT}/)+(?:{_SEGMENT}\.py)?|{_SEGMENT}\.py)(?![\w/-])(?!\.\w)")


def _package_paths() -> set[str]:
    """Every file and directory under src/llmserve, relative, directories ending in "/"."""
    out = set()
    for p in PACKAGE.rglob("*"):
        if "__pycache__" in p.parts:
            continue
        rel = p.relative_to(PACKAGE).as_posix()
        out.add(rel + "/" if p.is_dir() else rel)
    return out


def _doc_tokens() -> set[str]:
    """The path-like tokens of the document that may name something in the package."""
    outside = {p.name for p in ROOT.iterdir() if p.is_dir()} - {
        p.name for p in PACKAGE.iterdir() if p.is_dir()}
    tokens = set()
    for match in TOKEN.finditer(DOC.read_text(encoding="utf-8")):
        token = match.group(1).removeprefix("src/llmserve/")
        if not token or token.split("/")[0] in outside:
            continue
        tokens.add(token)
    return tokens


def _exists(token: str, paths: set[str], top_level: set[str]) -> bool:
    if token.split("/")[0] in top_level:
        return token in paths
    return any(p == token or p.endswith("/" + token) for p in paths)


def test_every_path_the_doc_names_exists():
    paths = _package_paths()
    top_level = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    tokens = _doc_tokens()
    assert len(tokens) >= 50, f"only {len(tokens)} path-like tokens found: is the regex broken?"
    missing = sorted(t for t in tokens if not _exists(t, paths, top_level))
    assert not missing, (
        f"{DOC.relative_to(ROOT)} names {len(missing)} path(s) that do not exist under "
        f"src/llmserve (directories end in '/', modules in '.py'): {missing}")


def test_every_subpackage_is_named():
    subpackages = sorted(
        p.parent.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in p.parts and 1 <= len(p.parent.relative_to(PACKAGE).parts) <= 2)
    assert subpackages, "no subpackages found under src/llmserve"
    tokens = _doc_tokens()
    unnamed = [pkg for pkg in subpackages
               if not any(t == pkg + "/" or t.startswith(pkg + "/") for t in tokens)]
    assert not unnamed, (
        f"{DOC.relative_to(ROOT)} never names these subpackages of src/llmserve by their "
        f"path (e.g. `{unnamed[0]}/`): {unnamed}")
