"""Deterministic payloads: ids, seeds, tiny real images and audio bytes.

Everything here is a pure function of a sha256 hex digest (plus the input
length for audio), so the same request body yields byte-identical output
across calls and across stub restarts. The images and the WAV are real,
decodable files, because the project hands them to clients that may open
them; they are built by hand (struct + zlib.crc32, no PIL) and never go
through a compressor whose output could differ between library versions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import uuid
import zlib
from typing import Any

IMAGE_SIDE_PX = 8  # width and height of every generated image, pixels
AUDIO_MAX_BYTES = 64 * 1024  # cap on generated audio, bytes
AUDIO_BASE_BYTES = 64  # audio size for empty input, bytes
AUDIO_BYTES_PER_CHAR = 32  # audio growth per input character, bytes
WAV_RATE_HZ = 24_000  # sample rate of generated WAV, Hz (16-bit mono)
VERTEX_IMAGE_TOKENS = 1290  # candidatesTokenCount Gemini reports per image


def to_json(obj: Any) -> bytes:
    """Compact JSON in the dict's insertion order: stable bytes for stable dicts."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def byte_stream(seed: str, length: int) -> bytes:
    """`length` pseudo-random bytes from sha256 in counter mode over `seed`."""
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:length])


def task_id(hex_digest: str) -> str:
    """A UUID-shaped id from the first 32 hex digits of a digest."""
    return str(uuid.UUID(hex=hex_digest[:32]))


def derived_seed(hex_digest: str) -> int:
    """A non-negative 31-bit seed for requests that did not pick one."""
    return int(hex_digest[32:40], 16) & 0x7FFFFFFF


def response_id(hex_digest: str) -> str:
    """22 URL-safe base64 characters, shaped like Gemini's responseId."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).decode("ascii")[:22]


def prompt_tokens(text: str) -> int:
    """A rough token count (about 4 characters a token), at least 1."""
    return max(1, (len(text) + 3) // 4)


def colour(hex_digest: str) -> tuple[int, int, int]:
    """The RGB colour an image for this digest is filled with."""
    raw = bytes.fromhex(hex_digest[:6])
    return raw[0], raw[1], raw[2]


# --- PNG ----------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _zlib_stored(data: bytes) -> bytes:
    """A zlib stream holding `data` in one uncompressed deflate block (< 64 KiB)."""
    header = b"\x78\x01"  # deflate, 32 KiB window, no preset dictionary
    block = struct.pack("<BHH", 1, len(data), len(data) ^ 0xFFFF)  # final, stored
    return header + block + data + struct.pack(">I", zlib.adler32(data) & 0xFFFFFFFF)


def png_bytes(hex_digest: str, side: int = IMAGE_SIDE_PX) -> bytes:
    """A valid side x side RGB PNG, solid in the digest's colour."""
    row = b"\x00" + bytes(colour(hex_digest)) * side  # filter type 0 per row
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", _zlib_stored(row * side))
        + _png_chunk(b"IEND", b"")
    )


# --- JPEG ---------------------------------------------------------------------
# One 8x8 baseline block per component (YCbCr, no subsampling). A solid block
# has only a DC coefficient, so the entropy data is: DC category, DC bits, EOB.
# Quantisation is all ones; the Huffman tables are minimal but valid: DC
# categories 0-11 as 4-bit codes, AC holds only EOB as the 1-bit code "0".


def _segment(marker: int, payload: bytes) -> bytes:
    return struct.pack(">HH", marker, len(payload) + 2) + payload


def _ycbcr(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    r, g, b = rgb  # JFIF conversion in integer fixed point, so no float rounding
    y = (299 * r + 587 * g + 114 * b + 500) // 1000
    cb = (-168736 * r - 331264 * g + 500000 * b + 128_000_000 + 500_000) // 1_000_000
    cr = (500000 * r - 418688 * g - 81312 * b + 128_000_000 + 500_000) // 1_000_000
    return tuple(min(255, max(0, v)) for v in (y, cb, cr))  # type: ignore[return-value]


def _dc_bits(level: int) -> str:
    """Huffman code + magnitude bits for the DC of a solid block at `level`."""
    diff = 8 * (level - 128)  # DC of a constant block after the level shift
    category = abs(diff).bit_length()
    code = format(category, "04b")  # our DC table: category k has code k, 4 bits
    if category == 0:
        return code
    magnitude = diff if diff > 0 else diff + (1 << category) - 1
    return code + format(magnitude, f"0{category}b")


def jpeg_bytes(hex_digest: str, side: int = IMAGE_SIDE_PX) -> bytes:
    """A valid baseline 8x8 JPEG, solid in the digest's colour (side must be 8)."""
    if side != 8:
        raise ValueError("jpeg_bytes only builds a single 8x8 block")
    components = _ycbcr(colour(hex_digest))
    bits = "".join(_dc_bits(level) + "0" for level in components)  # "0" = EOB
    bits += "1" * (-len(bits) % 8)  # pad with ones to a byte boundary
    scan = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    scan = scan.replace(b"\xff", b"\xff\x00")  # byte stuffing
    dc_table = b"\x00" + bytes([0, 0, 0, 12] + [0] * 12) + bytes(range(12))
    ac_table = b"\x10" + bytes([1] + [0] * 15) + b"\x00"
    frame = struct.pack(">BHHB", 8, side, side, 3) + b"".join(
        bytes([cid, 0x11, 0]) for cid in (1, 2, 3)
    )
    scan_header = bytes([3]) + b"".join(bytes([cid, 0x00]) for cid in (1, 2, 3)) + b"\x00\x3f\x00"
    return (
        b"\xff\xd8"
        + _segment(0xFFE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
        + _segment(0xFFDB, b"\x00" + b"\x01" * 64)
        + _segment(0xFFC0, frame)
        + _segment(0xFFC4, dc_table)
        + _segment(0xFFC4, ac_table)
        + _segment(0xFFDA, scan_header)
        + scan
        + b"\xff\xd9"
    )


#: A private ancillary PNG chunk ("stUb": decoders skip it) that pads an image
#: to the size `[stub:size=BYTES]` asks for.
PAD_CHUNK = b"stUb"
PNG_CHUNK_OVERHEAD = 12  # length, type and CRC around a chunk's data, bytes


def sized_png(hex_digest: str, size: int | None) -> bytes:
    """The digest's PNG, padded with a :data:`PAD_CHUNK` of pseudo-random bytes to
    exactly ``size`` bytes; the plain PNG when ``size`` is None or too small to pad."""
    png = png_bytes(hex_digest)
    room = (size or 0) - len(png) - PNG_CHUNK_OVERHEAD
    if room < 0:
        return png
    end = png.rindex(b"IEND") - 4  # IEND's length field
    return png[:end] + _png_chunk(PAD_CHUNK, byte_stream(hex_digest, room)) + png[end:]


def image_bytes(hex_digest: str, ext: str) -> bytes:
    """The file served at /files/<digest>.<ext>."""
    return png_bytes(hex_digest) if ext == "png" else jpeg_bytes(hex_digest)


# --- audio --------------------------------------------------------------------


def audio_length(text: str) -> int:
    """Total audio size in bytes for an input of this length."""
    return min(AUDIO_BASE_BYTES + AUDIO_BYTES_PER_CHAR * len(text), AUDIO_MAX_BYTES)


def mp3_bytes(hex_digest: str, text: str, size: int | None = None) -> bytes:
    """An empty ID3v2.4 tag followed by deterministic filler (not decodable
    audio): ``size`` bytes when given, else as long as the text asks."""
    tag = b"ID3\x04\x00\x00\x00\x00\x00\x00"  # version 2.4, no flags, size 0
    total = max(audio_length(text) if size is None else size, len(tag))
    return tag + byte_stream(hex_digest, total - len(tag))


def wav_bytes(hex_digest: str, text: str, size: int | None = None) -> bytes:
    """A valid 16-bit mono PCM WAV holding a triangle tone picked by the digest:
    ``size`` bytes when given (an odd one less one: whole samples), else as
    long as the text asks."""
    header_len = 44
    total = audio_length(text) if size is None else size
    data_len = max(total - header_len, 0) & ~1  # whole 16-bit samples
    period = 40 + int(hex_digest[:2], 16) % 80  # samples per cycle: 200-600 Hz
    amplitude = 8000  # of 32767
    cycle = []
    for i in range(period):
        phase = (4 * amplitude * i) // period  # 0 .. 4*amplitude
        cycle.append(phase - amplitude if phase < 2 * amplitude else 3 * amplitude - phase)
    one_cycle = struct.pack(f"<{period}h", *cycle)
    data = (one_cycle * (data_len // len(one_cycle) + 1))[:data_len]  # the tone repeats every cycle
    fmt = struct.pack("<HHIIHH", 1, 1, WAV_RATE_HZ, WAV_RATE_HZ * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(data))
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
