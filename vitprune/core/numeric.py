"""What the public functions take as a whole number and as a real number.

Python counts ``True`` as the integer 1, and sweeps often hand over NumPy scalars
(``np.int64`` from ``np.arange``, ``np.float32`` from a float32 array). Every argument
check asks these two questions the same way, so a value one function takes is taken by
all of them, and a bool is refused everywhere rather than read as 0 or 1.

For a type checker the two narrow to ``int`` and ``float``, which a NumPy integer or float
stands in for in every use here; typeshed's ``numbers.Integral`` and ``Real`` support too
little arithmetic to be worth naming.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing's own from Python 3.10; torch requires typing_extensions
    from typing_extensions import TypeGuard


#: Text and byte strings: never a sequence of numbers here, though ``bytes``, ``bytearray`` and
#: ``memoryview`` iterate as ints (``bytearray(b"\x03\x06")`` would read as the blocks ``(3, 6)``).
TEXT_OR_BYTES = (str, bytes, bytearray, memoryview)


def is_whole(value: object) -> TypeGuard[int]:
    """An ``int`` or another integer type (NumPy's, say), but not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[float]:
    """A real number (``int``, ``float``, a NumPy float or integer, a ``Fraction``), but not
    a bool. NaN and infinity pass: each caller says which range it accepts."""
    return isinstance(value, Real) and not isinstance(value, bool)


def real_or_type_error(name: str, value: object, wanted: str) -> float:
    """``value`` as a Python float; ``TypeError`` naming ``name`` and what is ``wanted`` when it
    is no real number (a string, a bool, ``None``). The range is the caller's to check, with
    ``ValueError``: NaN fails every comparison, so ``not low < x <= high`` refuses it there.

    One rule for every argument: the wrong kind of value is a ``TypeError``, a number out of
    range (NaN and infinity included) a ``ValueError``.
    """
    if not is_real(value):
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    return float(value)


def whole_or_type_error(name: str, value: object, wanted: str) -> int:
    """``value`` as a Python int; ``TypeError`` naming ``name`` and what is ``wanted`` when it
    is no whole number (a float, a bool, a string). The range is the caller's to check."""
    if not is_whole(value):
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r}")
    return int(value)


def unit_share(name: str, value: object) -> float:
    """``value`` as a Python float in (0, 1] (a keep rate, a share of the FLOPs): ``TypeError``
    when it is no number, ``ValueError`` when it is outside (NaN included)."""
    number = real_or_type_error(name, value, "a number in (0, 1]")
    if not 0.0 < number <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return number
