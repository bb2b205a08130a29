"""Checkpoint names: a local path or a hub id, and the local folder of one (light: the CLI checks its options with
it before importing torch)."""

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name


def check_path_or_id(path_or_id):
    """OSError (as diffusers raises for a checkpoint it cannot find) for a name that is neither an existing local
    path nor shaped like a hub id: diffusers would ask the hub for it and answer with the hub's validation error or
    a connection error, neither of which says that the folder does not exist."""
    if isinstance(path_or_id, (str, Path)) and not Path(path_or_id).expanduser().exists() and not HUB_ID.match(
            str(path_or_id)):
        raise OSError(f"{path_or_id}: no such local folder, and not a hub id (owner/name) either")


def local_folder(path_or_id, subfolder: str | None) -> Path:
    """A local folder as is; a hub repo id: its snapshot (the subfolder's files only)."""
    path = Path(path_or_id)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path_or_id), allow_patterns=[f"{subfolder}/*"] if subfolder else None))
    return path / subfolder if subfolder else path
