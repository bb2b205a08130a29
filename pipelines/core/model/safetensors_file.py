"""Reading a safetensors file tensor by tensor through a private memory map (MappedFile): peak host memory is one
tensor, not the file. The single files' reader (single_file/formats.py) and the fast folders' (checkpoint.py) use it.
"""

import json
import mmap
from pathlib import Path

import torch


class CheckpointFileError(ValueError):
    """A file that cannot be read as a checkpoint of the model asked for: one line naming the file and why."""


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
                      "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class MappedFile:
    """A file's bytes through a private memory map. `read(offset, nbytes, device)` asks the kernel for the whole range
    at once (MADV_WILLNEED: one large read-ahead instead of a page fault per 128 KiB), copies it onto `device` into
    memory of its own, then drops the range's pages from this process (MADV_DONTNEED; the page cache keeps them): a
    file read tensor by tensor holds one tensor resident, not the file (a mapping left whole counts every page read
    in the process's resident memory)."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:  # the map holds the file open
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable to torch, never written

    def read(self, offset: int, nbytes: int, device) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) as a uint8 tensor on `device`."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_WILLNEED, start, offset + nbytes - start)
        out = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset).to(device, copy=True)
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
        return out


class SafetensorsFile:
    """A safetensors file: its header checked here (an 8-byte little-endian header length, a JSON header of {name:
    {dtype, shape, data_offsets}} and "__metadata__", then the data: a truncated or foreign file is refused in one
    line), its tensors read one at a time as MappedFile reads (little-endian, as safetensors stores them)."""

    def __init__(self, path: Path):
        self.path, size = path, path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= length <= min(size - 8, 100 << 20):
                raise CheckpointFileError(f"{path}: not a readable safetensors or GGUF file (no safetensors header)")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointFileError(f"{path}: not a readable safetensors or GGUF file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries, self._data, self._bytes = header, 8 + length, MappedFile(path)
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._data + end > size:
            raise CheckpointFileError(f"{path}: truncated ({size} bytes; its header lists {self._data + end})")
        unknown = {e["dtype"] for e in header.values()} - set(SAFETENSORS_DTYPES)
        if unknown:
            raise CheckpointFileError(f"{path}: tensors of dtype {sorted(unknown)}, which this reader does not know")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple:
        return tuple(self.entries[key]["shape"])

    def dtype_name(self, key: str) -> str:
        return self.entries[key]["dtype"]

    def get_tensor(self, key: str, device="cpu") -> torch.Tensor:
        entry = self.entries[key]
        begin, end = entry["data_offsets"]
        raw = self._bytes.read(self._data + begin, end - begin, device)
        return raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
