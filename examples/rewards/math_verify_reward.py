"""A math reward plug-in for colotrain, using Hugging Face's math-verify.

For each response it extracts the final answer (math-verify's default extraction: the last
\\boxed{...} of a full response, else a LaTeX or plain expression) and checks it against the
prompt's reference answer, answering {"reward": 1.0 or 0.0, "parsed": 1 if anything was
extracted else 0}. A response with no reference answer, or one that fails to parse, gets 0.

Setup:   pip install math-verify==0.8.0
Config:  [reward]
         command = ["python3", "examples/rewards/math_verify_reward.py"]

Protocol: one JSON object per line on stdin ({"response", "answer", "prompt", "meta"}; absent
fields left out), one JSON answer per line on stdout, in order, flushed after each line.
"""

import json
import sys

from math_verify import parse, verify


def score(item):
    response, answer = item.get("response") or "", item.get("answer")
    try:
        pred = parse(response)
        if not pred or answer is None:
            return {"reward": 0.0, "parsed": int(bool(pred))}
        gold = parse("$" + str(answer) + "$")
        return {"reward": 1.0 if verify(gold, pred) else 0.0, "parsed": 1}
    except Exception as e:  # one bad line costs its reward, never the plug-in
        print(f"math_verify_reward: {type(e).__name__}: {e}", file=sys.stderr)
        return {"reward": 0.0, "parsed": 0}


def main():
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints from libraries must not break the protocol
    for line in sys.stdin:
        try:
            item = json.loads(line)
            answer = score(item) if isinstance(item, dict) else {"reward": 0.0, "parsed": 0}
        except ValueError as e:
            print(f"math_verify_reward: input line is not JSON: {e}", file=sys.stderr)
            answer = {"reward": 0.0, "parsed": 0}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
