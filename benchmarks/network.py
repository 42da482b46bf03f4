"""Strategies compared over a real, shaped network: SuperNodes in namespaces.

    .venv/bin/python benchmarks/network.py [--nodes 3] [--rounds 4]
        [--shape "delay=50ms,up=10mbit,down=50mbit"] [--only fedavg feddyn ...]
        [--train 9000] [--data-root ../shared/data] [--out bench-out/network]

Builds a `pollen.deployment.network.ShapedNetwork` (one namespace per SuperNode, every
link shaped the same way), brings up a TLS + authenticated deployment on it
(`pollen.deployment.cluster.up`, the SuperLink on the bridge address, each SuperNode
behind `ip netns exec`), and runs each strategy on the same data, partition
and seed with `pollen run --deployment`. Per strategy it reports wall time
per round, bytes up and down per round as counted from the messages and as
counted by the nodes' interfaces (headers, TLS and Flower's own traffic
included), and accuracy; it writes `network.md` (the table), `network.json`
and two plots (accuracy against wall time and against bytes). The network,
the processes and the namespaces are removed at the end, also on errors.

Data: a Fashion-MNIST subset (the first `--train` training and 2,000 test
images, written under --out) split over the nodes by Dirichlet(0.5), model
`cnn`, one local epoch per round, every node in every round. `fedsa` uses
`cnn-lora` (only its LoRA A matrices travel). Each strategy's numbers are
kept in `<out>/<name>.json`; a rerun with the same --out reads them back and
runs only the strategies that have none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from pollen.deployment import cluster  # noqa: E402
from pollen.deployment.network import LinkShape, ShapedNetwork, netns_available  # noqa: E402
from pollen.runs.results import plot_accuracy_against  # noqa: E402

STRATEGIES = {
    "fedavg": "strategy='fedavg' model='cnn'",
    "feddyn": "strategy='feddyn' model='cnn'",
    "fedadam": "strategy='fedadam' server-lr=0.003 model='cnn'",
    "fedbn": "strategy='fedavg' bn-policy='fedbn' model='cnn'",
    "fedsa": "strategy='fedsa' model='cnn-lora'",
}
COMMON = (
    "data-set='fashion-mnist' download=false partition='niid' alpha=0.5 "
    "client-frac=1.0 local-epochs=1 batch-size=32 lr=0.05 seed=845"
)


def subset(source: Path, target: Path, train: int) -> Path:
    """The first `train` training and 2,000 test images of Fashion-MNIST."""
    target.mkdir(parents=True, exist_ok=True)
    path = target / "fashion_mnist.npz"
    if not path.exists():
        with np.load(source / "fashion_mnist.npz") as full:
            np.savez(
                path,
                x_train=full["x_train"][:train], y_train=full["y_train"][:train],
                x_test=full["x_test"][:2000], y_test=full["y_test"][:2000],
            )  # fmt: skip
    return target


def run_strategy(
    net: ShapedNetwork, deployment: cluster.Deployment, out: Path, name: str,
    config: str,
) -> dict:  # fmt: skip
    """One `pollen run` on the deployment; its history and interface bytes."""
    before = [net.counters(i) for i in range(len(deployment.nodes))]
    started = time.monotonic()
    run = subprocess.run(
        [str(Path(sys.executable).parent / "pollen"), "run", str(PROJECT),
         "--deployment", deployment.directory, "-c", config],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    after = [net.counters(i) for i in range(len(deployment.nodes))]
    (out / f"{name}.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed; see {out / f'{name}.log'}")
    history = json.loads((out / name / "history.json").read_text())
    result = {
        "name": name,
        "wall-seconds": wall,
        "rounds": history,
        "wire-up": sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
        "wire-down": sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
    }
    (out / f"{name}.json").write_text(json.dumps(result))  # read back on a rerun
    return result


def table(results: list[dict], shape: LinkShape, nodes: int) -> str:
    mb = 1e6
    lines = [
        f"Link per node: {str(shape) or 'unshaped'}; {nodes} SuperNodes, every one in "
        "every round.",
        "",
        "| strategy | s / round | MB up / round (messages) | MB down / round "
        "(messages) | MB up / round (wire) | MB down / round (wire) | final acc. | "
        "best acc. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows, n = r["rounds"], len(r["rounds"])
        lines.append(
            f"| {r['name']} | {np.mean([x['seconds'] for x in rows]):.1f} | "
            f"{sum(x['bytes-up'] for x in rows) / n / mb:.3f} | "
            f"{sum(x['bytes-down'] + x['eval-bytes'] for x in rows) / n / mb:.3f} | "
            f"{r['wire-up'] / n / mb:.3f} | {r['wire-down'] / n / mb:.3f} | "
            f"{100 * rows[-1]['accuracy']:.2f}% | "
            f"{100 * max(x['accuracy'] for x in rows):.2f}% |"
        )
    return "\n".join(lines) + "\n"


def plots(results: list[dict], out: Path, shape: LinkShape) -> None:
    by_time, by_bytes = {}, {}
    for r in results:
        rows = r["rounds"]
        accuracy = [x["accuracy"] for x in rows]
        by_time[r["name"]] = (np.cumsum([x["seconds"] for x in rows]), accuracy)
        moved = [x["bytes-up"] + x["bytes-down"] + x["eval-bytes"] for x in rows]
        by_bytes[r["name"]] = (np.cumsum(moved) / 1e6, accuracy)
    title = f"Fashion-MNIST over a shaped network ({str(shape) or 'unshaped'})"
    plot_accuracy_against(by_time, out / "accuracy-time.png", title, "wall time (s)")
    plot_accuracy_against(
        by_bytes, out / "accuracy-bytes.png", title, "megabytes sent and received"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--shape", default="delay=50ms,up=10mbit,down=50mbit")
    parser.add_argument("--only", nargs="+", choices=list(STRATEGIES))
    parser.add_argument("--train", type=int, default=9000)
    parser.add_argument("--data-root", default=str(PROJECT.parent / "shared" / "data"))
    parser.add_argument("--out", default="bench-out/network", type=Path)
    args = parser.parse_args()
    if reason := netns_available():
        sys.exit(f"network namespaces are not available here: {reason}")
    shape = LinkShape.parse(args.shape)
    out = args.out.resolve()
    data = subset(Path(args.data_root), out / "data", args.train)
    results = []
    with ShapedNetwork(args.nodes, shape) as net:
        deployment = cluster.up(
            out / "deployment", args.nodes, host=net.server_address,
            data_root=str(data),
            node_prefix={k: net.exec_prefix(k) for k in range(args.nodes)},
        )  # fmt: skip
        try:
            for name in args.only or STRATEGIES:
                if (out / f"{name}.json").exists():
                    results.append(json.loads((out / f"{name}.json").read_text()))
                    continue
                config = (
                    f"{COMMON} {STRATEGIES[name]} data-root='{data}' rounds="
                    f"{args.rounds} num-clients={args.nodes} output-dir='{out}' "
                    f"run-name='{name}'"
                )
                results.append(run_strategy(net, deployment, out, name, config))
                print(f"{name}: {results[-1]['wall-seconds']:.0f} s", flush=True)
        finally:
            cluster.down(deployment.root)
    report = table(results, shape, args.nodes)
    (out / "network.md").write_text(report)
    (out / "network.json").write_text(json.dumps(results, indent=2))
    plots(results, out, shape)
    print(report)


if __name__ == "__main__":
    main()
