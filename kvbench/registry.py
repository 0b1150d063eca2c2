"""One registry helper for everything chosen by name: methods, tasks and storage codecs.

    TASKS = Registry("task", base=Task, package="kvbench.tasks")
    @TASKS.register("my_task")
    class MyTask(Task): ...
    TASKS.get("my_tsk")   -> UserError: unknown task 'my_tsk' (did you mean my_task?); choices are ...

`package` names a package whose modules are imported on first lookup (each registers itself on import), or one
module that registers them all, so a new method is one file: nothing else lists it.

The method and codec registries are created here, at the bottom of the layers, so that the rulebook
(kvbench.run.spec) can ask whether a method evicts and which codecs exist without importing either: they are loaded
by name when first looked up. kvbench.methods.base sets the methods' base class.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

from kvbench.errors import UserError

T = TypeVar("T")


def did_you_mean(value: object, choices: Iterable[object]) -> str:
    """" (did you mean x?)" for the closest choice, or "" when none is close."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_choice(kind: str, value: object, choices: list[str]) -> UserError:
    """The one-line error for a name that is not among `choices`."""
    return UserError(f"unknown {kind} {value!r}{did_you_mean(value, choices)}; choices are {', '.join(choices)}")


def source_file(obj: Any) -> str:
    """The source file that defines a registered class or factory (its module's file, or `<module>` when it has
    none)."""
    try:
        return inspect.getsourcefile(obj) or inspect.getfile(obj)
    except (TypeError, OSError):
        return f"<{getattr(obj, '__module__', '?')}>"


class Registry(Generic[T]):
    """Name -> class (or factory) of one kind, with a base-class check and did-you-mean errors."""

    def __init__(self, kind: str, base: Optional[type] = None, package: Optional[str] = None):
        self.kind, self.base, self.package = kind, base, package
        self._items: dict[str, T] = {}
        self._files: dict[str, str] = {}  # name -> the source file that registered it
        self._clashes: dict[str, list[str]] = {}  # name -> every file that registered it (a name registered twice)
        self._broken: dict[str, str] = {}  # module name -> why it failed to import
        self._loaded = package is None

    def set_base(self, base: type) -> None:
        """Every entry registered from now on must be a subclass of `base`."""
        self.base = base

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the class reachable as `<kind>=<name>` (its `name` attribute is set)."""

        def wrap(obj: T) -> T:
            if self.base is not None and not (isinstance(obj, type) and issubclass(obj, self.base)):
                raise TypeError(f"{obj!r} is not a subclass of {self.base.__name__}")
            file = source_file(obj)
            if name in self._items and self._items[name] is not obj and self._files.get(name) != file:
                # a second file registering a taken name (a user's file over a built-in, or two user files): neither
                # wins; asking for the name is refused, naming both files (a module reloaded from its own file
                # replaces its entry)
                files = self._clashes.setdefault(name, [self._files[name]])
                if file not in files:
                    files.append(file)
                return obj
            try:
                obj.name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            self._items[name] = obj
            self._files[name] = file
            return obj

        return wrap

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(getattr(pkg, "__path__", [])):  # a module registers its entries itself
            if not info.name.startswith("_") and info.name != "base":
                try:
                    importlib.import_module(f"{self.package}.{info.name}")
                except Exception as exc:  # a user's broken file must not take the other entries down
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    where = getattr(exc, "filename", None) if isinstance(exc, SyntaxError) else None
                    line = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
                    path = where or os.path.join(os.path.dirname(pkg.__file__ or ""), f"{info.name}.py")
                    self._broken[info.name] = f"{path}{line}: {type(exc).__name__}: {first}".rstrip(": ")

    def source_file(self, name: str) -> str:
        """The file that registered `name` (UserError as get() for an unknown or clashing name)."""
        self.get(name)
        return self._files[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def get(self, name: str) -> T:
        """The entry registered as `name`; UserError with the choices (and the closest one) otherwise."""
        self._load()
        if isinstance(name, str) and name not in self._items and name in self._broken:
            raise UserError(f"{self.kind} {name!r} failed to load: {self._broken[name]}")
        if isinstance(name, str) and name in self._clashes:
            raise UserError(f"{self.kind} {name!r} is registered twice, by {' and by '.join(self._clashes[name])}; "
                            f"rename one of them")
        if not isinstance(name, str) or name not in self._items:
            err = unknown_choice(self.kind, name, self.names())
            if self._broken:  # say which files did not load (each names its error when asked for by name)
                err = UserError(f"{err}; not loaded (import failed): {', '.join(sorted(self._broken))}")
            raise err
        return self._items[name]


# Compression methods (kvbench/methods/, one module each; kvbench.methods.base sets the base class Method).
METHODS: Registry[Any] = Registry("method", package="kvbench.methods")
# Storage codecs (kvbench.quant.registry registers each: its option defaults and its builder).
CODECS: Registry[Any] = Registry("quant", package="kvbench.quant.registry")
