"""A Hub model card (README.md) for an exported or merged model, naming only the files that are really uploaded.

``huggingface_hub``'s ModelCard and ModelCardData make it: base_model (a Hub id, never a path), base_model_relation,
license, tags, datasets, quantization, pipeline_tag, library_name. Body: what the files are (with the fidelity
numbers export measured), usage for textgen, llama.cpp, Ollama (a Modelfile), LM Studio and transformers (a LoRA
adapter: with its base), and, when a LoRA was merged, the LoRA settings, training parameters and datasets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from modules.lifecycle.merge import MERGE_INFO, public_name

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData


@dataclass
class CardArgs:
    """What the card describes."""

    folder: Path  # the folder to upload
    repo: str  # ORG/NAME on the Hub
    files: list[str] = field(default_factory=list)  # the file names that will be uploaded (relative to folder)
    base_model: str = ""  # the original model's Hub id (read from the merge info or config when empty)
    license: str = ""
    tags: list[str] = field(default_factory=list)


# what a training run keeps beside its adapter for this machine (resume, copy-from, the log): local paths,
# optimizer state; a push of the adapter leaves them here
RUN_RECORDS = ("training_parameters.json", "training_log.json", "checkpoints")


def upload_files(folder: Path) -> list[str]:
    """The files a push sends: everything in the folder but hidden, partial and fidelity-report files, and for a
    trained adapter its run's records and checkpoints."""
    adapter = (Path(folder) / "adapter_config.json").is_file()
    names = []
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if not path.is_file() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        if rel.endswith(".partial") or "/.partial" in rel or rel.endswith(".fidelity.json"):
            continue
        top = rel.split("/")[0]
        if adapter and (top in RUN_RECORDS or top.startswith("checkpoint-")):
            continue
        names.append(rel)
    return names


def public_bytes(path: Path) -> bytes:
    """What a push sends of a file: a PEFT adapter_config.json with its base as a name or a Hub id (PEFT records
    the local folder it was trained on), every other file as it is."""
    data = path.read_bytes()
    if path.name != "adapter_config.json":
        return data
    config = _read_json(path)
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or public_name(base) == base:
        return data
    config["base_model_name_or_path"] = public_name(base)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _hub_id(value: Any) -> bool:
    """Whether ``value`` names a Hub repo (``ORG/NAME``), not a folder on this machine."""
    return isinstance(value, str) and value.count("/") == 1 and public_name(value) == value


def _gguf_quant(name: str) -> str:
    parts = name.removesuffix(".gguf").split(".")
    return parts[-1].upper() if len(parts) > 1 else "GGUF"


def _is_gguf_adapter(path: Path) -> bool:
    """Whether a GGUF file is a LoRA adapter (llama.cpp's converter writes ``general.type: adapter``)."""
    from modules.formats.gguf import GGUFError, read_header

    try:
        return read_header(path)[0].get("general.type") == "adapter"
    except GGUFError:
        return False


def _is_adapter(folder: Path, files: list[str]) -> bool:
    """A LoRA export: a PEFT folder or a GGUF adapter."""
    return "adapter_config.json" in files or any(_is_gguf_adapter(folder / f) for f in files if f.endswith(".gguf"))


def _card_data(args: CardArgs, files: list[str], merge: dict[str, Any], adapter: bool) -> ModelCardData:
    """The card's metadata, as ``huggingface_hub`` models it. ``base_model_relation`` says what these files are to
    the base: ``adapter`` (a PEFT folder or a GGUF LoRA), ``finetune`` (a LoRA merged into its one base: the Hub's
    ``merge`` means a merge of several models), ``quantized`` (a GGUF of the base); a plain re-save says none."""
    from huggingface_hub import ModelCardData

    folder = Path(args.folder)
    ggufs = [f for f in files if f.endswith(".gguf")]
    peft = _read_json(folder / "adapter_config.json") if "adapter_config.json" in files else {}
    candidates = [merge.get("base_model"), peft.get("base_model_name_or_path"),
                  _read_json(folder / "config.json").get("_name_or_path")]  # fmt: skip
    given = args.base_model if public_name(args.base_model) == args.base_model else ""
    base = given or next((c for c in candidates if _hub_id(c)), "")  # never a local path
    relation = "adapter" if adapter else "finetune" if merge else "quantized" if ggufs else None
    training = merge.get("training") or {}
    datasets = [str(training[k]) for k in ("dataset", "eval_dataset") if _hub_id(training.get(k))]
    quants = sorted({_gguf_quant(f) for f in ggufs})
    tags = ["textgen", *(["gguf", "llama.cpp"] if ggufs else []), *(["merge", "lora"] if merge else []),
            *(["lora"] if adapter else []), *args.tags]  # fmt: skip
    library = "peft" if peft else "gguf" if ggufs and "config.json" not in files else "transformers"
    return ModelCardData(
        base_model=base or None, base_model_relation=relation if base else None, license=args.license or "other",
        tags=tags, datasets=datasets or None, library_name=library, pipeline_tag="text-generation",
        quantization=(quants[0] if len(quants) == 1 else quants) if quants else None,
    )  # fmt: skip


def render(args: CardArgs) -> str:
    """The README.md text: ``huggingface_hub``'s ModelCard, its YAML from ``_card_data``."""
    from huggingface_hub import ModelCard

    folder = Path(args.folder)
    files = args.files or upload_files(folder)
    ggufs = [f for f in files if f.endswith(".gguf")]
    merge = public_name(_read_json(folder / MERGE_INFO))  # a merge file of an older textgen may hold paths
    adapter = _is_adapter(folder, files)
    data = _card_data(args, files, merge, adapter)
    base = data.base_model or "a model"
    what = "A LoRA adapter for" if adapter else "A merge of a LoRA adapter into" if merge else "An export of"
    out = [f"# {args.repo.split('/')[-1]}", "", f"{what} `{base}`, made with textgen.", ""]
    out += ["## Files", "", "| file | size |", "|---|---|"]
    for f in files:
        size = (folder / f).stat().st_size if (folder / f).is_file() else 0
        out.append(f"| `{f}` | {size / 1e6:.1f} MB |")
    out.append("")
    for f in ggufs:
        fidelity = _read_json(folder / (f + ".fidelity.json"))
        if fidelity:
            out += [f"Fidelity of `{f}` (measured by textgen's export): " + _fidelity_line(fidelity), ""]
    if ggufs:
        out += _gguf_adapter_usage(ggufs[0]) if adapter else _gguf_usage(args.repo, ggufs[0])
    if "config.json" in files:
        out += _hf_usage(args.repo)
    if merge:
        out += _merge_section(merge)
    text = "\n".join(out).rstrip() + "\n"
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}"))


def _fidelity_line(data: dict[str, Any]) -> str:
    parts = [f"{data.get('bits_per_weight', 0):.2f} bits per weight"]
    agreement = data.get("agreement") or []
    if agreement:
        same = sum(a["agreed"] == a["total"] for a in agreement)
        parts.append(f"greedy tokens identical to the source on {same}/{len(agreement)} prompts")
    if data.get("perplexity") is not None:
        parts.append(f"perplexity {data['perplexity']:.3f}")
    if data.get("kld") is not None:
        parts.append(f"KL divergence vs F16 {data['kld']:.5f}")
    return ", ".join(parts) + "."


def _gguf_usage(repo: str, gguf: str) -> list[str]:
    return [
        "## Usage",
        "",
        "**textgen**: put the file in `models/` and run `python server.py --model " + Path(gguf).name + "`, or",
        "",
        "```sh",
        f"python -m modules.lifecycle download {repo} --specific-file {gguf}",
        "```",
        "",
        "**llama.cpp**:",
        "",
        "```sh",
        f"llama-cli -hf {repo} --hf-file {gguf}",
        f"llama-server -hf {repo} --hf-file {gguf}",
        "```",
        "",
        "**Ollama**: download the file, then with this `Modelfile` beside it:",
        "",
        "```",
        f"FROM ./{Path(gguf).name}",
        "```",
        "",
        "```sh",
        f"ollama create {repo.split('/')[-1].lower()} -f Modelfile",
        f"ollama run hf.co/{repo}:{_gguf_quant(gguf)}",
        "```",
        "",
        f"**LM Studio**: search for `{repo}` in the Discover tab and pick `{gguf}`, or `lms import {Path(gguf).name}`.",
        "",
    ]


def _gguf_adapter_usage(gguf: str) -> list[str]:
    name = Path(gguf).name
    return [
        "## Usage",
        "",
        "**textgen**: put the file in `loras/` and apply it in the Model tab to a GGUF of the base model.",
        "",
        "**llama.cpp**: the base model's GGUF with this adapter:",
        "",
        "```sh",
        f"llama-cli -m BASE.gguf --lora {name}",
        f"llama-server -m BASE.gguf --lora {name}",
        "```",
        "",
        f"**Ollama**: `FROM` the base model and `ADAPTER ./{name}` in the `Modelfile`.",
        "",
    ]


def _hf_usage(repo: str) -> list[str]:
    return [
        "## Usage with transformers",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        "```",
        "",
    ]


def _merge_section(merge: dict[str, Any]) -> list[str]:
    out = ["## Training", "", f"LoRA adapter `{merge.get('adapter', '')}` merged in {merge.get('dtype', '16 bit')}"]
    if merge.get("base_was_quantized"):
        out[-1] += " into the dequantized 4-bit base it was trained on"
    out[-1] += "."
    out.append("")
    for key, value in (merge.get("lora") or {}).items():
        out.append(f"- {key}: {value}")
    training = merge.get("training") or {}
    if training:
        datasets = [training[k] for k in ("dataset", "eval_dataset") if training.get(k)]
        if datasets:
            out += ["", "Datasets: " + ", ".join(f"`{d}`" for d in datasets)]
        out += ["", "Training parameters:", "", "```yaml", yaml.safe_dump(training, sort_keys=False).strip(), "```"]
    out.append("")
    return out
