"""Model variants: other implementations of the model's attention, kept outside gem_platform
and chosen by name with ``model.kernel`` (gem_bench's off-the-shelf parts, the e2e benchmark's
same-run baseline, are ``baseline``).

A package offers a variant through the entry-point group ``gem_platform.model_variants`` of its
metadata (pyproject.toml's ``[project.entry-points]``): every process where the package is
installed, Ray workers included, finds it by name, and gem_platform never imports the package
itself. ``register`` adds one to this process only (a package registering itself on import, so
that a source tree run without installing still finds it there). This module imports neither
torch nor any variant until one is asked for, so recipe validation can name the installed ones.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Protocol

from gem_platform.errors import GemError

GROUP = "gem_platform.model_variants"
KERNELS = ("auto", "triton", "pytorch")  # gem_kernels' own choices; any other name is a variant
_FIX = ("Use one of those; a variant comes installed with its package (gem_bench's "
        "'baseline': pip install -e .).")

_registered: dict[str, AttentionVariant] = {}


class AttentionVariant(Protocol):
    """What a variant provides: the model's two attention calls (see model/attention.py)."""

    def self_attention(self, q: Any, k: Any, v: Any, offsets: Any, max_len: int,
                       spec: Any) -> Any: ...

    def generalized_attention(self, q: Any, k: Any, v: Any, q_offsets: Any, kv_offsets: Any,
                              max_q: int, max_kv: int, *, activation: str, norm: str) -> Any: ...


def register(name: str, variant: AttentionVariant) -> None:
    """Make ``variant`` available as ``model.kernel: <name>`` in this process."""
    _registered[name] = variant


def installed() -> list[str]:
    """The variant names this process can use: registered here or declared by an installed
    package."""
    return sorted({*_registered, *(ep.name for ep in entry_points(group=GROUP))})


def _unknown(name: str) -> str:
    names = ", ".join(installed()) or "none installed"
    return (f"{name!r} is neither a kernel ({', '.join(KERNELS)}) nor an installed model "
            f"variant ({names}).")


def check_kernel(name: str) -> str:
    """``name`` if it is a kernel choice or an installed variant (recipe validation)."""
    if name in KERNELS or name in installed():
        return name
    raise ValueError(f"{_unknown(name)} {_FIX}")


def get(name: str) -> AttentionVariant:
    """The variant called ``name``, loaded from its entry point the first time."""
    if name in _registered:
        return _registered[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            _registered[name] = ep.load()
            return _registered[name]
    raise GemError(f"model.kernel {_unknown(name)}", _FIX)
