r"""Packs dflash's wheel from the files Bazel built (standard library only).

    build_wheel.py --out dflash-VERSION-PY-ABI-PLATFORM.whl \
                   --readme README.md FILE...

Each FILE lies under a python/dflash/ directory (source or bazel-out) and
lands at dflash/... in the wheel; the name of --out gives version and tags,
and the version must be the one dflash/_version.py holds (both come from
python/defs.bzl's VERSION). Entries carry fixed timestamps, so the same
inputs give the same wheel.
"""

import argparse
import base64
import hashlib
import os
import re
import sys
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _metadata(version, readme, python_tag):
    return "\n".join([
        "Metadata-Version: 2.1",
        "Name: dflash",
        f"Version: {version}",
        "Summary: Fused, chunked vocabulary-projection heads and DFlash-family "
        "losses for PyTorch training of speculative-decoding draft models",
        "License: Apache-2.0",
        # The extension is built for one CPython minor version (cp311).
        f"Requires-Python: =={python_tag[2]}.{python_tag[3:]}.*",
        "Provides-Extra: torch",
        'Requires-Dist: torch>=1.13; extra == "torch"',
        "Description-Content-Type: text/markdown",
        "",
        readme,
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--readme", required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()

    name, version, python_tag, abi_tag, platform_tag = (
        os.path.basename(args.out)[:-len(".whl")].split("-"))
    entries = {}
    for path in args.files:
        marker = "python/dflash/"
        archive = path[path.rindex(marker) + len("python/"):]
        with open(path, "rb") as f:
            entries[archive] = f.read()
    written = re.fullmatch(r'__version__ = "([^"]*)"\n',
                           entries.get("dflash/_version.py", b"").decode())
    if written is None or written.group(1) != version:
        sys.exit(f"build_wheel.py: --out names version {version}, but "
                 "dflash/_version.py is missing or holds another: "
                 f"{entries.get('dflash/_version.py')!r}")
    with open(args.readme) as f:
        readme = f.read()
    info = f"{name}-{version}.dist-info"
    entries[f"{info}/METADATA"] = _metadata(version, readme,
                                            python_tag).encode()
    entries[f"{info}/WHEEL"] = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: dflash python/build_wheel.py",
        "Root-Is-Purelib: false",
        f"Tag: {python_tag}-{abi_tag}-{platform_tag}",
        "",
    ]).encode()
    record = [f"{path},{_record_hash(data)},{len(data)}"
              for path, data in sorted(entries.items())]
    entries[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"])
                                 + "\n").encode()

    with zipfile.ZipFile(args.out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in entries.items():
            entry = zipfile.ZipInfo(path, _EPOCH)
            mode = 0o755 if path.endswith(".so") else 0o644
            entry.external_attr = (0o100000 | mode) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(entry, data)


if __name__ == "__main__":
    main()
