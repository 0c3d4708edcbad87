#!/usr/bin/python3
"""An independent PNG reader (standard library only) for the `xlr8 plot` test.

Usage: read_png.py FILE RRGGBB ROWS COLUMNS
Checks the signature and every chunk's CRC, inflates the image data, undoes the scanline filters, and
prints JSON: width, height, and for each of ROWS x COLUMNS equal cells of the image the number of pixels
within 40 (per channel) of the colour RRGGBB."""
import json
import struct
import sys
import zlib


def chunks(data):
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit("not a PNG: bad signature")
    at = 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind = data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        if zlib.crc32(kind + body) != crc:
            raise SystemExit(f"chunk {kind!r} has a bad CRC")
        yield kind, body
        at += 12 + length


def paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def decode(path):
    data = open(path, "rb").read()
    header, idat, palette = None, b"", None
    for kind, body in chunks(data):
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = [tuple(body[i:i + 3]) for i in range(0, len(body), 3)]
        elif kind == b"IDAT":
            idat += body
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or interlace != 0 or colour not in (2, 3, 6):
        raise SystemExit(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    channels = {2: 3, 3: 1, 6: 4}[colour]
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous, at = [], bytearray(stride), 0
    for _ in range(height):
        kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
        at += 1 + stride
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                line[i] = (line[i] + paeth(left, up, corner)) & 255
        rows.append(line)
        previous = line
    def pixel(x, y):
        row = rows[y]
        if colour == 3:
            return palette[row[x]]
        return tuple(row[x * channels:x * channels + 3])
    return width, height, pixel


def main():
    path, hex_colour, grid_rows, grid_columns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    target = tuple(int(hex_colour[i:i + 2], 16) for i in (0, 2, 4))
    width, height, pixel = decode(path)
    cells = [[0] * grid_columns for _ in range(grid_rows)]
    for y in range(height):
        for x in range(width):
            if all(abs(p - t) <= 40 for p, t in zip(pixel(x, y), target)):
                cells[y * grid_rows // height][x * grid_columns // width] += 1
    print(json.dumps({"width": width, "height": height, "cells": cells}))


main()
