"""The mpi4py classes that the MPI executor's annotations name, in one place.

mpi4py is optional: it is imported only when an MPI call runs (:func:`.datatypes.mpi`). The
executor's modules annotate with these names under ``from __future__ import annotations``, so
at run time the names are never looked up: here they are mpi4py's classes to a type checker and
``Any`` at run time, and importing this module imports no mpi4py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - mpi4py is optional at run time
    from mpi4py.MPI import Comm, Datatype, Intracomm, Prequest
else:
    Comm = Datatype = Intracomm = Prequest = Any

__all__ = ["Comm", "Datatype", "Intracomm", "Prequest"]
