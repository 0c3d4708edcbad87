"""What the bench scripts share: where the build is, and running a program that prints one JSON line last."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("XLR8_BUILD_DIR", os.path.join(ROOT, "build"))
XLR8 = os.path.join(BUILD, "bin", "xlr8")


def run_json(cmd, timeout=1800):
    """Runs cmd; its last output line holding a JSON object, parsed (a failure stops the bench, showing why)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    line = [l for l in out.stdout.splitlines() if "{" in l][-1]
    return json.loads(line[line.index("{"):])
