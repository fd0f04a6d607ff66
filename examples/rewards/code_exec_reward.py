"""A code-execution reward plug-in for colotrain.

For each response it takes the last ```python fenced block, appends the tests of the item's
meta["tests"] (a list of assert statements, one per line), and runs the result with this
Python (`python -I`, in a fresh temporary directory, stdin closed, output discarded) under a
per-item timeout. It answers {"reward": 1.0 if the program exited with status 0 else 0.0,
"timeout": 0/1, "has_code": 0/1}; a response without a python block gets 0 and is not run.
Items are run in parallel (CODE_REWARD_WORKERS, default: the CPU count) and answered in order.

NOT A SANDBOX: the model's code runs as the trainer's user, with its files, network and
memory. Run the trainer (or at least this plug-in) inside a container or VM you can throw away.

Config:   [reward]
          command = ["python3", "examples/rewards/code_exec_reward.py"]
          timeout_s = 120   # per batch: leave room for batch / workers x CODE_REWARD_TIMEOUT
Env:      CODE_REWARD_TIMEOUT  seconds per item (default 5)
          CODE_REWARD_WORKERS  items run at once (default: the CPU count)
Input:    {"response": "```python\\ndef add(a, b):\\n    return a + b\\n```", "meta": {"tests": ["assert add(1, 2) == 3"]}}
Output:   {"reward": 1.0, "timeout": 0, "has_code": 1}
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

TIMEOUT = float(os.environ.get("CODE_REWARD_TIMEOUT", "5"))
WORKERS = int(os.environ.get("CODE_REWARD_WORKERS", "0")) or os.cpu_count() or 1
BLOCK = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.DOTALL)


def run(program):
    """Runs `program`; returns (exit status or None, timed out)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "main.py")
        with open(path, "w") as f:
            f.write(program)
        p = subprocess.Popen(
            [sys.executable, "-I", path], cwd=d, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            return p.wait(timeout=TIMEOUT), False
        except subprocess.TimeoutExpired:
            return None, True
        finally:
            try:  # the whole process group: whatever the program started, too
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()


def score(line):
    try:
        item = json.loads(line)
        blocks = BLOCK.findall(item.get("response") or "")
        if not blocks:
            return {"reward": 0.0, "timeout": 0, "has_code": 0}
        tests = (item.get("meta") or {}).get("tests") or []
        tests = [tests] if isinstance(tests, str) else [str(t) for t in tests]
        status, timed_out = run(blocks[-1] + "\n\n" + "\n".join(tests) + "\n")
        return {"reward": 1.0 if status == 0 else 0.0, "timeout": int(timed_out), "has_code": 1}
    except Exception as e:  # one bad line costs its reward, never the plug-in
        print(f"code_exec_reward: {type(e).__name__}: {e}", file=sys.stderr)
        return {"reward": 0.0, "timeout": 0, "has_code": 0}


def main():
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not break the protocol
    pending = queue.Queue()  # futures in input order; None: end of input

    def answer():
        while (f := pending.get()) is not None:
            out.write(json.dumps(f.result()) + "\n")
            out.flush()

    writer = threading.Thread(target=answer)
    writer.start()
    with ThreadPoolExecutor(WORKERS) as pool:
        for line in sys.stdin:
            pending.put(pool.submit(score, line))
        pending.put(None)
        writer.join()


if __name__ == "__main__":
    main()
