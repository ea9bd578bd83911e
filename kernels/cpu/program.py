"""Programs of kernel operations that kernels/cpu/step_program.c runs in one call.

A program is written once (core/worker/cpu_program.py writes a model's
decode step and its prefill chunks) as a list of operations over fixed
addresses, and run every step with that step's row count: the whole step
is then one ctypes call, with the GIL released, instead of several calls a
layer. ``Op`` mirrors the C opcodes, and each operation's arguments are
listed beside its opcode in step_program.c.
"""

from __future__ import annotations

import enum
import struct

import numpy as np

from kernels import cpu

OP_WORDS = 24  # int64 words per operation: the opcode, then its arguments


class Op(enum.IntEnum):
    EMBED_FLOAT = 1
    EMBED_PACKED = 2
    RMS_NORM = 3
    ADD_RMS_NORM = 4
    HEAD_NORM = 5
    LINEAR = 6
    ROTARY = 7
    WRITE_KV = 8
    DECODE_ATTENTION = 9
    PREFILL_ATTENTION = 10
    SILU_MUL = 11
    CHUNK_LENS = 12
    GELU_TANH_MUL = 13
    SCALE = 14
    DENSE = 15
    LORA = 16
    MOE = 17


def _word(value: int | float) -> int:
    """An argument as one int64 word: an integer (or address) as it is, a float as a double's bits."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return int(value)


class Program:
    """Operations added in order, then run as many times as wanted.

    The program holds addresses, not objects: whoever writes it keeps what they
    point to alive (and writes a new program when an address changes)."""

    def __init__(self) -> None:
        self._ops: list[list[int]] = []
        self._array: np.ndarray | None = None

    def add(self, op: Op, *args: int | float) -> None:
        if len(args) >= OP_WORDS:
            raise ValueError(f"{op.name}: {len(args)} arguments do not fit in an operation")
        self._ops.append([int(op), *map(_word, args)])
        self._array = None

    def __len__(self) -> int:
        return len(self._ops)

    def run(self, rows: int, seq_len: int, threads: int) -> None:
        """Every operation over ``rows`` rows (a chunk's request at ``seq_len``) on up to ``threads``."""
        if self._array is None:
            lib = cpu.load()
            if lib.program_op_words() != OP_WORDS:
                raise RuntimeError("kernels/cpu/step_program.c and program.py disagree on OP_WORDS")
            array = np.zeros((len(self._ops), OP_WORDS), np.int64)
            for i, op in enumerate(self._ops):
                array[i, : len(op)] = op
            self._array = array
            self._call = (lib.run_program, array.ctypes.data, len(self._ops))
        run, address, count = self._call
        run(address, count, rows, seq_len, threads)
