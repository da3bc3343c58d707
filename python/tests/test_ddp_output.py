"""The lines that ddp_train.py's ranks print for the launcher: two ranks share torchrun's stdout
pipe, so a line must reach it whole, also under PYTHONUNBUFFERED=1, where print() writes the text
and its newline separately. Runs without a GPU or torch."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository's lab/bench, or the copy staged for the GPU machine beside python/tests.
BENCH = next(
    (
        d
        for d in (
            os.path.join(HERE, "..", "..", "lab", "bench", "python"),
            os.path.join(HERE, "..", "..", "bench", "python"),
        )
        if os.path.exists(os.path.join(d, "ddp_train.py"))
    ),
    None,
)
RANK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import ddp_train
rank = int(sys.argv[2])
for i in range(3000):
    ddp_train.emit("RESULT " + json.dumps({"rank": rank, "step": i, "pad": "x" * 96}))
"""


def test_lines_of_two_ranks_on_one_pipe_stay_whole():
    assert BENCH, "ddp_train.py is neither in lab/bench/python nor in a staged bench/python"
    read, write = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, BENCH, str(r)], stdout=write, env=env)
        for r in (0, 1)
    ]
    os.close(write)
    with os.fdopen(read) as f:
        lines = f.read().splitlines()
    assert [p.wait() for p in ranks] == [0, 0]
    seen = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    assert len(lines) == len(seen) == 6000, [l for l in lines if not l.startswith("RESULT {")][:3]
    for r in (0, 1):
        assert [s["step"] for s in seen if s["rank"] == r] == list(range(3000))
