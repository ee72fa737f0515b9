"""``pipec export-checkpoint DIR -o FILE``: one state dict of the unpartitioned model from a checkpoint.

Reads the model's entries (``model.<canonical name>``) of a checkpoint in this
process, without a process group (DCP's ``no_dist``), whatever plan wrote it,
adds the names a tied weight also goes by (so ``model.load_state_dict`` of a
freshly built model accepts the file), and writes ``torch.save`` for ``.pt``
or safetensors for ``.safetensors``. ``DIR`` is one checkpoint folder, or a
``checkpoint_dir``, whose newest valid checkpoint is used.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipec.runtime.checkpoint import CheckpointError, Manifest, is_checkpoint, list_checkpoints, validate

__all__ = ["ExportResult", "export_checkpoint", "load_model_state", "newest_valid"]

FORMATS = (".pt", ".safetensors")


@dataclass(frozen=True, slots=True)
class ExportResult:
    path: Path
    """The checkpoint folder read."""
    manifest: Manifest
    num_tensors: int
    num_aliases: int


def newest_valid(src: str | Path) -> tuple[Path, Manifest]:
    """``src`` itself when it is one checkpoint, else the newest valid checkpoint under it (older ones on corruption)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such folder; give a checkpoint_dir or one of its step_N folders")
    if is_checkpoint(src):
        return src, validate(src)
    candidates = list_checkpoints(src)
    if not candidates:
        raise CheckpointError(f"{src}: no checkpoint in it (no step_N folder)")
    problems = []
    for _, path in candidates:
        try:
            manifest = validate(path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"pipec: warning: {'; '.join(problems)}; using {path} instead", file=sys.stderr)
        return path, manifest
    raise CheckpointError(f"{src}: no valid checkpoint: {'; '.join(problems)}")


def load_model_state(src: str | Path) -> tuple[dict[str, torch.Tensor], Path, Manifest]:
    """The model's tensors of a checkpoint by canonical name (no aliases), the folder read and its manifest."""
    path, manifest = newest_valid(src)
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"checkpoint {path} holds no model tensors (no 'model.' keys)")
    with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return {key[len("model."):]: t for key, t in state.items()}, path, manifest


def export_checkpoint(src: str | Path, output: str | Path) -> ExportResult:
    """Write the unpartitioned model's state dict of a checkpoint to ``output`` (.pt or .safetensors)."""
    output = Path(output)
    if output.suffix not in FORMATS:
        raise CheckpointError(f"-o {output}: the file must end in .pt (torch.save) or .safetensors, "
                              f"got {output.suffix or 'no suffix'!r}")
    tensors, path, manifest = load_model_state(src)
    safetensors = output.suffix == ".safetensors"
    num_aliases = 0
    for canon, names in manifest.aliases.items():
        if canon not in tensors:
            continue
        for name in names:  # torch.save keeps the sharing; safetensors refuses shared tensors: a copy each
            tensors[name] = tensors[canon].clone() if safetensors else tensors[canon]
            num_aliases += 1
    if output.parent != Path(""):
        output.parent.mkdir(parents=True, exist_ok=True)
    if safetensors:
        from safetensors.torch import save_file

        save_file(tensors, str(output), metadata={"format": "pt", "pipec_step": str(manifest.step),
                                                   "pipec_model": str(manifest.model.get("target"))})
    else:
        torch.save(tensors, output)
    return ExportResult(path, manifest, len(tensors), num_aliases)
