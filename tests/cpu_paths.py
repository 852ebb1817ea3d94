"""Run the numerical tests under every other CPU code path torch can take on this machine.

torch picks its vectorised kernels (SIMD width, hence the order of float sums) from the CPU at
start-up; ``ATEN_CPU_CAPABILITY`` lowers that choice (a capability above the machine's own is
ignored). `make test` runs the whole suite on the machine's own path, then this script runs the
tests marked ``numerical`` under ``default`` and ``avx2`` where those differ from the machine's
own path, so a tolerance tuned on one CPU fails here rather than on the next machine. Tests also
marked ``cpu_independent`` are not run again: their outcome cannot depend on the path (float64
gradchecks, two runs of one path compared bitwise, imports in a subprocess; pyproject.toml).

    python tests/cpu_paths.py [pytest args...]
"""

from __future__ import annotations

import os
import subprocess
import sys

PATHS = ("default", "avx2")


def capability(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if env_value is not None:
        env["ATEN_CPU_CAPABILITY"] = env_value
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    out.check_returncode()
    return out.stdout.strip()


def main(argv: list[str]) -> int:
    own = capability(None)
    done = {own}
    print(f"cpu_paths: the machine's own path {own} ran with the whole suite", flush=True)
    for value in PATHS:
        got = capability(value)
        if got in done:
            print(f"cpu_paths: ATEN_CPU_CAPABILITY={value} gives {got}, already run", flush=True)
            continue
        done.add(got)
        print(f"cpu_paths: numerical tests under ATEN_CPU_CAPABILITY={value} ({got})", flush=True)
        env = dict(os.environ, ATEN_CPU_CAPABILITY=value)
        marks = "numerical and not cpu_independent"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", marks, "-p", "no:cacheprovider"]
        rc = subprocess.run([*cmd, *argv], env=env).returncode
        if rc != 0:
            print(f"cpu_paths: FAILED under ATEN_CPU_CAPABILITY={value} ({got})", flush=True)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
