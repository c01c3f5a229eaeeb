"""Runs the GPU stress tests in one command, then summarises them.

    python bench/gpu_stress.py                      # the engine group, summary in $OUT/gpu_stress.json
    python bench/gpu_stress.py --group kernels      # the kernel group (another device call)
    python bench/gpu_stress.py tests/test_gpu_stress.py --out stress.json -- -k storm -x

Runs `pytest -m gpu` over the given test files, or a group of them (GROUPS: `engine`, the
stress, engine and serving suites; `kernels`, the GPU tests of the kernel, quantization, KV-cache
and LoRA files; each fits one 10-minute device call), from the repository root, with
`--junitxml`; prints a table of every test (outcome, seconds, the first line of a
failure) and writes a JSON summary to `--out` (default: $OUT/gpu_stress.json when $OUT is
set, else nothing). Arguments after `--` go to pytest. The exit code is pytest's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"engine": ["tests/test_gpu_stress.py", "tests/test_gpu_engine.py", "tests/test_gpu_serving.py"],
          "kernels": ["tests/test_kernels.py", "tests/test_linear.py", "tests/test_fp8.py", "tests/test_fp8_grouped.py",
                      "tests/test_w4a16.py",
                      "tests/test_gguf_quantized.py", "tests/test_kv_cache_dtype.py", "tests/test_lora.py",
                      "tests/test_lora_kernels.py", "tests/test_pdl.py"]}


def read_junit(path: Path) -> list[dict]:
    """One record per test case of a pytest junit XML file, in run order."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = element.get("message") or (element.text or "")
                break
        tests.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0.0), 2),
                      "message": message.strip().splitlines()[0][:300] if message.strip() else ""})
    return tests


def table(tests: list[dict]) -> str:
    width = max([len(t["test"]) for t in tests] + [4])
    lines = [f"{'test':<{width}}  {'outcome':<8} {'seconds':>8}", "-" * (width + 18)]
    for t in tests:
        line = f"{t['test']:<{width}}  {t['outcome']:<8} {t['seconds']:>8.2f}"
        if t["outcome"] in ("failed", "error") and t["message"]:
            line += f"  {t['message'][:160]}"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="test files (default: the --group's)")
    parser.add_argument("--group", choices=sorted(GROUPS), default="engine", help="files to run when none are given")
    parser.add_argument("--out", default=None, help="JSON summary path (default: $OUT/gpu_stress.json)")
    parser.add_argument("--junitxml", default=None, help="where pytest writes its junit XML "
                        "(default: next to --out, else a temporary file)")
    args = parser.parse_args(argv)

    files = args.files or [f for f in GROUPS[args.group] if (ROOT / f).exists()]
    name = "gpu_stress" if args.files or args.group == "engine" else f"gpu_stress_{args.group}"
    out = args.out or (os.path.join(os.environ["OUT"], f"{name}.json") if os.environ.get("OUT") else None)
    if args.junitxml:
        junit = Path(args.junitxml)
    elif out:
        junit = Path(out).with_suffix(".junit.xml")
    else:
        junit = Path(tempfile.mkdtemp(prefix="gpu_stress_")) / "junit.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)

    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *files, *extra]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(command, cwd=ROOT).returncode
    seconds = time.perf_counter() - start

    tests = read_junit(junit) if junit.exists() else []
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    print()
    print(table(tests) if tests else f"no junit results in {junit} (pytest exit code {returncode})")
    print(f"\n{len(tests)} tests in {seconds:.0f} s: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f"; pytest exit code {returncode}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        summary = {"command": command, "files": files, "returncode": returncode, "seconds": round(seconds, 1),
                   "counts": counts, "junitxml": str(junit), "tests": tests}
        Path(out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {out}")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
