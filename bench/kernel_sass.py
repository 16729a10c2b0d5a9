"""Instructions in a one-token matmul kernel's slice loop, from its SASS, without a GPU.

Compiles a format's matmul module with NVRTC (the nvidia-cuda-nvrtc wheel) at each --rows (DECODE_ROWS) and --variants
(macros defined before the source, as bench/gpu_kernels.py --variants does), disassembles it with nvdisasm (on PATH or
from the nvidia-cuda-nvdisasm wheel) and prints, for --kernel (moe_matmul_1q by default), its registers and the
instructions of its slice loop: the longest loop that loads from global memory and has no shuffle or barrier (the
rows_dot_store loop of matmul.cu: one slice of every row of a lane group), also per 32 weights and row.

    python bench/kernel_sass.py --format iq3_s [--rows 2,4] [--variants ,IQ3S_SIGNED_GRID] [--arch sm_90]
"""
import argparse
import collections
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as Q

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_kernels import variant_defines  # noqa: E402
from gpu_kernels.kernels import SLICE_WEIGHTS, tuned_source  # noqa: E402
from gpu_kernels.nvrtc import Nvrtc  # noqa: E402

EIATTR_REGCOUNT = 0x2F


def nvdisasm_path():
    found = shutil.which("nvdisasm")
    if found:
        return found
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    paths = sorted(wheel.glob("cu*/bin/nvdisasm")) + sorted(wheel.glob("cuda_nvdisasm/bin/nvdisasm"))
    if not paths:
        raise SystemExit("no nvdisasm: put it on PATH or pip install nvidia-cuda-nvdisasm")
    return str(paths[-1])


def _sections(elf):
    """{name: (offset, size)} of an ELF64 file's sections."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    base = headers[names][4]
    return {elf[base + h[0]:elf.index(b"\0", base + h[0])].decode(): (h[4], h[5]) for h in headers}


def registers(cubin):
    """{kernel: registers a thread} from the cubin's .nv.info (EIATTR_REGCOUNT entries)."""
    sections = _sections(cubin)
    sym_at, sym_size = sections[".symtab"]
    str_at, _ = sections[".strtab"]
    names = []
    for i in range(sym_size // 24):
        name, = struct.unpack_from("<I", cubin, sym_at + 24 * i)
        names.append(cubin[str_at + name:cubin.index(b"\0", str_at + name)].decode())
    at, size = sections[".nv.info"]
    info, out, i = cubin[at:at + size], {}, 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == 0x04:  # EIFMT_SVAL: a 2-byte size and that many bytes
            length, = struct.unpack_from("<H", info, i + 2)
            if attr == EIATTR_REGCOUNT:
                symbol, value = struct.unpack_from("<II", info, i + 4)
                out[names[symbol]] = value
            i += 4 + length
        else:  # EIFMT_NVAL (2 bytes), EIFMT_BVAL (3), EIFMT_HVAL (4)
            i += {0x01: 2, 0x02: 3, 0x03: 4}[fmt]
    return out


def kernel_instructions(sass, kernel):
    """(instructions, {label: index}) of `kernel` in nvdisasm's output."""
    lines = sass.split("\n")
    start = lines.index(f".text.{kernel}:")
    instructions, labels = [], {}
    for line in lines[start + 1:]:
        if line.startswith(".text.") or line.lstrip().startswith(".section"):
            break
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            instructions.append(op.group(1).strip())
    return instructions, labels


def slice_loop(instructions, labels):
    """The instructions of the longest loop (a backward branch's span) with a global load and no shuffle or barrier."""
    best = []
    for i, text in enumerate(instructions):
        target = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = instructions[labels[target.group(1)]:i + 1]
            ops = " ".join(body)
            if "LDG" in ops and "SHFL" not in ops and "BAR" not in ops and len(body) > len(best):
                best = body
    return best


def loop_weights(source, qtype):
    """Weights of a row the slice loop goes through in one pass: the module's SLICE_WEIGHTS * SLICE_UNROLL (a variant or
    the format's header may change either), by the C preprocessor; without g++ kernels.SLICE_WEIGHTS."""
    if shutil.which("g++") is None:
        return SLICE_WEIGHTS[qtype]
    text = "\n".join(line for line in source.split("\n") if line.startswith("#"))
    text += "\nWEIGHTS_ARE SLICE_WEIGHTS * SLICE_UNROLL\n"
    out = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=text, capture_output=True, text=True).stdout
    expression = out.split("WEIGHTS_ARE")[-1].strip()
    if not re.fullmatch(r"[\d\s()*+]+", expression):
        return SLICE_WEIGHTS[qtype]
    return int(eval(expression, {"__builtins__": {}}))  # digits, spaces, parentheses, * and + only


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="iq3_s")
    p.add_argument("--rows", default="2,4", help="DECODE_ROWS, each compiled")
    p.add_argument("--variants", default="", help="macros (NAME, NAME=VALUE, joined by +) each compiled ('' plain)")
    p.add_argument("--kernel", default="moe_matmul_1q")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--ops", action="store_true", help="also print the loop's opcode counts")
    args = p.parse_args(argv)
    qtype, nvrtc, nvdisasm = Q[args.format.upper()], Nvrtc(), nvdisasm_path()
    print("| variant | rows / group | registers | slice loop | a 32-weight slice and row |\n|---|---|---|---|---|")
    for variant in args.variants.split(","):
        defines = variant_defines(variant)
        for rows in (int(r) for r in args.rows.split(",")):
            cubin = nvrtc.compile(f"sass_{qtype.name.lower()}", tuned_source(qtype, rows, 0, defines), args.arch,
                                  ("--std=c++14",))
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
            loop = slice_loop(*kernel_instructions(sass, args.kernel))
            slice_weights = loop_weights(tuned_source(qtype, rows, 0, defines), qtype)
            per = len(loop) / rows / (slice_weights / 32)
            print(f"| {variant or 'plain'} | {rows} | {registers(cubin).get(args.kernel, '?')} | {len(loop)} | "
                  f"{per:.0f} |")
            if args.ops:
                print(dict(collections.Counter(opcode(t) for t in loop).most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
