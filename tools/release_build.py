"""Build the one package a release tag names, and check that what was built is that release.

    python tools/release_build.py tidal-batching-v0.1.0 --out dist/

The tag is ``tidal-<pkg>-v<version>``. The package must be one of the five, ``version`` in its pyproject.toml must
equal the tag's, and its CHANGELOG.md must hold a ``## <version>`` entry. ``uv build --package tidal-<pkg>`` then
writes its sdist and wheel to ``--out`` (which must be empty or missing), and the wheel's own metadata must carry the
same name and version. The release workflow (.github/workflows/release.yml) runs this before publishing; run it
locally as a dry run of that build. Exit status 0 when all holds, else one line naming what to fix and status 1.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batching", "ckpt", "placement", "actor", "rollout")
TAG = re.compile(r"^tidal-(?P<pkg>[a-z]+)-v(?P<version>\d+\.\d+\.\d+(?:[.-]?(?:a|b|rc|post|dev)\d+)*)$")


def parse_tag(tag: str) -> tuple[str, str]:
    """``(package, version)`` of a release tag.

    Raises:
        ValueError: the tag is not ``tidal-<one of the five>-v<version>``.
    """
    match = TAG.match(tag)
    if match is None or match["pkg"] not in PACKAGES:
        raise ValueError(
            f"tag {tag!r} is not a release tag: use tidal-<pkg>-v<version> with <pkg> one of {', '.join(PACKAGES)}, "
            "e.g. tidal-batching-v0.1.0"
        )
    return match["pkg"], match["version"]


def check_sources(package: str, version: str) -> None:
    """The package's pyproject version and CHANGELOG agree with the tag.

    Raises:
        ValueError: naming the file to fix.
    """
    where = ROOT / "packages" / package
    with open(where / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    if declared != version:
        raise ValueError(
            f"the tag says {version} but packages/{package}/pyproject.toml says {declared}: tag the commit that "
            f"sets version = {version!r}, or retag as tidal-{package}-v{declared}"
        )
    if f"\n## {version}" not in "\n" + (where / "CHANGELOG.md").read_text():
        raise ValueError(f"packages/{package}/CHANGELOG.md has no '## {version}' entry: add one before releasing")


def build(package: str, version: str, out: Path) -> list[Path]:
    """``uv build`` the package into ``out`` and check the wheel's name and version; return the built files.

    Raises:
        ValueError: ``out`` holds files already, or the wheel is not the named release.
    """
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty: give an empty or new folder, so that only this build is uploaded")
    subprocess.run(["uv", "build", "--package", f"tidal-{package}", "--out-dir", str(out)], cwd=ROOT, check=True)
    built = sorted(p for p in out.iterdir() if p.suffix in (".whl", ".gz"))
    wheels = [p for p in built if p.suffix == ".whl"]
    if len(wheels) != 1 or len(built) != 2:
        raise ValueError(f"expected one wheel and one sdist in {out}, found {[p.name for p in built]}")
    with zipfile.ZipFile(wheels[0]) as whl:
        meta_name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(whl.read(meta_name).decode())
    if (meta["Name"], meta["Version"]) != (f"tidal-{package}", version):
        raise ValueError(f"{wheels[0].name} is {meta['Name']} {meta['Version']}, not tidal-{package} {version}")
    return built


def main(argv: list[str] | None = None) -> int:
    """Command line: build and check the release a tag names."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tag", help="tidal-<pkg>-v<version>, e.g. tidal-batching-v0.1.0")
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="empty folder for the sdist and wheel")
    args = parser.parse_args(argv)
    try:
        package, version = parse_tag(args.tag)
        check_sources(package, version)
        built = build(package, version, args.out)
    except ValueError as e:
        print(f"release_build: {e}", file=sys.stderr)
        return 1
    print(f"release_build: tidal-{package} {version}: {', '.join(p.name for p in built)} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
