"""The private names of torch and Lightning that lightning_3d's source uses, read from the source (ast), for
tests/unit/test_private_apis.py. Two kinds of finding:

* a dotted path, for what is reached through an import: ``from torch.utils._pytree import tree_flatten``,
  ``dist.distributed_c10d._get_default_store()``, ``torch.ops._c10d_functional`` -- any path under torch or
  Lightning with a part that starts with one underscore;
* ``._name``, for a private attribute of an object, whose owner the source does not say: ``stage._x``,
  ``getattr(stage, "_x")``, and on ``self`` in a class whose torch/Lightning bases (its own, or those of the
  class it is mixed into) have ``_x``. An attribute the package defines itself is not one of these, unless
  it is set on another object (``module._x = ...`` writes into someone else's object).

Not seen: attribute names built at run time (``getattr(m, name)`` over a tuple of names) and private
attributes of a base class that the package also sets on its own objects under the same name elsewhere.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

FOREIGN = ("torch", "lightning", "lightning_utilities")
NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_make", "_field_defaults"}  # public, despite the "_"
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _foreign(path: str) -> bool:
    return path.split(".")[0] in FOREIGN


def scan(package: Path) -> dict[str, set[str]]:
    """Each finding (a dotted path or ``._name``) with the files it is in, relative to ``package``'s parent."""
    # Every node of every file, walked once: the passes below each look at all of them.
    nodes = {str(p.relative_to(package.parent)): list(ast.walk(ast.parse(p.read_text(), str(p))))
             for p in sorted(package.rglob("*.py"))}
    aliases = {f: _aliases(file_nodes) for f, file_nodes in nodes.items()}
    ours = set().union(*(_defined(file_nodes) for file_nodes in nodes.values()))
    families = _families(nodes, aliases)
    found: dict[str, set[str]] = defaultdict(set)
    for f, file_nodes in nodes.items():
        for finding in _findings(file_nodes, aliases[f], ours, families):
            found[finding].add(f)
    return dict(found)


def _aliases(nodes: list[ast.AST]) -> dict[str, str]:
    """Local name -> the dotted path it was imported as (modules, classes and functions alike)."""
    names = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _defined(nodes: list[ast.AST]) -> set[str]:
    """Private names the package gives its own objects: defs, classes, class and module variables, ``self._x``."""
    names = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif (attribute := _named_attribute(node)) and attribute[1] in ("setattr", "object.__setattr__") \
                and _on_self(attribute[0]):
            names.add(attribute[2])
    return {n for n in names if is_private(n)}


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _named_attribute(node: ast.AST) -> tuple[ast.AST, str, str] | None:
    """(object, function, name) for ``getattr(obj, "_x", ...)`` and the like, ``object.__setattr__`` too."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    func = node.func
    if isinstance(func, ast.Name) and func.id in ATTRIBUTE_FUNCTIONS:
        function = func.id
    elif isinstance(func, ast.Attribute) and func.attr == "__setattr__" and ast.unparse(func.value) == "object":
        function = "object.__setattr__"
    else:
        return None
    name = node.args[1]
    if isinstance(name, ast.Constant) and isinstance(name.value, str) and is_private(name.value):
        return node.args[0], function, name.value
    return None


def _families(nodes: dict[str, list[ast.AST]], aliases: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    """Our class name -> the private names of the torch/Lightning classes it is built with: its own foreign
    bases' and, for a mixin, those of the classes it is mixed into."""
    bases: dict[str, set[str]] = {}
    for f, file_nodes in nodes.items():
        for node in file_nodes:
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {_resolve(ast.unparse(b), aliases[f]) for b in node.bases}
    local = {name: {b.rsplit(".", 1)[-1] for b in paths if not _foreign(b)} for name, paths in bases.items()}

    def foreign_of(name: str, seen: frozenset = frozenset()) -> set[str]:
        if name in seen or name not in bases:
            return set()
        paths = {b for b in bases[name] if _foreign(b)}
        for base in local[name]:
            paths |= foreign_of(base, seen | {name})
        return paths

    families = {}
    for name in bases:
        paths = foreign_of(name)
        for other in bases:  # classes that take this one in as a (possibly indirect) base
            if name in _local_ancestors(other, local):
                paths |= foreign_of(other)
        families[name] = set().union(*(_private_names_of(p) for p in paths)) if paths else set()
    return families


def _resolve(expression: str, aliases: dict[str, str]) -> str:
    head, dot, rest = expression.partition(".")
    return aliases.get(head, head) + dot + rest


def _local_ancestors(name: str, local: dict[str, set[str]]) -> set[str]:
    todo, seen = list(local.get(name, ())), set()
    while todo:
        base = todo.pop()
        if base not in seen:
            seen.add(base)
            todo.extend(local.get(base, ()))
    return seen


@lru_cache(maxsize=None)
def _private_names_of(path: str) -> frozenset[str]:
    """Private attributes of the class at ``path`` and its torch/Lightning ancestors: those in their class
    dicts and those their methods set or read on ``self``."""
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return frozenset().union(*(_own_private_names(k) for k in cls.__mro__ if _foreign(k.__module__)))


@lru_cache(maxsize=None)
def _own_private_names(klass: type) -> frozenset[str]:
    names = {n for n in vars(klass) if is_private(n)}
    try:
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(klass)))
    except (OSError, TypeError):  # a class defined in C
        pass
    return frozenset(names)


def _findings(nodes: list[ast.AST], aliases: dict[str, str], ours: set[str], families: dict[str, set[str]]) -> set[str]:
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {p for a in node.names if _foreign(p := f"{node.module}.{a.name}") and _has_private(p)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _foreign(a.name) and _has_private(a.name)}
        elif isinstance(node, ast.ClassDef):
            found |= _in_class(node, families.get(node.name, set()))
        elif (attribute := _named_attribute(node)) and attribute[2] not in NAMEDTUPLE_API:
            target, function, name = attribute
            if isinstance(target, ast.Name) and target.id in aliases:  # getattr(module, "_x"): a path
                path = f"{aliases[target.id]}.{name}"
                found |= {path} if _foreign(path) else set()
            elif name not in ours or (function in ("setattr", "object.__setattr__") and not _on_self(target)):
                found.add("." + name)
    return found | _attribute_chains(nodes, aliases, ours)


def _attribute_chains(nodes: list[ast.AST], aliases: dict[str, str], ours: set[str]) -> set[str]:
    found = set()
    inner = {id(node.value) for node in nodes if isinstance(node, ast.Attribute)}
    for node in nodes:
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # only whole chains: a.b._c once, not also a.b
        parts, root = [], node
        while isinstance(root, ast.Attribute):
            parts.append(root.attr)
            root = root.value
        parts.reverse()
        if isinstance(root, ast.Name) and root.id in aliases:  # rooted at an import
            path = ".".join([aliases[root.id], *parts])
            if _foreign(path) and _has_private(path):
                found.add(path)
            continue
        for sub in _attributes_in(node):  # on an object: each private attribute of the chain
            if sub.attr in NAMEDTUPLE_API:
                continue
            if sub.attr not in ours or (isinstance(sub.ctx, (ast.Store, ast.Del)) and not _on_self(sub.value)):
                found.add("." + sub.attr)
    return found


def _attributes_in(node: ast.AST) -> list[ast.Attribute]:
    chain = []
    while isinstance(node, ast.Attribute):
        if is_private(node.attr):
            chain.append(node)
        node = node.value
    return chain


def _in_class(node: ast.ClassDef, family: set[str]) -> set[str]:
    """In a class built with torch/Lightning classes: their private names it overrides, reads or sets on self."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name in family:
            found.add("." + sub.name)
        elif isinstance(sub, ast.Attribute) and _on_self(sub.value) and is_private(sub.attr):
            if sub.attr in family:
                found.add("." + sub.attr)
    return found


def _has_private(path: str) -> bool:
    return any(is_private(part) for part in path.split(".")[1:])
