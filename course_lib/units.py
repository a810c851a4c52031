"""One byte convention for the whole course: IEC binary units.

    KiB = 2**10 bytes    MiB = 2**20 bytes    GiB = 2**30 bytes    TiB = 2**40 bytes

Everything the course computes or measures (model state, activations, traced bytes, buffer
sizes) is reported in these units by `fmt_bytes`. Vendors quote memory and bandwidth in
decimal units (an "80 GB" H100 holds 80 * 10**9 bytes); such a figure enters the course only
through `from_spec_gb`, which says so, and `spec_gb_to_gib` shows the conversion:

    80 GB  = 80e9 / 2**30  = 74.5 GiB
    141 GB = 131.3 GiB      192 GB = 178.8 GiB      288 GB = 268.2 GiB

Network and memory bandwidths stay in the vendors' decimal units (GB/s = 10**9 bytes/s), as
every datasheet and benchmark writes them; `fmt_rate` formats them.
"""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
GB = 10**9  # a vendor's decimal gigabyte, only for quoting spec sheets

_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def fmt_bytes(n: float, digits: int = 1) -> str:
    """'74.5 GiB' style: the largest IEC unit the value reaches, `digits` decimals; '512 B' below 1 KiB."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def from_spec_gb(gb: float) -> int:
    """Bytes in a vendor's "gb GB" (decimal: 10**9 bytes each), e.g. an 80 GB GPU -> 80e9 bytes."""
    if not gb > 0:
        raise ValueError(f"gb={gb!r} must be > 0 (a spec-sheet memory size in decimal GB)")
    return int(round(gb * GB))


def spec_gb_to_gib(gb: float) -> float:
    """A spec sheet's decimal GB in GiB: gb * 10**9 / 2**30 (80 GB -> 74.5 GiB)."""
    return from_spec_gb(gb) / GiB


def fmt_rate(bytes_per_second: float) -> str:
    """A bandwidth in the vendors' decimal units: '25.0 GB/s', '3.6 GB/s', '850.0 MB/s'."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(bytes_per_second) >= scale:
            return f"{bytes_per_second / scale:.1f} {unit}"
    return f"{bytes_per_second:.0f} B/s"
