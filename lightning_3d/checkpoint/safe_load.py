"""Reading pickled files without running code from them.

A pickle can name any function to call while it is read (``__reduce__``), so a downloaded ``.pt`` or a
checkpoint directory from elsewhere could run code on every rank. Every pickled file lightning_3d reads goes
through here:

* ``torch.save`` files (``init_from`` state dicts, Lightning ``.ckpt`` files, our checkpoints'
  ``lightning_3d.meta.pt`` and ``rng/rank{N}.pt``): ``torch.load(weights_only=True)``, which builds only
  tensors and plain values, plus the types our own files hold (:data:`OWN_TYPES`).
* DCP's ``.metadata`` (``torch.distributed.checkpoint`` reads it with plain ``pickle.load``): checked first
  by an unpickler that builds only DCP's own metadata classes (:class:`CheckedReader`).

Anything else is refused with :class:`UnsafeCheckpointError`, naming the file and what it asked to build.
A type of your own in a module's hyper-parameters is allowed with ``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import enum
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_3d.errors import UnsafeCheckpointError
from lightning_3d.models.gpt import GPTConfig


def _numpy_rng_types() -> list:
    """What ``numpy.random.get_state()`` pickles as: an array of uint32 keys (rng/rank{N}.pt)."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
    return [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]


OWN_TYPES: list = [GPTConfig]
"""Types our own modules save in a checkpoint's hyper-parameters (``GPTLightningModule(config=GPTConfig())``)."""


def torch_load(path: str | Path, *, what: str, opt_out: str = "", **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, **kwargs)`` with our own types allowed. ``what`` names the file's
    role in the error (e.g. "init_from"); ``opt_out``, where there is one, says how to read a trusted file as
    it is.

    Example::

        meta = torch_load(ckpt / "lightning_3d.meta.pt", what="checkpoint metadata")
    """
    with torch.serialization.safe_globals([*OWN_TYPES, *_numpy_rng_types()]):
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            if "Weights only load failed" not in str(err):  # a damaged file, not a refused one: torch's error says so
                raise
            # torch's own message advises allow-listing whatever it met, io.open included: name it, advise less
            unsafe = _globals_in(path)
            holds = f"asks to build {unsafe}" if unsafe else f"holds what a weights-only load refuses ({_reason(err)})"
            raise UnsafeCheckpointError(
                f"Refused to read {what} {str(path)!r}: it {holds}, which is neither a tensor, a plain value nor"
                " a type lightning_3d allows, and reading it could run code from the file. If the file comes from"
                " a source you trust and names a type of yours, allow that type with"
                f" torch.serialization.add_safe_globals([YourType]) before loading{opt_out}; for weights, prefer a"
                " safetensors file (lightning-3d convert writes one)."
            ) from None


def _reason(err: Exception) -> str:
    """The line of torch's long weights-only message that says what it refused."""
    lines = [line.strip() for line in str(err).splitlines()]
    return next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")


def _globals_in(path: str | Path) -> str:
    """The functions and classes a torch.save file names, read without unpickling it ("" if it cannot say)."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 -- not a zip file: torch.load's own message still says what it met
        return ""
    return ", ".join(unsafe)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """``getattr(cls, name)`` for one member of one of DCP's metadata enums, and nothing else.

    Python before 3.11.3 pickles an Enum member as ``getattr(TheEnum, "NAME")`` (later ones as
    ``TheEnum(value)``), and DCP's ``.metadata`` holds one (``_MEM_FORMAT_ENCODING``): a plain ``getattr`` would
    let a file reach any attribute of anything it can name, so this one reaches only a member by its name.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == _DCP_METADATA \
            and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeCheckpointError(f"builtins.getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r})")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP writes into ``.metadata``; anything else is refused before it is called."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name == "getattr":  # an enum member, pickled by name
            return _enum_member
        value = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in self._ALLOWED or module == _DCP_METADATA \
                or isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{module}.{name}")


class CheckedReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that refuses a ``.metadata`` asking to build anything but DCP's metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / (".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata")
        try:
            with open(path, "rb") as file:
                _MetadataUnpickler(file).load()
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(
                f"Refused to read the checkpoint {str(self.path)!r}: its {path.name} asks to build {err}, which"
                " DCP never writes there, and reading it would run code from the file. Use a checkpoint written"
                " by lightning_3d (or torch.distributed.checkpoint) that has not been altered.") from None
        return super().read_metadata(*args, **kwargs)
