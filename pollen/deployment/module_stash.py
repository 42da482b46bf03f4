"""Modules preloaded by a warm-up (an app's, and the user's plug-ins it
imports), used only where a task would import exactly those files.

Flower loads a ClientApp with `importlib.import_module` from the directory
its FAB is installed in (`<FLWR_HOME>/apps/<publisher>.<name>.<version>.<hash>`)
and takes a module already in `sys.modules` as it is. A warm parent that
kept its preloaded app in `sys.modules` would therefore hand every later
task that code, whatever FAB the task's run carries. So the parent moves
the modules it preloaded out of `sys.modules` into a `ModuleStash`, and a
forked child installs the stash as the first import finder: a stashed
module comes back only when the normal path search, run at that moment on
the child's `sys.path`, resolves its name to the very file it was loaded
from, with the same size and modification time. Another FAB lives in
another directory, so its imports miss the stash and run its own code; an
edited plug-in has another modification time, so it is imported again.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType


@dataclass(frozen=True)
class _Origin:
    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | None) -> _Origin | None:
        if not path:
            return None
        try:
            stat = Path(path).stat()
        except OSError:
            return None
        return cls(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


class ModuleStash(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules taken out of `sys.modules`, each with the file it came from."""

    def __init__(self, modules: dict[str, tuple[ModuleType, _Origin]]) -> None:
        self.modules = modules
        self.restored: list[str] = []

    @classmethod
    def take(cls, names: Iterable[str]) -> ModuleStash:
        """Remove the modules `names` that were loaded from a file outside
        this Python environment from `sys.modules` and keep them here: the
        app's own, and a user's plug-ins beside it (a rule or model named by
        import path, on `PYTHONPATH` or installed in editable mode), which a
        child must import again once their file changes. Modules installed
        in the environment (its standard library, its packages, torch's
        lazily imported parts) stay where they are."""
        environment = {
            Path(prefix).resolve()
            for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                           sys.base_exec_prefix)
        }  # fmt: skip
        taken: dict[str, tuple[ModuleType, _Origin]] = {}
        for name in names:
            module = sys.modules.get(name)
            origin = _Origin.of(getattr(module, "__file__", None))
            if origin is not None and not any(
                Path(origin.path).is_relative_to(prefix) for prefix in environment
            ):
                taken[name] = (module, origin)
                del sys.modules[name]
        return cls(taken)

    @classmethod
    def empty(cls) -> ModuleStash:
        return cls({})

    def install(self) -> None:
        """Make this stash the first finder of every later import."""
        if self.modules and self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    # importlib's finder and loader protocol

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        entry = self.modules.get(fullname)
        if entry is None:
            return None
        module, origin = entry
        found = importlib.machinery.PathFinder.find_spec(fullname, path)
        if found is None or _Origin.of(found.origin) != origin:
            return None  # another file (another FAB): import it normally
        spec = ModuleSpec(
            fullname, self, origin=found.origin, is_package=hasattr(module, "__path__")
        )
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return self.modules[spec.name][0]

    def exec_module(self, module: ModuleType) -> None:
        """Already executed in the parent: nothing to run again."""
        self.restored.append(module.__name__)
