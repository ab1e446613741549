"""Compile every Triton launch the tests make, offline for a GPU target, with any Triton.

    python benchmarks/dev/compile_check.py record [--out FILE] [pytest args...]
    python benchmarks/dev/compile_check.py compile [--only SUBSTR,...] [--jobs N] [--arch 90]
    PYTHONPATH=/path/to/triton-3.6:$PWD python benchmarks/dev/compile_check.py compile

The tests run the kernels through Triton's interpreter, which accepts code that a compiler
front end may reject (older Triton releases especially). ``record`` runs pytest under the
interpreter with the ``launch_recorder`` plugin and writes the distinct launch signatures
(kernel, argument types and specialisations, constexpr values, launch options) to a JSON-lines
file (default ``out/compile_check/launches.jsonl``). ``compile`` rebuilds each signature as the
JIT would at a real launch and compiles it to a cubin for ``--arch`` (Triton bundles ptxas, no
GPU needed) with the Triton first on ``sys.path``; every failure gets a line, and the exit
status is 1 when any signature failed. The kernels are imported from ``fusedops`` as found on
``sys.path``, so run from the checkout with ``PYTHONPATH=$PWD``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_LAUNCHES = "out/compile_check/launches.jsonl"
DEFAULT_PYTEST = ["tests", "-q", "-n", "2", "-p", "no:cacheprovider"]


def merge(files: list[Path]) -> tuple[list[dict], list[dict]]:
    """The distinct launches of the workers' files (each with the first test, by name, that
    made it) and the distinct recording errors."""
    first: dict[str, str] = {}
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                test = rec.pop("test", "")
                key = json.dumps(rec, sort_keys=True)
                first[key] = min(first.get(key, test), test)
    launches, errors = [], []
    for key in sorted(first):
        rec = json.loads(key) | {"test": first[key]}
        (errors if "error" in rec else launches).append(rec)
    return launches, errors


def cmd_record(out: Path, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter with the recorder; write the merged launches to out."""
    raw = Path(tempfile.mkdtemp(prefix="compile_check-"))
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-p", "launch_recorder", "--record-launches",
           str(raw), *(pytest_args or DEFAULT_PYTEST)]
    print("compile_check record:", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    files = sorted(raw.glob("launches-*.jsonl"))
    launches, errors = merge(files)
    shutil.rmtree(raw, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in launches + errors))
    kernels = len({r["kernel"] for r in launches})
    print(f"compile_check record: {len(launches)} launch signatures of {kernels} kernels, "
          f"{len(errors)} recording errors, from {len(files)} pytest processes -> {out} "
          f"(pytest exit {rc}, {time.perf_counter() - start:.0f} s)")
    for e in errors:
        print(f"  recording error {e['kernel']}: {e['error']} ({e['test']})")
    return rc if files else rc or 1


def select(recs: list[dict], only: str | None, limit: int | None) -> list[dict]:
    """The records whose ``module:kernel`` contains one of ``only``'s comma-separated strings;
    with ``limit``, at most that many, taken from the kernels in turn so each is represented."""
    if only:
        subs = [s for s in only.split(",") if s]
        recs = [r for r in recs if any(s in r["kernel"] for s in subs)]
    if limit is None or limit >= len(recs):
        return recs
    by_kernel: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_kernel[r["kernel"]].append(r)
    queues, picked = [list(v) for v in by_kernel.values()], []
    while len(picked) < limit:
        for q in queues:
            if q and len(picked) < limit:
                picked.append(q.pop(0))
    return picked


def describe_failure(rec: dict, err: str) -> str:
    """One failure: the kernel, its recorded constexprs, the options, the first test that
    launched it, then the error's last lines, indented."""
    consts = " ".join(f"{n}={json.dumps(d[1])}" for n, d in sorted(rec.get("args", {}).items())
                      if d[0] == "const")
    opts = " ".join(f"{k}={v}" for k, v in sorted(rec.get("options", {}).items()))
    head = f"FAIL {rec['kernel']} [{consts}] [{opts}] ({rec.get('test', '')})"
    return head + "".join(f"\n    {line}" for line in err.splitlines())


def summarise(results: list[tuple[dict, str | None, str | None]], seconds: float,
              jobs: int, arch: int) -> None:
    """Counts: compiled, failed, not checked, per kernel; the Triton and time."""
    import triton

    failed = Counter(r["kernel"] for r, err, _ in results if err)
    total = Counter(r["kernel"] for r, _, _ in results)
    skipped = [(r, why) for r, _, why in results if why]
    for rec, why in skipped:
        print(f"NOT CHECKED {rec['kernel']}: {why} ({rec.get('test', '')})")
    for kernel, n in sorted(failed.items()):
        print(f"  {kernel}: {n} of {total[kernel]} failed")
    print(f"compile_check compile: {len(results)} signatures of {len(total)} kernels, "
          f"{sum(failed.values())} failed, {len(skipped)} not checked; Triton "
          f"{triton.__version__} ({Path(triton.__file__).parent}), sm_{arch}, "
          f"{seconds:.0f} s with {jobs} jobs")


def load(path: Path, only: str | None, limit: int | None) -> tuple[list[dict], int]:
    """The records to compile, one per distinct compile input, and how many were read."""
    from launch_compiler import distinct, preload

    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = select(recs, only, None)
    preload(recs)
    return select(distinct(recs), None, limit), len(recs)


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile the selected records in a process pool; print failures as they come."""
    start = time.perf_counter()
    path = Path(args.input)
    if not path.exists():
        print(f"compile_check: {path} not found; run `compile_check.py record` first")
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # the JIT's own decorators, not the interpreter's
    # a fresh cache unless one is named: every signature really compiles, and nothing is kept
    cache = args.cache_dir or tempfile.mkdtemp(prefix="compile_check-cache-")
    os.environ["TRITON_CACHE_DIR"] = str(Path(cache).resolve())
    # Triton 3.9 warns once per process that its fp-fusion default will change; the default
    # itself is what a launch gets, so it stays, and only the warning goes.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import triton  # noqa: F401  (imported once here, inherited by the forked compile processes)
    from launch_compiler import run_all

    try:
        recs, read = load(path, args.only, args.limit)
        print(f"compile_check compile: {len(recs)} signatures ({read} records) from {path}",
              flush=True)
        results = []
        for rec, err, why in run_all(recs, args.jobs, args.arch, args.tail):
            results.append((rec, err, why))
            if err:
                print(describe_failure(rec, err), flush=True)
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    summarise(results, time.perf_counter() - start, args.jobs, args.arch)
    return 1 if any(err for _, err, _ in results) else 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The subcommand's options; for ``record``, also the pytest arguments (in order)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", allow_abbrev=False,
                         help="run pytest under the interpreter, write the launch signatures",
                         description="Other arguments go to pytest (default: "
                                     + " ".join(DEFAULT_PYTEST) + ").")
    rec.add_argument("--out", default=DEFAULT_LAUNCHES, help=f"default {DEFAULT_LAUNCHES}")
    com = sub.add_parser("compile", help="compile every recorded signature offline")
    com.add_argument("--input", default=DEFAULT_LAUNCHES, help=f"default {DEFAULT_LAUNCHES}")
    com.add_argument("--only", help="comma-separated substrings of 'module:kernel' to keep")
    com.add_argument("--limit", type=int, help="at most N signatures, kernels taken in turn")
    com.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    com.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: sm_90)")
    com.add_argument("--tail", type=int, default=6, help="error lines shown per failure")
    com.add_argument("--cache-dir", help="Triton cache to use and keep (default: a fresh one)")
    if argv[:1] == ["record"]:
        ns, rest = p.parse_known_args(argv)
        return ns, rest[1:] if rest[:1] == ["--"] else rest
    return p.parse_args(argv), []


def main(argv: list[str] | None = None) -> int:
    args, pytest_args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "record":
        return cmd_record(Path(args.out), pytest_args)
    return cmd_compile(args)


if __name__ == "__main__":
    sys.exit(main())
