"""Names -> policies: ``register_policy`` adds one, ``resolve_policy`` turns what the user passed into one."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from lightning_3d.policies.base import Policy, PolicyError

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a :class:`Policy` subclass available as ``ThreeDStrategy(policy=name)``."""

    def register(cls: type[Policy]) -> type[Policy]:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"register_policy({name!r}) decorates Policy subclasses, got {cls!r}")
        if name in _POLICIES and _POLICIES[name] is not cls:
            raise PolicyError(f"a policy named {name!r} is already registered ({_POLICIES[name].__qualname__})")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return register


def registered_policies() -> dict[str, type[Policy]]:
    """Name -> class of every registered policy."""
    return dict(_POLICIES)


def resolve_policy(spec: Any) -> Policy:
    """A registered name, a dotted ``"pkg.module.Class"`` path, a Policy class or instance -> a Policy instance."""
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, type) and issubclass(spec, Policy):
        return spec()
    if not isinstance(spec, str):
        raise PolicyError(f"policy must be a name, a dotted class path or a Policy, got {type(spec).__name__}")
    if spec in _POLICIES:
        return _POLICIES[spec]()
    if "." in spec:
        return _import_policy(spec)
    raise PolicyError(
        f"Unknown policy {spec!r}. Registered policies: {sorted(_POLICIES)}. Pass one of them, a dotted path"
        " to a Policy subclass ('my_pkg.policies.MyPolicy'), or register yours with @register_policy(name)."
    )


def _import_policy(path: str) -> Policy:
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise PolicyError(f"Cannot import policy {path!r}: {err}. Check the module path and class name.") from err
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"{path!r} is not a subclass of lightning_3d.policies.Policy")
    return cls()
