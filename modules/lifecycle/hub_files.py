"""Which files of a Hub repo to download and where they land: GGUF quantizations, safetensors over .bin, globs.

Pure functions over the repo's file list (no network), so the rules are easy to test and to read:

- a GGUF repo (``.gguf`` files and no transformers weights) gives one quantization: the one asked for, else
  ``Q4_K_M``, else the nearest in :data:`QUANT_PREFERENCE`; a split quantization (``-00001-of-00003``) comes whole;
- a transformers repo drops ``.bin``/``.pt`` weights when safetensors exist, and TensorFlow/Flax/ONNX copies;
- a PEFT adapter repo (``adapter_config.json``) is a LoRA;
- ``--include``/``--exclude`` globs and ``--specific-file`` override the defaults.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from modules.errors import InvalidRequest

DEFAULT_QUANT = "Q4_K_M"
QUANT_PREFERENCE = (
    "Q4_K_M", "Q4_K_S", "Q4_K_L", "Q4_K_XL", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q5_K_M", "Q5_K_S", "Q5_0",
    "Q5_1", "Q6_K", "Q8_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_XS", "Q2_K", "BF16", "F16", "F32",
)  # fmt: skip
"""Without ``--quant`` and without a Q4_K_M file: the first of these the repo has (quality per byte, roughly)."""

_QUANT = re.compile(
    r"(?<![A-Z0-9])((?:IQ|TQ|Q)\d(?:_[A-Z0-9]{1,2}){0,3}|BF16|FP16|FP32|F16|F32|MXFP4(?:_MOE)?)(?![A-Z0-9])"
)
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SAFETENSORS = re.compile(r"(^|/)[^/]*\.safetensors$")
_PICKLE = re.compile(r"(^|/)[^/]*\.(bin|pt|pth|ckpt)$")
_OTHER_FRAMEWORKS = ("tf_model*.h5", "*.msgpack", "flax_model*", "*.ot", "onnx/*", "*.onnx", "*.tflite", "*.mlmodel")
_ALWAYS_SKIPPED = (".gitattributes",)


@dataclass
class RepoFile:
    """One file of a repo at a commit, with what its checksum must be."""

    path: str
    size: int
    sha256: str | None = None  # LFS files: the content's sha256
    blob_id: str | None = None  # other files: the git blob sha1


@dataclass
class Selection:
    """The files to fetch and what they make."""

    files: list[RepoFile]
    kind: str  # "gguf" | "hf" | "lora"
    quant: str | None = None  # the GGUF quantization taken
    quants: dict[str, list[str]] = field(default_factory=dict)  # every GGUF quantization -> its files
    notes: list[str] = field(default_factory=list)  # what was left out and why

    @property
    def total_bytes(self) -> int:
        """Bytes of every selected file."""
        return sum(f.size for f in self.files)


def quant_of(path: str) -> str | None:
    """The GGUF quantization named in a file name (``Model-Q4_K_M.gguf`` -> ``Q4_K_M``), or None."""
    name = _SHARD.sub(".gguf", path.rsplit("/", 1)[-1]).upper()
    found = _QUANT.findall(name)
    if not found:
        folder = path.rsplit("/", 1)[0].upper() if "/" in path else ""
        found = _QUANT.findall(folder)
    quant = found[-1] if found else None
    return {"FP16": "F16", "FP32": "F32"}.get(quant or "", quant)


def is_mmproj(path: str) -> bool:
    """A vision projector that ships beside a GGUF model (not a quantization of it)."""
    return "mmproj" in path.rsplit("/", 1)[-1].lower()


def gguf_quants(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The repo's GGUF quantizations, each with its file (or shards), in file order."""
    quants: dict[str, list[RepoFile]] = {}
    for f in files:
        if not f.path.lower().endswith(".gguf") or is_mmproj(f.path):
            continue
        quants.setdefault(quant_of(f.path) or f.path.rsplit("/", 1)[-1], []).append(f)
    return quants


def _matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) for p in patterns)


def _kind(paths: set[str]) -> str:
    names = {p.rsplit("/", 1)[-1] for p in paths}
    weights = any(_SAFETENSORS.search(p) or _PICKLE.search(p) for p in paths)
    if "adapter_config.json" in names and "config.json" not in paths:
        return "lora"
    if any(p.lower().endswith(".gguf") for p in paths) and not ("config.json" in paths and weights):
        return "gguf"
    return "hf"


def select(
    files: list[RepoFile],
    quant: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    specific_file: str | None = None,
) -> Selection:
    """Choose the files to download; raises InvalidRequest when what was asked for is not there."""
    by_path = {f.path: f for f in files}
    kind = _kind(set(by_path))
    quants = {q: [f.path for f in fs] for q, fs in gguf_quants(files).items()}
    if specific_file:
        if specific_file not in by_path:
            shown = ", ".join(sorted(by_path)[:20]) or "none"
            raise InvalidRequest(f"{specific_file!r} is not in the repo (files: {shown})", param="specific_file")
        picked = by_path[specific_file]
        kind = "gguf" if specific_file.lower().endswith(".gguf") else kind
        return Selection([picked], kind, quant_of(specific_file) if kind == "gguf" else None, quants)
    include, exclude = list(include or []), list(exclude or [])
    notes: list[str] = []
    chosen = [f for f in files if f.path not in _ALWAYS_SKIPPED]
    taken_quant = None
    if kind == "gguf" and not include:
        taken_quant = _pick_quant(quants, quant, notes)
        keep = set(quants[taken_quant])
        chosen = [f for f in chosen if f.path in keep]  # llama.cpp needs nothing else (--include for more)
    elif kind == "hf" and not include:
        if any(_SAFETENSORS.search(f.path) for f in chosen) and any(_PICKLE.search(f.path) for f in chosen):
            dropped = [f.path for f in chosen if _PICKLE.search(f.path) or f.path.endswith(".bin.index.json")]
            chosen = [f for f in chosen if f.path not in dropped]
            notes.append(f"safetensors preferred: left out {', '.join(dropped)}")
        other = [f.path for f in chosen if _matches(f.path, list(_OTHER_FRAMEWORKS))]
        if other and len(other) < len(chosen):
            chosen = [f for f in chosen if f.path not in other]
            notes.append(f"left out other frameworks' copies: {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}")
        ggufs = [f.path for f in chosen if f.path.lower().endswith(".gguf")]
        if ggufs:
            chosen = [f for f in chosen if f.path not in ggufs]
            notes.append(f"left out {len(ggufs)} GGUF file(s) of this transformers repo (pick one with --include)")
    if include:
        chosen = [f for f in chosen if _matches(f.path, include)]
    if exclude:
        chosen = [f for f in chosen if not _matches(f.path, exclude)]
    if not chosen:
        raise InvalidRequest("no file of the repo matches the --include/--exclude patterns", param="include")
    if kind == "gguf" and taken_quant is None:
        picked_quants = {quant_of(f.path) for f in chosen if f.path.lower().endswith(".gguf")}
        taken_quant = next(iter(picked_quants)) if len(picked_quants) == 1 else None
    return Selection(chosen, kind, taken_quant, quants, notes)


def _pick_quant(quants: dict[str, list[str]], asked: str | None, notes: list[str]) -> str:
    if not quants:
        raise InvalidRequest("the repo holds no GGUF model file", param="quant")
    upper = {q.upper(): q for q in quants}
    if asked:
        if asked.upper() in upper:
            return upper[asked.upper()]
        raise InvalidRequest(
            f"the repo has no {asked} quantization; it has {', '.join(quants)}", param="quant", code="quant_not_found"
        )
    if len(quants) == 1:
        return next(iter(quants))
    for candidate in QUANT_PREFERENCE:
        if candidate in upper:
            if candidate != DEFAULT_QUANT:
                notes.append(
                    f"no {DEFAULT_QUANT} in the repo; took {upper[candidate]} (available: {', '.join(quants)})"
                )
            return upper[candidate]
    first = next(iter(quants))
    notes.append(f"no known quantization name; took {first} (available: {', '.join(quants)})")
    return first


def folder_name(repo_id: str, branch: str | None) -> str:
    """``ORG_NAME``, plus ``_BRANCH`` for a branch other than main (text-generation-webui's convention)."""
    name = "_".join(repo_id.split("/")[-2:])
    if branch and branch != "main":
        name += "_" + re.sub(r"[^\w.-]", "_", branch)
    return name


def single_file(selection: Selection) -> bool:
    """True when the download is one GGUF file that goes straight into the models folder."""
    ggufs = [f for f in selection.files if f.path.lower().endswith(".gguf")]
    return (
        selection.kind == "gguf" and len(ggufs) == 1 and not _SHARD.search(ggufs[0].path) and len(selection.files) == 1
    )
