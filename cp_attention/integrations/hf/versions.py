"""The transformers releases cp_attention admits and tests, and the check at registration.

``pyproject.toml`` admits ``transformers>=5.17,<=5.25.0``: the releases of :data:`TESTED_VERSIONS` and those
between. Registration raises ImportError outside ``[MIN_VERSION, MAX_VERSION)`` (the integration is then
not available: ``import cp_attention`` warns and leaves transformers alone) and warns once for a release
newer than every tested one: its mixer functions are still admitted by behaviour
(:mod:`.function_admission`) or refused under context parallelism.
"""

from __future__ import annotations

import warnings

__all__ = ["MIN_VERSION", "MAX_VERSION", "TESTED_VERSIONS", "parse", "transformers_version", "untested_warning",
           "check_version"]

MIN_VERSION, MAX_VERSION = (5, 17), (6, 0)
TESTED_VERSIONS = ("5.17.0", "5.24.0", "5.25.0")
"""The releases the suite runs: the lowest, the pin of the support tables, the newest (docs/transformers.md)."""


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def parse(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string; a pre-release suffix ends the numbers (``5.26.0.dev0``)."""
    parts = []
    for part in text.split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
        if digits != part:
            break
    return tuple(parts + [0] * (3 - len(parts)))


def untested_warning(text: str) -> str | None:
    """The warning for transformers ``text`` when it is newer than every tested release, else None."""
    newest = max(TESTED_VERSIONS, key=parse)
    if parse(text) <= parse(newest):
        return None
    return (f"cp_attention was tested with transformers {', '.join(TESTED_VERSIONS)}; {text} is newer. Its mixer "
            "functions are admitted by behaviour (what fails its check is refused under context parallelism), but "
            f"other changes are untested: `pip install 'transformers<={newest}'` for a tested release")


def check_version() -> None:
    """Raise ImportError for a transformers outside the supported range; warn for an untested newer one."""
    text = transformers_version()
    if not (MIN_VERSION <= parse(text)[:2] < MAX_VERSION):
        raise ImportError(f"cp_attention's transformers integration supports transformers >= "
                          f"{'.'.join(map(str, MIN_VERSION))} and < {'.'.join(map(str, MAX_VERSION))}, found {text}")
    warning = untested_warning(text)
    if warning is not None:
        warnings.warn(warning, stacklevel=3)
