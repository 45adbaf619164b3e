"""The toy register machine of the essay, executable.

The machine has a DRAM (named arrays such as ``a``, ``b``, ``x``, ``out``) and a small register
file ``R0 .. R{n-1}``. Every instruction takes one cycle. Only LOAD reads DRAM and only STORE
writes it, so the three counts the essay reasons with -- cycles, DRAM reads, DRAM writes -- fall
out of running a program rather than being worked out by hand.

Instruction set (operands as the essay writes them; the last register is the destination)::

    LOAD src, Rd            Rd = DRAM[src]
    STORE Rs, dst           DRAM[dst] = Rs
    MAC_Z Ra, Rb, Rd        Rd = Ra * Rb            (multiply, no accumulator yet)
    MAC Ra, Rb, Rc, Rd      Rd = Ra * Rb + Rc
    MAX Ra, Rb, Rd          Rd = max(Ra, Rb)
    SUB Ra, Rb, Rd          Rd = Ra - Rb
    EXP Ra, Rd              Rd = exp(Ra)
    ADD Ra, Rb, Rd          Rd = Ra + Rb
    MUL Ra, Rb, Rd          Rd = Ra * Rb
    DIV Ra, Rb, Rd          Rd = Ra / Rb
    MOV Rs, Rd              Rd = Rs

Each register holds a number and a *label*, the symbolic name the essay's register tables print
(``a00``, ``a00·b00``, ``e^(x1 − m)``). LOAD labels a value by its address; arithmetic composes
the labels of its operands; an instruction's ``note`` renames the result when the composed label
would hide the idea (the essay writes ``c00`` rather than ``a01·b10 + a00·b00``).

A register that does not exist, or one read before anything wrote it, is a ``MachineError`` that
names the step, the instruction and the register.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Address", "Instruction", "MachineError", "Value", "Counts", "Step", "Program", "Run",
    "RegisterMachine", "assemble", "op", "run",
]

_REGISTER = re.compile(r"^[Rr](\d+)$")
_ADDRESS = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\])+)$")


class MachineError(ValueError):
    """A program the machine cannot run: bad operand, missing register, unwritten register."""


@dataclass(frozen=True)
class Address:
    """A DRAM location such as ``a[0][1]``: an array name and an index."""

    array: str
    index: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> Address:
        match = _ADDRESS.match(text.strip())
        if not match:
            raise MachineError(f"{text!r} is not a DRAM address (expected e.g. 'a[0][1]')")
        return cls(match.group(1), tuple(int(i) for i in re.findall(r"\d+", match.group(2))))

    def __str__(self) -> str:
        return self.array + "".join(f"[{i}]" for i in self.index)

    @property
    def label(self) -> str:
        """The essay's subscript name: a[0][1] -> 'a01' (commas once an index has two digits)."""
        sep = "," if any(i > 9 for i in self.index) else ""
        return self.array + sep.join(str(i) for i in self.index)


def _register_number(text: str) -> int:
    match = _REGISTER.match(text.strip())
    if not match:
        raise MachineError(f"{text!r} is not a register (expected R0, R1, ...)")
    return int(match.group(1))


def _wrap(label: str) -> str:
    """Parenthesise a label that has a top-level space, so composed labels stay unambiguous."""
    depth = 0
    for ch in label:
        depth += ch == "("
        depth -= ch == ")"
        if ch == " " and depth == 0:
            return f"({label})"
    return label


@dataclass(frozen=True)
class _OpSpec:
    sources: int  # register operands read (LOAD reads an address instead)
    compute: Callable[..., float]
    label: Callable[..., str]


# Arithmetic: `sources` registers in, the last operand is the destination register.
_ARITHMETIC: dict[str, _OpSpec] = {
    "MAC_Z": _OpSpec(2, lambda a, b: a * b, lambda a, b: f"{_wrap(a)}·{_wrap(b)}"),
    "MAC": _OpSpec(3, lambda a, b, c: a * b + c, lambda a, b, c: f"{c} + {_wrap(a)}·{_wrap(b)}"),
    "MAX": _OpSpec(2, max, lambda a, b: f"max({a}, {b})"),
    "SUB": _OpSpec(2, lambda a, b: a - b, lambda a, b: f"{a} − {_wrap(b)}"),
    "EXP": _OpSpec(1, math.exp, lambda a: f"e^({a})"),
    "ADD": _OpSpec(2, lambda a, b: a + b, lambda a, b: f"{a} + {b}"),
    "MUL": _OpSpec(2, lambda a, b: a * b, lambda a, b: f"{_wrap(a)}·{_wrap(b)}"),
    "DIV": _OpSpec(2, lambda a, b: a / b, lambda a, b: f"{_wrap(a)} / {_wrap(b)}"),
    "MOV": _OpSpec(1, lambda a: a, lambda a: a),
}
OPCODES = ("LOAD", "STORE", *_ARITHMETIC)


@dataclass(frozen=True)
class Instruction:
    """One instruction, operands as written (``Instruction("LOAD", ("a[0][0]", "R0"))``).

    ``note`` names the value the instruction writes in the register table (e.g. ``"c00"``).
    Construction checks the opcode and the operands' number and kind, not the machine size.
    """

    opcode: str
    operands: tuple[str, ...]
    note: str | None = None

    def __post_init__(self) -> None:
        if self.opcode not in OPCODES:
            raise MachineError(f"unknown opcode {self.opcode!r}; the machine has {OPCODES}")
        expected = 2 if self.opcode in ("LOAD", "STORE") else _ARITHMETIC[self.opcode].sources + 1
        if len(self.operands) != expected:
            raise MachineError(f"{self}: {self.opcode} takes {expected} operands, "
                               f"got {len(self.operands)}")
        if self.opcode == "LOAD":
            Address.parse(self.operands[0])
            _register_number(self.operands[1])
        elif self.opcode == "STORE":
            _register_number(self.operands[0])
            Address.parse(self.operands[1])
        else:
            for operand in self.operands:
                _register_number(operand)

    def __str__(self) -> str:
        return f"{self.opcode} {', '.join(self.operands)}"

    @property
    def registers(self) -> tuple[int, ...]:
        """Every register number the instruction names."""
        return tuple(_register_number(o) for o in self.operands if _REGISTER.match(o.strip()))

    @property
    def destination(self) -> int | None:
        """The register written, or None for STORE."""
        return None if self.opcode == "STORE" else _register_number(self.operands[-1])


def op(opcode: str, *operands: str, note: str | None = None) -> Instruction:
    """``op("MAC", "R0", "R1", "R2", "R2", note="c00")``: an instruction as the essay writes it."""
    return Instruction(opcode, tuple(operands), note)


def assemble(source: str) -> list[Instruction]:
    """Parse one instruction per line (``LOAD a[0][0], R0``); ``#`` starts a comment."""
    program = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        opcode, _, rest = text.partition(" ")
        operands = tuple(o.strip() for o in rest.split(",")) if rest.strip() else ()
        try:
            program.append(Instruction(opcode.upper(), operands))
        except MachineError as error:
            raise MachineError(f"line {number}: {error}") from None
    return program


@dataclass(frozen=True)
class Value:
    """What a register holds: the number and the essay's symbolic name for it."""

    number: float
    label: str


@dataclass
class Counts:
    """The essay's cost measures: one cycle per instruction, DRAM reads (LOAD), writes (STORE)."""

    cycles: int = 0
    dram_reads: int = 0
    dram_writes: int = 0


@dataclass(frozen=True)
class Step:
    """One executed instruction and the register file right after it (None = never written)."""

    number: int
    instruction: Instruction
    section: str
    registers: tuple[Value | None, ...]


@dataclass
class Program:
    """Instructions in named sections (the essay's passes), plus the DRAM they run against.

    ``inputs`` are the arrays the program LOADs; ``outputs`` name the arrays it STOREs into and
    their shapes (allocated as NaN, so an element the program forgets to write stays NaN).
    """

    name: str
    num_registers: int
    inputs: dict[str, np.ndarray]
    outputs: dict[str, tuple[int, ...]]
    sections: list[tuple[str, list[Instruction]]]
    description: str = ""

    @property
    def instructions(self) -> list[Instruction]:
        return [instruction for _, body in self.sections for instruction in body]


@dataclass
class Run:
    """The result of running a program: its trace, counts (total and per section) and DRAM."""

    program: Program
    steps: list[Step]
    counts: Counts
    section_counts: dict[str, Counts]
    dram: dict[str, np.ndarray] = field(repr=False)

    def output(self, name: str) -> np.ndarray:
        return self.dram[name]


class RegisterMachine:
    """``num_registers`` registers and a DRAM of named float64 arrays; one cycle per instruction."""

    def __init__(self, num_registers: int, dram: Mapping[str, np.ndarray]):
        if num_registers < 1:
            raise ValueError(f"num_registers must be >= 1, got {num_registers}")
        self.num_registers = num_registers
        self.dram = {name: np.array(array, dtype=np.float64) for name, array in dram.items()}
        self.registers: list[Value | None] = [None] * num_registers
        self.counts = Counts()

    def check(self, instructions: Sequence[Instruction], first_step: int = 1) -> None:
        """Fail before running if any instruction names a register this machine lacks."""
        for step, instruction in enumerate(instructions, start=first_step):
            for register in instruction.registers:
                if register >= self.num_registers:
                    raise MachineError(
                        f"step {step} ({instruction}): register R{register} does not exist on a "
                        f"{self.num_registers}-register machine (R0..R{self.num_registers - 1})")

    def _read(self, register: int, step: int, instruction: Instruction) -> Value:
        value = self.registers[register]
        if value is None:
            raise MachineError(f"step {step} ({instruction}): R{register} is read before any "
                               f"instruction wrote it")
        return value

    def _locate(self, address: Address, step: int,
                instruction: Instruction) -> tuple[np.ndarray, tuple[int, ...]]:
        array = self.dram.get(address.array)
        if array is None:
            raise MachineError(f"step {step} ({instruction}): DRAM has no array "
                               f"{address.array!r} (it has {sorted(self.dram)})")
        if len(address.index) != array.ndim or any(
                not 0 <= i < s for i, s in zip(address.index, array.shape, strict=True)):
            raise MachineError(f"step {step} ({instruction}): {address} is outside "
                               f"{address.array} of shape {array.shape}")
        return array, address.index

    def execute(self, instruction: Instruction, step: int = 1) -> None:
        """Run one instruction (``step`` numbers it in errors): one cycle, plus a DRAM read or
        write for LOAD / STORE."""
        self.check([instruction], first_step=step)
        operands = instruction.operands
        if instruction.opcode == "LOAD":
            address = Address.parse(operands[0])
            array, index = self._locate(address, step, instruction)
            number = float(array[index])
            result = Value(number, instruction.note or address.label)
            self.counts.dram_reads += 1
        elif instruction.opcode == "STORE":
            value = self._read(_register_number(operands[0]), step, instruction)
            address = Address.parse(operands[1])
            array, index = self._locate(address, step, instruction)
            array[index] = value.number
            self.counts.dram_writes += 1
            result = None
        else:
            spec = _ARITHMETIC[instruction.opcode]
            sources = [self._read(_register_number(o), step, instruction) for o in operands[:-1]]
            number = spec.compute(*(s.number for s in sources))
            result = Value(number, instruction.note or spec.label(*(s.label for s in sources)))
        if result is not None:
            self.registers[instruction.destination] = result
        self.counts.cycles += 1

    def run(self, program: Program) -> Run:
        """Execute every section of ``program`` in order and record the register table."""
        self.check(program.instructions)
        steps, section_counts = [], {}
        for section, body in program.sections:
            before = Counts(**vars(self.counts))
            for instruction in body:
                self.execute(instruction, step=len(steps) + 1)
                steps.append(Step(len(steps) + 1, instruction, section, tuple(self.registers)))
            now = self.counts
            section_counts[section] = Counts(now.cycles - before.cycles,
                                             now.dram_reads - before.dram_reads,
                                             now.dram_writes - before.dram_writes)
        return Run(program, steps, Counts(**vars(self.counts)), section_counts, self.dram)


def run(program: Program) -> Run:
    """Run ``program`` on a fresh machine with its register count and its inputs in DRAM."""
    dram = dict(program.inputs)
    for name, shape in program.outputs.items():
        dram[name] = np.full(shape, np.nan)
    return RegisterMachine(program.num_registers, dram).run(program)
