"""The prepared GPU check: the important cells first, each step under its own time limit, every
cell written as it ends, one table at the end. Run it through ``benchmarks/gpu_check.sh``,
which first installs the wheels of ``make gpu-wheels`` (the GPU machine has no registry).

Part 1 (about 7.5 minutes on an H200; one call of the device tool):

1. the library imports (else one sentence naming what is missing, and stop); versions, GPU;
2. the smoke check (``gpu_smoke.py``): every kernel variant the benchmark launches, bf16,
   n = 1,024, H 16, D 64 and 128, causal and not, forward and backward, against the float32
   naive path, one process per family and head dimension in parallel (it also fills Triton's
   cache);
3. the headline cells: bf16 forward+backward at 16k, 4k and 32k keys, 16 heads, D 64, for the
   softmax family, ``sink``, adaptive, the element-wise and row-normalised maps and
   stick-breaking (``gpu.py``);
4. each sparse map, top-k and hardmax at 4k and 16k in a process of its own under a short limit,
   with ``python -X faulthandler`` (a hang leaves its stack in the log);
5. the bfloat16 CUDA tests (``SHARPATTN_TEST_DEVICE=cuda``, parallel workers, a per-test limit).

Part 2 (``--part 2``, a second call of about 6.5 minutes): 64k, forward only, α = 1.3, float32, D 128, the anchors
(AdaSplash, stick-breaking), decoding steps (Lq 1 and 16 against 4k, 16k and 64k keys, H 8,
forward, causal: the template's split-K forward, two element-wise and two row-normalised maps,
against SDPA on the same shapes), packed documents (16k tokens as 8 documents through
``cu_seqlens``, against SDPA on the documents as a batch) and a sliding window (1,024 keys at
16k, against SDPA with the banded mask), softmax, sigmoid and 1.5-entmax forward+backward, and the whole CUDA suite (the
adversarial suite included).

Output, in ``--out`` (default ``$OUT``, else ``build/gpu-check``), five files per part (the
device tool brings back at most eight): ``cells-P.jsonl`` (every cell, smoke variant, step and
test count, one JSON line each, appended as it ends), ``check-P.log`` (everything printed,
children's stacks included), ``tests-P.log`` (pytest, one line per test), ``env-P.json`` and
``summary-P.md`` (the table, also printed last). ``--dry-run`` runs the same steps on the CPU
with tiny sizes and the kernels in Triton's interpreter (float32; the tests are only
collected), so a broken script is found before a GPU is at hand.

    bash benchmarks/gpu_check.sh                  # part 1
    bash benchmarks/gpu_check.sh --part 2
    bash benchmarks/gpu_check.sh --dry-run        # on the CPU, about a minute
    python benchmarks/gpu_check.py --table build/gpu-check/cells-1.jsonl [more files]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_common import (  # noqa: E402
    CASES,
    DECODING,
    HEADLINE,
    SPARSE,
    STRUCTURED,
    append_cell,
    family,
    read_cells,
    versions,
)

#: the CUDA test files (every one reads SHARPATTN_TEST_DEVICE)
CUDA_TESTS = (
    "tests/paths/test_triton.py",
    "tests/paths/test_triton_decoding.py",
    "tests/paths/test_triton_decoding_rules.py",
    "tests/paths/test_triton_stick.py",
    "tests/paths/test_triton_structure.py",
    "tests/paths/test_devices.py",
    "tests/paths/test_no_sync.py",
)
ADVERSARIAL = "tests/contract/test_adversarial.py"


def plan(part: int, dry: bool) -> list[dict]:
    """The steps of a part, in order: name, seconds, and the command's arguments (``smoke``,
    ``bench`` or ``tests``)."""
    bench = {"dtype": "bfloat16", "heads": 16, "head_dim": 64}
    if part == 1:
        steps = [
            {"name": "smoke", "seconds": 120, "kind": "smoke", "head_dims": "64,128"},
            {
                "name": "headline",
                "seconds": 130,
                "kind": "bench",
                **bench,
                "sizes": "16384,4096,32768",
                "modes": "fwdbwd",
                "methods": HEADLINE,
            },
            *(
                {
                    "name": f"sparse:{m}",
                    "seconds": 22,
                    "kind": "bench",
                    **bench,
                    "sizes": "4096,16384",
                    "modes": "fwdbwd",
                    "methods": (m,),
                }
                for m in SPARSE
            ),
            {
                "name": "tests-bf16",
                "seconds": 80,
                "kind": "tests",
                "select": "bfloat16 or test_devices",
                "files": CUDA_TESTS,
            },
        ]
    else:
        steps = [
            {
                "name": "64k",
                "seconds": 50,
                "kind": "bench",
                **bench,
                "sizes": "65536",
                "modes": "fwdbwd",
                "methods": HEADLINE,
            },
            {
                "name": "forward",
                "seconds": 35,
                "kind": "bench",
                **bench,
                "sizes": "4096,16384,32768",
                "modes": "fwd",
                "methods": HEADLINE,
            },
            {
                "name": "alpha-1.3",
                "seconds": 25,
                "kind": "bench",
                **bench,
                "sizes": "4096,16384",
                "modes": "fwd,fwdbwd",
                "methods": ("entmax@alpha=1.3",),
            },
            {
                "name": "float32",
                "seconds": 40,
                "kind": "bench",
                **bench,
                "dtype": "float32",
                "sizes": "4096,16384",
                "modes": "fwdbwd",
                "methods": CASES,
            },
            {
                "name": "d128",
                "seconds": 30,
                "kind": "bench",
                **bench,
                "head_dim": 128,
                "sizes": "16384",
                "modes": "fwdbwd",
                "methods": HEADLINE,
            },
            {
                "name": "anchors",
                "seconds": 25,
                "kind": "bench",
                **bench,
                "sizes": "4096,16384",
                "modes": "fwdbwd",
                "methods": (
                    "anchor:adasplash",
                    "entmax15",
                    "anchor:stickbreaking",
                    "stick_breaking",
                ),
            },
            {
                "name": "decoding",
                "seconds": 50,
                "kind": "bench",
                **bench,
                "heads": 8,
                "lq": "1,16",
                "sizes": "4096,16384,65536",
                "modes": "fwd",
                "causal": "yes",
                "methods": DECODING,
            },
            {
                "name": "packed",
                "seconds": 25,
                "kind": "bench",
                **bench,
                "sizes": "16384",
                "docs": 8,
                "modes": "fwdbwd",
                "causal": "yes",
                "methods": STRUCTURED,
            },
            {
                "name": "window",
                "seconds": 25,
                "kind": "bench",
                **bench,
                "sizes": "16384",
                "window": 1024,
                "modes": "fwdbwd",
                "causal": "yes",
                "methods": STRUCTURED,
            },
            {
                "name": "tests-all",
                "seconds": 80,
                "kind": "tests",
                "select": None,
                "files": (*CUDA_TESTS, ADVERSARIAL),
            },
        ]
    if dry:  # each kind of step on the CPU, small enough for the interpreter
        kept = {
            1: ("smoke", "headline", "sparse:sparsemax", "tests-bf16"),
            2: ("float32", "anchors", "decoding", "packed", "window", "tests-all"),
        }[part]
        steps = [s for s in steps if s["name"] in kept]
        for step in steps:
            step["seconds"] = 240
            if step["kind"] == "bench":
                step.update(dtype="float32", heads=2, head_dim=16, sizes="32")
                step.update({k: 8 for k in ("docs", "window") if k in step})
                step["methods"] = step["methods"][:2]
            if step["kind"] == "smoke":
                step.update(head_dims="16", cases=("sigmoid", "sparsemax"))
    return steps


def command(step: dict, part: int, args, cells: Path, tests_log: Path) -> tuple[list, dict]:
    """The child process of a step and its extra environment."""
    py = [sys.executable, "-X", "faulthandler"]
    env = {}
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
        dry = ["--device", "cpu", "--triton-cpu"]
        if step["kind"] == "bench":  # one timed call each: the script's path, not a timing
            dry += ["--reps", "1", "--window-ms", "0", "--host-calls", "1", "--causal", "yes"]
    else:
        dry = []
    if step["kind"] == "smoke":
        budget = step["timeout"] - 5
        extra = ["--cases", ",".join(step.get("cases", CASES))]
        if args.dry_run:
            extra += ["--dtype", "float32", "--n", "32", "--heads", "2"]
        return [
            *py,
            str(HERE / "gpu_smoke.py"),
            "--cells",
            str(cells),
            "--timeout",
            str(budget),
            "--head-dims",
            step["head_dims"],
            *extra,
            *dry,
        ], env
    if step["kind"] == "bench":
        shape = ["--lq", step["lq"]] if step.get("lq") else []
        shape += [x for k in ("docs", "window") if step.get(k) for x in (f"--{k}", str(step[k]))]
        if step.get("causal") and not args.dry_run:  # (a dry run is causal only)
            shape += ["--causal", step["causal"]]
        return [
            *py,
            str(HERE / "gpu.py"),
            "--cells",
            str(cells),
            "--tag",
            step["name"],
            "--dtype",
            step["dtype"],
            "--heads",
            str(step["heads"]),
            "--head-dim",
            str(step["head_dim"]),
            "--sizes",
            step["sizes"],
            "--modes",
            step["modes"],
            "--methods",
            ",".join(step["methods"]),
            "--deadline",
            str(max(1, step["timeout"] - 15)),
            *shape,
            *dry,
        ], env
    files = [f for f in step["files"] if (ROOT / f).exists()]
    cmd = [
        *py,
        "-m",
        "pytest",
        "-v",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::pytest.PytestWarning",
        *files,
    ]
    if step["select"]:
        cmd += ["-k", step["select"]]
    if args.dry_run:
        cmd.append("--collect-only")
    else:
        env["SHARPATTN_TEST_DEVICE"] = "cuda"
        if importlib.util.find_spec("xdist"):
            cmd += ["-n", str(args.workers)]
        if importlib.util.find_spec("pytest_timeout"):
            cmd += ["--timeout", "60"]
    return cmd, env


class Log:
    """Prints and writes to the check's log, line by line."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, line: str, console: bool = True) -> None:
        with self.lock:
            self.file.write(line + "\n")
            if console:
                print(line, flush=True)


def run_step(cmd, env, timeout: float, log: Log, sink: Path | None = None) -> dict:
    """Run ``cmd`` under ``timeout`` seconds; its lines go to the log (or to ``sink``, a file of
    their own, with only failures on the console). On timeout: SIGABRT (faulthandler prints the
    stack), then SIGKILL. Returns the exit code, the seconds, and the last line it printed."""
    t = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    last = [""]
    out = sink.open("a", buffering=1) if sink else None

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.strip():
                last[0] = line
            if out:
                out.write(line + "\n")
                if any(k in line for k in (" FAILED", " ERROR", "Timeout", "Fatal Python")):
                    log(line)
            else:
                log(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler: every thread's stack
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    if out:
        out.close()
    return {
        "code": proc.returncode,
        "seconds": round(time.monotonic() - t, 1),
        "timed_out": timed_out,
        "last": last[0][:300],
    }


def preflight(python: str) -> str | None:
    """None if sharpattn's library imports in a fresh interpreter, else one sentence saying what
    is missing. (``import sharpattn`` alone imports its names on first use: the check imports
    ``sharpattn.attention``, which needs torch, numpy and entmax.)"""
    got = subprocess.run(
        [python, "-c", "import sharpattn.attention"], cwd=ROOT, capture_output=True, text=True
    )
    if got.returncode == 0:
        return None
    lines = [x for x in got.stderr.strip().splitlines() if x.strip()]
    why = lines[-1] if lines else f"exit code {got.returncode}"
    return (
        f"sharpattn does not import here ({why}): run `make gpu-wheels` on a machine that "
        "reaches the package registries and carry benchmarks/wheels with the checkout."
    )


def tests_row(step: str, log_path: Path, result: dict) -> dict:
    """Counts and failing tests of a pytest log."""
    text = log_path.read_text() if log_path.exists() else ""
    lines = text.splitlines()
    failed = sorted(
        {
            ln.split(" - ")[0].replace("FAILED ", "").replace("ERROR ", "").strip()
            for ln in lines
            if ln.startswith(("FAILED ", "ERROR "))
        }
    )
    return {
        "kind": "tests",
        "step": step,
        "passed": sum(" PASSED" in ln for ln in lines),
        "failed": sum(" FAILED" in ln for ln in lines),
        "errors": sum(" ERROR" in ln for ln in lines),
        "skipped": sum(" SKIPPED" in ln for ln in lines),
        "collected": next((ln for ln in lines if "collected" in ln), ""),
        "failures": failed[:60],
        "timed_out": result["timed_out"],
        "last": result["last"],
    }


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    part = args.part
    cells, tests_log = out / f"cells-{part}.jsonl", out / f"tests-{part}.log"
    log = Log(out / f"check-{part}.log")
    t0 = time.monotonic()
    why = preflight(sys.executable)
    env = versions() | {"dry_run": args.dry_run}
    log(
        f"gpu_check part {part}{' (dry run on the CPU)' if args.dry_run else ''}: "
        f"GPU {env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), "
        f"Triton {env['triton']}, Python {env['python']}"
    )
    if why:
        log(why)
        return 2
    if not args.dry_run and env["gpu"] is None:
        log(
            "No CUDA GPU is visible to torch here: run with --dry-run to check the script "
            "on the CPU."
        )
        return 2
    (out / f"env-{part}.json").write_text(json.dumps(env, indent=1))
    steps = plan(part, args.dry_run)
    if args.only:
        steps = [s for s in steps if s["name"] in args.only.split(",")]
    for step in steps:
        left = args.budget - (time.monotonic() - t0) - 10  # the table's time
        if left < 5:
            append_cell(
                cells,
                {
                    "kind": "step",
                    "step": step["name"],
                    "status": "not run",
                    "why": "no time left in the part's budget",
                },
            )
            log(f"== {step['name']}: not run (no time left)")
            continue
        step["timeout"] = min(step["seconds"], left)
        cmd, extra = command(step, part, args, cells, tests_log)
        log(f"== {step['name']} (limit {step['timeout']:.0f} s, at {time.monotonic() - t0:.0f} s)")
        sink = tests_log if step["kind"] == "tests" else None
        if sink:
            with sink.open("a") as f:
                f.write(f"== {step['name']}: {' '.join(cmd)}\n")
        result = run_step(cmd, extra, step["timeout"], log, sink)
        status = (
            "timeout"
            if result["timed_out"]
            else ("ok" if result["code"] == 0 else f"exit {result['code']}")
        )
        append_cell(cells, {"kind": "step", "step": step["name"], "status": status, **result})
        if sink:
            row = tests_row(step["name"], sink, result)
            append_cell(cells, row)
            log(
                f"   tests: {row['passed']} passed, {row['failed']} failed, {row['errors']} "
                f"errors, {row['skipped']} skipped; {row['collected']}"
            )
        log(
            f"== {step['name']}: {status} after {result['seconds']:.0f} s"
            + (f" (last line: {result['last']})" if result["timed_out"] else "")
        )
    table = summary(read_cells(cells), env)
    (out / f"summary-{part}.md").write_text(table + "\n")
    log(table)
    log(f"gpu_check part {part}: {time.monotonic() - t0:.0f} s")
    return 0


# --- the table ------------------------------------------------------------------------------


def load(paths) -> list[dict]:
    """Rows of cells files (JSON lines) and of whole ``gpu.py`` results (JSON; older results,
    whose one ratio was against SDPA as torch picked it, read as ``ratio_default``)."""
    rows = []
    for path in paths:
        path = Path(path)
        if path.suffix == ".jsonl":
            rows += read_cells(path)
            continue
        result = json.loads(path.read_text())
        shape = result.get("shape", {})
        setting = {
            "dtype": result.get("dtype"),
            "H": result.get("H", shape.get("H")),
            "D": result.get("D", shape.get("D", 64)),
        }
        for r in result["rows"]:
            r = {"kind": "bench", **setting, **r}
            if "time_ratio" in r:
                r["ratio_default"] = r.pop("time_ratio")
            if "family" not in r:
                try:
                    r["family"] = family(r["method"])
                except (KeyError, ValueError, ImportError):
                    r["family"] = ""
            rows.append(r)
    return rows


def _size(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _short(dtype: str | None) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, str(dtype))


def _shape(r: dict) -> str:
    """A bench cell's kind of call beyond its size, for its row's setting: decoding rows, packed
    documents, a sliding window."""
    return (
        (f" Lq{r['lq']}" if r.get("lq") else "")
        + (f" docs{r['docs']}" if r.get("docs") else "")
        + (f" window{r['window']}" if r.get("window") else "")
    )


def summary(rows: list[dict], env: dict | None = None) -> str:
    """One table of the bench cells (ratio to flash attention / to SDPA as torch picks it, per
    size), then the baselines, the smoke check, the steps and the tests."""
    from gpu import TARGETS

    bench = [r for r in rows if r.get("kind") == "bench"]
    sizes = sorted({r["n"] for r in bench})
    groups: dict[tuple, dict] = {}
    for r in bench:
        setting = (
            f"{_short(r.get('dtype'))} D{r.get('D')} H{r.get('H')} "
            f"{'fwd+bwd' if r['mode'] == 'fwdbwd' else 'fwd'}" + _shape(r)
        )
        key = (r["method"], setting, r["causal"])
        groups.setdefault(key, {"family": r.get("family", ""), "cells": {}})["cells"][r["n"]] = r
    lines = []
    if env:
        lines += [
            f"GPU {env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
            f"cuDNN {env.get('cudnn')}, Triton {env.get('triton')}",
            "",
        ]
    lines += (
        []
        if not bench
        else [
            "Time as a ratio to SDPA pinned to flash attention / to SDPA as torch picks it "
            "(kernel time of back-to-back calls between CUDA events; * = host time is over half "
            "the kernel time: the cell measures Python and launches). Memory: peak above the inputs "
            "against flash attention's (default SDPA's where flash cannot run), at the largest size.",
            "",
            "| method | family | setting | causal | "
            + " | ".join(map(_size, sizes))
            + " | target (fwd+bwd vs flash, n ≥ 4k) | memory vs SDPA |",
            "|---" * (6 + len(sizes)) + "|",
        ]
    )

    def cell(r: dict | None) -> str:
        if r is None:
            return "–"
        if "error" in r:
            return "n/a" if r["method"].startswith("anchor:") else "error"
        f, d = r.get("ratio_flash"), r.get("ratio_default")
        text = " / ".join("–" if x is None else f"{x:.2f}" for x in (f, d))
        host = r.get("host_ms")
        return text + ("*" if host is not None and host > 0.5 * r["ms"] else "")

    order = sorted(groups, key=lambda k: (k[1], k[0], k[2]))
    for method, setting, causal in order:
        g = groups[(method, setting, causal)]
        row_cells = g["cells"]
        target = ""
        if method in TARGETS and "fwd+bwd" in setting and setting.startswith("bf16"):
            big = [r for r in row_cells.values() if r["n"] >= 4096 and "ratio_flash" in r]
            if big:
                worst = max(r["ratio_flash"] for r in big)
                verdict = "met" if worst <= TARGETS[method] else "missed"
                target = f"{TARGETS[method]}: {verdict} ({worst:.2f})"
            else:
                target = f"{TARGETS[method]}"
        measured = [r for r in row_cells.values() if "memory_ratio" in r]
        memory = ""
        if measured:
            top = max(measured, key=lambda r: r["n"])
            memory = f"{top['memory_ratio']:.2f} at {_size(top['n'])}"
        lines.append(
            f"| {method} | {g['family']} | {setting} | {'yes' if causal else 'no'} | "
            + " | ".join(cell(row_cells.get(n)) for n in sizes)
            + f" | {target} | {memory} |"
        )
    errors = [r for r in bench if "error" in r]
    if errors:
        lines += ["", "Not measured:"]
        seen = set()
        for r in errors:
            key = (r["method"], r["error"][:80])
            if key not in seen:
                seen.add(key)
                lines.append(
                    f"- {r['method']} ({_size(r['n'])}, {r['mode']}"
                    f"{', causal' if r['causal'] else ''}): {r['error'][:200]}"
                )
    base = {}
    for r in bench:
        if "flash_ms" in r or "default_ms" in r:
            setting = f"{_short(r.get('dtype'))} D{r.get('D')} H{r.get('H')} {r['mode']}"
            setting += _shape(r)
            base.setdefault(setting, {})[(r["n"], r["causal"])] = (
                r.get("flash_ms"),
                r.get("default_ms"),
                r.get("default_backend"),
            )
    if base:
        lines += ["", "Baselines, ms (flash / default SDPA, the backend default SDPA ran):"]
        for setting, cells in sorted(base.items()):
            parts = [
                f"{_size(n)}{' causal' if c else ''} "
                + " / ".join("–" if x is None else f"{x:.3f}" for x in v[:2])
                + (f" ({v[2]})" if v[2] else "")
                for (n, c), v in sorted(cells.items())
            ]
            lines.append(f"- {setting}: " + "; ".join(parts))
    smoke = [r for r in rows if r.get("kind") == "smoke"]
    if smoke:
        lines += ["", "Smoke check (fast path against the float32 naive path, tests' rule):"]
        fams = {}
        for r in smoke:
            fams.setdefault(r["family"], []).append(r)
        for fam, rs in sorted(fams.items()):
            ok = sum(1 for r in rs if r.get("method") and not r.get("failed"))
            n = sum(1 for r in rs if r.get("method"))
            bad = [
                f"{r.get('method')} D{r.get('D')}{' causal' if r.get('causal') else ''}: "
                f"{str(r['failed'])[:160]}"
                for r in rs
                if r.get("failed")
            ]
            lines.append(
                f"- {fam}: {ok}/{n} within bound" + (f"; FAILED {'; '.join(bad)}" if bad else "")
            )
    steps = [r for r in rows if r.get("kind") == "step"]
    if steps:
        lines += ["", "Steps:"]
        for r in steps:
            extra = f", last line: {r.get('last')}" if r.get("status") == "timeout" else ""
            lines.append(
                f"- {r['step']}: {r['status']}"
                + (f" after {r['seconds']:.0f} s" if "seconds" in r else "")
                + (f" ({r['why']})" if r.get("why") else "")
                + extra
            )
    for r in (r for r in rows if r.get("kind") == "tests"):
        lines += [
            "",
            f"Tests ({r['step']}): {r['passed']} passed, {r['failed']} failed, "
            f"{r['errors']} errors, {r['skipped']} skipped ({r['collected'].strip()})"
            + (" (stopped at its time limit)" if r.get("timed_out") else ""),
        ]
        lines += [f"- FAILED {name}" for name in r["failures"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", type=int, default=1, choices=[1, 2])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, tiny, the interpreter")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build" / "gpu-check"))
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole part (default 455 for part 1, 385 for part 2; dry run 900)",
    )
    p.add_argument("--workers", type=int, default=12, help="pytest-xdist workers")
    p.add_argument("--only", default=None, help="comma-separated step names")
    p.add_argument("--table", nargs="+", metavar="FILE", help="print the table of cells files")
    args = p.parse_args(argv)
    if args.table:
        print(summary(load(args.table)))
        return 0
    if args.budget is None:
        args.budget = 900.0 if args.dry_run else {1: 455.0, 2: 385.0}[args.part]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
