"""The catalogue: every identity of ``docs/theory.md`` that linop proves, as named entries.

Entries come from one module per feature, each holding a list ``ENTRIES`` of
:class:`~verify.catalogue.Entry`. :data:`SOURCES` lists those modules explicitly; a
new feature adds its module there.

=======================================  ======================================================
module                                   section of ``docs/theory.md`` (``Entry.section``)
=======================================  ======================================================
verify.catalogue_primitives              ``primitives``: allocate, deallocate, clear, add; copy
                                         and move
verify.catalogue_distributed_primitives  ``distributed-primitives``: send-receive and the
                                         patterns built from it
verify.catalogue_collectives             ``collectives``: the collective nodes (scatter ...
                                         all-to-all); ``collective-algorithms``: the ring
verify.catalogue_halo                    ``halo-exchange``: halo exchange
verify.catalogue_algorithms              ``collective-algorithms``: each algorithm variant equals
                                         its collective; its adjoint is the reverse algorithm
verify.catalogue_layers                  ``local-operators``, ``layers``, ``outer-product-gradients``:
                                         local kernels, distributed layers, the dAD identity
=======================================  ======================================================

Examples
--------
>>> from verify import identities
>>> entry = identities.get("copy-inplace-adjoint")
>>> entry.statement
'C_{a->b}* is the adjoint of C_{a->b}'
"""

from __future__ import annotations

import fnmatch
import importlib

from .catalogue import Entry

__all__ = ["ENTRIES", "SOURCES", "get", "select", "sections", "load"]

SOURCES: tuple[str, ...] = (
    "verify.catalogue_primitives",
    "verify.catalogue_distributed_primitives",
    "verify.catalogue_collectives",
    "verify.catalogue_halo",
    "verify.catalogue_algorithms",
    "verify.catalogue_layers",
)
"""The modules whose ``ENTRIES`` make the catalogue, in report order."""


def load(sources: tuple[str, ...] = SOURCES) -> tuple[Entry, ...]:
    """Collect the entries of ``sources``; raise ValueError on a duplicate name."""
    entries: list[Entry] = []
    seen: dict[str, str] = {}
    for module_name in sources:
        module = importlib.import_module(module_name)
        for entry in module.ENTRIES:
            if not isinstance(entry, Entry):
                raise TypeError(f"{module_name}.ENTRIES holds {type(entry).__name__}, not Entry")
            if entry.kind not in ("adjoint", "equal"):
                raise ValueError(
                    f"identity {entry.name!r}: kind must be 'adjoint' or 'equal', not {entry.kind!r}"
                )
            if entry.name in seen:
                raise ValueError(
                    f"identity {entry.name!r} is defined in both {seen[entry.name]} and {module_name}"
                )
            seen[entry.name] = module_name
            entries.append(entry)
    return tuple(entries)


ENTRIES: tuple[Entry, ...] = load()
"""Every entry of the catalogue, in report order."""


def get(name: str) -> Entry:
    """The entry called ``name``."""
    for entry in ENTRIES:
        if entry.name == name:
            return entry
    raise KeyError(f"no identity called {name!r}")


def select(pattern: str | None) -> tuple[Entry, ...]:
    """Entries matching ``pattern``: comma-separated alternatives, each a glob (``copy-*``),
    a plain substring of the name (``adjoint``) or ``section:ANCHOR`` for a whole
    section of ``docs/theory.md`` (``section:halo-exchange``)."""
    if not pattern:
        return ENTRIES
    alternatives = [p.strip() for p in pattern.split(",") if p.strip()]

    def matches(entry: Entry) -> bool:
        for p in alternatives:
            if p.startswith("section:"):
                if entry.section == p.split(":", 1)[1]:
                    return True
            elif any(c in p for c in "*?["):
                if fnmatch.fnmatchcase(entry.name, p):
                    return True
            elif p in entry.name:
                return True
        return False

    return tuple(e for e in ENTRIES if matches(e))


def sections() -> tuple[str, ...]:
    """The sections (anchors in ``docs/theory.md``) that have entries, in order."""
    return tuple(dict.fromkeys(e.section for e in ENTRIES))
