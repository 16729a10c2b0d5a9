"""Numba's on-disk cache, made to notice edits of the modules a cached kernel calls into.

Numba keys a cached function by a hash of the file that defines it, not of the files whose functions it compiles
in: a kernel of q4_k.py that calls act_quant.py's quantize_rows kept its old machine code after act_quant.py
changed (a git pull that leaves q4_k.py alone), and read past a buffer the new code sized differently. `install`
puts locators first in Numba's list that, for a function of one of `packages`, add to that stamp a digest of the
package modules its module's source imports, followed transitively. The cache folders stay Numba's own
(NUMBA_CACHE_DIR, the module's __pycache__, or the user-wide one).
"""
import ast
import hashlib
import importlib.util
import os

from numba.core import caching

PACKAGES = ("cpu_kernels", "hybrid")
_digests = {}  # (module name, packages): hex digest
_sources = {}  # file: (its bytes, its imports as _imported gives them)


def _module_file(name, top_dirs):
    """The file of package module `name` (a.b.c: <a's parent>/a/b/c.py or .../c/__init__.py), or None."""
    top = top_dirs.get(name.split(".", 1)[0])
    if top is None:
        return None
    base = os.path.join(os.path.dirname(top), *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _source(path, name):
    """The file's bytes and its imports as (module, names imported from it or ()), read once."""
    if path not in _sources:
        with open(path, "rb") as f:
            text = f.read()
        _sources[path] = text, _imported(ast.parse(text, path), path, name)
    return _sources[path]


def _imported(tree, path, name):
    """(module, names) of each import statement in a module's syntax tree, relative ones resolved against `name`."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((base, tuple(alias.name for alias in node.names)))
    return found


def _reached(imports, top_dirs):
    """The package modules a file's imports reach: `from a import b, c` reaches a.b and a.c where they are modules,
    and a itself unless every name is one (a package's __init__ is not a dependency of its modules)."""
    names = []
    for base, imported in imports:
        if base.split(".", 1)[0] not in top_dirs:
            continue
        modules = [f"{base}.{n}" for n in imported if _module_file(f"{base}.{n}", top_dirs)]
        names += modules + ([base] if len(modules) < len(imported) or not imported else [])
    return names


def module_digest(name, packages=PACKAGES):
    """sha1 of module `name`'s file and of every file of `packages` it imports, followed transitively (read from
    the sources, so the same whenever it is asked)."""
    key = (name, packages)
    if key not in _digests:
        top_dirs = {}
        for package in packages:
            spec = importlib.util.find_spec(package)
            if spec is not None and spec.origin:
                top_dirs[package] = os.path.dirname(spec.origin)
        seen, todo = {}, [name]
        while todo:
            current = todo.pop()
            path = None if current in seen else _module_file(current, top_dirs)
            if path is None:
                continue
            seen[current] = path
            todo.extend(_reached(_source(path, current)[1], top_dirs))
        digest = hashlib.sha1()
        for module_name in sorted(seen):
            digest.update(module_name.encode() + b"\0" + _source(seen[module_name], module_name)[0])
        _digests[key] = digest.hexdigest()
    return _digests[key]


def _stamped(locator_class, packages):
    """locator_class, its source stamp extended by module_digest for the functions of `packages` (None: others)."""

    class Stamped(locator_class):
        @classmethod
        def from_function(cls, py_func, py_file):
            module = getattr(py_func, "__module__", None)
            if not isinstance(module, str) or module.split(".", 1)[0] not in packages:
                return None
            self = super().from_function(py_func, py_file)
            if self is not None:
                self._module_name = py_func.__module__
            return self

        def get_source_stamp(self):
            return super().get_source_stamp(), module_digest(self._module_name, packages)

    Stamped.__name__ = Stamped.__qualname__ = f"Stamped{locator_class.__name__}"
    return Stamped


def install(packages=PACKAGES):
    """Put the stamped locators for `packages` first in Numba's locator list (once per package set)."""
    impl = caching.CacheImpl
    if any(getattr(cls, "_packages", None) == packages for cls in impl._locator_classes):
        return
    stamped = []
    for cls in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator):
        cls = _stamped(cls, packages)
        cls._packages = packages
        stamped.append(cls)
    impl._locator_classes = stamped + list(impl._locator_classes)
