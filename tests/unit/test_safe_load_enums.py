"""DCP's ``.metadata`` as every Python 3.10+ writes it is read; an enum by name opens no other ``getattr``.

Python 3.11.2 (Debian 12's ``python3``) pickles an Enum member as ``getattr(TheEnum, "NAME")``, later
releases as ``TheEnum(value)``. DCP's metadata holds one, ``_MEM_FORMAT_ENCODING``: before the fix, every
checkpoint written under 3.11.2 was refused as asking to build ``builtins.getattr``. The files here are
re-pickled in each form, so the test says the same on any interpreter.
"""

import enum
import io
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from lightning_3d.checkpoint.safe_load import CheckedReader, _MetadataUnpickler
from lightning_3d.errors import UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as meant


class _ByName:
    """Pickles as ``getattr(owner, name)``: the form Python 3.11.2 gives an Enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


class _EnumsAs(pickle.Pickler):
    """Pickles every Enum member in the form of the Python named (``"3.11.2"`` by name, else by value)."""

    def __init__(self, file, form):
        super().__init__(file)
        self.form = form

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name)) if self.form == "by name" else (type(obj), (obj.value,))
        return NotImplemented


class _Outside(enum.Enum):
    """An enum DCP does not define: its members are not DCP's to build."""

    SYSTEM = 1


def _checkpoint(path, form):
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(path), no_dist=True)
    with open(path / ".metadata", "rb") as file:
        metadata = pickle.load(file)  # our own file, just written
    buffer = io.BytesIO()
    _EnumsAs(buffer, form).dump(metadata)
    (path / ".metadata").write_bytes(buffer.getvalue())
    return buffer.getvalue()


@pytest.mark.parametrize("form", ["by name", "by value"])
def test_a_dcp_checkpoint_with_its_enum_pickled_either_way_loads(tmp_path, form):
    data = _checkpoint(tmp_path, form)
    assert (b"getattr" in data) == (form == "by name")  # the file really holds the form named
    metadata = CheckedReader(tmp_path).read_metadata()
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])
    state = {"w": torch.zeros(2, 3)}
    dcp.load(state, storage_reader=CheckedReader(tmp_path), no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))


def test_an_enum_member_by_name_is_the_member_itself():
    data = pickle.dumps(_ByName(_MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST"))
    assert _MetadataUnpickler(io.BytesIO(data)).load() is _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST


@pytest.mark.parametrize("owner, name", [
    (_MEM_FORMAT_ENCODING, "__class__"),   # an attribute of the enum that is not a member
    (_MEM_FORMAT_ENCODING, "_missing_"),   # a method of it
    (torch.Size, "__init__"),              # an allowed class that is no enum
    (_Outside, "SYSTEM"),                  # a member of an enum DCP does not define
])
def test_getattr_on_anything_but_a_dcp_enum_member_is_refused(owner, name):
    data = pickle.dumps(_ByName(owner, name))
    with pytest.raises(UnsafeCheckpointError):
        _MetadataUnpickler(io.BytesIO(data)).load()


def test_a_refused_getattr_in_a_checkpoint_names_the_file(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_ByName(torch.Size, "__init__")))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata asks to build builtins\.getattr\(Size, '__init__'\)"):
        CheckedReader(tmp_path).read_metadata()
