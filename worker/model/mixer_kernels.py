"""Which kernels a hybrid model's recurrent mixers run: transformers resolves each of their kernel
functions at import to the flash-linear-attention, causal-conv1d or mamba-ssm one where installed,
else to its own torch form; this reads that resolution (``--require-mixer-kernels``, the metric).

Design notes: docs/worker.md ("The state cache of hybrid models", "Kernels").
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.model.loader import ModelLoadError
from worker.model.recurrent import find_mixers

log = logging.getLogger(__name__)

# The import names of the kernel packages and the distributions people install.
DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


@dataclass(frozen=True)
class KernelFunction:
    """One kernel function of a mixer's module: its name, its package, and whether transformers
    resolved it to the package's kernel (False: its torch form runs)."""

    name: str
    package: str
    kernel: bool


@dataclass(frozen=True)
class MixerKernels:
    """The kernel functions of a model's mixers by mixer class (empty: none found)."""

    functions: Mapping[str, tuple[KernelFunction, ...]]

    @property
    def torch_forms(self) -> list[str]:
        """``Class: function (distribution)`` for each function that runs its torch form, and
        ``Class: no kernel function found`` for a mixer whose functions are not known."""
        found = []
        for mixer, functions in self.functions.items():
            if not functions:
                found.append(f"{mixer}: no kernel function found")
            found += [
                f"{mixer}: {f.name} ({DISTRIBUTIONS.get(f.package, f.package)})"
                for f in functions
                if not f.kernel
            ]
        return found

    @property
    def on_kernels(self) -> bool:
        """Every mixer runs its packages' kernels (the fast-path metric's ``mixers`` part)."""
        return bool(self.functions) and not self.torch_forms

    def describe(self) -> str:
        """The start-up log's words for it."""
        if self.on_kernels:
            packages = sorted({f.package for fs in self.functions.values() for f in fs})
            return "the kernels of " + ", ".join(DISTRIBUTIONS.get(p, p) for p in packages)
        return "transformers' torch forms for " + "; ".join(self.torch_forms)


def resolution(function: Callable[..., Any]) -> KernelFunction | None:
    """What transformers' ``use_kernel_func_from_hub_with_fallback`` chose for ``function`` (None:
    not such a function): the names its wrapper closes over."""
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or closure is None or "is_new_implementation" not in code.co_freevars:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
    return KernelFunction(
        str(cells.get("func_name", "?")), str(cells.get("package", "?")), bool(cells["is_new_implementation"])
    )


def mixer_kernels(mixers: Mapping[int, Any]) -> MixerKernels:
    """The kernel functions the module of each mixer class in ``mixers`` calls."""
    functions: dict[str, tuple[KernelFunction, ...]] = {}
    for mixer in mixers.values():
        cls = type(mixer)
        if cls.__name__ in functions:
            continue
        module = sys.modules.get(cls.__module__)
        found = [resolution(value) for value in vars(module).values()] if module is not None else []
        functions[cls.__name__] = tuple(f for f in found if f is not None)
    return MixerKernels(functions)


def checked_mixer_kernels(model: Any, require: bool) -> bool | None:
    """Logs which kernels ``model``'s mixers run; True: the packages' kernels, False: some torch
    form, None: no recurrent mixers. With ``require`` (``--require-mixer-kernels``), a torch form
    raises :class:`ModelLoadError` in one line naming them."""
    mixers = find_mixers(model)
    if not mixers:
        return None
    kernels = mixer_kernels(mixers)
    log.info("recurrent mixers: %s", kernels.describe())
    if require and not kernels.on_kernels:
        raise ModelLoadError(
            f"--require-mixer-kernels: the recurrent mixers would run {kernels.describe()}",
            param="require_mixer_kernels",
        )
    return kernels.on_kernels
