"""The int16 decode kernels on AMD chips, read from their assembly (no GPU): instructions with the chip's 4-byte dot
instruction against four products a dot (DP4A_PRODUCTS, the way every AMD chip went before), side by side.

For each format with an int16 decode (gpu_kernels.sources.INT_DECODE) at its decode tuning
(kernels.format_tuning) and each chip, hipcc compiles the module both ways to assembly; per one-token kernel
(matmul_1q, moe_matmul_1q) the table gives the kernel's instructions, those of its dot loop (the innermost loop, as
LLVM's loop comments mark them, with the most dot instructions; in the products build, with the most 24-bit integer
products) and the dots in it.
Static counts, not time: a decode matvec that is bound by instructions a weight, not by memory, gains by their ratio.

    python bench/hip_assembly.py [--chips gfx906,gfx1030,gfx1100] [--formats q8_0,q4_k] [--output FILE]
"""
import argparse
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from gpu_kernels.hipcc import Hipcc, kernel_assembly, kernel_lines  # noqa: E402
from gpu_kernels.kernels import format_tuning, tuned_source  # noqa: E402
from gpu_kernels.sources import INT_DECODE, INT_DOT_KERNELS, module_name  # noqa: E402

LABEL = re.compile(r"^\.(LBB\d+_\d+):(.*)$")
WORK = ("v_dot4", "v_mul_i32_i24", "v_mad_i32_i24")  # the dots' instructions: the chip's, or the products' multiplies


def loops(assembly, kernel):
    """{loop header label: (instructions, dot instructions, dot or product instructions)} of `kernel`, each block
    counted in its innermost loop (LLVM marks a header "Loop Header: Depth=n" and the other blocks of a loop
    "in Loop: Header=BBx_y")."""
    counts, loop = {}, None
    for line in kernel_lines(assembly, kernel):
        label = LABEL.match(line)
        if label:
            header = re.search(r"Header=(BB\d+_\d+)", label.group(2))
            loop = label.group(1)[1:] if "Loop Header" in label.group(2) else header.group(1) if header else None
        elif loop and not line.startswith((";", ".")):
            total, dots, work = counts.get(loop, (0, 0, 0))
            counts[loop] = (total + 1, dots + line.startswith("v_dot4"), work + line.startswith(WORK))
    return counts


def source(qtype, products):
    rows, _, blocks = format_tuning(qtype)
    return tuned_source(qtype, rows, blocks, "#define DP4A_PRODUCTS\n" if products else "")


def dot_loop(assembly, kernel):
    """(instructions, dot instructions) of `kernel`'s loop with the most dot or product instructions."""
    return max(loops(assembly, kernel).values(), key=lambda counts: counts[2])[:2]


def row(qtype, chip, kernel, dot_asm, products_asm):
    hot, products_loop = dot_loop(dot_asm, kernel), dot_loop(products_asm, kernel)
    dot_total, products_total = len(kernel_assembly(dot_asm, kernel)), len(kernel_assembly(products_asm, kernel))
    return (f"| {qtype.name} | {chip} | {kernel} | {products_total} | {dot_total} | {products_loop[0]} | "
            f"{hot[0]} | {hot[1]} | {products_loop[0] / max(1, hot[0]):.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chips", default="gfx906,gfx1030,gfx1100")
    parser.add_argument("--formats", default=",".join(q.name.lower() for q in sorted(INT_DECODE)))
    parser.add_argument("--output", help="also write the table here")
    args = parser.parse_args()
    formats = [Q[f.strip().upper()] for f in args.formats.split(",")]
    unknown = [q.name for q in formats if q not in INT_DECODE]
    if unknown:
        parser.error(f"no int16 decode kernels for {', '.join(unknown)}")
    chips = [c.strip() for c in args.chips.split(",")]
    hipcc = Hipcc()
    jobs = [(q, chip, products) for q in formats for chip in chips for products in (False, True)]
    with ThreadPoolExecutor(2) as pool, tqdm(total=len(jobs), desc="hipcc", unit="module") as progress:
        def build(job):
            q, chip, products = job
            text = hipcc.assembly(module_name(q), source(q, products), chip)
            progress.update()
            return text

        built = dict(zip(jobs, pool.map(build, jobs)))
    lines = ["| format | chip | kernel | instructions, 4 products | with the dot instruction | dot loop, 4 products "
             "| dot loop, with the dot instruction | dots in it | loop ratio |", "|---" * 9 + "|"]
    lines += [row(q, chip, kernel, built[(q, chip, False)], built[(q, chip, True)])
              for q in formats for chip in chips for kernel in INT_DOT_KERNELS]
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")


if __name__ == "__main__":
    main()
