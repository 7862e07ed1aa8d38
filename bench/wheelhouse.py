"""The wheels bench/gpu_throughput.py needs on a GPU machine that has only torch, pandas, matplotlib and
pytest, and no network: fetched here into .wheelhouse/, installed there from it.

    python bench/wheelhouse.py fill [--torch 2.11.0 --torchvision 0.26.0 --python 3.12]   # here, with PyPI
    python3 bench/wheelhouse.py install --target DIR      # there (bench/gpu_throughput.sh runs it)

`fill` downloads, for the GPU machine's Python and x86-64 Linux, the version of each package that
this checkout runs with here, and the torchvision built for the GPU machine's torch (the defaults
are the lent H100/H200 machines': torch 2.11.0, Python 3.12). It refuses a torchvision whose wheel
pins another torch. `install` installs, into DIR, only the packages that do not import there, and
leaves torchvision out when its wheel pins a torch other than the one installed: ResNet is then
skipped with a message rather than failing.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

WHEELHOUSE = Path(__file__).resolve().parent.parent / ".wheelhouse"
# What the workloads import beyond torch, pandas, matplotlib and pytest (and what those pull in):
# distribution name -> the module it provides.
NEEDED = {"mlperf-logging": "mlperf_logging", "h5py": "h5py", "orjson": "orjson", "nvidia-ml-py": "pynvml",
          "tqdm": "tqdm", "pyarrow": "pyarrow", "torchvision": "torchvision"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def wheel_torch_pin(wheel: Path) -> str | None:
    """The exact torch version a wheel requires (torchvision pins one), from its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    match = re.search(r"^Requires-Dist: torch ?\(?==([^),;\s]+)", text, re.MULTILINE)
    return match.group(1) if match else None


def fill(torch_version: str, torchvision_version: str, python_version: str, folder: Path) -> int:
    folder.mkdir(exist_ok=True)
    wanted = [f"{dist}=={metadata.version(dist)}" for dist in NEEDED if dist != "torchvision"]
    wanted.append(f"torchvision=={torchvision_version}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(folder),
               *wanted]
    subprocess.run(command, check=True)
    vision = sorted(folder.glob(f"torchvision-{torchvision_version}-*.whl"))
    pin = wheel_torch_pin(vision[-1]) if vision else None
    if pin != torch_version:
        print(f"wheelhouse: torchvision {torchvision_version} is built for torch {pin}, not {torch_version}: "
              "give the torchvision release made for that torch (--torchvision)", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"wheelhouse: {len(list(folder.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {folder}")
    return 0


def install(target: Path, folder: Path) -> int:
    missing = [dist for dist, module in NEEDED.items() if importlib.util.find_spec(module) is None]
    if "torchvision" in missing:
        import torch

        here = torch.__version__.split("+")[0]
        wheels = sorted(folder.glob("torchvision-*.whl"))
        pin = wheel_torch_pin(wheels[-1]) if wheels else None
        if pin != here:
            missing.remove("torchvision")
            print(f"wheelhouse: no torchvision for torch {here} in {folder} (it has one for {pin}): resnet will be "
                  "skipped; fill it with --torch " + here, file=sys.stderr)
    if not missing:
        return 0
    if not folder.is_dir():
        print(f"wheelhouse: {', '.join(missing)} missing and no {folder}: run `python bench/wheelhouse.py fill` "
              "where PyPI is reachable, and bring the folder along", file=sys.stderr)
        return 2
    print(f"wheelhouse: installing {', '.join(missing)} into {target}", file=sys.stderr)
    # --upgrade: a target left by an earlier run is replaced, not kept with a warning
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--root-user-action=ignore",
                           "--no-index", "--no-deps", "--no-compile", "--find-links", str(folder), "--target",
                           str(target), *missing]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fill_parser = commands.add_parser("fill", help="download the wheels (here, with PyPI)")
    fill_parser.add_argument("--torch", default="2.11.0", help="the GPU machine's torch (default 2.11.0)")
    fill_parser.add_argument("--torchvision", default="0.26.0", help="the torchvision made for it (default 0.26.0)")
    fill_parser.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    install_parser = commands.add_parser("install", help="install what is missing (there, no network)")
    install_parser.add_argument("--target", type=Path, required=True, help="folder to install into (PYTHONPATH)")
    for sub in (fill_parser, install_parser):
        sub.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="default: .wheelhouse/ in the checkout")
    args = parser.parse_args(argv)
    if args.command == "fill":
        return fill(args.torch, args.torchvision, args.python, args.wheelhouse)
    return install(args.target, args.wheelhouse)


if __name__ == "__main__":
    sys.exit(main())
