"""benchmarks/throughput.py's arms on a GPU machine: pollen against the floor.

The benchmark as committed gives pollen's ClientApp actors no GPU share (Ray
then hides the GPU from them and they train on the CPU) while its floor arm
runs in one process with device auto (CUDA where there is one). Here the
same workload runs with the clients given a GPU share:

  pollen        client-resources-num-gpus=GPUS (as many clients at once as
                the share allows, and as the CPUs allow: num-cpus stays 1)
  pollen-serial client-resources-num-gpus=1 and every CPU: one client at a
                time on the whole GPU, as in the floor
  floor         benchmarks/throughput.py's floor arm (one process, CUDA)

The plain arm (PIL images, a DataLoader, on the CPU) is left out: it is the
CPU comparison and would take minutes here. Usage (from the checkout):

    python benchmarks/gpu/gpu_throughput.py --data-root DIR [--rounds 3] [--gpus 0.25]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "benchmarks"))

import throughput  # noqa: E402
from measure import run_pollen  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--workload", default="cifar10-cnn", choices=throughput.WORKLOADS
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", default="0.25")
    parser.add_argument("--data-root", required=True)
    parser.add_argument(
        "--arms", nargs="+", default=["floor", "pollen", "pollen-serial"]
    )
    args = parser.parse_args()
    config = throughput.run_config(args.workload, args.rounds, args.data_root)
    print(f"config: {config}", flush=True)
    throughput.warm_data_cache(config)
    results = {}
    for arm in args.arms:
        try:
            if arm == "floor":
                results[arm] = throughput.run_arm("floor", config)
            elif arm == "plain":
                results[arm] = throughput.run_arm("plain", config)
            else:
                federation = (
                    (f"client-resources-num-gpus={args.gpus}",)
                    if arm == "pollen"
                    else (
                        f"client-resources-num-gpus={1 if float(args.gpus) else 0}",
                        f"client-resources-num-cpus={os.cpu_count()}",
                    )
                )
                with tempfile.TemporaryDirectory() as out:
                    results[arm] = run_pollen(
                        [config], Path(out), arm, federation=federation
                    )
            r = results[arm]
            print(
                f"{arm}: rounds {[round(s, 3) for s in r['rounds']]} wall {r['wall']:.1f} "
                f"accuracy {r['accuracy']:.4f}",
                flush=True,
            )
        except Exception as err:  # one arm's failure must not hide the others
            print(f"{arm}: FAILED {err}"[:3000], flush=True)
    print(
        "| workload | arm | wall s | start-up s | round 1 s | later rounds s | "
        "overhead s/round | rounds time | peak RSS GiB | accuracy |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    floor = results.get("floor")
    pollen = results.get("pollen", results.get("pollen-serial"))
    for arm, r in results.items():
        if floor and pollen:
            print(throughput.row(args.workload, arm, r, pollen, floor))
        else:
            print(arm, r)


if __name__ == "__main__":
    main()
