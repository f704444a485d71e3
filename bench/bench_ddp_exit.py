"""How often a finished two-process DDP run on CPU (gloo) aborts at exit, by how it exits.

    python bench/bench_ddp_exit.py --runs 60          # each mode 60 times, a CPU burner beside
    python bench/bench_ddp_exit.py --runs 3 --modes leave --no-burner   # quick check

A worker trains a small DDP model for 5 steps under `torchrun --standalone --nproc_per_node 2`,
then exits one of three ways: `keep` (returns, the group alive), `destroy`
(destroy_process_group, then returns) or `leave` (ibpo.distributed.leave: exit handlers, group
destroyed, os._exit). Printed per mode: runs, failed launches, and launches whose output holds
"terminate called" (the C++ teardown abort, SIGABRT). The abort is intermittent and more frequent
under load, hence the burner (one busy process) by default.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
m = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(5):
    m(torch.randn(8, 64)).sum().backward(); opt.step(); opt.zero_grad()
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
elif sys.argv[1] == "leave":
    from ibpo.distributed import leave
    leave(0)
"""


def run_mode(mode: str, runs: int, worker: Path) -> tuple[int, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    failed = aborted = 0
    for _ in range(runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(worker), mode]  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        failed += res.returncode != 0
        aborted += "terminate called" in res.stdout + res.stderr
    return failed, aborted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--modes", nargs="+", default=["keep", "destroy", "leave"])
    ap.add_argument("--no-burner", action="store_true", help="no busy process beside the runs")
    args = ap.parse_args(argv)
    burner = None
    if not args.no_burner:
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            worker = Path(tmp) / "ddp_worker.py"
            worker.write_text(WORKER)
            for mode in args.modes:
                failed, aborted = run_mode(mode, args.runs, worker)
                print(f"{mode}: {args.runs} runs, {failed} failed, {aborted} aborted at exit")
    finally:
        if burner is not None:
            burner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
