"""What ``torch.compile`` does not trace: the process group's and its Work's methods.

DDP's C++ reducer calls the group back from inside a compiled forward (``_rebuild_buckets``'s
broadcast, ``_sync_buffers``'s), and waits on its Work: each call enters a Python frame of
this backend, which Dynamo would try to compile, with the group as an opaque C++ object whose
Python members it cannot see (``UnsafeScriptObjectError``). A collective is I/O with threads
and sockets, not a graph: every method that torch's ``ProcessGroup`` or ``Work`` declares, and
every public method of ours, runs eagerly under ``torch.compiler.disable``, as gloo's C++
methods do. What Dynamo captures of a collective is torch's own: the functional collectives'
ops in a graph, which call the group through the dispatcher when the graph runs.
"""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T", bound=type)

#: what a method of a class made by ``untraced`` carries (``torch.compiler.disable``'s mark)
MARK = "_torchdynamo_disable"


def _covered(cls: type, base: type) -> list[str]:
    """The methods of ``cls`` that ``untraced`` wraps: each one it defines that ``base``
    declares too, or whose name is public."""
    return [name for name, fn in vars(cls).items()
            if not name.startswith("__") and callable(fn) and not isinstance(fn, type)
            and (not name.startswith("_") or hasattr(base, name))]


def untraced(base: type):
    """A class decorator: each method ``_covered`` names, wrapped in ``torch.compiler.disable``
    (recursive: what it calls is not traced either)."""

    def wrap(cls: T) -> T:
        for name in _covered(cls, base):
            setattr(cls, name, torch.compiler.disable(vars(cls)[name]))
        return cls

    return wrap


def traced_methods(cls: type, base: type) -> list[str]:
    """The methods of ``cls`` that Dynamo would still trace: none, for a class made by
    ``untraced(base)``."""
    return [name for name in _covered(cls, base) if not getattr(vars(cls)[name], MARK, False)]
